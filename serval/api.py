"""`serval.moe`: the autograd-aware MoE layer, its input validation, and its torch.library custom ops.

The layer is two custom ops, `serval::moe_forward` and `serval::moe_backward`,
joined by `register_autograd`; each has a fake (meta) implementation, so
`torch.compile(fullgraph=True)` traces through the layer and CUDA graphs can
capture it (no op inside synchronises with the host: every shape comes from the
inputs' shapes and the schedule's fixed capacity).

Validation happens in two places:
* `validate_inputs` (Python, before the op): shapes, dtypes, devices,
  contiguity, k vs E, swiglu_limit. Metadata only, so it never syncs and also runs
  while tracing.
* the expert-id range (a value check) inside the op: on CPU a host check with a
  clear ValueError; on CUDA a device-side assertion (`torch._assert_async`,
  no host sync; a bad id then fails the next synchronising CUDA call), or, with
  `Config(debug=True)`, a host check that synchronises and raises a ValueError.
* EP capacity overflow (the routing sent one rank more rows than its capacity), inside
  the op: on CPU or with `debug`, a ValueError at once; on CUDA, without a sync, y,
  d_x and the experts' weight gradients of that step become NaN (the router weights are
  poisoned; rows past the capacity are dropped, never written out of bounds) and a later call, once the GPU
  has run that step, raises the ValueError (`Workspace.check_overflow`).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import functional
from .config import Config
from .schedule import Schedule, build_schedule, capacity_rows, dense_schedule

FLOAT_DTYPES = (torch.bfloat16, torch.float32, torch.float64)


# ---------------------------------------------------------------- validation

def _check_tensor(name, t, ndim, dtypes, device=None):
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device} (the device of x), got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous())")


def _check_shape(name, t, expected):
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)}, got {tuple(t.shape)}")


def validate_inputs(x, router_weights, topk_ids, w_gate, w_up, w_down, shared, swiglu_limit, ep_size=1):
    """Check everything about the inputs that their metadata can tell (no host sync)."""
    _check_tensor("x", x, 2, FLOAT_DTYPES)
    num_tokens, hidden = x.shape
    if num_tokens == 0:
        raise ValueError("x must hold at least one token, got shape (0, H)")
    rw_dtypes = (torch.float64,) if x.dtype == torch.float64 else (torch.float32,)
    _check_tensor("router_weights", router_weights, 2, rw_dtypes, x.device)
    _check_tensor("topk_ids", topk_ids, 2, (torch.int32, torch.int64), x.device)
    top_k = router_weights.shape[1]
    _check_shape("router_weights", router_weights, (num_tokens, top_k))
    _check_shape("topk_ids", topk_ids, (num_tokens, top_k))
    _check_tensor("w_gate", w_gate, 3, (x.dtype,), x.device)
    num_experts, inter, _ = w_gate.shape
    _check_shape("w_gate", w_gate, (num_experts, inter, hidden))
    _check_tensor("w_up", w_up, 3, (x.dtype,), x.device)
    _check_shape("w_up", w_up, (num_experts, inter, hidden))
    _check_tensor("w_down", w_down, 3, (x.dtype,), x.device)
    _check_shape("w_down", w_down, (num_experts, hidden, inter))
    if not 1 <= top_k <= num_experts * ep_size:
        raise ValueError(f"top-k (router_weights.shape[1] = {top_k}) must be in [1, E = {num_experts * ep_size}]")
    if inter == 0:
        raise ValueError("w_gate must have a non-empty intermediate dimension I")
    if shared is not None:
        if not isinstance(shared, (tuple, list)) or len(shared) != 3:
            raise TypeError("shared must be None or a tuple (ws_gate [Is, H], ws_up [Is, H], ws_down [H, Is])")
        ws_gate, ws_up, ws_down = shared
        _check_tensor("shared[0] (ws_gate)", ws_gate, 2, (x.dtype,), x.device)
        shared_inter = ws_gate.shape[0]
        _check_shape("shared[0] (ws_gate)", ws_gate, (shared_inter, hidden))
        _check_tensor("shared[1] (ws_up)", ws_up, 2, (x.dtype,), x.device)
        _check_shape("shared[1] (ws_up)", ws_up, (shared_inter, hidden))
        _check_tensor("shared[2] (ws_down)", ws_down, 2, (x.dtype,), x.device)
        _check_shape("shared[2] (ws_down)", ws_down, (hidden, shared_inter))
    if swiglu_limit is not None and not (isinstance(swiglu_limit, (int, float)) and 0 < swiglu_limit < float("inf")):
        raise ValueError(f"swiglu_limit must be None or a positive finite float, got {swiglu_limit!r}")


def _check_on_device(ok: Tensor, message: str, debug: bool) -> None:
    """A value check: a ValueError on CPU or in debug mode (a host sync), else a device-side assert."""
    if ok.device.type == "cpu" or debug:
        if not bool(ok):
            raise ValueError(message)
    else:
        torch._assert_async(ok, f"serval.moe: {message}")


def check_expert_ids(topk_ids: Tensor, num_experts: int, debug: bool) -> None:
    """topk_ids must hold expert ids in [0, num_experts)."""
    in_range = ((topk_ids >= 0) & (topk_ids < num_experts)).all()
    _check_on_device(in_range, f"topk_ids must hold expert ids in [0, {num_experts})", debug)


# ---------------------------------------------------------------- custom ops

def _config(block_m, recompute, backend, debug) -> Config:
    return Config(block_m=block_m, recompute=recompute, backend=backend, debug=debug)


def _shared(ws_gate, ws_up, ws_down):
    return None if ws_gate is None else (ws_gate, ws_up, ws_down)


_EMPTY = (0,)


@torch.library.custom_op("serval::moe_forward", mutates_args=())
def _moe_forward(x: Tensor, router_weights: Tensor, topk_ids: Tensor, w_gate: Tensor, w_up: Tensor,
                 w_down: Tensor, ws_gate: Optional[Tensor], ws_up: Optional[Tensor], ws_down: Optional[Tensor],
                 swiglu_limit: Optional[float], block_m: int, recompute: bool, backend: str, debug: bool,
                 workspace_id: int,
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns y, the five schedule tensors, the kept pre-activations (empty when recomputed) and,
    at EP, the group's router weights (else empty)."""
    config = _config(block_m, recompute, backend, debug)
    workspace = _workspace(workspace_id)
    shared = _shared(ws_gate, ws_up, ws_down)
    if workspace is None:
        check_expert_ids(topk_ids, w_gate.shape[0], debug)
        schedule, all_router_weights = build_schedule(topk_ids, w_gate.shape[0], block_m), None
    else:
        workspace.check_overflow()
        check_expert_ids(topk_ids, workspace.num_experts, debug)
        schedule, all_router_weights, overflow = functional.build_ep_schedule(topk_ids, router_weights, workspace)
        if x.device.type == "cpu" or debug:  # a host check costs nothing on CPU; debug accepts the sync
            workspace.check_overflow(overflow)
        else:  # no sync: this step's y, d_x, weight gradients become NaN; a later call raises
            workspace.record_overflow(overflow)
            router_weights = router_weights.masked_fill(overflow, float("nan"))
            all_router_weights = all_router_weights.masked_fill(overflow, float("nan"))
    y, ctx = functional.forward(x, router_weights, schedule, w_gate, w_up, w_down, shared, config=config,
                                swiglu_limit=swiglu_limit, workspace=workspace, all_router_weights=all_router_weights)
    kept = [t if t is not None else x.new_empty(_EMPTY) for t in (ctx.gate_up, ctx.shared_gate_up, all_router_weights)]
    return (y, *schedule.tensors(), *kept)


