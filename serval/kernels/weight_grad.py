"""Grouped weight gradients over the token axis: dW[e] = A[seg e].T @ B[seg e].

The backward of every expert GEMM needs, per expert e, a GEMM whose reduction
axis is that expert's rows of the routed buffer (see `serval.schedule`):

    d_w_gate, d_w_up = d_gate_up[seg].T @ x_rows[seg]    P = 2I (two outputs), Q = H
    d_w_down         = d_y_rows[seg].T  @ (rw * h)[seg]  P = H,               Q = I

A is [R, P] and B is [R, Q], both row-major, so the MMA's left operand A^T
[BP, BK] is read as a [BK, BP] tile and transposed in shared memory (Hopper's
wgmma takes 16-bit operands in either major order, so the transpose is free).

One persistent kernel, `_wgrad_kernel`:
* work item = (expert, output, P-tile, Q-tile): a static count fixed by the
  shapes; each output tile is produced by exactly one program, which walks the
  expert's rows in ascending order, reading the segment bounds from
  `expert_offsets` on the device (no host sync). No split-K, no atomics: the
  result is bitwise deterministic and independent of which program ran what.
* an expert with no rows stores exact zeros (zero K steps, or one discarded step when flattened).
* NUM_OUT = 2 splits the P axis into two outputs [E, P/2, Q] (gate and up),
  each written directly by the kernel: no copy, no views.
* LPT: work items are ordered expert by expert, longest expert first (the
  order computed by every program from `expert_offsets`, ties by expert id, and
  kept in a per-program scratch row), and dealt to the programs in a snake order
  (round r forward, round r+1 backward), so the heavy tiles of a skewed routing
  land on different programs and the light ones fill in behind them. Tiles of
  one expert stay adjacent, so programs running at the same time share that
  expert's A/B rows in L2. Off: plain expert order, round-robin.
* FLATTEN: all K steps of all of a program's tiles run as one software-pipelined
  loop (the next tile's first loads are in flight while the current one
  finishes, as in Triton's older persistent-matmul tutorial); off: a pipelined
  K loop per tile, with a pipeline drain and refill at every tile switch.
  (`tl.range(flatten=True)` does not apply: the inner trip count varies.)
* USE_TMA: tensor descriptors for the A / B tiles and the output tile (Hopper,
  and the Triton >= 3.9 interpreter); otherwise plain pointer loads/stores.
* UPCAST (interpreter only): fp64 dot products and sums (`_dot`): the interpreter's bf16 dot is wrong.
* WINDOW (`WgradWindow`): one launch per window of the rows (`serval.schedule.windows`, the macrobatch
  ring). Per expert, `expert_phase` says how its tiles begin and end: CARRY_IN starts the accumulator from
  the fp32 carry of the previous window instead of zeros, CARRY_OUT stores the fp32 accumulator to the
  next carry instead of the output, FINISH stores the output; an expert with neither CARRY_OUT nor FINISH
  is inactive (sorted after every active expert, its items are never dealt). The carrying experts (at
  most two) sort first and always run tile by tile, FLATTEN or not: in the flattened loop the carry's
  fp32 tile would need 128 KB of shared memory (its layout conversion) on top of the pipeline's.
  K steps start at the expert's first row and windows cut at multiples of block_m (BK divides it), so the
  window launches run the same steps on the same fp32 accumulator as one launch over all rows: the same
  bits. WINDOW is a constexpr: without it none of this is compiled in.

Configs come from a fixed table (`serval.plan.wgrad_config`), never from timing.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from .. import schedule as _schedule
from ..plan import WGRAD_CONFIGS, WgradConfig, wgrad_config
from ..schedule import Schedule
from ..values import WgradWindow
from ..weight_layout import dense_rows
from . import common
from .rows import gather as gather_rows

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# the window phase bits (serval.schedule) as kernel constants, and two unions: an expert's tiles store, carry
_CARRY_IN: tl.constexpr = tl.constexpr(_schedule.CARRY_IN)
_CARRY_OUT: tl.constexpr = tl.constexpr(_schedule.CARRY_OUT)
_FINISH: tl.constexpr = tl.constexpr(_schedule.FINISH)
_STORES: tl.constexpr = tl.constexpr(_schedule.CARRY_OUT | _schedule.FINISH)
_CARRIES: tl.constexpr = tl.constexpr(_schedule.CARRY_IN | _schedule.CARRY_OUT)


# ---------------------------------------------------------------- configs

def _resolve_block_k(config: WgradConfig, block_m: int) -> WgradConfig:
    block_k = min(config.block_k, block_m)
    if block_m % block_k or block_k < 16:
        raise ValueError(f"block_k={config.block_k} does not fit block_m={block_m} "
                         "(needs block_m % block_k == 0, >= 16)")
    return dataclasses.replace(config, block_k=block_k)


# ---------------------------------------------------------------- kernel helpers

@triton.jit
def _window_kind(phase):
    """Window mode, per expert: 2 if its tiles carry (in or out), 1 if they only store the output, 0 if they store
    nothing in this window (inactive)."""
    stores = ((phase & _STORES) != 0).to(tl.int32)
    return stores + stores * ((phase & _CARRIES) != 0).to(tl.int32)


@triton.jit
def _expert_key(offsets_ptr, phase_ptr, e, E, R, LPT: tl.constexpr, WINDOW: tl.constexpr):
    """The sort key of experts `e`, larger first: the row count with LPT, else 0; in a window, raised by R + 1 (more
    than any row count) for a carrying expert, -1 for an inactive one."""
    if LPT:
        key = tl.load(offsets_ptr + e + 1, mask=e < E, other=0) - tl.load(offsets_ptr + e, mask=e < E, other=0)
    else:
        key = tl.zeros_like(e)
    if WINDOW:
        kind = _window_kind(tl.load(phase_ptr + e, mask=e < E, other=0))
        key = tl.where(kind == 0, -1, key + (kind == 2).to(tl.int32) * (R + 1))
    return key


@triton.jit
def _expert_order(offsets_ptr, phase_ptr, order_ptr, E, R, E_PAD: tl.constexpr, CHUNK: tl.constexpr,
                  LPT: tl.constexpr, WINDOW: tl.constexpr):
    """order[s] = the expert of place s when experts are sorted by `_expert_key`, largest first, ties by id.

    Every program computes the same permutation from `expert_offsets` (an O(E^2) compare, once) and
    writes it to its own scratch row, so a tile's expert is one scalar load. Returns rank = order^-1.
    """
    e = tl.arange(0, E_PAD)
    key = _expert_key(offsets_ptr, phase_ptr, e, E, R, LPT, WINDOW)
    rank = tl.zeros([E_PAD], dtype=tl.int32)
    for c in tl.static_range(0, E_PAD, CHUNK):
        f = c + tl.arange(0, CHUNK)
        key_f = _expert_key(offsets_ptr, phase_ptr, f, E, R, LPT, WINDOW)
        longer = key_f[None, :] > key[:, None]
        tie_first = (key_f[None, :] == key[:, None]) & (f[None, :] < e[:, None])
        ahead = (longer | tie_first) & (f < E)[None, :]
        rank += tl.sum(ahead.to(tl.int32), axis=1)
    tl.store(order_ptr + rank, e, mask=e < E)
    tl.debug_barrier()  # the whole CTA reads the row back (global writes before bar.sync are visible after it)
    return rank


@triton.jit
def _tile_coords(t, order_ptr, n_p, n_q, ORDERED: tl.constexpr, NUM_OUT: tl.constexpr, GROUP_P: tl.constexpr):
    """Work item t -> (expert, output, P-tile, Q-tile); items are expert-major (in the scratch row's order when
    ORDERED), P-tiles grouped by GROUP_P."""
    per_out = n_p * n_q
    slot = t // (NUM_OUT * per_out)
    local = t % (NUM_OUT * per_out)
    if ORDERED:
        expert = tl.load(order_ptr + slot, volatile=True)  # volatile: read what this CTA just wrote, not L1
    else:
        expert = slot
    out = local // per_out
    local = local % per_out
    # grouped ordering (as in Triton's matmul tutorial): GROUP_P P-tiles sweep the Q-tiles together
    per_group = GROUP_P * n_q
    first_p = (local // per_group) * GROUP_P
    group_size = tl.minimum(n_p - first_p, GROUP_P)
    pid_p = first_p + (local % per_group) % group_size
    pid_q = (local % per_group) // group_size
    return expert, out, pid_p, pid_q


@triton.jit
def _count_progression(lo, hi, first, step):
    """How many of first, first + step, first + 2 step, ... lie in [lo, hi) (elementwise; lo >= 0)."""
    n_hi = hi - first
    n_lo = lo - first
    return (tl.where(n_hi > 0, (n_hi + step - 1) // step, 0) - tl.where(n_lo > 0, (n_lo + step - 1) // step, 0))


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a^T b. UPCAST (interpreter): the bf16 dot is wrong there, and numpy's fp32 matmul sums in an order
    that depends on the operands' layout, so fp64 products and sums, rounded once per step: layout-free."""
    if UPCAST:
        return acc + tl.dot(tl.trans(a).to(tl.float64), b.to(tl.float64)).to(tl.float32)
    return tl.dot(tl.trans(a), b, acc, input_precision=PRECISION)


