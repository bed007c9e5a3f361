"""The MoK-style lower layer: workspace, schedule, and the forward / backward passes as plain functions.

`serval.moe` (autograd) is a thin wrapper over this module; use it directly to
own the schedule (build it once, reuse it across layers that share a routing),
to keep or drop the forward context, or to drive recomputation yourself:

    schedule = functional.build_schedule(topk_ids, num_experts)
    y, ctx = functional.forward(x, router_weights, schedule, w_gate, w_up, w_down)
    grads = functional.backward(d_y, ctx, x, router_weights, w_gate, w_up, w_down)

Expert parallelism (EP = P ranks, expert e on rank e // E_local): pass the
workspace of the group (`get_workspace(..., group=pg)`) and the rank's schedule
from `build_ep_schedule`; the rows a rank computes are then pulled from their
owners (dispatch) and the results pushed back into the owners' slots (combine),
and the same for d_y and d_x in backward (see `serval.transport`); on the kernels
in bf16 the rows stream through the macrobatch ring (`serval.macrobatch`).

What is kept for backward (`ForwardContext`): the schedule (int32, O(N*k)) and
the gate/up pre-activations of the routed experts in packed rows (no padding:
[N*k, 2I] at EP=1; at EP the rank's rows, or the first window's where the pass
streams through the macrobatch ring) and [N, 2Is] of the shared expert,
in the input dtype; at EP also the group's router weights
[P*N, k] fp32. Expert outputs, h = SwiGLU(gate, up) and the gathered tokens are
NOT kept: backward recomputes h from the pre-activations and regathers (pulls)
tokens from `x`. With `Config(recompute=True)` the pre-activations are not kept
either (`recompute_forward_context` rebuilds them at the cost of the gate/up GEMM).

Each pass runs its stages on one backend: `serval.kernels` (Triton) or
`serval.stages` (torch ops); see `Config.backend`.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import torch.distributed as dist

from . import macrobatch, passes, precision
from . import schedule as schedule_module
from .config import Config
from .pass_plan import FUSED, GATHERED, STAGED, STORED, STREAMED, Direction, plan_pass, select_backend
from .schedule import Schedule, dense_schedule, local_schedule
from .workspace import ErrorFlags, Workspace, create_workspace, get_workspace, workspace_by_id

if dist.is_available():
    # torch.distributed.nn.functional evaluates `group.WORLD` into ten functions' default arguments when it is
    # imported, and torch imports it on the first call of any custom op (through torch._dynamo). Imported after
    # init_process_group, it would hold the default group past destroy_process_group, and gloo aborts the process
    # ("terminate called without an active exception") when interpreter teardown frees the group at last. Imported
    # here, with serval, before the caller makes a group, it holds None.
    import torch.distributed.nn.functional  # noqa: F401

__all__ = [
    "Workspace", "ErrorFlags", "get_workspace", "create_workspace", "workspace_by_id", "build_schedule",
    "build_ep_schedule", "gather_routing", "ep_schedule",
    "dense_schedule", "ForwardContext", "Grads", "forward", "backward", "recompute_forward_context",
    "select_backend", "plan_pass",
]


def gather_routing(topk_ids: torch.Tensor, router_weights: torch.Tensor, workspace: Workspace):
    """The group's routing at EP: (topk_ids [P*N, k] int64, router_weights [P*N, k]), all-gathered in rank order.
    The ids go as int64 whatever integer dtype each rank passed, so ranks may differ there."""
    transport = workspace.transport
    return transport.all_gather(topk_ids.to(torch.int64)), transport.all_gather(router_weights)


def ep_schedule(all_ids: torch.Tensor, workspace: Workspace) -> Schedule:
    """This rank's schedule from the group's expert ids [P*N, k] (in [0, E)) (see `build_ep_schedule`)."""
    group_schedule = schedule_module.build_schedule(all_ids, workspace.num_experts, workspace.block_m)
    # the workspace's capacity is the worst case: no routing overflows it
    return local_schedule(group_schedule, workspace.rank, workspace.experts_per_rank, workspace.capacity_rows)[0]


def build_ep_schedule(topk_ids: torch.Tensor, router_weights: torch.Tensor, workspace: Workspace):
    """This rank's schedule at EP: all-gather the group's routing, build the schedule of the whole
    group (identical on every rank) and keep this rank's experts' rows, every one of them.

    Returns (schedule, the group's router weights [P*N, k]).
    """
    all_ids, all_router_weights = gather_routing(topk_ids, router_weights, workspace)
    return ep_schedule(all_ids, workspace), all_router_weights


def build_schedule(topk_ids: torch.Tensor, num_experts: int, block_m: int = 128) -> Schedule:
    """The routing schedule of `topk_ids` [N, k] (global expert ids of an integer dtype, each in [0, num_experts))
    with rows padded per expert to block_m (`serval.schedule.build_schedule`), its arguments checked first; the
    ids' range on CPU only (a value check on CUDA would sync the host: there the caller keeps them in range)."""
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be a 2-D tensor [N, k], got "
                         f"{tuple(topk_ids.shape) if isinstance(topk_ids, torch.Tensor) else type(topk_ids).__name__}")
    if topk_ids.dtype == torch.bool or topk_ids.is_floating_point() or topk_ids.is_complex():
        raise TypeError(f"topk_ids must hold integer expert ids, got {str(topk_ids.dtype).replace('torch.', '')}")
    for name, value in (("num_experts", num_experts), ("block_m", block_m)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if topk_ids.device.type == "cpu" and topk_ids.numel() and not bool(
            ((topk_ids >= 0) & (topk_ids < num_experts)).all()):
        raise ValueError(f"topk_ids must hold expert ids in [0, {num_experts}) (num_experts), got values from "
                         f"{int(topk_ids.min())} to {int(topk_ids.max())}")
    return schedule_module.build_schedule(topk_ids, num_experts, block_m)


def _check_schedule(schedule: Schedule, x, router_weights, w_gate, workspace) -> None:
    """ValueError unless `schedule` was built for these inputs (at EP=1: N, k and E; at EP: k)."""
    want = (("top_k", schedule.top_k, router_weights.shape[1], "router_weights.shape[1]"),)
    if workspace is None:
        want += (("num_tokens", schedule.num_tokens, x.shape[0], "x.shape[0]"),
                 ("num_experts", schedule.num_experts, w_gate.shape[0], "w_gate.shape[0]"))
    for name, have, expected, source in want:
        if have != expected:
            raise ValueError(f"schedule was built for {name} = {have}, but {source} = {expected}: build it from these "
                             f"inputs' topk_ids")


# ---------------------------------------------------------------- passes

@dataclasses.dataclass
class ForwardContext:
    """What backward needs beyond the layer's inputs (see the module docstring)."""

    schedule: Schedule
    shared_schedule: Schedule | None
    gate_up: torch.Tensor | None  # [num_packed, 2I] routed pre-activations, packed rows (None: recompute)
    shared_gate_up: torch.Tensor | None  # [N, 2Is]
    swiglu_limit: float | None
    all_router_weights: torch.Tensor | None = None  # EP: the group's router weights [P*N, k]
    kept: precision.Kept | None = None  # FP8 precisions: what the routed experts keep (gate_up is None then)


class Grads(NamedTuple):
    """The layer's gradients; a weight gradient is None where `backward` was told not to make it."""

    x: torch.Tensor
    router_weights: torch.Tensor
    w_gate: torch.Tensor | None
    w_up: torch.Tensor | None
    w_down: torch.Tensor | None
    shared: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None] | None


