"""The routing schedule: layout invariants, capacity, order, and (on GPU) no host sync."""

import pytest
import torch

from conftest import make_routing, requires_cuda
from serval.schedule import build_schedule, capacity_rows, dense_schedule, packed_index, packed_rows


def check_schedule(ids, num_experts, block_m):
    num_tokens, top_k = ids.shape
    s = build_schedule(ids, num_experts, block_m)
    assert s.capacity == capacity_rows(num_tokens * top_k, num_experts, block_m)
    flat = ids.reshape(-1).cpu()
    counts = torch.bincount(flat, minlength=num_experts)
    assert s.tokens_per_expert.cpu().tolist() == counts.tolist()
    offsets = s.expert_offsets.cpu()
    assert offsets[0] == 0 and (offsets % block_m == 0).all()
    assert ((offsets[1:] - offsets[:-1]) == (counts + block_m - 1) // block_m * block_m).all()
    assert offsets[-1] <= s.capacity
    row_source = s.row_source.cpu()
    for e in range(num_experts):
        seg = row_source[offsets[e]:offsets[e + 1]]
        real, pad = seg[: counts[e]], seg[counts[e]:]
        assert (pad == -1).all()
        assert (flat[real.long()] == e).all()
        assert (real[1:] > real[:-1]).all(), "rows of an expert must be in ascending source order"
    assert (row_source[offsets[-1]:] == -1).all()
    # source_row is the inverse of row_source
    source_row = s.source_row.cpu().reshape(-1)
    assert (row_source[source_row.long()] == torch.arange(num_tokens * top_k)).all()
    tile_expert = s.tile_expert.cpu()
    for i, e in enumerate(tile_expert.tolist()):
        start = i * block_m
        if start >= offsets[-1]:
            assert e == -1
        else:
            assert offsets[e] <= start < offsets[e + 1]
    check_packing(s, expected_packed=num_tokens * top_k)
    return s


def check_packing(s, expected_packed):
    """Packed rows: the used rows in row order, numbered 0, 1, ...; packed_rows inverts packed_index."""
    assert s.num_packed == expected_packed
    index, rows = packed_index(s).cpu(), packed_rows(s).cpu()
    used = (s.row_source >= 0).cpu()
    assert (index[~used] == -1).all()
    assert torch.equal(index[used], torch.arange(int(used.sum()), dtype=index.dtype))
    assert rows.shape == (s.num_packed,)
    assert torch.equal(rows[: int(used.sum())], used.nonzero().squeeze(1))


@pytest.mark.parametrize("kind", ["random", "skewed", "empty"])
@pytest.mark.parametrize("block_m", [4, 16])
def test_schedule_layout(kind, block_m):
    rw, ids = make_routing(37, 6, 3, kind=kind)
    check_schedule(ids, 6, block_m)


def test_schedule_edges():
    check_schedule(torch.zeros(1, 1, dtype=torch.int64), 1, 8)  # one token, one expert, k = 1
    check_schedule(torch.zeros(50, 1, dtype=torch.int64), 4, 16)  # every token on one expert
    check_schedule(torch.tensor([[3, 1]]), 5, 4)  # one token, k = 2


def test_capacity_holds_worst_case():
    # every expert gets one row less than a multiple of the tile, the worst padding there is
    block_m, num_experts = 8, 5
    ids = torch.arange(num_experts).repeat_interleave(block_m + 1).view(-1, 1)
    s = check_schedule(ids, num_experts, block_m)
    assert s.expert_offsets[-1] <= s.capacity


def test_dense_schedule():
    s = dense_schedule(10, 8, "cpu")
    assert s.capacity == 16 and s.row_source.tolist() == list(range(10)) + [-1] * 6
    assert s.tile_expert.tolist() == [0, 0]
    check_packing(s, expected_packed=10)


@requires_cuda
def test_schedule_no_host_sync():
    rw, ids = make_routing(4096, 64, 8, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        build_schedule(ids, 64, 128)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    check_schedule(ids, 64, 128)


def test_local_schedules_partition_the_group_schedule():
    from serval.schedule import ep_capacity_rows, local_schedule

    world, experts_per_rank, block_m = 4, 3, 8
    rw, ids = make_routing(4 * 10, world * experts_per_rank, 2, kind="skewed")
    group = build_schedule(ids, world * experts_per_rank, block_m)
    capacity = ep_capacity_rows(10, 2, world, experts_per_rank, block_m, capacity_multiplier=float(world))
    rows = []
    for rank in range(world):
        local, overflow = local_schedule(group, rank, experts_per_rank, capacity)
        assert not overflow
        used = int(local.expert_offsets[-1])
        rows.append(local.row_source[:used])
        assert (local.row_source[used:] == -1).all()
        owner_expert = ids.reshape(-1)[local.row_source[:used].clamp(min=0).long()] // experts_per_rank
        assert (owner_expert[local.row_source[:used] >= 0] == rank).all()
        check_packing(local, expected_packed=min(capacity, ids.numel()))  # at EP: the capacity, or fewer
    # the ranks' rows, in rank order, are the group's rows: the same order as EP=1
    assert torch.equal(torch.cat(rows), group.row_source[: int(group.expert_offsets[-1])])
    # skewed routing (every token's first slot on expert 0) does not fit a balanced capacity
    tight = ep_capacity_rows(10, 2, world, experts_per_rank, block_m, capacity_multiplier=1.0)
    overflows = [bool(local_schedule(group, rank, experts_per_rank, tight)[1]) for rank in range(world)]
    assert overflows == [True] * world, "every rank must see the overflow, not only the one that overflows"


@pytest.mark.parametrize("kind", ["random", "skewed", "empty", "one"])
@pytest.mark.parametrize("tiles", [1, 2, 3, 100])
def test_windows_cover_the_schedule(kind, tiles):
    """`windows`: the rows in order, each window a schedule of its own rows; every expert finishes in exactly one
    window, and an expert carries its sums in and out exactly across the windows its rows span."""
    from serval.schedule import CARRY_IN, CARRY_OUT, FINISH, windows

    block_m, num_experts = 16, 6
    if kind == "one":
        ids = torch.full((40, 1), 2)
    else:
        _, ids = make_routing(40, num_experts, 2, kind="skewed" if kind == "skewed" else "random", seed=3)
        if kind == "empty":
            ids = ids % 3 * 2  # experts 1, 3, 5 get nothing
    s = build_schedule(ids, num_experts, block_m)
    parts = windows(s, tiles * block_m)
    assert len(parts) == -(-s.capacity // (tiles * block_m))
    assert torch.equal(torch.cat([w.schedule.row_source for w in parts]), s.row_source)
    assert torch.equal(torch.cat([w.schedule.tile_expert for w in parts]), s.tile_expert)
    offsets = s.expert_offsets.long()
    finished = torch.zeros(num_experts, dtype=torch.long)
    for w in parts:
        local = w.schedule.expert_offsets.long()
        rows = w.schedule.capacity
        assert torch.equal(local, (offsets - w.start).clamp(0, rows))
        phase = w.expert_phase
        finished += (phase & FINISH != 0).long()
        for e in range(num_experts):
            before, after = offsets[e] < w.start < offsets[e + 1], offsets[e] < w.start + rows < offsets[e + 1]
            assert bool(phase[e] & CARRY_IN) == bool(before) and bool(phase[e] & CARRY_OUT) == bool(after)
        assert int((phase & CARRY_IN != 0).sum()) <= 1 and int((phase & CARRY_OUT != 0).sum()) <= 1
        real = w.schedule.row_source >= 0
        per_expert = [int(real[local[e]:local[e + 1]].sum()) for e in range(num_experts)]
        assert w.schedule.tokens_per_expert.tolist() == per_expert
    assert finished.tolist() == [1] * num_experts
    with pytest.raises(ValueError, match="multiple of block_m"):
        windows(s, block_m + 1)
