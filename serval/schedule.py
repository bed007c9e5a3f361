"""The routing schedule: which rows each expert computes, in which order, and where they came from.

One table drives every stage of the layer: the token gather, the grouped GEMMs
(forward, data gradients and weight gradients), the combine, and (with expert
parallelism) the pull dispatch and push combine between ranks. It is built on
the device from `topk_ids` by sort/searchsorted/cumsum, with no host sync; every
shape comes from a capacity known before the data is seen.

Layout (EP=1; N tokens, k slots, E experts, M = block_m):

* a *source* is one (token, slot) pair, numbered ``source = token * k + slot``
  (row-major over ``topk_ids``). With expert parallelism the token index becomes
  the global one, ``rank * N + token``, so rows keep the same order at any EP size.
* the *rows* of the routed buffer are grouped by expert: expert e owns the segment
  ``[expert_offsets[e], expert_offsets[e + 1])``, its ``tokens_per_expert[e]``
  rows first, in ascending source order (token-major, then slot), then zero
  padding up to a multiple of M. Every M-tile of rows therefore belongs to exactly
  one expert, which is what the grouped GEMMs and the weight gradients iterate over.
* ``row_source[r]`` is the source of row r, -1 for a padding row.
* ``source_row[t, j]`` is the row holding (t, j): the combine reads a token's k
  rows through it in slot order, and ``d_x`` sums them in the same order.
* ``tile_expert[i]`` is the expert of M-tile i, -1 for a tile past the used rows;
  ``expert_offsets[E] // M`` is the number of used tiles.
* *packed* rows: the rows that hold a source, in row order, without the padding
  (``packed_index``). What the forward keeps for backward (the gate/up pre-activations)
  is stored packed, so padding costs no memory across the two passes: ``num_packed`` rows,
  N*k at EP=1, the same as a layout without padding.

Capacity: at most ``N*k`` real rows plus ``M - 1`` padding rows for each expert that
has rows, so ``capacity_rows = M * floor((N*k + min(E, N*k) * (M - 1)) / M)`` holds
any routing, however skewed: at EP=1 nothing can overflow and nothing is dropped.
"""

from __future__ import annotations

import dataclasses
import math

import torch


