"""The layer's four expert GEMM stages on the kernels: each runs the engine its `KernelPlan` names, where that
engine takes the operands, else the Triton GEMM (`triton_gemm`), which takes every operand. Engines agree
bit for bit, so the choice changes speed only.

Signatures and numerics are those of `serval.stages` (the torch-op contract), plus `plan` and the expert-
parallel hooks: `pull_from` (the gate/up GEMM and the down dgrad pull their own rows, `in_gemm_pull`, their
tile order grouped by minibatch: `KernelPlan.minibatch_rows`) and `push_to` (down and
the gate/up dgrad store their rows into the owners' slots, `triton_gemm` PUSH). Shapes: N tokens, k slots,
H hidden, I intermediate, E experts, R rows (the schedule's capacity).
"""

from __future__ import annotations

import dataclasses

import torch

from ..peers import PeerSlots, PeerTokens
from ..plan import FUSED_COMM_SMS, KernelPlan, TileConfig, layer_minibatch_rows
from ..schedule import Schedule
from ..values import Sync, new_sync
from . import common, fused_launch, gluon_common, gluon_cooperative, gluon_pingpong, in_gemm_pull, triton_gemm
from .rows import gather as gather_rows


def _pulling_tiles(tiles: TileConfig, plan: KernelPlan, pull: in_gemm_pull.Pull, schedule: Schedule, hidden: int,
                   inter: int, device) -> TileConfig:
    """A pulling GEMM's tiles, the tile order grouped by minibatch: plan.minibatch_rows, or MoK's rule on the
    SMs left to compute, in whole M-tiles."""
    block_m = min(tiles.block_m, schedule.block_m)
    rows = plan.minibatch_rows or layer_minibatch_rows(
        hidden, inter, max(1, common.num_sms(device.index) - pull.programs), block_m)
    return dataclasses.replace(tiles, group_m=max(1, rows // block_m))


def _in_gemm_pull(plan: KernelPlan, programs: int, tiles: TileConfig, pull_from: PeerTokens, pull_flags, rows,
                  schedule: Schedule, hidden: int, inter: int, quant_block: int = 0, raw_rows=None):
    """(Pull, tiles) of a GEMM whose first `programs` programs pull its A rows into `rows` (a contiguous
    [R, H] buffer of the token buffers' dtype; with quant_block, round-tripped, and as pulled into raw_rows if
    given): ValueError unless the arguments fit."""
    if not isinstance(quant_block, int) or quant_block < 0:
        raise ValueError(f"quant_block must be 0 or a block size (mxfp8: 32), got {quant_block!r}")
    if (pull_flags is None or pull_from.cols != hidden or pull_from.dtype != rows.dtype
            or tuple(rows.shape) != (schedule.capacity, hidden) or not rows.is_contiguous()):
        raise ValueError(f"pull_from: token buffers of [{pull_from.cols}] {pull_from.dtype} columns for A rows "
                         f"[{schedule.capacity}, {hidden}] {rows.dtype} (contiguous), and pull_flags")
    pull = in_gemm_pull.Pull(pull_from, max(programs, 1), plan.pull_block_c, *pull_flags, quant_block, raw_rows)
    return pull, _pulling_tiles(tiles, plan, pull, schedule, hidden, inter, rows.device)


def gate_up_swiglu(x, w_gate, w_up, schedule: Schedule, swiglu_limit: float | None, *, plan: KernelPlan,
                   a_rows: torch.Tensor | None = None, pull_from: PeerTokens | None = None,
                   pull_flags: tuple[torch.Tensor, torch.Tensor] | None = None, quant_block: int = 0):
    """Gate/up GEMM + SwiGLU of x's rows: gate_up [num_packed, 2I] (packed rows), h [R, I].

    x [N, H]; w_gate, w_up [E, I, H]. a_rows [R, H]: the rows already gathered or pulled; without them the
    stage gathers x's rows itself (on the cooperative engine, its loader does). pull_from: at EP, the owners'
    token buffers, which plan.pull_programs of the GEMM's programs pull the rows from while the others
    compute, with `pull_flags` (`in_gemm_pull.new_flags`, kept by the workspace); x is then not read;
    quant_block 32 (mxfp8): the pulled rows are E8M0-quantized and dequantized along H before the GEMM reads them.
    """
    hidden = w_gate.shape[2]
    if quant_block and pull_from is None:
        raise ValueError("quant_block: only the GEMM's own pull round-trips its rows (pass pull_from)")
    if pull_from is not None:
        if a_rows is not None:
            raise ValueError("pull_from: the GEMM pulls its rows itself; pass no a_rows")
        a_rows = common.empty((schedule.capacity, hidden), x.dtype, x.device)
        pull, tiles = _in_gemm_pull(plan, plan.pull_programs, plan.gate_up_tiles, pull_from, pull_flags, a_rows,
                                    schedule, hidden, w_gate.shape[1], quant_block)
        return triton_gemm.gate_up_swiglu(a_rows, w_gate, w_up, schedule, swiglu_limit, tiles, plan.use_tma,
                                          pull=pull)
    if a_rows is None:
        if plan.gate_up_engine == "cooperative" and gluon_common.takes(schedule, x, w_gate, w_up):
            return gluon_cooperative.gate_up_swiglu(x, w_gate, w_up, schedule, swiglu_limit, plan.cooperative_gather,
                                                    gather=True)
        a_rows = gather_rows(x, schedule)
    return triton_gemm.gate_up_swiglu(a_rows, w_gate, w_up, schedule, swiglu_limit, plan.gate_up_tiles,
                                      plan.use_tma)


def _shared_expert(shared, schedule: Schedule) -> fused_launch.SharedExpert | None:
    """A fused pass's `SharedExpert` from the layer's (tokens, ws_gate, ws_up, ws_down, dense schedule[, gate_up]),
    tokens the [N, H] tensor its first GEMM reads (x forward, d_y backward), whose rows it gathers; None without
    one."""
    if shared is None:
        return None
    tokens, ws_gate, ws_up, ws_down, shared_schedule, *gate_up = shared
    if shared_schedule.block_m != schedule.block_m:
        raise ValueError(f"shared: its schedule's block_m must be the routed schedule's {schedule.block_m}, got "
                         f"{shared_schedule.block_m}")
    return fused_launch.SharedExpert(gather_rows(tokens, shared_schedule), shared_schedule, ws_gate, ws_up, ws_down,
                                   *gate_up)


def quant_tiles(tiles: TileConfig, quant_block: int) -> TileConfig:
    """A fused pass's first-GEMM tiles with quant_block (mxfp8): epilogue chunks of whole blocks and at most 64
    columns (the E8M0 round trip's temporaries beside gate/up's two accumulators spilled at 128: sm_90a compile).
    The chunking changes no bits."""
    if not quant_block:
        return tiles
    chunk = max(quant_block, min(tiles.block_n // tiles.epi_split, 2 * quant_block))
    return dataclasses.replace(tiles, epi_split=max(1, tiles.block_n // chunk))


def gate_up_down(x, w_gate, w_up, w_down, schedule: Schedule, swiglu_limit: float | None, *, plan: KernelPlan,
                 pull_from: PeerTokens | None = None, pull_flags: tuple[torch.Tensor, torch.Tensor] | None = None,
                 push_to: PeerSlots | None = None, shared=None, quant_block: int = 0):
    """The forward's routed GEMMs in one persistent launch (`fused_forward`, plan.fused_forward): gate_up
    [num_packed, 2I], h [R, I], o [R, H] (None with push_to) and shared_out, bit for bit `gate_up_swiglu` then
    `down`.

    x [N, H]; w_gate, w_up [E, I, H]; w_down [E, H, I]. At EP=1 x's rows are gathered first. pull_from (EP): the
    owners' token buffers, pulled by plan.pull_programs programs of the launch (0: `plan.FUSED_COMM_SMS`;
    `pull_flags` as gate_up_swiglu's); push_to (EP): the owners' slot buffers, which the down tiles write o's rows
    into. shared: (x [N, H], ws_gate [1, Is, H], ws_up [1, Is, H], ws_down [1, H, Is], its dense schedule): the
    shared expert's two GEMMs join the launch (its tiles first); shared_out is then its (gate_up [N, 2Is], h
    [Rs, Is], o [Rs, H]) on its schedule's Rs rows, else None. quant_block 32 (mxfp8; x and the weights already
    quantized and dequantized): h reaches down quantized and dequantized (`fused_launch.fused_forward`)."""
    hidden, inter = w_gate.shape[2], w_gate.shape[1]
    pull = None
    if pull_from is not None:
        a_rows = common.empty((schedule.capacity, hidden), x.dtype, x.device)
        pull, _ = _in_gemm_pull(plan, plan.pull_programs or FUSED_COMM_SMS, plan.gate_up_tiles, pull_from,
                                pull_flags, a_rows, schedule, hidden, inter)
    else:
        a_rows = gather_rows(x, schedule)
    shared = _shared_expert(shared, schedule)
    block_m = min(plan.gate_up_tiles.block_m, schedule.block_m)
    sync = _new_sync(schedule, shared, block_m, x.device)
    return fused_launch.fused_forward(a_rows, w_gate, w_up, w_down, schedule, swiglu_limit,
                                    quant_tiles(plan.gate_up_tiles, quant_block), plan.down_tiles, plan.use_tma,
                                    plan.minibatch_rows, sync, pull=pull, push_to=push_to, shared=shared,
                                    quant_block=quant_block)


def _new_sync(schedule: Schedule, shared: fused_launch.SharedExpert | None, block_m: int, device) -> Sync:
    """A fused launch's sync state for the routed and the shared expert's M-tiles (zeros: three small fills, no
    host sync)."""
    rows = schedule.capacity + (0 if shared is None else shared.schedule.capacity)
    return new_sync(rows // block_m, device)


def down(h, w_down, schedule: Schedule, *, plan: KernelPlan, push_to: PeerSlots | None = None):
    """Down GEMM: h [R, I], w_down [E, H, I] -> o [R, H] = h @ w_down[e].T; with push_to, row r goes to its
    owner's slot row_source[r] instead and nothing is returned."""
    if push_to is None and plan.down_engine == "cooperative" and gluon_common.takes(schedule, h, w_down):
        return gluon_cooperative.down(h, w_down, schedule, plan.cooperative_store)
    return triton_gemm.down(h, w_down, schedule, plan.down_tiles, plan.use_tma, push_to=push_to)


def down_dgrad_swiglu(d_y_rows, w_down, gate_up, router_weights, schedule: Schedule, swiglu_limit: float | None,
                      *, plan: KernelPlan, pull_from: PeerTokens | None = None,
                      pull_flags: tuple[torch.Tensor, torch.Tensor] | None = None, quant_block: int = 0):
    """d_h = rw * (d_y_row @ w_down[e]), the SwiGLU backward and the router-weight gradient, in one GEMM.

    d_y_rows [R, H]; w_down [E, H, I]; gate_up [num_packed, 2I] packed, as gate_up_swiglu returns it;
    router_weights [N, k] (the group's [P*N, k] at EP). Returns d_gate_up [R, 2I], h_weighted = rw * h
    [R, I] and d_rw_rows fp32 [R]. pull_from (at EP, with pull_flags): d_y_rows is an empty [R, H] buffer that
    plan.dgrad_pull_programs of the GEMM's programs fill from the owners' token buffers (d_y) while the others
    compute, on the Triton engine; the caller reads the rows from it afterwards. quant_block 32 (mxfp8, with
    pull_from): the GEMM reads the pulled rows E8M0-quantized and dequantized along H, d_y_rows gets them as
    pulled (for the weight gradient's own quantization)."""
    inter = w_down.shape[2]
    if quant_block and pull_from is None:
        raise ValueError("quant_block: only the GEMM's own pull round-trips its rows (pass pull_from)")
    if gate_up.shape != (schedule.num_packed, 2 * inter):
        raise ValueError(f"gate_up must be the packed pre-activations [{schedule.num_packed}, {2 * inter}] "
                         f"(schedule.num_packed, 2I), got {tuple(gate_up.shape)}")
    router_weights = router_weights.contiguous().view(-1).float()
    pull, tiles = None, plan.down_dgrad_tiles
    if pull_from is not None:
        pull, tiles = _in_gemm_pull(plan, plan.dgrad_pull_programs, tiles, pull_from, pull_flags, d_y_rows,
                                    schedule, w_down.shape[1], inter, quant_block,
                                    raw_rows=d_y_rows if quant_block else None)
        if quant_block:  # the GEMM reads the round trip, d_y_rows keeps the rows as pulled
            d_y_rows = torch.empty_like(d_y_rows)
    pingpong = plan.down_dgrad_engine == "pingpong" and pull is None  # a pull runs on the Triton engine
    if pingpong and gluon_common.takes(schedule, d_y_rows, w_down, gate_up, k=w_down.shape[1], split_at=inter):
        d_gate_up, h_weighted, d_rw_partial = gluon_pingpong.down_dgrad_swiglu_partials(
            d_y_rows.contiguous(), w_down, gate_up, router_weights, schedule, swiglu_limit, plan.pingpong)
    else:
        d_gate_up, h_weighted, d_rw_partial = triton_gemm.down_dgrad_swiglu_partials(
            d_y_rows, w_down, gate_up, router_weights, schedule, swiglu_limit, tiles, plan.use_tma, pull=pull)
    return d_gate_up, h_weighted, triton_gemm.sum_partials(d_rw_partial, schedule)


def down_dgrad_gate_up_dgrad(d_y_rows, w_down, w_gate, w_up, gate_up, router_weights, schedule: Schedule,
                             swiglu_limit: float | None, *, plan: KernelPlan, pull_from: PeerTokens | None = None,
                             pull_flags: tuple[torch.Tensor, torch.Tensor] | None = None,
                             push_to: PeerSlots | None = None, shared=None, quant_block: int = 0):
    """The backward's routed dgrads in one persistent launch (`fused_launch.fused_backward`, plan.fused_backward):
    d_gate_up [R, 2I], h_weighted [R, I], d_rw_rows fp32 [R], d_x_rows [R, H] (None with push_to) and shared_out,
    bit for bit `down_dgrad_swiglu` then `gate_up_dgrad` on the Triton engine.

    Arguments as theirs. pull_from (EP, with pull_flags): d_y_rows is an empty [R, H] buffer that
    plan.dgrad_pull_programs (0: `plan.FUSED_COMM_SMS`) programs of the launch fill from the owners' token
    buffers (d_y); push_to (EP): the gate/up dgrad tiles write d_x's rows into the owners' slots. shared: (d_y
    [N, H], ws_gate, ws_up, ws_down, its dense schedule, its forward's gate_up [N, 2Is]): the shared expert's two
    dgrads join the launch (its tiles first, router weights 1); shared_out is then its (d_y_rows [Rs, H],
    d_gate_up [Rs, 2Is], h [Rs, Is], d_x_rows [Rs, H]) on its schedule's Rs rows, else None. quant_block 32
    (mxfp8; d_y, the weights and gate_up already quantized and dequantized): d_gate_up reaches the gate/up dgrad
    quantized and dequantized (`fused_launch.fused_backward`)."""
    hidden, inter = w_down.shape[1], w_down.shape[2]
    if gate_up.shape != (schedule.num_packed, 2 * inter):
        raise ValueError(f"gate_up must be the packed pre-activations [{schedule.num_packed}, {2 * inter}] "
                         f"(schedule.num_packed, 2I), got {tuple(gate_up.shape)}")
    pull = None
    if pull_from is not None:
        pull, _ = _in_gemm_pull(plan, plan.dgrad_pull_programs or FUSED_COMM_SMS, plan.down_dgrad_tiles, pull_from,
                                pull_flags, d_y_rows, schedule, hidden, inter)
    shared = _shared_expert(shared, schedule)
    block_m = min(plan.down_dgrad_tiles.block_m, schedule.block_m)
    sync = _new_sync(schedule, shared, block_m, d_y_rows.device)
    d_gate_up, h_weighted, d_rw_partial, d_x_rows, shared_out = fused_launch.fused_backward(
        d_y_rows, w_down, w_gate, w_up, gate_up, router_weights.contiguous().view(-1).float(), schedule,
        swiglu_limit, quant_tiles(plan.down_dgrad_tiles, quant_block), plan.gate_up_dgrad_tiles, plan.use_tma,
        plan.minibatch_rows, sync, pull=pull, push_to=push_to, shared=shared, quant_block=quant_block)
    if shared_out is not None:
        shared_out = (shared.rows, *shared_out)
    return d_gate_up, h_weighted, triton_gemm.sum_partials(d_rw_partial, schedule), d_x_rows, shared_out


def gate_up_dgrad(d_gate_up, w_gate, w_up, schedule: Schedule, *, plan: KernelPlan,
                  push_to: PeerSlots | None = None):
    """Gate/up dgrad: d_x_rows [R, H] = d_gate @ w_gate[e] + d_up @ w_up[e], one accumulation over K = 2I;
    with push_to, pushed into the owners' slots instead (as down)."""
    if (push_to is None and plan.gate_up_dgrad_engine == "cooperative"
            and gluon_common.takes(schedule, d_gate_up, w_gate, w_up, k=w_gate.shape[1])):
        return gluon_cooperative.gate_up_dgrad(d_gate_up, w_gate, w_up, schedule, plan.cooperative_store)
    return triton_gemm.gate_up_dgrad(d_gate_up, w_gate, w_up, schedule, plan.gate_up_dgrad_tiles, plan.use_tma,
                                     push_to=push_to)
