"""The Triton engine: one persistent grouped-GEMM kernel over the schedule's M-tiles, for every GEMM stage.

`_grouped_gemm_kernel` walks the output tiles of one stage and runs each through `gemm_tile.gemm_tile`, the
tile body the fused pass runs too; the stage is a constexpr `gemm_tile.Variant` (the weight layout, a K split
over two weights, the epilogue: plain store or push into the owners' slots, SwiGLU forward, SwiGLU backward with
the router-weight gradient) on a constexpr `gemm_tile.Tile`, so the compiler specialises each use. What this
module adds is the walk and the launch:

* Persistent: the grid is one program per SM (fewer when the capacity has fewer tiles); program p takes tiles
  p, p + programs, ... of the used tiles only. The used-tile count is read on the device (expert_offsets[E] //
  BLOCK_M): no host sync, idle capacity costs nothing. Tiles are visited GROUP_M M-tiles at a time across all
  N-tiles (`common.tile_coords`), so the SMs working at once share weight tiles (one expert's) and A tiles in L2.
  FLATTEN lets the pipeliner overlap a tile's epilogue with the next tile's loads.
* pull (at expert parallelism, the gate/up GEMM and the down dgrad): the dispatch inside the GEMM: the first
  `PULL.PROGRAMS` programs pull A's rows M-tile by M-tile from the owners' token buffers and publish each with a
  flag the compute programs wait for (`in_gemm_pull`).
* The stages on this engine (`gate_up_swiglu`, `down`, `down_dgrad_swiglu_partials`, `gate_up_dgrad`) and
  `sum_partials`, which adds the router-weight gradient's row partials in ascending column order.

Determinism: every output element is written by exactly one program, whichever SM ran its tile. Tile
configurations come from the `serval.plan.KernelPlan`, never from timing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..peers import PeerSlots
from ..plan import TileConfig
from ..schedule import Schedule
from . import common, in_gemm_pull
from .gemm_tile import (Operands, Outputs, SwigluBackwardInputs, Variant, check_d_rw_chunks, check_operands,
                        descriptors, gemm_tile, new_d_rw_partial, operand_rows, push_to, schedule_tables, tile,
                        tma_compatible, weights_in_place)


@triton.jit
def _grouped_gemm_kernel(ops, sched, swiglu_bwd, push, pull, swiglu_limit, V: tl.constexpr, T: tl.constexpr,
                         PULL: tl.constexpr, GROUP_M: tl.constexpr, COMPUTE_PROGRAMS: tl.constexpr,
                         FLATTEN: tl.constexpr):
    """Every used output tile of one stage (`gemm_tile.Operands` ops in variant V on tile T), COMPUTE_PROGRAMS
    programs walking them; with pull (`in_gemm_pull.PullTables`, PULL its `PullSteps`) the first PULL.PROGRAMS
    programs pull A's rows instead."""
    BLOCK_M: tl.constexpr = T.BLOCK_M
    BLOCK_N: tl.constexpr = T.BLOCK_N
    # used tiles only: the count lives on the device, no host sync
    num_m_tiles = tl.load(sched.expert_offsets + sched.num_experts) // BLOCK_M
    num_n_tiles = tl.cdiv(ops.n_out, BLOCK_N)
    num_tiles = num_m_tiles * num_n_tiles
    descs = descriptors(ops, sched, push, V, T)

    first_tile = tl.program_id(0)
    if PULL is not None:
        PULL_PROGRAMS: tl.constexpr = PULL.PROGRAMS
        PRINT_TIMEOUTS: tl.constexpr = PULL.PRINT_TIMEOUTS
        epoch = tl.load(pull.epoch)
        if tl.program_id(0) < PULL_PROGRAMS:
            in_gemm_pull.pull_tiles(pull, ops.a, sched.row_source, epoch, num_m_tiles, ops.k, BLOCK_M, PULL)
        first_tile = tl.where(tl.program_id(0) < PULL_PROGRAMS, num_tiles, tl.program_id(0) - PULL_PROGRAMS)
    for tile_id in tl.range(first_tile, num_tiles, COMPUTE_PROGRAMS, flatten=FLATTEN):
        m_tile, n_tile = common.tile_coords(tile_id, num_m_tiles, num_n_tiles, GROUP_M)
        if PULL is not None:
            in_gemm_pull.wait_for_rows(pull.flags + m_tile, epoch, m_tile, PRINT_TIMEOUTS)
        gemm_tile(descs, m_tile, n_tile, ops, sched, swiglu_bwd, push, swiglu_limit, V, T)


