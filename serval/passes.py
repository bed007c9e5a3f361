"""The staged and fused strategies of a pass (`serval.pass_plan`): the routed experts' forward and backward, at
EP=1 and at EP, with their rows in and out as the plan's `Direction` says.

`through` runs a computation `compute(rows_from, push_to)` with its first GEMM's rows gathered, pulled first or
pulled by the GEMM (`RowsFrom`), and its output rows stored, pushed after it or pushed by the GEMM (`push_to`):
expert parallelism wraps the compute instead of threading through it. The streamed strategy (the macrobatch
ring) is `serval.macrobatch`; `serval.functional` picks the strategy the plan names.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import precision, stages, weight_layout
from .pass_plan import GATHERED, PULLED_BY_GEMM, PUSHED_BY_GEMM, Direction, PassPlan, RowsFrom
from .peers import push_keywords
from .schedule import Schedule, slot_schedule

__all__ = ["Routed", "RoutedGrads", "through", "forward_compute", "forward", "backward", "expert_backward",
           "shared_weights", "shared_gate_up", "shared_after_launch", "router_weight_grad"]


class Routed(NamedTuple):
    """What a forward strategy gives: the rows the combine sums in slot order and their schedule (at EP this
    rank's slots once every rank pushed), what the routed experts keep for backward (bf16: the pre-activations;
    FP8: `precision.Kept`), and the shared expert's (gate_up, h, o) where its tiles ran in the launch, else None."""

    rows: torch.Tensor
    rows_schedule: Schedule
    keeps: object
    shared_made: tuple | None


class RoutedGrads(NamedTuple):
    """What a backward strategy gives: d_x [N, H] (the slot sums, the shared expert's d_x added), the rows' router
    weight gradients fp32 [R], the three weight gradients (None without weight gradients), and the shared
    expert's weight gradients where its dgrads ran in the routed launch (else None)."""

    d_x: torch.Tensor
    d_rw_rows: torch.Tensor
    d_w_gate: torch.Tensor | None
    d_w_up: torch.Tensor | None
    d_w_down: torch.Tensor | None
    shared_grads: tuple | None


def shared_weights(shared):
    """The shared expert as a one-expert group: [1, Is, H], [1, Is, H], [1, H, Is]."""
    return tuple(w.unsqueeze(0) for w in shared)


def _transport(workspace):
    return None if workspace is None else workspace.transport


def rows_out(rows, schedule: Schedule, transport):
    """Where each token's k rows are read from for the slot-order sums: (rows, schedule) at EP=1;
    at EP, this rank's slot buffer after every rank pushed its rows into their owners' slots. The group's
    schedule writes every slot (no zero fill needed), and the caller sums the slots right away,
    before the next push can reuse the buffer (no copy needed)."""
    if transport is None:
        return rows, schedule
    slots = transport.push(rows, schedule.row_source, complete=True, copy=False)
    return slots, slot_schedule(transport.num_tokens, transport.top_k, rows.device)


def rows_in(direction: Direction, workspace, tokens, schedule: Schedule, compute):
    """compute(RowsFrom) with the rows of `tokens` [N, C] as direction.rows_in says: gathered by the stage (EP=1),
    pulled first, or read from the owners by the GEMM's pull programs (inside the pull's two barriers)."""
    transport = _transport(workspace)
    if direction.rows_in == PULLED_BY_GEMM:
        return transport.pull_into(lambda peers: compute(RowsFrom(peers=peers, flags=workspace.pull_flags)), tokens)
    return compute(RowsFrom(None if direction.rows_in == GATHERED else transport.pull(tokens, schedule.row_source)))


def through(direction: Direction, workspace, tokens, schedule: Schedule, cols: int, dtype, compute):
    """compute(RowsFrom, push_to) -> (output rows [R, cols], or None where push_to took them; result), run with its
    rows in (`rows_in`) and out as `direction` says. Returns (the rows to sum in slot order, their schedule, result):
    stored, compute's rows and the schedule; at EP this rank's slots once every rank pushed (by the GEMM: it runs
    inside the push's two barriers, its pull inside), and the slot schedule."""
    transport = _transport(workspace)
    if direction.rows_out == PUSHED_BY_GEMM:
        made = []
        slots = transport.push_from(
            lambda target: made.append(rows_in(direction, workspace, tokens, schedule,
                                               lambda rows_from: compute(rows_from, target))[1]), cols, dtype)
        return slots, slot_schedule(transport.num_tokens, transport.top_k, slots.device), made[0]
    rows, result = rows_in(direction, workspace, tokens, schedule, lambda rows_from: compute(rows_from, None))
    return (*rows_out(rows, schedule, transport), result)


