"""The macrobatch ring: an expert-parallel pass's routed experts streamed through a fixed buffer, window by window.

At expert parallelism a rank computes every routed row the group sends to its experts, however skewed the
routing: its schedule holds the worst case (`Workspace.capacity_rows`: every routed row of the group), and
its rows go through the kernels in windows of `Workspace.ring_rows` rows (`Config.macrobatch_size`,
`serval.schedule.windows`), in row order. A window pulls its rows from their owners into one ring buffer,
runs the expert GEMMs on them and pushes its outputs into the owners' slots, all inside one pull phase and
one push phase of the transport. A window past the used rows has no tiles, so its launches exit at once:
the host launches the fixed worst-case number of windows and never syncs.

Results are those of one pass over all the rows, bit for bit: each window's tiles are the same tiles, and
the weight gradients carry each expert's fp32 K sums from one window to the next, in ascending row order
(`serval.values.WgradWindow`; two carry buffers, used in turn).

Memory: the ring itself, [ring_rows, H] buffers of pulled x and d_y rows that the workspace makes once and keeps
(`Workspace.ring`); the [ring_rows, *] intermediates of one window; the weight gradients' carries (fp32, two
[2I, H] and two [H, I]); and, kept from the forward for the backward, the first window's gate/up pre-activations
(every row under a routing that fits the ring); the backward recomputes the other windows' from re-pulled x rows.

The FP8 precisions (`recipe`) stream the same way: their blocks along a GEMM's K lie within a row, and their
weight gradients' along-tokens blocks lie whole in a window (windows start on block_m boundaries, a multiple of
the block), so each window's quantizations are those of one pass over all the rows; mxfp8's GEMMs are the BF16
ones (carried as above), fp8_blockwise's FP8 weight gradients carry their fp32 sums the same way
(`serval.kernels.fp8_gemm.weight_grad`), and its FP8 GEMMs, which do not push from their epilogue, make a window's
rows, which a push kernel then writes into the owners' slots. The forward keeps the first window's
`precision.Kept` (gate/up and h quantized), the backward recomputes the others'.

Runs on the kernel stages (`serval.kernels.KernelStages`); `serval.functional` calls it.
"""

from __future__ import annotations

import torch

from . import passes, precision, stages, weight_layout
from .ops import dequantize
from .pass_plan import PULLED_BY_GEMM, PassPlan, RowsFrom
from .passes import Routed, RoutedGrads, shared_after_launch
from .peers import PeerTokens
from .schedule import Schedule, Window, slot_schedule, windows
from .values import WgradWindow


def forward(plan: PassPlan, x, w_gate, w_up, w_down, schedule: Schedule, swiglu_limit, workspace,
            shared_launch=None, expert_weights=None) -> Routed:
    """The streamed strategy of a forward at EP: `serval.passes.forward_compute` (each window staged or fused, as
    plan.forward says) window by window, inside one pull and one push phase.

    x [N, H]; w_gate, w_up [E_local, I, H]; w_down [E_local, H, I]; schedule: the rank's (worst-case capacity).
    shared_launch: on a fused pass, the shared expert's (x, weights, dense schedule), whose tiles join the first
    window's launch. A window's x rows are read into the workspace's ring first, unless its GEMM pulls them."""
    transport = workspace.transport
    compute = passes.forward_compute(plan, x, w_gate, w_up, w_down, swiglu_limit, shared_launch, expert_weights)
    gemm_pulls = plan.forward.rows_in == PULLED_BY_GEMM
    x_ring = None if gemm_pulls else workspace.ring("x", x)
    first = []  # what the first window keeps, and the shared expert's outputs

    def write(target):
        def consume(source):
            for window in windows(schedule, workspace.ring_rows):
                s = window.schedule
                rows_from = (RowsFrom(peers=source, flags=workspace.pull_flags) if gemm_pulls else
                             RowsFrom(transport.read_rows(source, s.row_source, x_ring[: s.capacity])))
                o_rows, kept, shared_made = compute(s, rows_from, target, not first)
                if o_rows is not None:  # an FP8 GEMM, which does not push from its epilogue, made the rows
                    transport.write_rows(o_rows, s.row_source, target)
                if not first:
                    first.append((kept, shared_made))
        transport.pull_into(consume, x)

    slots = transport.push_from(write, w_down.shape[1], x.dtype)
    return Routed(slots, slot_schedule(transport.num_tokens, transport.top_k, slots.device), *first[0])


def _carry(window: Window, index: int, carries: torch.Tensor, outs: tuple[torch.Tensor, ...]):
    """The weight gradient's window arguments: window `index` reads carry index % 2 and writes the other."""
    return WgradWindow(window.expert_phase, carries[index % 2], carries[(index + 1) % 2], outs)