@triton.jit
def _load_a(a_desc, a_ptr, row, col, R, P, stride_a, BK: tl.constexpr, BP: tl.constexpr, USE_TMA: tl.constexpr):
    """A tile [BK, BP] at (row, col); columns past P read as zero."""
    if USE_TMA:
        a = a_desc.load([row, col])
    else:
        rows = row + tl.arange(0, BK)
        cols = col + tl.arange(0, BP)
        ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_a + cols[None, :]
        a = tl.load(ptrs, mask=(cols < P)[None, :], other=0.0)
    return a


@triton.jit
def _load_b(b_desc, b_ptr, row, col, Q, stride_b, BK: tl.constexpr, BQ: tl.constexpr, USE_TMA: tl.constexpr):
    """B tile [BK, BQ] at (row, col) of the routed rows."""
    cols = col + tl.arange(0, BQ)
    if USE_TMA:
        b = b_desc.load([row, col])
    else:
        rows = row + tl.arange(0, BK)
        ptrs = b_ptr + rows.to(tl.int64)[:, None] * stride_b + cols[None, :]
        b = tl.load(ptrs, mask=(cols < Q)[None, :], other=0.0)
    return b


@triton.jit
def _store_tile(desc, ptr, c, expert, p0, q0, P_OUT, Q, stride_oe, stride_op,
                BP: tl.constexpr, BQ: tl.constexpr, USE_TMA: tl.constexpr, SUBTILE: tl.constexpr):
    """Write the [BP, BQ] tile at (expert, p0, q0) of an [E, P_OUT, Q] output; the edges are clipped."""
    if USE_TMA:
        if SUBTILE:
            # two halves: the epilogue's shared-memory buffer is half as large (room for one more stage)
            c0, c1 = c.reshape(BP, 2, BQ // 2).permute(0, 2, 1).split()
            desc.store([expert, p0, q0], c0.reshape(1, BP, BQ // 2))
            desc.store([expert, p0, q0 + BQ // 2], c1.reshape(1, BP, BQ // 2))
        else:
            desc.store([expert, p0, q0], c.reshape(1, BP, BQ))
    else:
        p = p0 + tl.arange(0, BP)
        q = q0 + tl.arange(0, BQ)
        ptrs = ptr + expert.to(tl.int64) * stride_oe + p.to(tl.int64)[:, None] * stride_op + q[None, :]
        tl.store(ptrs, c, mask=(p < P_OUT)[:, None] & (q < Q)[None, :])


# ---------------------------------------------------------------- the kernel

@triton.jit
def _store_output(out0_desc, out1_desc, out0_ptr, out1_ptr, c, expert, out, p0, q0, P_OUT, Q, stride_oe, stride_op,
                  NUM_OUT: tl.constexpr, BP: tl.constexpr, BQ: tl.constexpr, USE_TMA: tl.constexpr,
                  SUBTILE: tl.constexpr):
    """Store the finished tile into output `out` (gate or up when NUM_OUT = 2)."""
    if NUM_OUT == 1:
        _store_tile(out0_desc, out0_ptr, c, expert, p0, q0, P_OUT, Q, stride_oe, stride_op, BP, BQ, USE_TMA, SUBTILE)
    elif out == 0:
        _store_tile(out0_desc, out0_ptr, c, expert, p0, q0, P_OUT, Q, stride_oe, stride_op, BP, BQ, USE_TMA, SUBTILE)
    else:
        _store_tile(out1_desc, out1_ptr, c, expert, p0, q0, P_OUT, Q, stride_oe, stride_op, BP, BQ, USE_TMA, SUBTILE)


@triton.jit
def _carry_ptrs(ptr, out, p0, q0, p_end, Q, P_OUT, stride_c, BP: tl.constexpr, BQ: tl.constexpr):
    """Pointers of the [BP, BQ] tile at (out * P_OUT + p0, q0) of a [P, Q] carry, and its mask: p < p_end, q < Q."""
    p = p0 + tl.arange(0, BP)
    q = q0 + tl.arange(0, BQ)
    ptrs = ptr + (out * P_OUT + p).to(tl.int64)[:, None] * stride_c + q[None, :]
    return ptrs, (p < p_end)[:, None] & (q < Q)[None, :]


@triton.jit
def _carry_in(carry_in_ptr, phase, out, p0, q0, P_OUT, Q, stride_c, BP: tl.constexpr, BQ: tl.constexpr):
    """The tile's initial accumulator: its carry with CARRY_IN, else zeros (a load with every row masked off;
    the flag goes into the row bound: the interpreter rejects a tensor mask and-ed with a scalar bool)."""
    p_end = tl.where((phase & _CARRY_IN) != 0, P_OUT, 0)
    ptrs, mask = _carry_ptrs(carry_in_ptr, out, p0, q0, p_end, Q, P_OUT, stride_c, BP, BQ)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _window_store(out0_desc, out1_desc, out0_ptr, out1_ptr, carry_out_ptr, acc, phase, expert, out, p0, q0,
                  P_OUT, Q, stride_oe, stride_op, stride_c, NUM_OUT: tl.constexpr, BP: tl.constexpr,
                  BQ: tl.constexpr, USE_TMA: tl.constexpr, SUBTILE: tl.constexpr):
    """A finished tile in window mode: the fp32 accumulator to the carry (CARRY_OUT), or the output (FINISH)."""
    if (phase & _CARRY_OUT) != 0:
        ptrs, mask = _carry_ptrs(carry_out_ptr, out, p0, q0, P_OUT, Q, P_OUT, stride_c, BP, BQ)
        tl.store(ptrs, acc, mask=mask)
    elif (phase & _FINISH) != 0:
        _store_output(out0_desc, out1_desc, out0_ptr, out1_ptr, common.to_dtype(acc, out0_ptr.dtype.element_ty),
                      expert, out, p0, q0, P_OUT, Q, stride_oe, stride_op, NUM_OUT, BP, BQ, USE_TMA, SUBTILE)


@triton.jit
def _wgrad_kernel(
    a_ptr, b_ptr, offsets_ptr, order_ptr, out0_ptr, out1_ptr, phase_ptr, carry_in_ptr, carry_out_ptr,
    R, P, Q, P_OUT, E,
    stride_a, stride_b, stride_oe, stride_op, stride_c,
    BP: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr, GROUP_P: tl.constexpr,
    NUM_OUT: tl.constexpr, USE_TMA: tl.constexpr, SUBTILE: tl.constexpr,
    LPT: tl.constexpr, FLATTEN: tl.constexpr, WINDOW: tl.constexpr, E_PAD: tl.constexpr, NUM_STAGES: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """out[o][e] = A[seg e, o*P_OUT : (o+1)*P_OUT].T @ B[seg e] for every expert e and output o.

    WINDOW: phase_ptr [E] int32, carry_in_ptr / carry_out_ptr [P, Q] fp32 (see the module docstring), stride_c
    their row stride; else all four None.
    """
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    n_p = tl.cdiv(P_OUT, BP)
    n_q = tl.cdiv(Q, BQ)
    per_expert = NUM_OUT * n_p * n_q
    total = E * per_expert

    a_desc = None
    b_desc = None
    out0_desc = None
    out1_desc = None
    if USE_TMA:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[R, P], strides=[stride_a, 1], block_shape=[BK, BP])
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[R, Q], strides=[stride_b, 1], block_shape=[BK, BQ])
        OUT_BQ: tl.constexpr = BQ // 2 if SUBTILE else BQ
        out0_desc = tl.make_tensor_descriptor(out0_ptr, shape=[E, P_OUT, Q], strides=[stride_oe, stride_op, 1],
                                              block_shape=[1, BP, OUT_BQ])
        if NUM_OUT == 2:
            out1_desc = tl.make_tensor_descriptor(out1_ptr, shape=[E, P_OUT, Q], strides=[stride_oe, stride_op, 1],
                                                  block_shape=[1, BP, OUT_BQ])

    e_idx = tl.arange(0, E_PAD)
    if WINDOW:
        # carrying experts first, then the ones that only finish; the inactive ones last, never dealt
        kind = _window_kind(tl.load(phase_ptr + e_idx, mask=e_idx < E, other=0))
        total = tl.sum((kind > 0).to(tl.int32)) * per_expert
    slot_of_expert = e_idx
    order_ptr += pid * E_PAD
    ORDERED: tl.constexpr = LPT or WINDOW
    if ORDERED:
        slot_of_expert = _expert_order(offsets_ptr, phase_ptr, order_ptr, E, R, E_PAD, CHUNK=min(E_PAD, 32), LPT=LPT,
                                       WINDOW=WINDOW)

    # Items are dealt round by round; with LPT the rounds alternate direction (snake), so the longest
    # tiles, which come first, go one per program. Position in round r, and this program's item count,
    # are computed branch-free: a runtime `if` in the outer loop stopped Triton from pipelining the
    # inner loop's pointer loads (seen in the sm_90 TTGIR).
    # The tile-by-tile loop takes the first `tile_items` items: all of them, or with FLATTEN those of a window's
    # carrying experts (flattened, the carry's fp32 tile would need shared memory the pipelined loop holds).
    snake = 1 if LPT else 0
    tile_items = total
    if FLATTEN and WINDOW:
        tile_items = tl.sum((kind == 2).to(tl.int32)) * per_expert
    full_rounds = tile_items // num_programs
    last_pos = pid + snake * (full_rounds % 2) * (num_programs - 1 - 2 * pid)
    my_rounds = full_rounds + (last_pos < tile_items % num_programs).to(tl.int32)

    if not FLATTEN or WINDOW:
        # one tile at a time: the K loop is software-pipelined, the tile switch is a bubble
        for r in range(0, my_rounds):
            pos = pid + snake * (r % 2) * (num_programs - 1 - 2 * pid)
            expert, out, pid_p, pid_q = _tile_coords(r * num_programs + pos, order_ptr, n_p, n_q, ORDERED, NUM_OUT,
                                                     GROUP_P)
            p0 = pid_p * BP
            q0 = pid_q * BQ
            row_begin = tl.load(offsets_ptr + expert)
            row_end = tl.load(offsets_ptr + expert + 1)

            # the reduction over the expert's rows, ascending: one fixed order, one program per tile
            if WINDOW:
                phase = tl.load(phase_ptr + expert)
                acc = _carry_in(carry_in_ptr, phase, out, p0, q0, P_OUT, Q, stride_c, BP, BQ)
            else:
                acc = tl.zeros([BP, BQ], dtype=tl.float32)
            for row in tl.range(row_begin, row_end, BK, num_stages=NUM_STAGES):
                a = _load_a(a_desc, a_ptr, row, out * P_OUT + p0, R, P, stride_a, BK, BP, USE_TMA)
                b = _load_b(b_desc, b_ptr, row, q0, Q, stride_b, BK, BQ, USE_TMA)
                acc = _dot(a, b, acc, UPCAST, PRECISION)
            if WINDOW:
                _window_store(out0_desc, out1_desc, out0_ptr, out1_ptr, carry_out_ptr, acc, phase, expert, out, p0, q0,
                              P_OUT, Q, stride_oe, stride_op, stride_c, NUM_OUT, BP, BQ, USE_TMA, SUBTILE)
            else:
                _store_output(out0_desc, out1_desc, out0_ptr, out1_ptr,
                              common.to_dtype(acc, out0_ptr.dtype.element_ty), expert, out, p0, q0, P_OUT, Q,
                              stride_oe, stride_op, NUM_OUT, BP, BQ, USE_TMA, SUBTILE)
    if FLATTEN:
        # All K steps of all this program's (remaining) tiles in one pipelined loop, so the next tile's first loads
        # are in flight while the current tile finishes. An empty expert takes one step (on rows 0.., whatever
        # they hold) whose accumulator is replaced by zeros. Step count: per expert, max(steps, 1) times
        # the number of this program's items in its slot (two arithmetic progressions with the snake); in a
        # window only the experts that just finish count (kind 1): the carrying ones went tile by tile, and the
        # inactive ones' items, last in every program's list, are never reached.
        lo = tl.load(offsets_ptr + e_idx, mask=e_idx < E, other=0)
        hi = tl.load(offsets_ptr + e_idx + 1, mask=e_idx < E, other=0)
        steps = tl.maximum((hi - lo) // BK, 1)
        if WINDOW:
            steps = tl.where(kind == 1, steps, 0)
        first_item = slot_of_expert * per_expert
        if LPT:
            mine = (_count_progression(first_item, first_item + per_expert, pid, 2 * num_programs)
                    + _count_progression(first_item, first_item + per_expert, 2 * num_programs - 1 - pid,
                                         2 * num_programs))
        else:
            mine = _count_progression(first_item, first_item + per_expert, pid, num_programs)
        total_steps = tl.sum(tl.where(e_idx < E, steps * mine, 0))

        acc = tl.zeros([BP, BQ], dtype=tl.float32)
        r = -1
        if WINDOW:
            r = my_rounds - 1
        kk = 0
        n_k = 0
        row_base = 0
        empty = 0
        expert = 0
        out = 0
        p0 = 0
        q0 = 0
        for _ in tl.range(0, total_steps, num_stages=NUM_STAGES):
            if kk == 0:  # next tile: scalars only
                r += 1
                pos = pid + snake * (r % 2) * (num_programs - 1 - 2 * pid)
                expert, out, pid_p, pid_q = _tile_coords(r * num_programs + pos, order_ptr, n_p, n_q, ORDERED,
                                                         NUM_OUT, GROUP_P)
                p0 = pid_p * BP
                q0 = pid_q * BQ
                row_begin = tl.load(offsets_ptr + expert)
                row_end = tl.load(offsets_ptr + expert + 1)
                empty = (row_end == row_begin).to(tl.int32)
                n_k = tl.maximum((row_end - row_begin) // BK, 1)
                row_base = row_begin * (1 - empty)
            row = row_base + kk * BK
            a = _load_a(a_desc, a_ptr, row, out * P_OUT + p0, R, P, stride_a, BK, BP, USE_TMA)
            b = _load_b(b_desc, b_ptr, row, q0, Q, stride_b, BK, BQ, USE_TMA)
            acc = _dot(a, b, acc, UPCAST, PRECISION)
            kk += 1
            if kk == n_k:  # tile done: store it and start the next accumulator
                c = common.to_dtype(tl.where(empty != 0, 0.0, acc), out0_ptr.dtype.element_ty)
                _store_output(out0_desc, out1_desc, out0_ptr, out1_ptr, c, expert, out, p0, q0, P_OUT, Q,
                              stride_oe, stride_op, NUM_OUT, BP, BQ, USE_TMA, SUBTILE)
                acc = tl.zeros([BP, BQ], dtype=tl.float32)
                kk = 0


# ---------------------------------------------------------------- host side

def _overlap(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether the storage spans of two contiguous tensors intersect."""
    x0, y0 = x.data_ptr(), y.data_ptr()
    return x0 < y0 + y.numel() * y.element_size() and y0 < x0 + x.numel() * x.element_size()


def check_window(window: WgradWindow, device: torch.device, dtype: torch.dtype, E: int, P: int, Q: int,
                 num_outputs: int) -> None:
    """ValueError unless `window` fits a launch on `device` with a [P, Q] gradient per expert in `num_outputs`
    row blocks of `dtype` (the kernels trust every shape)."""
    tensors = (window.expert_phase, window.carry_in, window.carry_out, *window.outs)
    if any(t.device != device for t in tensors):
        raise ValueError(f"window tensors must be on {device}, got {[str(t.device) for t in tensors]}")
    if window.expert_phase.shape != (E,) or window.expert_phase.dtype != torch.int32:
        raise ValueError(f"window.expert_phase must be [{E}] int32, got {list(window.expert_phase.shape)} "
                         f"{window.expert_phase.dtype}")
    for name in ("carry_in", "carry_out"):
        carry = getattr(window, name)
        if carry.shape != (P, Q) or carry.dtype != torch.float32 or not carry.is_contiguous():
            raise ValueError(f"window.{name} must be a contiguous [{P}, {Q}] fp32 tensor, got "
                             f"{list(carry.shape)} {carry.dtype}{'' if carry.is_contiguous() else ' (strided)'}")
    if _overlap(window.carry_in, window.carry_out):
        raise ValueError("window.carry_in and window.carry_out must be separate buffers")
    if len(window.outs) != num_outputs:
        raise ValueError(f"window.outs has {len(window.outs)} tensors, expected num_outputs={num_outputs}")
    check_outs("window.outs", window.outs, dtype, E, P // num_outputs, Q)


def check_outs(name: str, outs, dtype: torch.dtype, E: int, P_out: int, Q: int) -> None:
    """ValueError unless `outs` are [E, P_out, Q] tensors of `dtype` with dense rows in one layout
    (`serval.weight_layout.dense_rows`: contiguous, or the halves of one [E, 2 P_out, Q] tensor), the kernels' stores."""
    for out in outs:
        if out.shape != (E, P_out, Q) or out.dtype != dtype or not dense_rows(out) or out.stride() != outs[0].stride():
            raise ValueError(f"{name} must be [{E}, {P_out}, {Q}] {dtype} tensors with dense rows, one layout, got "
                             f"{[(list(o.shape), o.dtype, o.stride()) for o in outs]}")


def _tma_ok(*tensors) -> bool:
    """TMA needs a 16-byte aligned base, 16-byte multiple outer strides and a unit inner stride."""
    for t in tensors:
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any(s * t.element_size() % 16 for s in t.stride()[:-1]):
            return False
    return True


def grouped_wgrad(
    a: torch.Tensor,
    b: torch.Tensor,
    schedule: Schedule,
    *,
    num_outputs: int = 1,
    config: WgradConfig | str | None = None,
    use_tma: bool | None = None,
    lpt: bool = True,
    flatten: bool | None = None,
    window: WgradWindow | None = None,
    out: tuple[torch.Tensor, ...] | None = None,
) -> tuple[torch.Tensor, ...]:
    """The kernel's entry point: `num_outputs` tensors [E, P / num_outputs, Q] in a's dtype.

    a [R, P], b [R, Q]: routed rows (R = schedule.capacity), one dtype (bf16, fp16 or fp32). `config` (a WgradConfig
    or a `serval.plan.WGRAD_CONFIGS` name), `use_tma` and `flatten` override the table (benchmarks and tests); `lpt=False` deals tiles in
    plain expert order. None of these change the result.
    `window`: one window of the rows (schedule and a, b are the window's); returns `window.outs`, where only
    the window's FINISH experts are written. `out`: where to write the outputs without a window (`check_outs`:
    e.g. the halves of a joined gate/up gradient, `serval.weight_layout.grad_buffers`); None: new contiguous tensors.
    """
    if a.dtype not in _DTYPES or b.dtype != a.dtype:
        raise TypeError(f"weight_grad kernel takes bf16/fp16/fp32 a and b of one dtype, got {a.dtype}, {b.dtype}")
    R, P = a.shape
    Q = b.shape[1]
    E = schedule.num_experts
    if R != schedule.capacity:
        raise ValueError(f"a has {R} rows, the schedule's capacity is {schedule.capacity}")
    if b.shape[0] != R:
        raise ValueError(f"b has {b.shape[0]} rows, expected the schedule's capacity {R}")
    if P % num_outputs:
        raise ValueError(f"P={P} does not split into {num_outputs} outputs")
    if a.stride(-1) != 1:
        a = a.contiguous()
    if b.stride(-1) != 1:
        b = b.contiguous()
    P_out = P // num_outputs

    if config is None:
        config = wgrad_config(P_out, Q, schedule.block_m, common.INTERPRET)
    elif isinstance(config, str):
        config = WGRAD_CONFIGS[config]
    config = _resolve_block_k(config, schedule.block_m)

    if window is None and out is None:
        outs = tuple(common.empty((E, P_out, Q), a.dtype, a.device) for _ in range(num_outputs))
    elif window is None:
        if len(out) != num_outputs:
            raise ValueError(f"out: {len(out)} tensors for num_outputs={num_outputs}")
        check_outs("out", out, a.dtype, E, P_out, Q)
        outs = tuple(out)
    else:
        check_window(window, a.device, a.dtype, E, P, Q, num_outputs)
        outs = window.outs
    if use_tma is None:
        use_tma = common.supports_tma() and a.is_cuda
    use_tma = use_tma and _tma_ok(a, b, *outs)
    if use_tma and a.is_cuda:
        common.install_tma_allocator()

    n_tiles = E * num_outputs * common.cdiv(P_out, config.block_p) * common.cdiv(Q, config.block_q)
    grid = (min(n_tiles, common.num_sms(a.device.index if a.is_cuda else None)),)
    e_pad = triton.next_power_of_2(E)
    # per-program scratch row for the expert order (LPT or window); never read before the same program writes it
    order = torch.empty(grid[0] * e_pad if lpt or window is not None else 1, dtype=torch.int32, device=a.device)
    if flatten is None:
        flatten = config.flatten
    phase, carry_in, carry_out, stride_c = (None,) * 4 if window is None else (
        window.expert_phase, window.carry_in, window.carry_out, window.carry_in.stride(0))
    _wgrad_kernel[grid](
        a, b, schedule.expert_offsets, order, outs[0], outs[-1], phase, carry_in, carry_out,
        R, P, Q, P_out, E,
        a.stride(0), b.stride(0), outs[0].stride(0), outs[0].stride(1), stride_c,
        BP=config.block_p, BQ=config.block_q, BK=config.block_k, GROUP_P=config.group_p,
        NUM_OUT=num_outputs, USE_TMA=use_tma, SUBTILE=config.epilogue_subtile and use_tma,
        LPT=lpt, FLATTEN=flatten, WINDOW=window is not None, E_PAD=e_pad, NUM_STAGES=config.num_stages,
        UPCAST=common.INTERPRET,
        # fp32 inputs (tests) get true fp32 products; 16-bit inputs ignore it on the GPU
        PRECISION="ieee" if a.dtype == torch.float32 or common.INTERPRET else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return outs


# ---------------------------------------------------------------- the stages (same signatures as serval.stages)

def gate_up_weight_grad(d_gate_up: torch.Tensor, x: torch.Tensor, schedule: Schedule, *, x_rows=None,
                        config=None, window: WgradWindow | None = None,
                        out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(d_w_gate, d_w_up) [E, I, H] each = d_gate_up[seg].T @ x_rows[seg]; d_gate_up [R, 2I], x [N, H].

    x_rows [R, H]: the rows already gathered (at EP: pulled); otherwise x is regathered by the row kernel
    (a gather pass and TMA reads of its rows run faster than gathering with pointer loads in this kernel).
    `window`: one window of the rows (see `grouped_wgrad`); returns window.outs (gate, up). `out`: the
    (d_w_gate, d_w_up) to write (`serval.weight_layout.grad_buffers`); None: two new tensors.
    """
    x_rows = gather_rows(x, schedule) if x_rows is None else x_rows
    return grouped_wgrad(d_gate_up, x_rows, schedule, num_outputs=2, config=config, window=window, out=out)


def down_weight_grad(d_y_rows: torch.Tensor, h_weighted: torch.Tensor, schedule: Schedule, *, config=None,
                     window: WgradWindow | None = None) -> torch.Tensor:
    """d_w_down [E, H, I] = d_y_rows[seg].T @ h_weighted[seg]; d_y_rows [R, H], h_weighted [R, I].

    Its tiles: `serval.plan.wgrad_config` for the down gradient. `window`: one window of the rows (see
    `grouped_wgrad`); returns window.outs[0].
    """
    if config is None:
        config = wgrad_config(d_y_rows.shape[1], h_weighted.shape[1], schedule.block_m, common.INTERPRET, down=True)
    return grouped_wgrad(d_y_rows, h_weighted, schedule, config=config, window=window)[0]