def capacity_rows(num_sources: int, num_experts: int, block_m: int) -> int:
    """Rows the routed buffer needs for `num_sources` (token, slot) pairs of any routing."""
    padded = num_sources + min(num_experts, num_sources) * (block_m - 1)
    return block_m * (padded // block_m)


@dataclasses.dataclass
class Schedule:
    """Device-side routing table (see module docstring); int32 tensors on the device of topk_ids."""

    tokens_per_expert: torch.Tensor  # [E]
    expert_offsets: torch.Tensor  # [E + 1], multiples of block_m
    row_source: torch.Tensor  # [capacity]
    source_row: torch.Tensor  # [N, k]
    tile_expert: torch.Tensor  # [capacity // block_m]
    num_experts: int
    block_m: int

    @property
    def capacity(self) -> int:
        return self.row_source.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.source_row.shape[0]

    @property
    def top_k(self) -> int:
        return self.source_row.shape[1]

    @property
    def num_packed(self) -> int:
        """Rows of a packed buffer (see `packed_index`): the most rows that can hold a source."""
        return min(self.capacity, self.source_row.numel())

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The device tensors, in field order (what autograd saves for backward)."""
        return (self.tokens_per_expert, self.expert_offsets, self.row_source, self.source_row, self.tile_expert)


def packed_index(schedule: Schedule) -> torch.Tensor:
    """[capacity] int32: each row's index among the rows that hold a source (row order), -1 on padding."""
    used = schedule.row_source >= 0
    return torch.where(used, torch.cumsum(used, 0, dtype=torch.int32) - 1, -1)


def packed_rows(schedule: Schedule) -> torch.Tensor:
    """[num_packed] int64: the row of each packed index (the inverse of `packed_index`); indices past
    the used rows (only at EP, where num_packed is the capacity) map to the last row, never read back."""
    used_before = torch.cumsum(schedule.row_source >= 0, 0)  # [capacity], nondecreasing
    wanted = torch.arange(1, schedule.num_packed + 1, device=used_before.device)
    return torch.searchsorted(used_before, wanted).clamp(max=schedule.capacity - 1)


def build_schedule(topk_ids: torch.Tensor, num_experts: int, block_m: int = 128) -> Schedule:
    """Build the schedule for `topk_ids` [N, k] (expert ids in [0, num_experts)); no host sync."""
    num_tokens, top_k = topk_ids.shape
    device = topk_ids.device
    num_sources = num_tokens * top_k
    capacity = capacity_rows(num_sources, num_experts, block_m)

    # keys in the narrowest type that holds the expert ids: the radix sort makes one pass per key byte
    key_dtype = torch.int16 if num_experts < torch.iinfo(torch.int16).max else torch.int32
    # stable: within an expert, sources stay in ascending (token, slot) order
    sorted_keys, sorted_source = torch.sort(topk_ids.reshape(-1).to(key_dtype), stable=True)
    experts = torch.arange(num_experts + 1, device=device, dtype=key_dtype)
    first_sorted = torch.searchsorted(sorted_keys, experts)  # [E + 1]
    sorted_ids = sorted_keys.to(torch.int64)
    tokens_per_expert = first_sorted[1:] - first_sorted[:-1]
    padded = (tokens_per_expert + block_m - 1) // block_m * block_m
    expert_offsets = torch.zeros(num_experts + 1, device=device, dtype=torch.int64)
    expert_offsets[1:] = torch.cumsum(padded, 0)

    rank_in_expert = torch.arange(num_sources, device=device) - first_sorted[sorted_ids]
    row_of_sorted = expert_offsets[sorted_ids] + rank_in_expert
    row_source = torch.full((capacity,), -1, device=device, dtype=torch.int32)
    row_source[row_of_sorted] = sorted_source.to(torch.int32)  # a permutation: no two writes collide
    source_row = torch.empty(num_sources, device=device, dtype=torch.int32)
    source_row[sorted_source] = row_of_sorted.to(torch.int32)

    return Schedule(
        tokens_per_expert=tokens_per_expert.to(torch.int32),
        expert_offsets=expert_offsets.to(torch.int32),
        row_source=row_source,
        source_row=source_row.view(num_tokens, top_k),
        tile_expert=_tile_expert(expert_offsets, capacity, block_m),
        num_experts=num_experts,
        block_m=block_m,
    )


def _tile_expert(expert_offsets: torch.Tensor, capacity: int, block_m: int) -> torch.Tensor:
    """[capacity // block_m] expert of each M-tile, -1 past the used rows."""
    num_experts = expert_offsets.shape[0] - 1
    tile_start = torch.arange(0, capacity, block_m, device=expert_offsets.device, dtype=torch.int64)
    tile_expert = torch.searchsorted(expert_offsets[1:].to(torch.int64), tile_start, right=True)
    return torch.where(tile_expert < num_experts, tile_expert, -1).to(torch.int32)


def ep_capacity_rows(num_tokens: int, top_k: int, ep_size: int, experts_per_rank: int, block_m: int,
                     capacity_multiplier: float) -> int:
    """Rows one rank of an EP group reserves: capacity_multiplier x the balanced load (N*k rows per
    rank) plus the padding its experts can need, never more than the worst case (every row of
    every rank on this rank's experts)."""
    worst = capacity_rows(ep_size * num_tokens * top_k, experts_per_rank, block_m)
    wanted = math.ceil(capacity_multiplier * num_tokens * top_k) + experts_per_rank * (block_m - 1)
    return min(worst, block_m * math.ceil(wanted / block_m))


def local_schedule(global_schedule: Schedule, rank: int, experts_per_rank: int,
                   capacity: int) -> tuple[Schedule, torch.Tensor]:
    """Rank `rank`'s part of the schedule of the whole EP group: its experts' rows, same order.

    Every rank builds the same global schedule from the all-gathered routing (the EP=1 schedule
    of the concatenated batch); expert e lives on rank e // experts_per_rank, so a rank's rows are
    one contiguous slice of the global rows, rebased to 0. Row order, padding and tiles are those
    of EP=1, which is what makes the layer's results independent of the EP size. `row_source`
    keeps global sources; `source_row` stays the global [P*N, k] map to global rows.
    Returns (schedule with `capacity` rows, overflow: a device bool, True when ANY rank's slice does
    not fit; every rank computes the same value, so all of them stop together instead of leaving
    peers waiting; a slice that does not fit is cut at `capacity`, so nothing is written out of bounds).
    """
    first = rank * experts_per_rank
    offsets = global_schedule.expert_offsets.to(torch.int64)
    rank_bounds = offsets[::experts_per_rank]  # [P + 1]: first row of each rank's slice
    overflow = ((rank_bounds[1:] - rank_bounds[:-1]) > capacity).any()
    base = offsets[first]
    local_offsets = offsets[first:first + experts_per_rank + 1] - base
    local_offsets = local_offsets.clamp(max=capacity)
    rows = torch.arange(capacity, device=offsets.device) + base
    inside = rows < base + local_offsets[-1]
    row_source = global_schedule.row_source[rows.clamp(max=global_schedule.capacity - 1)]
    schedule = Schedule(
        tokens_per_expert=global_schedule.tokens_per_expert[first:first + experts_per_rank],
        expert_offsets=local_offsets.to(torch.int32),
        row_source=torch.where(inside, row_source, -1),
        source_row=global_schedule.source_row,
        tile_expert=_tile_expert(local_offsets, capacity, global_schedule.block_m),
        num_experts=experts_per_rank,
        block_m=global_schedule.block_m,
    )
    return schedule, overflow


# Bits of `Window.expert_phase`: how a window's weight-gradient tiles of an expert begin and end.
CARRY_IN = 1  # the expert has rows before the window: its sums start from the previous window's fp32 carry
CARRY_OUT = 2  # the expert has rows after the window: its fp32 sums go to the carry, not to the output
FINISH = 4  # the expert's gradient is complete in this window (its last rows, or it has none): store it


@dataclasses.dataclass
class Window:
    """Rows [start, start + schedule.capacity) of a schedule, as a schedule of their own (offsets rebased and
    clamped, `row_source` and `tile_expert` sliced), for a pass that streams the rows through a fixed buffer
    (the macrobatch ring: `Config.macrobatch_size`). Every tile of a window is the tile of the same rows in
    the whole schedule, so row-wise results do not depend on the window size; `expert_phase` lets the weight
    gradients carry an expert's fp32 K sums from one window to the next, ascending, which gives the bits of
    one pass over all the rows."""

    schedule: Schedule
    start: int
    expert_phase: torch.Tensor  # [E] int32: CARRY_IN | CARRY_OUT | FINISH


def windows(schedule: Schedule, rows: int) -> list[Window]:
    """The schedule's rows in windows of `rows` rows (a multiple of block_m; the last may be shorter), in row
    order. A fixed count, ceil(capacity / rows), known on the host: no sync; a window past the used rows has
    no tiles (its expert_offsets are all 0 or all its size) and its launches exit at once."""
    if rows <= 0 or rows % schedule.block_m:
        raise ValueError(f"window rows must be a positive multiple of block_m={schedule.block_m}, got {rows}")
    offsets = schedule.expert_offsets.to(torch.int64)
    begin, end = offsets[:-1], offsets[1:]
    real_end = begin + schedule.tokens_per_expert.to(torch.int64)  # an expert's source rows come first
    out = []
    for start in range(0, max(schedule.capacity, 1), rows):
        stop = min(start + rows, schedule.capacity)
        last = stop == schedule.capacity
        carry_in = (begin < start) & (end > start)
        carry_out = (begin < stop) & (end > stop)
        finish = torch.where(end > begin, (end > start) & (end <= stop),
                             (begin >= start) & ((begin < stop) | (last & (begin == stop))))
        phase = carry_in.int() * CARRY_IN + carry_out.int() * CARRY_OUT + finish.int() * FINISH
        local = (offsets - start).clamp(0, stop - start)
        real = ((real_end.clamp(max=stop) - begin.clamp(min=start)).clamp(min=0)).to(torch.int32)
        window = Schedule(
            tokens_per_expert=real,
            expert_offsets=local.to(torch.int32),
            row_source=schedule.row_source[start:stop],
            source_row=schedule.source_row,
            tile_expert=schedule.tile_expert[start // schedule.block_m:stop // schedule.block_m],
            num_experts=schedule.num_experts,
            block_m=schedule.block_m,
        )
        out.append(Window(window, start, phase.to(torch.int32)))
    return out


def slot_schedule(num_tokens: int, top_k: int, device) -> Schedule:
    """The schedule of an EP rank's slot buffer [N*k, H] (slot = token * k + slot index): the
    owner's combine and d_x sum read a token's k slots through it, in slot order."""
    slots = torch.arange(num_tokens * top_k, device=device, dtype=torch.int32)
    return Schedule(
        tokens_per_expert=torch.full((1,), num_tokens * top_k, device=device, dtype=torch.int32),
        expert_offsets=torch.arange(2, device=device, dtype=torch.int32) * (num_tokens * top_k),
        row_source=slots,
        source_row=slots.view(num_tokens, top_k),
        tile_expert=torch.zeros(0, device=device, dtype=torch.int32),
        num_experts=1,
        block_m=1,
    )


def dense_schedule(num_tokens: int, block_m: int, device) -> Schedule:
    """The schedule of an expert that sees every token once (the shared expert): rows = tokens."""
    capacity = block_m * ((num_tokens + block_m - 1) // block_m)
    row_source = torch.arange(capacity, device=device, dtype=torch.int32)
    row_source = torch.where(row_source < num_tokens, row_source, -1)
    return Schedule(
        tokens_per_expert=torch.full((1,), num_tokens, device=device, dtype=torch.int32),
        expert_offsets=torch.arange(2, device=device, dtype=torch.int32) * capacity,
        row_source=row_source,
        source_row=torch.arange(num_tokens, device=device, dtype=torch.int32).view(num_tokens, 1),
        tile_expert=torch.zeros(capacity // block_m, device=device, dtype=torch.int32),
        num_experts=1,
        block_m=block_m,
    )