def backward(plan: PassPlan, d_y, x, row_router_weights, schedule: Schedule, gate_up_first, w_gate, w_up, w_down,
             swiglu_limit, workspace, weight_grads: bool, shared_d_x=None, shared_launch=None,
             shared_weight_grads=True, expert_weights=None):
    """The routed experts of a backward at EP, streamed (the forward's windows, in the same order), each window
    staged or fused as plan.backward says; returns `serval.passes.RoutedGrads`.

    d_y, x [N, H]; row_router_weights: the group's [P*N, k]; gate_up_first: what the forward's first window kept
    (bf16 its pre-activations, FP8 its `precision.Kept`), or None (recomputed, as every later window's are).
    shared_d_x: the shared expert's d_x, added in the slot sums. shared_launch: on a fused pass, the shared
    expert's (d_y, weights, dense schedule, gate_up), whose dgrads join the first window's launch (the rest of its
    backward: `serval.passes.shared_after_launch`). An FP8 recipe's GEMMs read the weights in their form (gate_up
    for the recomputation, down_t and gate_up_t), made once here. The weight gradients None without
    weight_grads."""
    ops, recipe, direction = plan.ops, plan.recipe, plan.backward
    transport = workspace.transport
    parts = windows(schedule, workspace.ring_rows)
    num_experts, inter, hidden = w_gate.shape
    fused = direction.fused
    # the gate/up weights in the forward's form too: the later windows recompute the pre-activations
    made = None if recipe is None else precision.gemm_weights(recipe, w_gate, w_up, w_down, expert_weights,
                                                              ("gate_up", "down_t", "gate_up_t"))
    x_ring, d_y_ring = workspace.ring("x", x), workspace.ring("d_y", d_y)
    d_rw_rows = torch.empty(schedule.capacity, dtype=torch.float32, device=x.device)
    d_w_gate = d_w_up = d_w_down = None
    shared_out = [None]
    if weight_grads:
        d_w_gate, d_w_up = weight_layout.grad_buffers(w_gate, w_up)
        d_w_down = torch.empty(num_experts, hidden, inter, dtype=x.dtype, device=x.device)
        carry_gate_up = torch.empty(2, 2 * inter, hidden, dtype=torch.float32, device=x.device)
        carry_down = torch.empty(2, hidden, inter, dtype=torch.float32, device=x.device)

    def step(index: int, window: Window, d_y_source: PeerTokens, x_source: PeerTokens, target):
        s = window.schedule
        x_rows = transport.read_rows(x_source, s.row_source, x_ring[: s.capacity])
        kept = gate_up_first if index == 0 else None
        if kept is None and recipe is None:  # recomputed from the re-pulled rows
            kept, _ = ops.gate_up_swiglu(x, w_gate, w_up, s, swiglu_limit, a_rows=x_rows)
        elif kept is None:  # as the forward quantized and kept them
            _, kept = precision.forward(ops, recipe, x, x_rows, w_gate, w_up, None, s, swiglu_limit, made)
        wgrad_windows = None
        if weight_grads:
            wgrad_windows = (_carry(window, index, carry_down, (d_w_down,)),
                             _carry(window, index, carry_gate_up, (d_w_gate, d_w_up)))
        d_y_rows = d_y_ring[: s.capacity]
        pull = dict(pull_from=d_y_source, pull_flags=workspace.pull_flags)
        if direction.rows_in != PULLED_BY_GEMM:  # d_y's rows into the ring first
            transport.read_rows(d_y_source, s.row_source, d_y_rows)
            pull = {}
        if fused:  # pull of d_y (mxfp8: round-tripped by the pull programs), both dgrads and push of d_x in one launch
            down_t, gate_t, up_t = (w_down, w_gate, w_up) if recipe is None else (made.down_t, *made.gate_up_t)
            d_gate_up, h_weighted, d_rw, _, made_shared = ops.down_dgrad_gate_up_dgrad(
                d_y_rows, down_t, gate_t, up_t, kept if recipe is None else dequantize(kept.gate_up, x.dtype),
                row_router_weights, s, swiglu_limit, push_to=target, shared=None if index else shared_launch,
                quant_block=0 if recipe is None else recipe.block, **pull)
            if index == 0:
                shared_out[0] = made_shared
        elif recipe is None:
            d_gate_up, h_weighted, d_rw = ops.down_dgrad_swiglu(d_y_rows, w_down, kept, row_router_weights, s,
                                                                swiglu_limit, **pull)
            ops.gate_up_dgrad(d_gate_up, w_gate, w_up, s, push_to=target)
        else:  # the recipe's staged backward on the pulled rows, its weight gradients window by window
            d_x_rows, d_rw, weight_grads_to_run = precision.backward(
                ops, recipe, d_y, d_y_rows, x, x_rows, kept, row_router_weights, w_gate, w_up, w_down, s,
                swiglu_limit, made, weight_grads, push_to=target, d_y_pull=pull or None)
            if d_x_rows is not None:  # an FP8 GEMM, which does not push from its epilogue, made the rows
                transport.write_rows(d_x_rows, s.row_source, target)
            del d_x_rows
            if weight_grads_to_run is not None:
                weight_grads_to_run(windows=wgrad_windows)
        d_rw_rows[window.start: window.start + s.capacity] = d_rw
        if wgrad_windows is not None and recipe is None:
            ops.down_weight_grad(d_y_rows, h_weighted, s, window=wgrad_windows[0])
            ops.gate_up_weight_grad(d_gate_up, x, s, x_rows=x_rows, window=wgrad_windows[1])
        elif wgrad_windows is not None and fused:  # mxfp8: the operands quantized along tokens, window by window
            precision.expert_weight_grads(ops, recipe, d_y, d_y_rows, x, x_rows, recipe.tokens(d_gate_up), kept,
                                          stages.row_weights(row_router_weights, s).float(), s, w_gate, w_up,
                                          wgrad_windows)

    def write(target):
        def with_d_y(d_y_source):
            def with_x(x_source):
                for index, window in enumerate(parts):
                    step(index, window, d_y_source, x_source, target)
            transport.pull_into(with_x, x, role="x")  # x and d_y are published at once: two token buffers
        transport.pull_into(with_d_y, d_y)

    slots = transport.push_from(write, hidden, d_y.dtype)
    shared_grads = None
    if shared_out[0] is not None:
        shared_d_x, shared_grads = shared_after_launch(ops, x, shared_out[0], shared_launch[4], shared_weight_grads)
    d_x = ops.sum_slots(slots, slot_schedule(transport.num_tokens, transport.top_k, slots.device), shared_d_x)
    return RoutedGrads(d_x, d_rw_rows, d_w_gate, d_w_up, d_w_down, shared_grads)
