"""The MoK-style lower layer: workspace, schedule, and the forward / backward passes as plain functions.

`serval.moe` (autograd) is a thin wrapper over this module; use it directly to
own the schedule (build it once, reuse it across layers that share a routing),
to keep or drop the forward context, or to drive recomputation yourself:

    schedule = functional.build_schedule(topk_ids, num_experts)
    y, ctx = functional.forward(x, router_weights, schedule, w_gate, w_up, w_down)
    grads = functional.backward(d_y, ctx, x, router_weights, w_gate, w_up, w_down)

What is kept for backward (`ForwardContext`): the schedule (int32, O(N*k)) and
the gate/up pre-activations [R, 2I] of the routed experts (and [N, 2Is] of the
shared expert), in the input dtype. Expert outputs, h = SwiGLU(gate, up) and
the gathered tokens are NOT kept: backward recomputes h from the
pre-activations and regathers tokens from `x`. With `Config(recompute=True)`
the pre-activations are not kept either (`recompute_forward_context` rebuilds
them in backward at the cost of the gate/up GEMM).

Each pass runs its stages on one backend: `serval.kernels` (Triton) or
`serval.stages` (torch ops); see `Config.backend`.
"""

from __future__ import annotations

import dataclasses
import functools
from types import ModuleType
from typing import NamedTuple

import torch

from . import stages
from .config import Config
from .schedule import Schedule, build_schedule, capacity_rows, dense_schedule

__all__ = [
    "Workspace", "get_workspace", "create_workspace", "build_schedule", "dense_schedule",
    "ForwardContext", "Grads", "forward", "backward", "recompute_forward_context", "select_backend",
]


# ---------------------------------------------------------------- workspace

@dataclasses.dataclass(frozen=True)
class Workspace:
    """Everything sized once from the problem, never from the routing.

    At EP=1 this is the row capacity of the routed buffer; with expert
    parallelism it also owns the symmetric-memory buffers and signal pads that
    peers read from and write into, which is why it is created once and cached.
    """

    num_tokens: int
    top_k: int
    hidden: int
    num_experts: int
    block_m: int
    device: torch.device
    capacity_rows: int


def create_workspace(num_tokens: int, top_k: int, hidden: int, num_experts: int, *, device=None,
                     config: Config | None = None, group=None) -> Workspace:
    """A new workspace (see `get_workspace` for the cached one)."""
    config = config or Config()
    if group is not None and group.size() > 1:
        raise NotImplementedError("expert parallelism (group with size > 1) is not built yet")
    return Workspace(num_tokens, top_k, hidden, num_experts, config.block_m, torch.device(device or "cpu"),
                     capacity_rows(num_tokens * top_k, num_experts, config.block_m))


@functools.lru_cache(maxsize=16)
def _cached_workspace(num_tokens, top_k, hidden, num_experts, device, config, group):
    return create_workspace(num_tokens, top_k, hidden, num_experts, device=device, config=config, group=group)


def get_workspace(num_tokens: int, top_k: int, hidden: int, num_experts: int, *, device=None,
                  config: Config | None = None, group=None) -> Workspace:
    """The workspace for this problem, created on first use and cached."""
    return _cached_workspace(num_tokens, top_k, hidden, num_experts, torch.device(device or "cpu"),
                             config or Config(), group)


# ---------------------------------------------------------------- passes

def select_backend(config: Config, x: torch.Tensor, w_gate: torch.Tensor, shared=None) -> ModuleType:
    """The stage implementations for this call: Triton kernels or torch ops (see Config.backend).

    "auto" takes the kernels for bf16 on CUDA when every feature dimension (H, I, Is) is a multiple
    of 8, i.e. 16-byte rows; other shapes take the torch stages (see `serval.kernels.supports`).
    """
    if config.backend == "torch":
        return stages
    from . import kernels

    dims = (x.shape[1], w_gate.shape[1]) + (() if shared is None else (shared[0].shape[0],))
    if config.backend == "triton":
        kernels.check_supported(dims)
        return kernels
    return kernels if x.is_cuda and x.dtype == torch.bfloat16 and kernels.supports(dims) else stages


@dataclasses.dataclass
class ForwardContext:
    """What backward needs beyond the layer's inputs (see the module docstring)."""

    schedule: Schedule
    shared_schedule: Schedule | None
    gate_up: torch.Tensor | None  # [R, 2I] routed pre-activations (None: recompute)
    shared_gate_up: torch.Tensor | None  # [Rs, 2Is]
    swiglu_limit: float | None


class Grads(NamedTuple):
    x: torch.Tensor
    router_weights: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None


def _shared_weights(shared):
    """The shared expert as a one-expert group: [1, Is, H], [1, Is, H], [1, H, Is]."""
    return tuple(w.unsqueeze(0) for w in shared)