def shared_gate_up(ops, x, shared, shared_schedule, swiglu_limit):
    """The shared expert's pre-activations [N, 2Is] and h (None, None without one)."""
    if shared is None:
        return None, None
    ws_gate, ws_up, _ = shared_weights(shared)
    return ops.gate_up_swiglu(x, ws_gate, ws_up, shared_schedule, swiglu_limit)


# ---------------------------------------------------------------- forward

def forward_compute(plan: PassPlan, x, w_gate, w_up, w_down, swiglu_limit, shared_launch=None, expert_weights=None):
    """The routed experts' forward on one schedule's rows, as plan.forward.window runs it: compute(schedule,
    rows_from, push_to, first) -> (o's rows [R, H], or None where push_to took them; what backward keeps (bf16: the
    pre-activations, FP8: `precision.Kept`) and, where the shared expert's tiles ran in the launch, its (gate_up, h,
    o), both None unless `first`, the pass's only or first window).

    Staged: one launch per GEMM stage (an FP8 recipe's passes, `precision.forward`; its FP8 GEMMs return o's rows
    even with push_to: they do not push from their epilogue). Fused: both GEMMs in one launch (`gate_up_down`,
    KernelPlan.fused_forward), the shared expert's tiles (`shared_launch`: its (x, weights, dense schedule)) first
    in the first window's; mxfp8 reads the dequantized operands (`precision.fused_forward_operands`), quantizes h
    between the GEMMs and keeps what the staged path keeps. The weights in an FP8 recipe's form are made here, once
    for every window."""
    ops, recipe = plan.ops, plan.recipe
    if plan.forward.fused:
        quant_block = 0
        if recipe is not None:
            x, w_gate, w_up, w_down = precision.fused_forward_operands(recipe, x, w_gate, w_up, w_down,
                                                                       expert_weights, at_ep=plan.ep_size > 1)
            quant_block = recipe.block

        def fused(schedule: Schedule, rows_from: RowsFrom, push_to, first: bool):
            gate_up, h, o, shared_made = ops.gate_up_down(x, w_gate, w_up, w_down, schedule, swiglu_limit,
                                                          shared=shared_launch if first else None,
                                                          quant_block=quant_block, **(rows_from.pull or {}),
                                                          **push_keywords(push_to))
            if not first:
                return o, None, None
            return o, gate_up if recipe is None else precision.keep(recipe, gate_up, h), shared_made
        return fused
    made = None if recipe is None else precision.gemm_weights(recipe, w_gate, w_up, w_down, expert_weights,
                                                              ("gate_up", "down"))

    def staged(schedule: Schedule, rows_from: RowsFrom, push_to, first: bool):
        if recipe is None:
            gate_up, h = ops.gate_up_swiglu(x, w_gate, w_up, schedule, swiglu_limit, **rows_from.kwargs())
            return ops.down(h, w_down, schedule, **push_keywords(push_to)), gate_up if first else None, None
        o, kept = precision.forward(ops, recipe, x, rows_from.rows, w_gate, w_up, w_down, schedule, swiglu_limit,
                                    made, push_to=push_to, keeps=first, pull=rows_from.pull)
        return o, kept, None
    return staged


def forward(plan: PassPlan, x, w_gate, w_up, w_down, schedule: Schedule, swiglu_limit, workspace,
            shared_launch=None, expert_weights=None) -> Routed:
    """The staged and the fused strategy: `forward_compute` once over all the rows, its rows in and out as
    plan.forward says (`through`)."""
    compute = forward_compute(plan, x, w_gate, w_up, w_down, swiglu_limit, shared_launch, expert_weights)

    def all_rows(rows_from: RowsFrom, push_to):
        o, kept, shared_made = compute(schedule, rows_from, push_to, True)
        return o, (kept, shared_made)

    rows, rows_schedule, (kept, shared_made) = through(plan.forward, workspace, x, schedule, w_down.shape[1],
                                                       x.dtype, all_rows)
    return Routed(rows, rows_schedule, kept, shared_made)


# ---------------------------------------------------------------- backward