@triton.jit
def _sum_partials_kernel(partial_ptr, out_ptr, expert_offsets_ptr, num_experts, num_rows, num_cols,
                         BLOCK_R: tl.constexpr):
    """out[r] = sum_j partial[r, j], j ascending (one fixed order); 0 on rows past the used tiles."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    used = rows < tl.load(expert_offsets_ptr + num_experts)
    total = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for j in range(0, num_cols):
        total += tl.load(partial_ptr + rows.to(tl.int64) * num_cols + j, mask=used, other=0.0)
    tl.store(out_ptr + rows, total, mask=rows < num_rows)


# ---------------------------------------------------------------- host side


def tma_operands(ops: Operands, variant: Variant, pushes: bool) -> list:
    """(tensor, column offset) of every operand a GEMM reads or writes through TMA (the packed gate_up never)."""
    operands = [(ops.w.w0, 0), (ops.w.w1, 0), (ops.a.ptr, 0)] + ([(ops.a.ptr, ops.k)] if variant.K_SPLIT else [])
    if variant.EPILOGUE == "store" and not pushes:
        operands += [(ops.out.c, 0)]
    if variant.EPILOGUE == "swiglu_bwd":
        operands += [(ops.out.c, 0), (ops.out.c, ops.n_out)]
    if ops.out.h is not None:
        operands += [(ops.out.h, 0)]
    return operands


def _launch(ops: Operands, variant: Variant, schedule: Schedule, tiles: TileConfig, use_tma: bool, *,
            swiglu_limit=None, swiglu_bwd: SwigluBackwardInputs | None = None, push: PeerSlots | None = None,
            pull: in_gemm_pull.Pull | None = None):
    """Launch the persistent grid for one stage; outputs are written in place (ops.out, or with push the
    peers' slot buffers). use_tma: TMA where every operand allows it."""
    block_m = min(tiles.block_m, schedule.block_m)
    if schedule.block_m % block_m:
        raise ValueError(f"tile rows {block_m} must divide the schedule's block_m {schedule.block_m}")
    use_tma = use_tma and tma_compatible(*tma_operands(ops, variant, push is not None))
    if use_tma and not common.INTERPRET:
        common.install_tma_allocator()
    sms = common.num_sms(ops.a.ptr.device.index)
    max_tiles = (schedule.capacity // block_m) * common.cdiv(ops.n_out, tiles.block_n)
    num_programs = max(1, min(sms, max_tiles))
    pull_tables = pull_steps = None
    if pull is not None:
        num_programs = sms  # every program resident at once, pull programs first
        pull_tables, pull_steps = in_gemm_pull.kernel_arguments(
            pull, ops.k, num_programs, schedule.capacity // block_m, use_tma and not common.INTERPRET,
            common.INTERPRET)
    _grouped_gemm_kernel[(num_programs,)](
        ops, schedule_tables(schedule, packed=variant.EPILOGUE != "store"), swiglu_bwd, push_to(push), pull_tables,
        float(swiglu_limit) if swiglu_limit is not None else 0.0,
        V=variant, T=tile(tiles, block_m, use_tma, tma_stores=True), PULL=pull_steps, GROUP_M=tiles.group_m,
        COMPUTE_PROGRAMS=num_programs - (0 if pull_steps is None else pull_steps.PROGRAMS), FLATTEN=tiles.flatten,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )


def _output(schedule: Schedule, cols: int, like: torch.Tensor, push_to: PeerSlots | None) -> Outputs:
    """A "store" stage's output: [R, cols] rows, or (pushing) the owners' slots, where nothing local is written."""
    if push_to is None:
        out = common.empty((schedule.capacity, cols), like.dtype, like.device)
        return Outputs(out, out.stride(0))
    if push_to.cols != cols or push_to.dtype != like.dtype:
        raise ValueError(f"push_to: slot buffers of [{push_to.cols}] {push_to.dtype} columns, the GEMM makes "
                         f"[{cols}] {like.dtype}")
    return Outputs(None, cols)


# ---------------------------------------------------------------- the stages on this engine


def gate_up_swiglu(a_rows, w_gate, w_up, schedule: Schedule, swiglu_limit: float | None, tiles: TileConfig,
                   use_tma: bool, *, pull: in_gemm_pull.Pull | None = None):
    """Gate/up GEMM + SwiGLU.

    a_rows [R, H]: the schedule's rows of x (with `pull`, an empty buffer the GEMM's communication programs
    fill from the owners' token buffers); w_gate, w_up [E, I, H]; all one dtype. Returns gate_up
    [num_packed, 2I] (packed rows, kept for backward) and h = SwiGLU(gate, up) [R, I]."""
    check_operands(a_rows, w_gate, w_up)
    _, inter, hidden = w_gate.shape
    gate_up = common.empty((schedule.num_packed, 2 * inter), a_rows.dtype, a_rows.device)
    h = common.empty((schedule.capacity, inter), a_rows.dtype, a_rows.device)
    ops = Operands(operand_rows(a_rows), weights_in_place(w_gate, w_up), Outputs(gate_up, gate_up.stride(0), h), inter,
                   hidden)
    _launch(ops, Variant(True, False, "swiglu_fwd", swiglu_limit is not None), schedule, tiles, use_tma,
            swiglu_limit=swiglu_limit, pull=pull)
    return gate_up, h


def down(h, w_down, schedule: Schedule, tiles: TileConfig, use_tma: bool, *, push_to: PeerSlots | None = None):
    """Down GEMM: h [R, I], w_down [E, H, I] -> o [R, H] = h @ w_down[e].T; with push_to, row r goes to its
    owner's slot row_source[r] instead and nothing is returned."""
    check_operands(h, w_down)
    hidden, inter = w_down.shape[1:]
    out = _output(schedule, hidden, h, push_to)
    ops = Operands(operand_rows(h), weights_in_place(w_down), out, hidden, inter)
    _launch(ops, _store_variant(False, push_to), schedule, tiles, use_tma, push=push_to)
    return None if push_to is not None else out.c


def _store_variant(k_split: bool, push: PeerSlots | None) -> Variant:
    """A "store" stage's variant: down (W_NK) or the gate/up dgrad (K_SPLIT), its pushes 16-byte where aligned."""
    return Variant(not k_split, k_split, "store", False, PUSH_ALIGNED=push is not None and push.aligned)


def down_dgrad_swiglu_partials(d_y_rows, w_down, gate_up, router_weights, schedule: Schedule,
                               swiglu_limit: float | None, tiles: TileConfig, use_tma: bool, *,
                               pull: in_gemm_pull.Pull | None = None):
    """Down dgrad + SwiGLU backward: d_y_rows [R, H], w_down [E, H, I], gate_up [num_packed, 2I] (packed),
    router_weights fp32 [N * k] (by source). Returns d_gate_up [R, 2I], h_weighted = rw * h [R, I] and the
    router-weight gradient's row partials fp32 [R, ceil(I / 16)] (`sum_partials` reduces them). With
    `pull`, d_y_rows is the contiguous buffer the GEMM's communication programs fill (as gate_up_swiglu's)."""
    check_operands(d_y_rows, w_down, gate_up)
    hidden, inter = w_down.shape[1:]
    num_rows = schedule.capacity
    check_d_rw_chunks("tiles", tiles.block_n, tiles.epi_split)
    d_gate_up = common.empty((num_rows, 2 * inter), gate_up.dtype, gate_up.device)
    h_weighted = common.empty((num_rows, inter), gate_up.dtype, gate_up.device)
    d_rw_partial = new_d_rw_partial(num_rows, inter, gate_up.device)
    ops = Operands(operand_rows(d_y_rows), weights_in_place(w_down),
                   Outputs(d_gate_up, d_gate_up.stride(0), h_weighted), inter, hidden)
    _launch(ops, Variant(False, False, "swiglu_bwd", swiglu_limit is not None), schedule, tiles, use_tma,
            swiglu_limit=swiglu_limit, swiglu_bwd=SwigluBackwardInputs(gate_up.contiguous(), router_weights,
                                                                       d_rw_partial), pull=pull)
    return d_gate_up, h_weighted, d_rw_partial


def sum_partials(d_rw_partial, schedule: Schedule):
    """d_rw_rows fp32 [R]: each row's partials [R, n] (`gemm_tile.new_d_rw_partial`) added in ascending column
    order."""
    num_rows, num_groups = d_rw_partial.shape
    d_rw_rows = common.empty((num_rows,), torch.float32, d_rw_partial.device)
    block_r = 128
    _sum_partials_kernel[(common.cdiv(num_rows, block_r),)](
        d_rw_partial, d_rw_rows, schedule.expert_offsets, schedule.num_experts, num_rows, num_groups,
        BLOCK_R=block_r)
    return d_rw_rows


def gate_up_dgrad(d_gate_up, w_gate, w_up, schedule: Schedule, tiles: TileConfig, use_tma: bool, *,
                  push_to: PeerSlots | None = None):
    """Gate/up dgrad: d_gate_up [R, 2I], w_gate, w_up [E, I, H] -> d_x_rows [R, H] = d_gate @ w_gate[e] +
    d_up @ w_up[e], one accumulation over K = 2I; with push_to, pushed into the owners' slots (as down)."""
    check_operands(d_gate_up, w_gate, w_up)
    inter, hidden = w_gate.shape[1:]
    out = _output(schedule, hidden, d_gate_up, push_to)
    ops = Operands(operand_rows(d_gate_up), weights_in_place(w_gate, w_up), out, hidden, inter)
    _launch(ops, _store_variant(True, push_to), schedule, tiles, use_tma, push=push_to)
    return None if push_to is not None else out.c