def forward(x, router_weights, schedule: Schedule, w_gate, w_up, w_down, shared=None, *,
            config: Config | None = None, swiglu_limit: float | None = None,
            shared_schedule: Schedule | None = None) -> tuple[torch.Tensor, ForwardContext]:
    """y = shared(x) + routed experts combined in slot order; returns (y, what backward needs)."""
    config = config or Config()
    ops = select_backend(config, x, w_gate, shared)
    gate_up, h = ops.gate_up_swiglu(x, w_gate, w_up, schedule, swiglu_limit)
    expert_out = ops.down(h, w_down, schedule)
    shared_out = shared_gate_up = None
    if shared is not None:
        ws_gate, ws_up, ws_down = _shared_weights(shared)
        shared_schedule = shared_schedule or dense_schedule(x.shape[0], schedule.block_m, x.device)
        shared_gate_up, shared_h = ops.gate_up_swiglu(x, ws_gate, ws_up, shared_schedule, None)
        shared_out = ops.down(shared_h, ws_down, shared_schedule)[: x.shape[0]]
    y = ops.combine(expert_out, router_weights, schedule, shared_out)
    keep = not config.recompute
    ctx = ForwardContext(schedule, shared_schedule, gate_up if keep else None,
                         shared_gate_up if keep else None, swiglu_limit)
    return y, ctx


def recompute_forward_context(ctx: ForwardContext, x, w_gate, w_up, shared=None, *,
                              config: Config | None = None) -> ForwardContext:
    """Fill in the pre-activations a `Config(recompute=True)` forward did not keep."""
    if ctx.gate_up is not None:
        return ctx
    ops = select_backend(config or Config(), x, w_gate, shared)
    gate_up, _ = ops.gate_up_swiglu(x, w_gate, w_up, ctx.schedule, ctx.swiglu_limit)
    shared_gate_up = None
    if shared is not None:
        ws_gate, ws_up, _ = _shared_weights(shared)
        shared_gate_up, _ = ops.gate_up_swiglu(x, ws_gate, ws_up, ctx.shared_schedule, None)
    return dataclasses.replace(ctx, gate_up=gate_up, shared_gate_up=shared_gate_up)


def _expert_backward(ops, d_y, x, router_weights, schedule, gate_up, w_gate, w_up, w_down, swiglu_limit):
    """One expert group's backward: (d_x_rows [R, H], d_rw_rows [R], d_w_gate, d_w_up, d_w_down)."""
    d_y_rows = ops.gather(d_y, schedule)
    d_gate_up, h_weighted, d_rw_rows = ops.down_dgrad_swiglu(d_y_rows, w_down, gate_up, router_weights,
                                                             schedule, swiglu_limit)
    d_x_rows = ops.gate_up_dgrad(d_gate_up, w_gate, w_up, schedule)
    d_w_gate, d_w_up = ops.gate_up_weight_grad(d_gate_up, x, schedule)
    d_w_down = ops.down_weight_grad(d_y_rows, h_weighted, schedule)
    return d_x_rows, d_rw_rows, d_w_gate, d_w_up, d_w_down


def backward(d_y, ctx: ForwardContext, x, router_weights, w_gate, w_up, w_down, shared=None, *,
             config: Config | None = None) -> Grads:
    """Gradients of the layer for output gradient d_y [N, H]; see `Grads`."""
    config = config or Config()
    ops = select_backend(config, x, w_gate, shared)
    ctx = recompute_forward_context(ctx, x, w_gate, w_up, shared, config=config)
    d_y = d_y.contiguous()
    d_x_rows, d_rw_rows, d_w_gate, d_w_up, d_w_down = _expert_backward(
        ops, d_y, x, router_weights, ctx.schedule, ctx.gate_up, w_gate, w_up, w_down, ctx.swiglu_limit)
    shared_d_x = shared_grads = None
    if shared is not None:
        ones = torch.ones(x.shape[0], 1, device=x.device, dtype=router_weights.dtype)
        s_d_x_rows, _, s_d_gate, s_d_up, s_d_down = _expert_backward(
            ops, d_y, x, ones, ctx.shared_schedule, ctx.shared_gate_up, *_shared_weights(shared), None)
        shared_d_x = s_d_x_rows[: x.shape[0]]
        shared_grads = (s_d_gate[0], s_d_up[0], s_d_down[0])
    d_x = ops.sum_slots(d_x_rows, ctx.schedule, shared_d_x)
    d_router_weights = d_rw_rows[ctx.schedule.source_row.to(torch.int64)].to(router_weights.dtype)
    return Grads(d_x, d_router_weights, d_w_gate, d_w_up, d_w_down, shared_grads)