def _workspace(workspace_id: int):
    return None if workspace_id < 0 else functional.workspace_by_id(workspace_id)


@_moe_forward.register_fake
def _(x, router_weights, topk_ids, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, swiglu_limit, block_m,
      recompute, backend, debug, workspace_id):
    num_tokens, top_k = topk_ids.shape
    num_experts, inter, _ = w_gate.shape
    workspace = _workspace(workspace_id)
    ep_size = 1 if workspace is None else workspace.ep_size
    capacity = workspace.capacity_rows if workspace else capacity_rows(num_tokens * top_k, num_experts, block_m)
    i32 = dict(dtype=torch.int32, device=x.device)
    schedule = (x.new_empty(num_experts, **i32), x.new_empty(num_experts + 1, **i32), x.new_empty(capacity, **i32),
                x.new_empty(ep_size * num_tokens, top_k, **i32), x.new_empty(capacity // block_m, **i32))
    # the kept pre-activations are packed: Schedule.num_packed rows
    gate_up = x.new_empty(_EMPTY) if recompute else x.new_empty(min(capacity, ep_size * num_tokens * top_k), 2 * inter)
    shared_gate_up = x.new_empty(_EMPTY)
    if ws_gate is not None and not recompute:
        shared_gate_up = x.new_empty(num_tokens, 2 * ws_gate.shape[0])
    all_router_weights = router_weights.new_empty(ep_size * num_tokens, top_k) if workspace else x.new_empty(_EMPTY)
    return (torch.empty_like(x), *schedule, gate_up, shared_gate_up, all_router_weights)


@torch.library.custom_op("serval::moe_backward", mutates_args=())
def _moe_backward(d_y: Tensor, x: Tensor, router_weights: Tensor, w_gate: Tensor, w_up: Tensor, w_down: Tensor,
                  ws_gate: Optional[Tensor], ws_up: Optional[Tensor], ws_down: Optional[Tensor],
                  tokens_per_expert: Tensor, expert_offsets: Tensor, row_source: Tensor, source_row: Tensor,
                  tile_expert: Tensor, gate_up: Tensor, shared_gate_up: Tensor, all_router_weights: Tensor,
                  swiglu_limit: Optional[float], block_m: int, recompute: bool, backend: str, debug: bool,
                  workspace_id: int,
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns d_x, d_router_weights, d_w_gate, d_w_up, d_w_down, and the shared expert's (empty if none)."""
    config = _config(block_m, recompute, backend, debug)
    workspace = _workspace(workspace_id)
    schedule = Schedule(tokens_per_expert, expert_offsets, row_source, source_row, tile_expert,
                        num_experts=w_gate.shape[0], block_m=block_m)
    shared = _shared(ws_gate, ws_up, ws_down)
    shared_schedule = None if shared is None else dense_schedule(x.shape[0], block_m, x.device)
    ctx = functional.ForwardContext(schedule, shared_schedule, None if recompute else gate_up,
                                    None if recompute or shared is None else shared_gate_up, swiglu_limit,
                                    all_router_weights if workspace else None)
    grads = functional.backward(d_y, ctx, x, router_weights, w_gate, w_up, w_down, shared, config=config,
                                workspace=workspace)
    shared_grads = grads.shared or tuple(x.new_empty(_EMPTY) for _ in range(3))
    return (grads.x, grads.router_weights, grads.w_gate, grads.w_up, grads.w_down, *shared_grads)


@_moe_backward.register_fake
def _(d_y, x, router_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, *rest):
    shared = [torch.empty_like(w) if w is not None else x.new_empty(_EMPTY) for w in (ws_gate, ws_up, ws_down)]
    return (torch.empty_like(x), torch.empty_like(router_weights), torch.empty_like(w_gate),
            torch.empty_like(w_up), torch.empty_like(w_down), *shared)


_FORWARD_TENSOR_INPUTS = 9  # x, router_weights, topk_ids, w_gate, w_up, w_down, ws_gate, ws_up, ws_down


def _setup_context(ctx, inputs, output):
    x, router_weights, _, w_gate, w_up, w_down, ws_gate, ws_up, ws_down = inputs[:_FORWARD_TENSOR_INPUTS]
    ctx.options = inputs[_FORWARD_TENSOR_INPUTS:]  # swiglu_limit, block_m, recompute, backend, debug, workspace
    ctx.has_shared = ws_gate is not None
    ctx.save_for_backward(x, router_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, *output[1:])
    # only y has a gradient: autograd must not fill zero gradients for the kept tensors (270 MB on kimi-k2)
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)


def _backward(ctx, d_y, *_unused_output_grads):  # the unused ones arrive as None
    if d_y is None:  # y took no part in what is differentiated
        return (None,) * (_FORWARD_TENSOR_INPUTS + len(ctx.options))
    grads = torch.ops.serval.moe_backward(d_y, *ctx.saved_tensors, *ctx.options)
    d_x, d_rw, d_w_gate, d_w_up, d_w_down, *shared_grads = grads
    if not ctx.has_shared:
        shared_grads = [None, None, None]
    return (d_x, d_rw, None, d_w_gate, d_w_up, d_w_down, *shared_grads) + (None,) * len(ctx.options)


_moe_forward.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------- public entry point

def moe(x, router_weights, topk_ids, w_gate, w_up, w_down, shared=None, *, group=None, config=None,
        swiglu_limit=None):
    """The MoE layer of SPEC.md: y[t] = shared(x[t]) + sum_j router_weights[t, j] * expert_{topk_ids[t, j]}(x[t]).

    x [N, H]; router_weights [N, k] fp32 (differentiable); topk_ids [N, k] int (global expert ids);
    w_gate, w_up [E_local, I, H], w_down [E_local, H, I] (nn.Linear layout); shared = (ws_gate [Is, H],
    ws_up [Is, H], ws_down [H, Is]) or None; group: the expert-parallel process group (None: EP=1);
    config: `serval.Config`; swiglu_limit: clamp of the routed experts' gate (max) and up (+-limit).
    Returns y [N, H] in x's dtype; differentiable in x, router_weights and every weight; bitwise
    deterministic; no host-device synchronisation.
    """
    config = config or Config()
    if not isinstance(config, Config):
        raise TypeError(f"config must be a serval.Config, got {type(config).__name__}")
    if config.precision != "bf16":
        raise NotImplementedError(f"serval.moe: precision={config.precision!r} is not built yet; use 'bf16'")
    ep_size = 1 if group is None else group.size()
    validate_inputs(x, router_weights, topk_ids, w_gate, w_up, w_down, shared, swiglu_limit, ep_size)
    workspace_id = -1
    if ep_size > 1:
        num_tokens, top_k = topk_ids.shape
        workspace_id = functional.get_workspace(num_tokens, top_k, x.shape[1], w_gate.shape[0] * ep_size,
                                                device=x.device, config=config, group=group).id
    ws_gate, ws_up, ws_down = shared if shared is not None else (None, None, None)
    limit = None if swiglu_limit is None else float(swiglu_limit)
    outputs = torch.ops.serval.moe_forward(x, router_weights, topk_ids, w_gate, w_up, w_down, ws_gate, ws_up,
                                           ws_down, limit, config.block_m, config.recompute, config.backend,
                                           config.debug, workspace_id)
    return outputs[0]