_FORWARD = {STAGED: passes.forward, FUSED: passes.forward, STREAMED: macrobatch.forward}
_BACKWARD = {STAGED: passes.backward, FUSED: passes.backward, STREAMED: macrobatch.backward}
# the shared expert outside the routed launch: its own tokens, never moved, one launch per stage
_SHARED_BACKWARD = Direction(STAGED, STAGED, GATHERED, STORED, shared_in_launch=False)


def forward(x, router_weights, schedule: Schedule, w_gate, w_up, w_down, shared=None, *,
            config: Config | None = None, swiglu_limit: float | None = None,
            shared_schedule: Schedule | None = None, workspace: Workspace | None = None,
            all_router_weights: torch.Tensor | None = None,
            expert_weights: precision.ExpertWeights | None = None) -> tuple[torch.Tensor, ForwardContext]:
    """y = shared(x) + routed experts combined in slot order; returns (y, what backward needs).

    At EP: `workspace` of the group, `schedule` and `all_router_weights` from `build_ep_schedule`.
    The routed experts run in `config.precision` (`serval.precision`), the shared expert in x's dtype, as the
    call's `PassPlan` says (`serval.pass_plan`: staged, fused or streamed through the macrobatch ring);
    expert_weights: in an FP8 precision, the weights already in its GEMMs' form (`precision.expert_weights`).
    """
    config = config or Config()
    _check_schedule(schedule, x, router_weights, w_gate, workspace)
    plan = plan_pass(config, x, w_gate, shared, workspace)
    ops, recipe = plan.ops, plan.recipe
    if shared is not None:
        shared_schedule = shared_schedule or dense_schedule(x.shape[0], schedule.block_m, x.device)
    if recipe is not None:
        precision.check_inputs(recipe, x.dtype, w_gate.shape[1], schedule.block_m)
        if config.debug:
            for name, t in (("x", x), ("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
                precision.check_finite(name, t)
    # in a fused launch the shared expert's tiles join the routed ones (first: they need no pulled rows)
    shared_launch = (x, *passes.shared_weights(shared), shared_schedule) if plan.forward.shared_in_launch else None
    routed = _FORWARD[plan.forward.strategy](plan, x, w_gate, w_up, w_down, schedule, swiglu_limit, workspace,
                                             shared_launch, expert_weights)
    shared_gate_up = shared_out = None
    if routed.shared_made is not None:  # the shared expert's outputs from the fused launch
        shared_gate_up, _, shared_o = routed.shared_made
        shared_out = shared_o[: x.shape[0]]
    elif shared is not None:
        shared_gate_up, shared_h = passes.shared_gate_up(ops, x, shared, shared_schedule, swiglu_limit)
        shared_out = ops.down(shared_h, passes.shared_weights(shared)[2], shared_schedule)[: x.shape[0]]
    y = ops.combine(routed.rows, router_weights, routed.rows_schedule, shared_out)
    keep = not config.recompute
    gate_up, kept = (routed.keeps, None) if recipe is None else (None, routed.keeps)
    ctx = ForwardContext(schedule, shared_schedule, gate_up if keep else None,
                         shared_gate_up if keep else None, swiglu_limit, all_router_weights,
                         kept if keep else None)
    return y, ctx


def kept_rows(config: Config, x, w_gate, shared, workspace: Workspace | None, capacity: int,
              num_sources: int) -> tuple[int, int]:
    """(packed rows, rows) of what a forward keeps of the routed experts (the custom op's fake implementation sizes
    its outputs with them): a schedule's num_packed (`Schedule.num_packed`: the pre-activations) and capacity (an
    FP8 precision's h along tokens), for the whole schedule of `capacity` rows and `num_sources` (token, slot)
    pairs, or for the first window where the pass streams through the ring."""
    if plan_pass(config, x, w_gate, shared, workspace).forward.strategy == STREAMED:
        capacity = workspace.ring_rows
    return min(capacity, num_sources), capacity


def recompute_forward_context(ctx: ForwardContext, x, w_gate, w_up, shared=None, *,
                              config: Config | None = None, workspace: Workspace | None = None,
                              expert_weights: precision.ExpertWeights | None = None) -> ForwardContext:
    """Fill in what a `Config(recompute=True)` forward did not keep (from the forward's x and weights), with x's
    rows in as the forward's plan takes them. A pass that streams through the macrobatch ring
    (`serval.macrobatch`) recomputes the routed experts' pre-activations in its backward, window by window: here
    only the shared expert's."""
    config = config or Config()
    _check_shared(ctx, shared)
    if ctx.gate_up is not None or ctx.kept is not None:
        return ctx
    plan = plan_pass(config, x, w_gate, shared, workspace)
    ops, recipe = plan.ops, plan.recipe
    shared_gate_up = ctx.shared_gate_up
    if shared is not None and shared_gate_up is None:
        shared_gate_up = passes.shared_gate_up(ops, x, shared, ctx.shared_schedule, ctx.swiglu_limit)[0]
    if plan.forward.strategy == STREAMED:
        return dataclasses.replace(ctx, shared_gate_up=shared_gate_up)

    def pre_activations(rows_from):
        if recipe is None:
            return ops.gate_up_swiglu(x, w_gate, w_up, ctx.schedule, ctx.swiglu_limit, **rows_from.kwargs())[0]
        return precision.forward(ops, recipe, x, rows_from.rows, w_gate, w_up, None, ctx.schedule,
                                 ctx.swiglu_limit, expert_weights, pull=rows_from.pull)[1]

    keeps = passes.rows_in(plan.forward, workspace, x, ctx.schedule, pre_activations)
    if recipe is None:
        return dataclasses.replace(ctx, gate_up=keeps, shared_gate_up=shared_gate_up)
    return dataclasses.replace(ctx, kept=keeps, shared_gate_up=shared_gate_up)


def _check_shared(ctx: ForwardContext, shared) -> None:
    """ValueError unless the shared expert is passed exactly when the forward had one."""
    if (ctx.shared_schedule is None) != (shared is None):
        had = "had none" if ctx.shared_schedule is None else "had one"
        raise ValueError(f"shared: the forward {had}; pass the shared expert's weights exactly as to the forward")


def backward(d_y, ctx: ForwardContext, x, router_weights, w_gate, w_up, w_down, shared=None, *,
             config: Config | None = None, workspace: Workspace | None = None,
             expert_weights: precision.ExpertWeights | None = None, weight_grads: bool = True,
             shared_weight_grads: bool = True) -> Grads:
    """Gradients of the layer for output gradient d_y [N, H]; see `Grads` (expert_weights: as in `forward`).
    weight_grads / shared_weight_grads False: the routed / shared experts' weight gradients are None and their
    GEMMs do not run (frozen experts)."""
    config = config or Config()
    plan = plan_pass(config, x, w_gate, shared, workspace)
    ops, recipe = plan.ops, plan.recipe
    # recompute_forward_context checks the shared expert is passed as to the forward
    ctx = recompute_forward_context(ctx, x, w_gate, w_up, shared, config=config, workspace=workspace,
                                    expert_weights=expert_weights)
    d_y = d_y.contiguous()
    row_router_weights = router_weights if plan.ep_size == 1 else ctx.all_router_weights
    streamed = plan.backward.strategy == STREAMED
    # (a streamed pass under recompute keeps nothing: its backward recomputes every window)
    if (recipe is None and ctx.kept is not None) or (
            recipe is not None and ctx.kept is None and (ctx.gate_up is not None or not streamed)):
        made = "bf16" if ctx.kept is None else "an FP8 precision"
        raise ValueError(f"serval.functional.backward: the forward context was made in {made}, not "
                         f"{config.precision}: pass the Config of the forward")
    shared_d_x = shared_grads = shared_launch = None
    if shared is not None and plan.backward.shared_in_launch:  # its dgrads join the routed fused launch
        shared_launch = (d_y, *passes.shared_weights(shared), ctx.shared_schedule, ctx.shared_gate_up)
    elif shared is not None:  # the shared expert: every local token once, rows = tokens, never moved
        ones = torch.ones(x.shape[0], 1, device=x.device, dtype=router_weights.dtype)
        shared_d_x, _, *shared_grads, _ = passes.expert_backward(
            ops, _SHARED_BACKWARD, d_y, x, ones, ctx.shared_schedule, ctx.shared_gate_up,
            *passes.shared_weights(shared), ctx.swiglu_limit, None, weight_grads=shared_weight_grads)
        shared_grads = tuple(None if g is None else g[0] for g in shared_grads)
    if recipe is not None and config.debug:
        precision.check_finite("d_y", d_y)
    grads = _BACKWARD[plan.backward.strategy](
        plan, d_y, x, row_router_weights, ctx.schedule, ctx.gate_up if recipe is None else ctx.kept, w_gate, w_up,
        w_down, ctx.swiglu_limit, workspace, weight_grads, shared_d_x, shared_launch, shared_weight_grads,
        expert_weights)
    d_router_weights = passes.router_weight_grad(grads.d_rw_rows, router_weights, ctx.schedule, workspace)
    return Grads(grads.d_x, d_router_weights, grads.d_w_gate, grads.d_w_up, grads.d_w_down,
                 grads.shared_grads or shared_grads)
