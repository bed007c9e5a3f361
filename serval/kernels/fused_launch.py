"""The fused pass's host side (`fused_pass` holds the kernel): `fused_forward` and `fused_backward` check their
arguments (a clear error naming the one that is off, before anything runs), make the outputs, build the kernel's
bundles in one place (`_launch`) and launch it.

Constraints: both TileConfigs must give the same BLOCK_M (min(block_m, schedule.block_m)); one launch has one
num_warps and num_stages: the forward's gate/up config's, the backward's gate/up dgrad config's (the other GEMM's
tiles compile with them: checked for the plan's Hopper tiles). F stores with pointer stores whatever
`epi_tma_stores` says (its release then covers them with one proxy fence); S follows its config. `flatten` of
either config and S's `group_m` do not apply (the task loop is a while loop over ids; one M-group serves both
GEMMs). Operands: bf16, fp16 or fp32, one dtype, as the staged GEMM.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..peers import PeerSlots
from ..plan import TileConfig
from ..schedule import Schedule
from . import common, in_gemm_pull
from ..values import Sync
from .fused_pass import ExpertGroup, Pass, SyncTables, fused_pass_kernel
from .gemm_tile import (Operands, Outputs, SwigluBackwardInputs, Variant, check_d_rw_chunks, check_operands,
                        new_d_rw_partial, push_to as push_bundle, operand_rows, schedule_tables, tile, tma_compatible,
                        weights_in_place)
from .task_order import minibatch_m_tiles
from .triton_gemm import tma_operands

MXFP8_BLOCK = 32  # quant_block of the mxfp8 passes: elements per E8M0 scale (`serval.precision`'s "mxfp8")


class SharedExpert(NamedTuple):
    """The shared expert's part of a fused pass: its two GEMMs' tiles join the launch's tasks, before the routed
    ones (they need no pulled rows: at EP they fill the time while the routed rows arrive). schedule:
    `schedule.dense_schedule(N, block_m)` (the routed schedule's block_m: rows = tokens, never moved); rows
    [Rs, H]: its rows of x (forward) or d_y (backward), Rs = schedule.capacity, padding rows zero
    (`rows.gather`); w_gate, w_up [1, Is, H] and w_down [1, H, Is] (a one-expert group); gate_up: backward only,
    the forward's packed pre-activations [N, 2Is]."""

    rows: torch.Tensor
    schedule: Schedule
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    gate_up: torch.Tensor | None = None


# ---------------------------------------------------------------- checks


def _check_tiles(what: str, name: str, tiles) -> None:
    if not isinstance(tiles, TileConfig):
        raise TypeError(f"{what}: {name} must be a serval.plan.TileConfig, got {type(tiles).__name__}")
    if tiles.epi_split not in (1, 2, 4) or tiles.block_n % tiles.epi_split:
        raise ValueError(f"{what}: {name}.epi_split must be 1, 2 or 4 and divide block_n {tiles.block_n}, "
                         f"got {tiles.epi_split}")


def _check_sync(what: str, sync, num_m_tiles: int, device) -> None:
    if not isinstance(sync, Sync):
        raise TypeError(f"{what}: sync must be a fused_pass.Sync (new_sync), got {type(sync).__name__}")
    shapes = {"counters": (2,), "flags": (2, sync.flags.shape[-1] if sync.flags.dim() == 2 else -1), "epoch": (1,)}
    for field, shape in shapes.items():
        t = getattr(sync, field)
        if t.dtype != torch.int32 or tuple(t.shape) != shape or t.device != device or not t.is_contiguous():
            raise ValueError(f"{what}: sync.{field} must be a contiguous int32 {list(shape)} tensor on {device} "
                             f"(new_sync), got {t.dtype} {list(t.shape)} on {t.device}")
    if sync.flags.shape[1] < num_m_tiles:
        raise ValueError(f"{what}: sync.flags holds {sync.flags.shape[1]} M-tiles per epoch, the schedules have "
                         f"{num_m_tiles} (capacity // block_m, the shared expert's included): allocate it with "
                         f"new_sync({num_m_tiles})")


def _check_weights(what: str, a_rows, schedule: Schedule, w_gate, w_up, w_down, a_name: str) -> tuple[int, int]:
    """(I, H) of the layer, or ValueError / TypeError naming the argument that is off."""
    check_operands(a_rows, w_gate, w_up, w_down)
    for name, t in ((a_name, a_rows), ("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        ndim = 2 if name == a_name else 3
        if t.dim() != ndim:
            raise ValueError(f"{what}: {name} must be {ndim}-D, got {list(t.shape)}")
        if t.device != a_rows.device:
            raise ValueError(f"{what}: {name} is on {t.device}, {a_name} on {a_rows.device}")
    num_experts, inter, hidden = w_gate.shape
    if tuple(w_up.shape) != tuple(w_gate.shape):
        raise ValueError(f"{what}: w_up must be [E, I, H] = {list(w_gate.shape)} as w_gate, got {list(w_up.shape)}")
    if tuple(w_down.shape) != (num_experts, hidden, inter):
        raise ValueError(f"{what}: w_down must be [E, H, I] = {[num_experts, hidden, inter]}, "
                         f"got {list(w_down.shape)}")
    if num_experts != schedule.num_experts:
        raise ValueError(f"{what}: the weights hold {num_experts} experts, the schedule {schedule.num_experts}")
    if tuple(a_rows.shape) != (schedule.capacity, hidden):
        raise ValueError(f"{what}: {a_name} must be [schedule.capacity, H] = {[schedule.capacity, hidden]}, "
                         f"got {list(a_rows.shape)}")
    return inter, hidden


def _check_shared(what: str, shared, a_rows, hidden: int, block_m: int, backward: bool) -> int:
    """The shared expert's Is, or ValueError / TypeError naming the argument that is off."""
    if not isinstance(shared, SharedExpert):
        raise TypeError(f"{what}: shared must be None or a fused_launch.SharedExpert, got {type(shared).__name__}")
    rows, schedule = shared.rows, shared.schedule
    for name in ("rows", "w_gate", "w_up", "w_down") + (("gate_up",) if backward else ()):
        t = getattr(shared, name)
        if not isinstance(t, torch.Tensor) or t.dtype != a_rows.dtype or t.device != a_rows.device:
            raise ValueError(f"{what}: shared.{name} must be a {a_rows.dtype} tensor on {a_rows.device}, got "
                             + (f"{t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__))
    if schedule.num_experts != 1 or schedule.block_m % block_m or schedule.capacity < 1:
        raise ValueError(f"{what}: shared.schedule must be a dense_schedule(N, block_m) with block_m a multiple of "
                         f"the tile rows {block_m}, got {schedule.num_experts} experts, capacity {schedule.capacity}, "
                         f"block_m {schedule.block_m}")
    if tuple(rows.shape) != (schedule.capacity, hidden):
        raise ValueError(f"{what}: shared.rows must be [shared.schedule.capacity, H] = {[schedule.capacity, hidden]}, "
                         f"got {list(rows.shape)}")
    if shared.w_gate.dim() != 3 or shared.w_gate.shape[0] != 1 or shared.w_gate.shape[2] != hidden:
        raise ValueError(f"{what}: shared.w_gate must be [1, Is, H] (H = {hidden}), got {list(shared.w_gate.shape)}")
    inter = shared.w_gate.shape[1]
    for name, shape in (("w_up", (1, inter, hidden)), ("w_down", (1, hidden, inter))) + (
            (("gate_up", (schedule.num_packed, 2 * inter)),) if backward else ()):
        if tuple(getattr(shared, name).shape) != shape:
            raise ValueError(f"{what}: shared.{name} must be {list(shape)}, got {list(getattr(shared, name).shape)}")
    return inter


def _check_quant_block(what: str, quant_block, a_rows, inter: int, first_name: str, first: TileConfig,
                       backward: bool) -> None:
    """ValueError unless quant_block is 0, or an mxfp8 block the launch can quantize in its epilogues: whole blocks
    per epilogue chunk, and (backward) per half of d_gate_up."""
    if not isinstance(quant_block, int) or isinstance(quant_block, bool) or quant_block not in (0, MXFP8_BLOCK):
        raise ValueError(f"{what}: quant_block must be 0 or {MXFP8_BLOCK} (mxfp8), got {quant_block!r}")
    if quant_block == 0:
        return
    if a_rows.dtype != torch.bfloat16:
        raise ValueError(f"{what}: quant_block needs bf16 operands, got {a_rows.dtype}")
    if (first.block_n // first.epi_split) % quant_block:
        raise ValueError(f"{what}: with quant_block {quant_block}, {first_name}'s epilogue chunks (block_n "
                         f"{first.block_n} // epi_split {first.epi_split}) must be a multiple of {quant_block} columns")
    if backward and inter % quant_block:
        raise ValueError(f"{what}: with quant_block {quant_block}, I = {inter} must be a multiple of it (a block of "
                         f"d_gate_up must not straddle its gate and up halves)")


def _check_launch(what: str, a_rows, schedule: Schedule, hidden: int, swiglu_limit, minibatch_rows, tiles: dict,
                  sync, pull, push_to, a_name: str, shared, backward: bool, inter: int = 0,
                  quant_block: int = 0) -> tuple[int, int | None]:
    """The launch's BLOCK_M and the shared expert's Is (None without one), or ValueError / TypeError naming the
    argument that is off. tiles: {name: TileConfig} of the first and the second GEMM."""
    if swiglu_limit is not None and (isinstance(swiglu_limit, bool) or not isinstance(swiglu_limit, (int, float))):
        raise ValueError(f"{what}: swiglu_limit must be None or a float, got {swiglu_limit!r}")
    if minibatch_rows is not None and (not isinstance(minibatch_rows, int) or isinstance(minibatch_rows, bool)
                                       or minibatch_rows < 1):
        raise ValueError(f"{what}: minibatch_rows must be None or an int >= 1, got {minibatch_rows!r}")
    for name, t in tiles.items():
        _check_tiles(what, name, t)
    (first_name, first), (second_name, second) = tiles.items()
    _check_quant_block(what, quant_block, a_rows, inter, first_name, first, backward)
    block_m = min(first.block_m, schedule.block_m)
    if min(second.block_m, schedule.block_m) != block_m:
        raise ValueError(f"{what}: {first_name} and {second_name} must have one block_m (after min with the "
                         f"schedule's {schedule.block_m}), got {first.block_m} and {second.block_m}")
    if schedule.block_m % block_m:
        raise ValueError(f"{what}: tile rows {block_m} must divide the schedule's block_m {schedule.block_m}")
    capacity_m_tiles = schedule.capacity // block_m
    shared_inter = None if shared is None else _check_shared(what, shared, a_rows, hidden, block_m, backward)
    shared_m_tiles = 0 if shared is None else shared.schedule.capacity // block_m
    _check_sync(what, sync, capacity_m_tiles + shared_m_tiles, a_rows.device)
    if pull is not None:
        if not a_rows.is_contiguous():
            raise ValueError(f"{what}: with pull, {a_name} is the buffer the pull fills: it must be contiguous")
        if pull.source.cols != hidden or pull.source.dtype != a_rows.dtype:
            raise ValueError(f"{what}: pull.source holds [{pull.source.cols}] {pull.source.dtype} tokens, "
                             f"{a_name} [{hidden}] {a_rows.dtype} rows")
        if pull.flags.numel() < capacity_m_tiles or pull.programs < 1:
            raise ValueError(f"{what}: pull needs programs >= 1 and a flag per M-tile ({capacity_m_tiles}), "
                             f"got {pull.programs} programs and {pull.flags.numel()} flags")
    if push_to is not None and (push_to.cols != hidden or push_to.dtype != a_rows.dtype):
        raise ValueError(f"{what}: push_to holds [{push_to.cols}] {push_to.dtype} slots, the second GEMM makes "
                         f"[{hidden}] {a_rows.dtype} rows")
    return block_m, shared_inter


def _launch(routed: ExpertGroup, shared: ExpertGroup | None, *, backward: bool, schedule: Schedule,
            shared_schedule: Schedule | None, swiglu_limit, first_tiles: TileConfig, second_tiles: TileConfig,
            launch_tiles: TileConfig, use_tma: bool, minibatch_rows, sync: Sync, pull, push_to, debug_waits: bool,
            block_m: int, quant_block: int):
    """One launch of `fused_pass.fused_pass_kernel` on the groups' bundles (arguments checked by the callers);
    launch_tiles: whose num_warps and num_stages the launch takes; pull: with quant_block, the pull's round trip
    and its rows as pulled (`in_gemm_pull.Pull`) set by the caller."""
    first = Variant(not backward, False, "swiglu_bwd" if backward else "swiglu_fwd", swiglu_limit is not None,
                    QUANT_BLOCK=quant_block)
    second = Variant(not backward, backward, "store", swiglu_limit is not None,
                     PUSH_ALIGNED=push_to is not None and push_to.aligned)
    operands = [*tma_operands(routed.first, first, False), *tma_operands(routed.second, second, push_to is not None)]
    if shared is not None:
        operands += [*tma_operands(shared.first, first, False), *tma_operands(shared.second, second, False)]
    use_tma = use_tma and tma_compatible(*operands)
    if use_tma and not common.INTERPRET:
        common.install_tma_allocator()
    hidden, inter = routed.first.k, routed.first.n_out
    sms = common.num_sms(routed.first.a.ptr.device.index)
    capacity_m_tiles = schedule.capacity // block_m
    n_second = common.cdiv(hidden, second_tiles.block_n)
    max_tasks = capacity_m_tiles * (common.cdiv(inter, first_tiles.block_n) + n_second)
    shared_m_tiles = 0
    if shared is not None:
        shared_m_tiles = shared_schedule.capacity // block_m
        max_tasks += shared_m_tiles * (common.cdiv(shared.first.n_out, first_tiles.block_n) + n_second)
    num_programs = max(1, min(sms, max_tasks))
    pull_tables = pull_steps = None
    if pull is not None:
        num_programs = sms  # every program resident at once, the pull programs first
        pull_tables, pull_steps = in_gemm_pull.kernel_arguments(
            pull, hidden, num_programs, capacity_m_tiles, use_tma and not common.INTERPRET,
            debug_waits or common.INTERPRET)
    if max_tasks + 2 * num_programs >= 2**31:
        raise ValueError(f"fused pass: {max_tasks} tasks do not fit the int32 task counter")
    # one minibatch size for both expert groups; clamped only where one minibatch holds every M-tile of both
    mb, group_m = minibatch_m_tiles(minibatch_rows, hidden, inter, block_m, max(capacity_m_tiles, shared_m_tiles, 1),
                                    first_tiles.block_n, second_tiles.block_n, first_tiles.group_m,
                                    sms - (0 if pull_steps is None else pull_steps.PROGRAMS))
    constants = Pass(first, second, tile(first_tiles, block_m, use_tma, tma_stores=False),
                     tile(second_tiles, block_m, use_tma, tma_stores=True), mb, group_m, num_programs,
                     use_tma and not common.INTERPRET, debug_waits or common.INTERPRET, shared is not None)
    sync.epoch.add_(1)
    fused_pass_kernel[(num_programs,)](
        routed, shared, SyncTables(sync.counters, sync.flags, sync.flags.shape[1], sync.epoch), pull_tables,
        push_bundle(push_to), float(swiglu_limit) if swiglu_limit is not None else 0.0, P=constants, PULL=pull_steps,
        num_warps=launch_tiles.num_warps, num_stages=launch_tiles.num_stages,
    )


def fused_forward(a_rows: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                  schedule: Schedule, swiglu_limit: float | None, gate_up_tiles: TileConfig, down_tiles: TileConfig,
                  use_tma: bool, minibatch_rows: int | None, sync: Sync, *, pull: in_gemm_pull.Pull | None = None,
                  push_to: PeerSlots | None = None, shared: SharedExpert | None = None, quant_block: int = 0,
                  debug_waits: bool = False):
    """Gate/up + SwiGLU and down in one persistent launch: (gate_up, h, o, shared_out), bit for bit
    `triton_gemm.gate_up_swiglu(a_rows, w_gate, w_up, schedule, swiglu_limit, gate_up_tiles, use_tma)` followed by
    `triton_gemm.down(h, w_down, schedule, down_tiles, use_tma)`.

    a_rows [R, H]: the schedule's rows of x (R = schedule.capacity; padding rows zero, as `rows.gather` leaves
    them); w_gate, w_up [E, I, H], w_down [E, H, I]; all one dtype (bf16, fp16 or fp32), on one device.
    swiglu_limit: None or a float (SwiGLU's clamp). gate_up_tiles / down_tiles: each GEMM's tiles (one BLOCK_M;
    num_warps and num_stages are gate_up_tiles'). use_tma: TMA where the operands allow it. minibatch_rows: rows
    per minibatch of the task order (whole M-tiles, at least one; None: MoK's rule on all SMs). sync: `new_sync`
    (flags for at least capacity // BLOCK_M M-tiles), reused across calls; the call bumps its epoch on the device.
    debug_waits: a down tile whose wait times out prints its M-tile before it traps; without, it only traps (the
    printf is a call, which makes ptxas serialize every wgmma of the kernel: see `in_gemm_pull.wait_until`).

    At expert parallelism, the dispatch and the combine join the launch. pull: the first `pull.programs`
    programs pull x's rows from the owners' token buffers into a_rows (then a contiguous buffer whose contents are
    not read before), M-tile by M-tile, publishing each with a flag the gate/up tiles wait for (`in_gemm_pull`);
    they take no tasks. push_to: each down row goes straight into its owner's slot row_source[r], as
    `triton_gemm.down(..., push_to=)` writes it, and o is not made. The launch then holds every SM (the pull
    programs must run beside the compute programs).

    shared: the shared expert's gate/up + SwiGLU and down join the launch (`SharedExpert` with x's rows; its tasks
    first), bit for bit the same two staged launches on its dense schedule.

    quant_block = 32 (mxfp8, bf16 operands that the caller has quantized and dequantized along K: a_rows and the
    weights): the down GEMM reads h quantized along I in blocks of 32 with E8M0 scales and dequantized (the gate/up
    tiles' epilogue makes it beside h), as the staged mxfp8 forward's `down(quantize(h)...)`; the routed GEMMs
    only (the shared expert stays in bf16); gate_up_tiles' epilogue chunks a multiple of 32 columns. With pull the
    token buffers hold x as it is and the pull programs round-trip each pulled row into a_rows (row blocks: the
    same bits as rows quantized after the pull).

    Returns gate_up [num_packed, 2I] (packed rows, kept for backward), h = SwiGLU(gate, up) [R, I], o = h @
    w_down[e].T [R, H] (None with push_to) and shared_out: None, or the shared expert's (gate_up [N, 2Is], h [Rs,
    Is], o [Rs, H]) on its schedule's Rs rows; in the operands' dtype; rows past the used M-tiles are not written.
    """
    what = "fused_forward"
    inter, hidden = _check_weights(what, a_rows, schedule, w_gate, w_up, w_down, "a_rows")
    block_m, shared_inter = _check_launch(what, a_rows, schedule, hidden, swiglu_limit, minibatch_rows,
                                          {"gate_up_tiles": gate_up_tiles, "down_tiles": down_tiles}, sync, pull,
                                          push_to, "a_rows", shared, backward=False, inter=inter,
                                          quant_block=quant_block)
    a_rows = a_rows.contiguous()
    dtype, device = a_rows.dtype, a_rows.device
    num_rows = schedule.capacity
    gate_up = common.empty((schedule.num_packed, 2 * inter), dtype, device)
    h = common.empty((num_rows, inter), dtype, device)
    o = common.empty((num_rows, hidden), dtype, device) if push_to is None else None
    h_deq = common.empty((num_rows, inter), dtype, device) if quant_block else None
    routed = ExpertGroup(
        Operands(operand_rows(a_rows), weights_in_place(w_gate, w_up), Outputs(gate_up, 2 * inter, h, h_deq), inter,
                 hidden),
        Operands(operand_rows(h if h_deq is None else h_deq), weights_in_place(w_down), Outputs(o, hidden), hidden,
                 inter),
        schedule_tables(schedule, packed=True), None)
    launch_shared = shared_out = None
    if shared is not None:
        rows_s, capacity_s = shared.rows.contiguous(), shared.schedule.capacity
        c_s = common.empty((shared.schedule.num_packed, 2 * shared_inter), dtype, device)
        h_s = common.empty((capacity_s, shared_inter), dtype, device)
        o_s = common.empty((capacity_s, hidden), dtype, device)
        launch_shared = ExpertGroup(
            Operands(operand_rows(rows_s), weights_in_place(shared.w_gate, shared.w_up),
                     Outputs(c_s, 2 * shared_inter, h_s), shared_inter, hidden),
            Operands(operand_rows(h_s), weights_in_place(shared.w_down), Outputs(o_s, hidden), hidden, shared_inter),
            schedule_tables(shared.schedule, packed=True), None)
        shared_out = (c_s, h_s, o_s)
    if pull is not None:
        pull = pull._replace(quant_block=quant_block)
    _launch(routed, launch_shared, backward=False, schedule=schedule,
            shared_schedule=None if shared is None else shared.schedule, swiglu_limit=swiglu_limit,
            first_tiles=gate_up_tiles, second_tiles=down_tiles, launch_tiles=gate_up_tiles, use_tma=use_tma,
            minibatch_rows=minibatch_rows, sync=sync, pull=pull, push_to=push_to, debug_waits=debug_waits,
            block_m=block_m, quant_block=quant_block)
    return gate_up, h, o, shared_out


def fused_backward(d_y_rows: torch.Tensor, w_down: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                   gate_up: torch.Tensor, router_weights: torch.Tensor, schedule: Schedule,
                   swiglu_limit: float | None, dgrad_tiles: TileConfig, gate_up_dgrad_tiles: TileConfig,
                   use_tma: bool, minibatch_rows: int | None, sync: Sync, *, pull: in_gemm_pull.Pull | None = None,
                   push_to: PeerSlots | None = None, shared: SharedExpert | None = None, quant_block: int = 0,
                   debug_waits: bool = False):
    """The down dgrad with its SwiGLU backward and the gate/up dgrad in one persistent launch:
    (d_gate_up, h_weighted, d_rw_partial, d_x_rows, shared_out), bit for bit
    `triton_gemm.down_dgrad_swiglu_partials(d_y_rows, w_down, gate_up, router_weights, schedule, swiglu_limit,
    dgrad_tiles, use_tma)` followed by `triton_gemm.gate_up_dgrad(d_gate_up, w_gate, w_up, schedule,
    gate_up_dgrad_tiles, use_tma)`.

    d_y_rows [R, H]: the schedule's rows of d_y, unscaled (padding rows zero); w_down [E, H, I], w_gate, w_up
    [E, I, H]; gate_up [num_packed, 2I]: the forward's packed pre-activations; all one dtype. router_weights fp32
    [N * k] by source (at EP the group's). The other arguments as `fused_forward`'s, with dgrad_tiles and
    gate_up_dgrad_tiles the two GEMMs' tiles (one BLOCK_M; num_warps and num_stages are gate_up_dgrad_tiles':
    the larger tile, whose shared memory bounds the stages). pull (EP): the first programs pull d_y's rows into
    d_y_rows, which the gate/up-dgrad-independent down weight gradient then reads too; push_to (EP): d_x's rows
    go straight into their owners' slots and d_x_rows is not made. shared: the shared expert's two dgrads join the
    launch (`SharedExpert` with d_y's rows and the forward's gate_up; its tasks first; router weights 1), bit for
    bit the same two staged launches on its dense schedule. quant_block = 32 (mxfp8, d_y_rows and the weights
    quantized and dequantized along K by the caller, gate_up the dequantized kept pre-activations): the gate/up
    dgrad reads d_gate_up quantized along 2I in blocks of 32 (E8M0) and dequantized, made by the dgrad tiles'
    epilogue beside d_gate_up, as the staged mxfp8 backward; routed GEMMs only; I and dgrad_tiles' epilogue
    chunks multiples of 32. With pull the token buffers hold d_y as it is: d_y_rows gets the rows as pulled (which
    the weight gradients quantize along tokens) and the dgrad reads them round-tripped by the pull programs.

    Returns d_gate_up [R, 2I], h_weighted = rw * h [R, I], the router-weight gradient's row partials fp32
    [R, ceil(I / 16)] (`triton_gemm.sum_partials` reduces them), d_x_rows [R, H] (None with push_to) and
    shared_out: None, or the shared expert's (d_gate_up [Rs, 2Is], h [Rs, Is], d_x [Rs, H]) on its schedule's Rs
    rows; rows past the used M-tiles are not written.
    """
    what = "fused_backward"
    inter, hidden = _check_weights(what, d_y_rows, schedule, w_gate, w_up, w_down, "d_y_rows")
    check_operands(d_y_rows, gate_up)
    if tuple(gate_up.shape) != (schedule.num_packed, 2 * inter):
        raise ValueError(f"{what}: gate_up must be [num_packed, 2I] = {[schedule.num_packed, 2 * inter]} (the "
                         f"forward's packed rows), got {list(gate_up.shape)}")
    if router_weights.dtype != torch.float32 or router_weights.dim() != 1 or router_weights.device != d_y_rows.device:
        raise ValueError(f"{what}: router_weights must be a 1-D float32 tensor (by source) on {d_y_rows.device}, "
                         f"got {router_weights.dtype} {list(router_weights.shape)} on {router_weights.device}")
    block_m, shared_inter = _check_launch(what, d_y_rows, schedule, hidden, swiglu_limit, minibatch_rows,
                                          {"dgrad_tiles": dgrad_tiles, "gate_up_dgrad_tiles": gate_up_dgrad_tiles},
                                          sync, pull, push_to, "d_y_rows", shared, backward=True, inter=inter,
                                          quant_block=quant_block)
    check_d_rw_chunks(f"{what}: dgrad_tiles", dgrad_tiles.block_n, dgrad_tiles.epi_split)
    d_y_rows = d_y_rows.contiguous()
    dtype, device = d_y_rows.dtype, d_y_rows.device
    num_rows = schedule.capacity
    d_gate_up = common.empty((num_rows, 2 * inter), dtype, device)
    h_weighted = common.empty((num_rows, inter), dtype, device)
    d_rw_partial = new_d_rw_partial(num_rows, inter, device)
    d_x_rows = common.empty((num_rows, hidden), dtype, device) if push_to is None else None
    d_gate_up_deq = common.empty((num_rows, 2 * inter), dtype, device) if quant_block else None
    # mxfp8 at EP: the pull programs keep the rows as pulled in d_y_rows and write the dgrad's A round-tripped
    a_rows = common.empty((num_rows, hidden), dtype, device) if quant_block and pull is not None else d_y_rows
    routed = ExpertGroup(
        Operands(operand_rows(a_rows), weights_in_place(w_down),
                 Outputs(d_gate_up, 2 * inter, h_weighted, d_gate_up_deq), inter, hidden),
        Operands(operand_rows(d_gate_up if d_gate_up_deq is None else d_gate_up_deq), weights_in_place(w_gate, w_up),
                 Outputs(d_x_rows, hidden), hidden, inter),
        schedule_tables(schedule, packed=True),
        SwigluBackwardInputs(gate_up.contiguous(), router_weights.contiguous(), d_rw_partial))
    launch_shared = shared_out = None
    if shared is not None:  # router weights 1: the shared expert's rows are unweighted
        rows_s, capacity_s = shared.rows.contiguous(), shared.schedule.capacity
        c_s = common.empty((capacity_s, 2 * shared_inter), dtype, device)
        h_s = common.empty((capacity_s, shared_inter), dtype, device)
        o_s = common.empty((capacity_s, hidden), dtype, device)
        launch_shared = ExpertGroup(
            Operands(operand_rows(rows_s), weights_in_place(shared.w_down), Outputs(c_s, 2 * shared_inter, h_s),
                     shared_inter, hidden),
            Operands(operand_rows(c_s), weights_in_place(shared.w_gate, shared.w_up), Outputs(o_s, hidden), hidden,
                     shared_inter),
            schedule_tables(shared.schedule, packed=True),
            SwigluBackwardInputs(shared.gate_up.contiguous(), torch.ones(capacity_s, dtype=torch.float32,
                                                                         device=device),
                                 new_d_rw_partial(capacity_s, shared_inter, device)))
        shared_out = (c_s, h_s, o_s)
    if pull is not None:
        pull = pull._replace(quant_block=quant_block, raw_rows=d_y_rows if a_rows is not d_y_rows else None)
    _launch(routed, launch_shared, backward=True, schedule=schedule,
            shared_schedule=None if shared is None else shared.schedule, swiglu_limit=swiglu_limit,
            first_tiles=dgrad_tiles, second_tiles=gate_up_dgrad_tiles, launch_tiles=gate_up_dgrad_tiles,
            use_tma=use_tma, minibatch_rows=minibatch_rows, sync=sync, pull=pull, push_to=push_to,
            debug_waits=debug_waits, block_m=block_m, quant_block=quant_block)
    return d_gate_up, h_weighted, d_rw_partial, d_x_rows, shared_out