def _fused_dgrads(ops, direction: Direction, d_y, row_router_weights, schedule: Schedule, gate_up, w_gate, w_up,
                  w_down, swiglu_limit, workspace, shared_launch=None, quant_block: int = 0):
    """(d_y_rows, d_gate_up, h_weighted, d_rw_rows, (d_x rows, their schedule), shared_made) from one launch
    (`down_dgrad_gate_up_dgrad`, KernelPlan.fused_backward; shared_made: the shared expert's dgrads from the same
    launch, its `shared_out`, None without `shared_launch`). At EP=1 d_y's rows are gathered first; at EP the
    launch's programs pull them into d_y_rows (which the down weight gradient reads next) and push d_x's rows
    into the owners' slots. mxfp8: d_y, gate_up and the weights as `precision.fused_backward_operands` makes
    them, quant_block its block (at EP d_y_rows are then the rows as pulled, which the launch round-trips)."""
    if direction.rows_in == GATHERED:
        d_y_rows = ops.gather(d_y, schedule)
    else:
        d_y_rows = torch.empty(schedule.capacity, d_y.shape[1], dtype=d_y.dtype, device=d_y.device)

    def compute(rows_from: RowsFrom, push_to):
        d_gate_up, h_weighted, d_rw_rows, d_x_rows, shared_made = ops.down_dgrad_gate_up_dgrad(
            d_y_rows, w_down, w_gate, w_up, gate_up, row_router_weights, schedule, swiglu_limit,
            shared=shared_launch, quant_block=quant_block, **(rows_from.pull or {}), **push_keywords(push_to))
        return d_x_rows, (d_gate_up, h_weighted, d_rw_rows, shared_made)

    slots, slots_schedule, (d_gate_up, h_weighted, d_rw_rows, shared_made) = through(
        direction, workspace, d_y, schedule, w_gate.shape[2], d_y.dtype, compute)
    return d_y_rows, d_gate_up, h_weighted, d_rw_rows, (slots, slots_schedule), shared_made


def shared_after_launch(ops, x, shared_made, shared_schedule: Schedule, weight_grads: bool):
    """The rest of the shared expert's backward once its dgrads ran in the routed experts' fused launch
    (shared_made: its d_y_rows, d_gate_up, h and d_x rows on its dense schedule): (d_x [N, H], (d_ws_gate,
    d_ws_up, d_ws_down), None without weight_grads), each computed as `expert_backward` computes it."""
    d_y_rows, d_gate_up, h, d_x_rows = shared_made
    d_w_down = ops.down_weight_grad(d_y_rows, h, shared_schedule) if weight_grads else None
    d_x = ops.sum_slots(d_x_rows, shared_schedule, None)
    d_w_gate = d_w_up = None
    if weight_grads:
        d_w_gate, d_w_up = ops.gate_up_weight_grad(d_gate_up, x, shared_schedule,
                                                   x_rows=ops.gather(x, shared_schedule))
    return d_x, tuple(None if g is None else g[0] for g in (d_w_gate, d_w_up, d_w_down))


def expert_backward(ops, direction: Direction, d_y, x, row_router_weights, schedule, gate_up, w_gate, w_up,
                    w_down, swiglu_limit, workspace, weight_grads=True, shared_d_x=None, shared_launch=None,
                    shared_weight_grads=True) -> RoutedGrads:
    """One bf16 expert group's backward, staged or fused as `direction` says (the routed experts, or the shared
    expert as a one-expert group at EP=1); the weight gradients None without `weight_grads` (their GEMMs do not
    run; at EP the pull of x's rows still does, so that every rank makes the same transport calls whatever its
    weights require). shared_d_x: the shared expert's d_x, added in the slot sums. shared_launch: on a fused
    backward, the shared expert's (d_y, weights, dense schedule, gate_up), whose dgrads then join the launch
    (its d_x joins the sums, its weight gradients come back, `shared_weight_grads` False: None).

    Ordered so that each [R, *] buffer dies as soon as its last use is done (d_y rows and rw * h
    after the down weight gradient, d_x rows after their slot sum; at EP with the kernels they are
    never made: the GEMM pushes them): the peak holds about two of them.
    """
    transport = _transport(workspace)
    d_x_rows = shared_grads = None
    if direction.fused:  # both dgrads in one launch: d_x's rows come with the others
        d_y_rows, d_gate_up, h_weighted, d_rw_rows, d_x_rows, shared_made = _fused_dgrads(
            ops, direction, d_y, row_router_weights, schedule, gate_up, w_gate, w_up, w_down, swiglu_limit,
            workspace, shared_launch)
        if shared_made is not None:
            shared_d_x, shared_grads = shared_after_launch(ops, x, shared_made, shared_launch[4],
                                                           shared_weight_grads)
    elif direction.rows_in == PULLED_BY_GEMM:  # the dgrad's programs pull d_y's rows into d_y_rows
        d_y_rows = torch.empty(schedule.capacity, d_y.shape[1], dtype=d_y.dtype, device=d_y.device)
        d_gate_up, h_weighted, d_rw_rows = rows_in(direction, workspace, d_y, schedule, lambda rows_from:
                                                   ops.down_dgrad_swiglu(d_y_rows, w_down, gate_up, row_router_weights,
                                                                         schedule, swiglu_limit, **rows_from.pull))
    else:
        d_y_rows = ops.gather(d_y, schedule) if transport is None else transport.pull(d_y, schedule.row_source)
        d_gate_up, h_weighted, d_rw_rows = ops.down_dgrad_swiglu(d_y_rows, w_down, gate_up, row_router_weights,
                                                                 schedule, swiglu_limit)
    d_w_down = ops.down_weight_grad(d_y_rows, h_weighted, schedule) if weight_grads else None
    del d_y_rows, h_weighted
    if d_x_rows is None:
        d_x_rows = _dgrad_rows_out(ops, direction, d_gate_up, w_gate, w_up, schedule, workspace)
    d_x = ops.sum_slots(*d_x_rows, shared_d_x)
    del d_x_rows
    d_w_gate = d_w_up = None
    if weight_grads or transport is not None:
        x_rows = ops.gather(x, schedule) if transport is None else transport.pull(x, schedule.row_source)
    if weight_grads:  # in the weights' layout: the halves of one tensor for a joined gate/up weight
        d_w_gate, d_w_up = ops.gate_up_weight_grad(d_gate_up, x, schedule, x_rows=x_rows,
                                                   out=weight_layout.grad_buffers(w_gate, w_up))
    return RoutedGrads(d_x, d_rw_rows, d_w_gate, d_w_up, d_w_down, shared_grads)


def _dgrad_rows_out(ops, direction: Direction, d_gate_up, w_gate, w_up, schedule: Schedule, workspace):
    """(d_x's rows, their schedule) from the gate/up dgrad: stored at EP=1, at EP pushed by its epilogue or after."""
    transport = _transport(workspace)
    if direction.rows_out == PUSHED_BY_GEMM:
        slots = transport.push_from(lambda target: ops.gate_up_dgrad(d_gate_up, w_gate, w_up, schedule,
                                                                     push_to=target), w_gate.shape[2], d_gate_up.dtype)
        return slots, slot_schedule(transport.num_tokens, transport.top_k, slots.device)
    return rows_out(ops.gate_up_dgrad(d_gate_up, w_gate, w_up, schedule), schedule, transport)


def backward(plan: PassPlan, d_y, x, row_router_weights, schedule: Schedule, keeps, w_gate, w_up, w_down,
             swiglu_limit, workspace, weight_grads: bool, shared_d_x=None, shared_launch=None, shared_weight_grads=True,
             expert_weights=None) -> RoutedGrads:
    """The staged and the fused strategy of a backward, over all the rows, with its rows in and out as
    plan.backward says: bf16 `expert_backward`; an FP8 recipe's passes staged (`_recipe_staged_backward`) or, in
    mxfp8, fused (`_recipe_fused_backward`). keeps: what the forward kept (bf16 the pre-activations, FP8
    `precision.Kept`)."""
    if plan.recipe is None:
        return expert_backward(plan.ops, plan.backward, d_y, x, row_router_weights, schedule, keeps, w_gate, w_up,
                               w_down, swiglu_limit, workspace, weight_grads, shared_d_x, shared_launch,
                               shared_weight_grads)
    strategy = _recipe_fused_backward if plan.backward.fused else _recipe_staged_backward
    return strategy(plan, d_y, x, row_router_weights, schedule, keeps, w_gate, w_up, w_down, swiglu_limit, workspace,
                    weight_grads, shared_d_x, shared_launch, shared_weight_grads, expert_weights)


def _recipe_staged_backward(plan: PassPlan, d_y, x, row_router_weights, schedule: Schedule, keeps, w_gate, w_up,
                            w_down, swiglu_limit, workspace, weight_grads: bool, shared_d_x, shared_launch,
                            shared_weight_grads, expert_weights) -> RoutedGrads:
    """An FP8 recipe's passes, one launch per GEMM stage (`precision.backward`). At EP it pulls x's rows (for the
    weight gradients, by every rank whatever its weights need) and d_y's (or its down dgrad pulls them), and pushes
    d_x's rows after its gate/up dgrad or from its epilogue. The weight gradients run after d_x is summed and its
    rows freed."""
    ops, recipe = plan.ops, plan.recipe
    transport = _transport(workspace)
    x_rows = pulled_into = None
    if transport is not None:
        x_rows = transport.pull(x, schedule.row_source)
        if plan.backward.rows_in == PULLED_BY_GEMM:  # the down dgrad pulls d_y's rows (into d_y_rows, as pulled)
            pulled_into = d_y.new_empty(schedule.capacity, d_y.shape[1])

    def compute(rows_from: RowsFrom, push_to):
        d_x_rows, *rest = precision.backward(
            ops, recipe, d_y, rows_from.rows if pulled_into is None else pulled_into, x, x_rows, keeps,
            row_router_weights, w_gate, w_up, w_down, schedule, swiglu_limit, expert_weights, weight_grads,
            push_to=push_to, d_y_pull=rows_from.pull)
        return d_x_rows, rest

    d_x_rows, d_x_schedule, (d_rw_rows, weight_grads_to_run) = through(
        plan.backward, workspace, d_y, schedule, w_gate.shape[2], d_y.dtype, compute)
    d_x = ops.sum_slots(d_x_rows, d_x_schedule, shared_d_x)
    del d_x_rows  # d_x's rows go before the weight gradients' outputs are made (peak memory)
    d_w_gate, d_w_up, d_w_down = weight_grads_to_run() if weight_grads_to_run is not None else (None,) * 3
    return RoutedGrads(d_x, d_rw_rows, d_w_gate, d_w_up, d_w_down, None)


def _recipe_fused_backward(plan: PassPlan, d_y, x, row_router_weights, schedule: Schedule, keeps, w_gate, w_up,
                           w_down, swiglu_limit, workspace, weight_grads: bool, shared_d_x, shared_launch,
                           shared_weight_grads, expert_weights) -> RoutedGrads:
    """mxfp8's two routed dgrads in one launch (`down_dgrad_gate_up_dgrad`, KernelPlan.fused_backward) on the
    dequantized operands, the shared expert's first in it; the weight gradients after it as staged, from d_y's and
    x's rows quantized along tokens (at EP d_y's as the launch pulled them, x's pulled after it by every rank,
    whatever its weights need)."""
    ops, recipe = plan.ops, plan.recipe
    transport = _transport(workspace)
    d_y_in, down_t, gate_t, up_t, gate_up = precision.fused_backward_operands(
        recipe, d_y, keeps, w_gate, w_up, w_down, expert_weights, at_ep=transport is not None)
    d_y_rows, d_gate_up, _, d_rw_rows, d_x_rows, shared_made = _fused_dgrads(
        ops, plan.backward, d_y_in, row_router_weights, schedule, gate_up, gate_t, up_t, down_t, swiglu_limit,
        workspace, shared_launch, quant_block=recipe.block)
    del d_y_in, gate_up
    shared_grads = None
    if shared_made is not None:
        shared_d_x, shared_grads = shared_after_launch(ops, x, shared_made, shared_launch[4], shared_weight_grads)
    d_x = ops.sum_slots(*d_x_rows, shared_d_x)
    del d_x_rows
    # the weight gradients quantize d_y's and x's own rows along tokens: at EP=1 read through the schedule
    x_rows = None
    if transport is None:
        d_y_rows = None
    else:
        x_rows = transport.pull(x, schedule.row_source)
    d_w_gate = d_w_up = d_w_down = None
    if weight_grads:
        row_rw = stages.row_weights(row_router_weights, schedule).float()
        d_w_gate, d_w_up, d_w_down = precision.expert_weight_grads(ops, recipe, d_y, d_y_rows, x, x_rows,
                                                                   recipe.tokens(d_gate_up), keeps, row_rw, schedule,
                                                                   w_gate, w_up)
    return RoutedGrads(d_x, d_rw_rows, d_w_gate, d_w_up, d_w_down, shared_grads)


def router_weight_grad(d_rw_rows, router_weights, schedule: Schedule, workspace):
    """d_router_weights [N, k] from the rows' gradients [R] (fp32): each source's row, moved to its owner."""
    d_rw_slots, slots = rows_out(d_rw_rows[:, None], schedule, _transport(workspace))
    return d_rw_slots[slots.source_row.to(torch.int64), 0].to(router_weights.dtype)
