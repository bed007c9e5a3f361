"""`serval.moe`: the autograd-aware MoE layer, its input validation, and its torch.library custom ops.

The layer is two custom ops, `serval::moe_forward` and `serval::moe_backward`,
joined by `register_autograd`; each has a fake (meta) implementation, so
`torch.compile(fullgraph=True)` traces through the layer and CUDA graphs can
capture it (no op inside synchronises with the host: every shape comes from the
inputs' shapes and the schedule's fixed capacity). The ops carry the `Config` and
the EP workspace as ints (`config_id`, `workspace_id`) that index module-level
registries, since a custom op takes only tensors and plain scalars.

Validation happens in three places:
* `validate_inputs` (Python, before the op): shapes, dtypes, devices,
  k vs E, swiglu_limit; every message names the argument (strided views are then copied). Metadata
  only, so it never syncs and also runs while tracing.
* the expert-id range (a value check), inside the op: on CPU, or with
  `Config(debug=True)` (a host sync), a ValueError at once. On CUDA without debug
  there is no sync: out-of-range ids are clamped (nothing is read or written out of
  bounds), that step's y, d_x and expert weight gradients become NaN (its router
  weights are poisoned), a device flag is counted and copied, non_blocking, into
  pinned host memory, and a later call, once the GPU has run that step, raises
  `ValueError: topk_ids must hold expert ids in [0, E) ... in an earlier step`.
  The CUDA context stays usable. At EP=1 the flags are per device (`ErrorFlags`,
  allocated by the first call on that device: run once before capturing a CUDA
  graph); at EP they are the workspace's, and the check covers the ids of every
  rank, so all ranks poison and raise together.
There is no EP capacity error: a rank's schedule holds the worst case of any routing, and
its rows stream through the macrobatch ring (`Config.macrobatch_size`), so no row is dropped.
A CUDA graph replay runs no Python: errors of replayed steps are reported by the next
call that runs eagerly.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from . import functional, precision, weight_cache, weight_layout
from . import precision as _precision  # for `quantize_expert_weights`, whose argument is named precision
from .config import DEFAULT_CONFIG, Config, config_by_id, config_id
from .functional import ErrorFlags
from .schedule import Schedule, build_schedule, capacity_rows, dense_schedule

FLOAT_DTYPES = (torch.bfloat16, torch.float32, torch.float64)
ROUTER_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # taken as float32
INDEX_DTYPES = (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8)  # topk_ids (others: as int64)


# ---------------------------------------------------------------- validation

def _check_tensor(name, t, layout, dtypes, device=None, dtype_note=""):
    """t is a tensor of len(layout) dims, one of `dtypes`, on `device` (any strides: `moe` makes it contiguous)."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layout}, got {type(t).__name__}")
    ndim = layout.count(",") + 1
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        expected = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype {expected}{dtype_note}, got {str(t.dtype).replace('torch.', '')}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device} (the device of x), got {t.device}")


def _check_shape(name, t, expected, note=""):
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)}{note}, got {tuple(t.shape)}")


def validate_inputs(x, router_weights, topk_ids, w_gate, w_up, w_down, shared, swiglu_limit, ep_size=1):
    """Check everything about the inputs that their metadata can tell (no host sync).

    Sizes are taken from x (N, H), topk_ids (k) and w_gate (E_local, I); every other
    argument is checked against them, and each message names the argument that was passed.
    """
    _check_tensor("x", x, "[N, H]", FLOAT_DTYPES)
    num_tokens, hidden = x.shape
    if num_tokens == 0:
        raise ValueError(f"x must hold at least one token (x.shape[0] >= 1), got shape {tuple(x.shape)}")
    if hidden == 0:
        raise ValueError(f"x must have a hidden size H >= 1 (x.shape[1]), got shape {tuple(x.shape)}")
    dtype_of_x = " (the dtype of x)"
    rw_dtypes = (torch.float64,) if x.dtype == torch.float64 else ROUTER_WEIGHT_DTYPES
    _check_tensor("router_weights", router_weights, "[N, k]", rw_dtypes, x.device,
                  " (router weights are float32, bfloat16 or float16, computed in float32; float64 when x is "
                  "float64)")
    _check_tensor("topk_ids", topk_ids, "[N, k]", INDEX_DTYPES, x.device)
    for name, t in (("router_weights", router_weights), ("topk_ids", topk_ids)):
        if t.shape[0] != num_tokens:
            raise ValueError(f"{name} must have one row per token of x (N = x.shape[0] = {num_tokens}), "
                             f"got shape {tuple(t.shape)}")
    if router_weights.shape != topk_ids.shape:
        raise ValueError(f"router_weights and topk_ids must have the same shape [N, k], got router_weights "
                         f"{tuple(router_weights.shape)} and topk_ids {tuple(topk_ids.shape)}")
    top_k = topk_ids.shape[1]
    joined = w_up is None  # w_gate holds both projections, [E_local, 2I, H]
    layout = "[E_local, 2I, H] (w_up=None: gate rows then up rows)" if joined else "[E_local, I, H]"
    _check_tensor("w_gate", w_gate, layout, (x.dtype,), x.device, dtype_of_x)
    num_experts, inter, weight_hidden = w_gate.shape
    if num_experts == 0:
        raise ValueError(f"w_gate must hold at least one expert (w_gate.shape[0] >= 1), got shape "
                         f"{tuple(w_gate.shape)}")
    if joined and (inter == 0 or inter % 2):
        raise ValueError(f"w_gate with w_up=None must be the joined gate/up weight [E_local, 2I, H], 2I even and "
                         f">= 2 (w_gate.shape[1]), got shape {tuple(w_gate.shape)}")
    if joined:
        inter //= 2
    if inter == 0:
        raise ValueError(f"w_gate must have an intermediate size I >= 1 (w_gate.shape[1]), got shape "
                         f"{tuple(w_gate.shape)}")
    if weight_hidden != hidden:
        raise ValueError(f"x must have the experts' hidden size H = {weight_hidden} (w_gate.shape[2]) as "
                         f"x.shape[1], got x of shape {tuple(x.shape)}")
    if not joined:
        _check_tensor("w_up", w_up, "[E_local, I, H]", (x.dtype,), x.device, dtype_of_x)
        _check_shape("w_up", w_up, w_gate.shape, " (the shape of w_gate, [E_local, I, H])")
    _check_tensor("w_down", w_down, "[E_local, H, I]", (x.dtype,), x.device, dtype_of_x)
    _check_shape("w_down", w_down, (num_experts, hidden, inter), " ([E_local, H, I], from w_gate)")
    total_experts = num_experts * ep_size
    if not 1 <= top_k <= total_experts:
        where = "w_gate.shape[0]" + (f" * EP group size {ep_size}" if ep_size > 1 else "")
        raise ValueError(f"top-k (topk_ids.shape[1] = {top_k}) must be in [1, E = {total_experts}] "
                         f"(E = {where})")
    if shared is not None:
        if not isinstance(shared, (tuple, list)) or len(shared) != 3:
            raise TypeError("shared must be None or a tuple of 3 tensors (ws_gate [Is, H], ws_up [Is, H], "
                            f"ws_down [H, Is]), got {type(shared).__name__}"
                            + (f" of length {len(shared)}" if isinstance(shared, (tuple, list)) else ""))
        ws_gate, ws_up, ws_down = shared
        _check_tensor("shared[0] (ws_gate)", ws_gate, "[Is, H]", (x.dtype,), x.device, dtype_of_x)
        shared_inter = ws_gate.shape[0]
        if shared_inter == 0:
            raise ValueError(f"shared[0] (ws_gate) must have an intermediate size Is >= 1 (ws_gate.shape[0]), "
                             f"got shape {tuple(ws_gate.shape)}")
        _check_shape("shared[0] (ws_gate)", ws_gate, (shared_inter, hidden), " ([Is, H], H = x.shape[1])")
        _check_tensor("shared[1] (ws_up)", ws_up, "[Is, H]", (x.dtype,), x.device, dtype_of_x)
        _check_shape("shared[1] (ws_up)", ws_up, (shared_inter, hidden), " (the shape of ws_gate, [Is, H])")
        _check_tensor("shared[2] (ws_down)", ws_down, "[H, Is]", (x.dtype,), x.device, dtype_of_x)
        _check_shape("shared[2] (ws_down)", ws_down, (hidden, shared_inter), " ([H, Is], from x and ws_gate)")
    check_swiglu_limit(swiglu_limit)


def check_swiglu_limit(swiglu_limit) -> None:
    """swiglu_limit must be None or a positive finite number (a bool is not one)."""
    if swiglu_limit is not None and (isinstance(swiglu_limit, bool) or not isinstance(swiglu_limit, (int, float))
                                     or not 0 < swiglu_limit < float("inf")):
        raise ValueError(f"swiglu_limit must be None or a positive finite float, got {swiglu_limit!r}")


# ---------------------------------------------------------------- expert ids

def _checks_on_host(device: torch.device, debug: bool) -> bool:
    """Whether value checks may read device values on the host: everywhere but on CUDA (where it
    would sync), and on CUDA with Config(debug=True)."""
    return device.type != "cuda" or debug


_ERROR_FLAGS: dict[torch.device, ErrorFlags] = {}  # EP=1: one per device, made by its first deferring call


def _error_flags(device: torch.device) -> ErrorFlags:
    if device not in _ERROR_FLAGS:
        _ERROR_FLAGS[device] = ErrorFlags(device)
    return _ERROR_FLAGS[device]


_SHOWN_IDS = 8  # the out-of-range ids a host check's error names


def _expert_ids_error(num_experts: int, ep_size: int, earlier: bool, bad: Tensor | None = None) -> ValueError:
    """The error of out-of-range expert ids; bad: those ids (read on the host), which the message names."""
    where = "" if ep_size == 1 else " (on at least one rank of the EP group)"
    if earlier:
        return ValueError(
            f"serval.moe: topk_ids must hold expert ids in [0, E) (E: the layer's number of experts), but ids "
            f"outside were passed{where} in an earlier step; that step's y, d_x and expert weight gradients are "
            "NaN (Config(debug=True) raises in the call itself, at the cost of a host sync)")
    got = ""
    if bad is not None and bad.numel():
        values = bad.unique().tolist()  # sorted
        shown = ", ".join(map(str, values[:_SHOWN_IDS]))
        if len(values) > _SHOWN_IDS:
            shown += f", ... (from {values[0]} to {values[-1]})"
        got = f", got {bad.numel()} id(s) outside it: {shown}"
    return ValueError(f"serval.moe: topk_ids must hold expert ids in [0, {num_experts}){where}{got}")


def _report_earlier_errors(flags: ErrorFlags | None, ep_size: int) -> None:
    """ValueError if a step that ran without a host check passed out-of-range expert ids."""
    if flags is not None and flags.pending(ErrorFlags.EXPERT_IDS):
        raise _expert_ids_error(0, ep_size, earlier=True)


def _out_of_range(topk_ids: Tensor, num_experts: int) -> Tensor:
    """Device bool: some id is outside [0, num_experts)."""
    return ((topk_ids < 0) | (topk_ids >= num_experts)).any()


def _clamp_ids(topk_ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """(ids clamped into [0, num_experts), device bool: some id was outside): the schedule then indexes in bounds."""
    clamped = topk_ids.clamp(0, num_experts - 1)
    return clamped, (clamped != topk_ids).any()


def check_expert_ids(topk_ids: Tensor, num_experts: int, ep_size: int = 1) -> None:
    """ValueError naming the ids outside [0, num_experts) unless there are none (a host check: syncs on CUDA)."""
    if bool(_out_of_range(topk_ids, num_experts)):
        bad = topk_ids[(topk_ids < 0) | (topk_ids >= num_experts)]
        raise _expert_ids_error(num_experts, ep_size, earlier=False, bad=bad)


# ---------------------------------------------------------------- custom ops

def _workspace(workspace_id: int):
    return None if workspace_id < 0 else functional.workspace_by_id(workspace_id)


def _shared(ws_gate, ws_up, ws_down):
    return None if ws_gate is None else (ws_gate, ws_up, ws_down)


def _kept_router_weight_rows(workspace, num_tokens: int, device: torch.device, config: Config) -> int:
    """Rows of the router weights the forward op returns for backward: the group's [P*N, k] at EP; at
    EP=1 without host checks, the step's (possibly NaN-poisoned) [N, k]; else none."""
    if workspace is not None:
        return workspace.ep_size * num_tokens
    return 0 if _checks_on_host(device, config.debug) else num_tokens


_EMPTY = (0,)
_FP8_KEPT = 4  # tensors of serval.precision.Kept


@torch.library.custom_op("serval::moe_forward", mutates_args=())
def _moe_forward(x: Tensor, router_weights: Tensor, topk_ids: Tensor, w_gate: Tensor, w_up: Optional[Tensor],
                 w_down: Tensor, ws_gate: Optional[Tensor], ws_up: Optional[Tensor], ws_down: Optional[Tensor],
                 expert_weights: list[Tensor], swiglu_limit: Optional[float], config_id: int,
                 workspace_id: int,
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                            Tensor, Tensor]:
    """Returns y, the five schedule tensors, the kept pre-activations (empty when recomputed or FP8),
    the router weights the rows use in backward (`_kept_router_weight_rows`; else empty) and what an FP8
    precision keeps (`serval.precision.Kept.tensors()`; empty for bf16 or when recomputed). w_up None: w_gate is
    the joined gate/up weight [E_local, 2I, H], read in place through its halves (`serval.weight_layout`)."""
    config = config_by_id(config_id)
    workspace = _workspace(workspace_id)
    shared = _shared(ws_gate, ws_up, ws_down)
    w_gate, w_up = _gate_and_up(w_gate, w_up)
    on_host = _checks_on_host(x.device, config.debug)
    kept_router_weights = None
    if workspace is None:
        num_experts = w_gate.shape[0]
        _report_earlier_errors(_ERROR_FLAGS.get(x.device), 1)
        if on_host:
            check_expert_ids(topk_ids, num_experts)
        else:  # no sync: clamp, poison this step, report in a later call
            topk_ids, bad_ids = _clamp_ids(topk_ids, num_experts)
            _error_flags(x.device).record(ErrorFlags.EXPERT_IDS, bad_ids)
            router_weights = kept_router_weights = router_weights.masked_fill(bad_ids, float("nan"))
        schedule = build_schedule(topk_ids, num_experts, config.block_m)
    else:
        _report_earlier_errors(workspace.errors, workspace.ep_size)
        # the group's ids are checked, so that every rank stops (or poisons) together
        all_ids, kept_router_weights = functional.gather_routing(topk_ids, router_weights, workspace)
        if on_host:
            check_expert_ids(all_ids, workspace.num_experts, workspace.ep_size)
        else:
            all_ids, bad_ids = _clamp_ids(all_ids, workspace.num_experts)
        schedule = functional.ep_schedule(all_ids, workspace)
        if not on_host:  # no sync: this step's y, d_x, weight gradients become NaN; a later call raises
            workspace.errors.record(ErrorFlags.EXPERT_IDS, bad_ids)
            router_weights = router_weights.masked_fill(bad_ids, float("nan"))
            kept_router_weights = kept_router_weights.masked_fill(bad_ids, float("nan"))
    y, ctx = functional.forward(x, router_weights, schedule, w_gate, w_up, w_down, shared, config=config,
                                swiglu_limit=swiglu_limit, workspace=workspace,
                                all_router_weights=kept_router_weights if workspace is not None else None,
                                expert_weights=_expert_weights(config, expert_weights))
    kept_fp8 = ctx.kept.tensors() if ctx.kept is not None else (None,) * _FP8_KEPT
    kept = [t if t is not None else x.new_empty(_EMPTY)
            for t in (ctx.gate_up, ctx.shared_gate_up, kept_router_weights, *kept_fp8)]
    return (y, *schedule.tensors(), *kept)


@_moe_forward.register_fake
def _(x, router_weights, topk_ids, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, expert_weights, swiglu_limit,
      config_id, workspace_id):
    config = config_by_id(config_id)
    block_m = config.block_m
    num_tokens, top_k = topk_ids.shape
    w_gate, w_up = _gate_and_up(w_gate, w_up)
    num_experts, inter, _ = w_gate.shape
    workspace = _workspace(workspace_id)
    ep_size = 1 if workspace is None else workspace.ep_size
    capacity = workspace.capacity_rows if workspace else capacity_rows(num_tokens * top_k, num_experts, block_m)
    i32 = dict(dtype=torch.int32, device=x.device)
    schedule = (x.new_empty(num_experts, **i32), x.new_empty(num_experts + 1, **i32), x.new_empty(capacity, **i32),
                x.new_empty(ep_size * num_tokens, top_k, **i32), x.new_empty(capacity // block_m, **i32))
    # the kept pre-activations are packed: Schedule.num_packed rows
    recompute = config.recompute
    recipe = precision.recipe_of(config.precision)
    kept_packed, kept_rows = functional.kept_rows(config, x, w_gate, _shared(ws_gate, ws_up, ws_down), workspace,
                                                  capacity, ep_size * num_tokens * top_k)
    gate_up = x.new_empty(_EMPTY) if recompute or recipe else x.new_empty(kept_packed, 2 * inter)
    kept_fp8 = [x.new_empty(_EMPTY) for _ in range(_FP8_KEPT)]
    if recipe is not None and not recompute:
        kept_fp8 = precision.kept_like(recipe, kept_packed, kept_rows, inter, x.device)
    shared_gate_up = x.new_empty(_EMPTY)
    if ws_gate is not None and not recompute:
        shared_gate_up = x.new_empty(num_tokens, 2 * ws_gate.shape[0])
    rows = _kept_router_weight_rows(workspace, num_tokens, x.device, config)
    kept_router_weights = router_weights.new_empty(rows, top_k) if rows else x.new_empty(_EMPTY)
    return (torch.empty_like(x), *schedule, gate_up, shared_gate_up, kept_router_weights, *kept_fp8)


@torch.library.custom_op("serval::moe_backward", mutates_args=())
def _moe_backward(d_y: Tensor, x: Tensor, router_weights: Tensor, w_gate: Tensor, w_up: Optional[Tensor],
                  w_down: Tensor,
                  ws_gate: Optional[Tensor], ws_up: Optional[Tensor], ws_down: Optional[Tensor],
                  tokens_per_expert: Tensor, expert_offsets: Tensor, row_source: Tensor, source_row: Tensor,
                  tile_expert: Tensor, gate_up: Tensor, shared_gate_up: Tensor, kept_router_weights: Tensor,
                  gate_up_fp8: Tensor, gate_up_scale: Tensor, h_tokens: Tensor, h_tokens_scale: Tensor,
                  expert_weights: list[Tensor], swiglu_limit: Optional[float], config_id: int,
                  workspace_id: int, weight_grads: bool, shared_weight_grads: bool,
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns d_x, d_router_weights, d_w_gate, d_w_up, d_w_down, and the shared expert's (empty if none); a
    weight gradient not asked for (weight_grads / shared_weight_grads False: no input needs it) is empty and
    its GEMMs do not run. w_up None (w_gate joined, as in the forward): d_w_gate is the joined [E_local, 2I, H]
    gradient, written in place by the weight-gradient GEMMs, and d_w_up is empty."""
    config = config_by_id(config_id)
    joined = w_up is None
    w_gate, w_up = _gate_and_up(w_gate, w_up)
    recompute = config.recompute
    workspace = _workspace(workspace_id)
    schedule = Schedule(tokens_per_expert, expert_offsets, row_source, source_row, tile_expert,
                        num_experts=w_gate.shape[0], block_m=config.block_m)
    shared = _shared(ws_gate, ws_up, ws_down)
    shared_schedule = None if shared is None else dense_schedule(x.shape[0], config.block_m, x.device)
    if workspace is None and kept_router_weights.numel():  # EP=1 without host checks: the step's poisoned copy
        router_weights = kept_router_weights
    recipe = precision.recipe_of(config.precision)
    kept = None
    if recipe is not None and not recompute:
        kept = precision.Kept.from_tensors(recipe, gate_up_fp8, gate_up_scale, h_tokens, h_tokens_scale)
    ctx = functional.ForwardContext(schedule, shared_schedule, None if recompute or recipe else gate_up,
                                    None if recompute or shared is None else shared_gate_up, swiglu_limit,
                                    kept_router_weights if workspace else None, kept)
    grads = functional.backward(d_y, ctx, x, router_weights, w_gate, w_up, w_down, shared, config=config,
                                workspace=workspace, expert_weights=_expert_weights(config, expert_weights),
                                weight_grads=weight_grads, shared_weight_grads=shared_weight_grads)
    d_w_gate, d_w_up = grads.w_gate, grads.w_up
    if joined and d_w_gate is not None:
        d_w_gate, d_w_up = weight_layout.joined(d_w_gate, d_w_up), None
    elif d_w_gate is not None and weight_layout.is_joined(d_w_gate, d_w_up):
        # w_gate and w_up were passed as the two halves of one tensor: their gradients are the halves of one buffer,
        # and a custom op's outputs must not alias each other (pass the joined tensor with w_up=None instead)
        d_w_up = d_w_up.clone()
    weights = (d_w_gate, d_w_up, grads.w_down, *(grads.shared or (None,) * 3))
    return (grads.x, grads.router_weights, *(x.new_empty(_EMPTY) if g is None else g for g in weights))


@_moe_backward.register_fake
def _(d_y, x, router_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, *rest):
    weight_grads, shared_weight_grads = rest[-2:]
    routed = [torch.empty_like(w) if weight_grads and w is not None else x.new_empty(_EMPTY)
              for w in (w_gate, w_up, w_down)]
    shared = [torch.empty_like(w) if w is not None and shared_weight_grads else x.new_empty(_EMPTY)
              for w in (ws_gate, ws_up, ws_down)]
    return (torch.empty_like(x), torch.empty_like(router_weights), *routed, *shared)


_FORWARD_TENSOR_INPUTS = 9  # x, router_weights, topk_ids, w_gate, w_up, w_down, ws_gate, ws_up, ws_down


def _gate_and_up(w_gate: Tensor, w_up: Tensor | None) -> tuple[Tensor, Tensor]:
    """The [E_local, I, H] gate and up weights the passes read: the halves of w_gate when w_up is None (joined)."""
    return weight_layout.split(w_gate) if w_up is None else (w_gate, w_up)


def _expert_weights(config: Config, tensors) -> precision.ExpertWeights | None:
    """The custom ops' flat expert_weights list back as `precision.ExpertWeights` (empty: quantize per call)."""
    if not tensors:
        return None
    return precision.ExpertWeights.from_tensors(precision.recipe_of(config.precision), tensors)


def _setup_context(ctx, inputs, output):
    x, router_weights, _, w_gate, w_up, w_down, ws_gate, ws_up, ws_down = inputs[:_FORWARD_TENSOR_INPUTS]
    expert_weights = inputs[_FORWARD_TENSOR_INPUTS]
    ctx.options = inputs[_FORWARD_TENSOR_INPUTS + 1:]  # swiglu_limit, config_id, workspace_id
    ctx.has_shared = ws_gate is not None
    ctx.joined = w_up is None
    ctx.num_kept = 8 + len(output) - 1  # the saved tensors before the expert weights
    ctx.num_expert_weights = len(expert_weights)
    ctx.save_for_backward(x, router_weights, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, *output[1:],
                          *expert_weights)
    # only y has a gradient: autograd must not fill zero gradients for the kept tensors (270 MB on kimi-k2)
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)


def _backward(ctx, d_y, *_unused_output_grads):  # the unused ones arrive as None
    if d_y is None:  # y took no part in what is differentiated
        return (None,) * _FORWARD_TENSOR_INPUTS + ([None] * ctx.num_expert_weights,) + (None,) * len(ctx.options)
    saved = ctx.saved_tensors
    # frozen weights (no input that needs a gradient): their weight-gradient GEMMs are skipped
    weight_grads, shared_weight_grads = any(ctx.needs_input_grad[3:6]), any(ctx.needs_input_grad[6:9])
    grads = torch.ops.serval.moe_backward(d_y, *saved[:ctx.num_kept], list(saved[ctx.num_kept:]), *ctx.options,
                                          weight_grads, shared_weight_grads)
    d_x, d_rw, d_w_gate, d_w_up, d_w_down, *shared_grads = grads
    if not weight_grads:
        d_w_gate = d_w_up = d_w_down = None
    elif ctx.joined:
        d_w_up = None
    if not (ctx.has_shared and shared_weight_grads):
        shared_grads = [None, None, None]
    # the expert weights in their GEMMs' form are a function of w_gate, w_up, w_down: no gradient of their own
    return ((d_x, d_rw, None, d_w_gate, d_w_up, d_w_down, *shared_grads, [None] * ctx.num_expert_weights)
            + (None,) * len(ctx.options))


_moe_forward.register_autograd(_backward, setup_context=_setup_context)


def _no_double_backward(ctx, *grads):
    raise NotImplementedError("serval.moe has first derivatives only: differentiating its gradients "
                              "(double backward, e.g. torch.autograd.grad(..., create_graph=True) then backward "
                              "through them) is not supported")


# a graph built through the backward (create_graph=True) ends here with that message, not with torch's "no
# autograd formula" for an internal op
_moe_backward.register_autograd(_no_double_backward, setup_context=lambda ctx, inputs, output: None)


# ---------------------------------------------------------------- public entry point

def quantize_expert_weights(w_gate, w_up, w_down, precision: str) -> _precision.ExpertWeights:
    """The routed experts' weights in the form the GEMMs of an FP8 precision read ("mxfp8" or "fp8_blockwise";
    `serval.precision.ExpertWeights` says what each holds), for `moe(..., expert_weights=...)`. `moe` keeps
    them itself, once per version of the weights (`serval.weight_cache`), so a caller needs this only where the
    weights change in ways their version counters do not see (writes through `.data`), or under torch.compile
    and CUDA graph capture, where that cache is not used. The values are the caller's to keep current: stale
    ones give the results of the weights they were made from. w_gate, w_up [E_local, I, H] (or w_gate the joined
    [E_local, 2I, H] and w_up None) and w_down [E_local, H, I] bf16, as passed to `moe`."""
    recipe = _precision.recipe_of(precision)
    if recipe is None:
        raise ValueError(f"precision must be one of {tuple(_precision.RECIPES)} (bf16 weights need no quantizing), "
                         f"got {precision!r}")
    for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        if name == "w_up" and w is None:
            continue
        if not isinstance(w, Tensor) or w.dim() != 3 or w.dtype != torch.bfloat16:
            got = f"{tuple(w.shape)} {w.dtype}" if isinstance(w, Tensor) else type(w).__name__
            raise ValueError(f"{name} must be a 3-D bfloat16 tensor, got {got}")
    if w_up is None:
        if w_gate.shape[1] % 2:
            raise ValueError(f"w_gate with w_up=None must be the joined gate/up weight [E, 2I, H], got "
                             f"{tuple(w_gate.shape)}")
        w_gate, w_up = weight_layout.split(w_gate)
    if w_up.shape != w_gate.shape or w_down.shape != (w_gate.shape[0], w_gate.shape[2], w_gate.shape[1]):
        raise ValueError(f"w_gate, w_up must be [E, I, H] and w_down [E, H, I], got {tuple(w_gate.shape)}, "
                         f"{tuple(w_up.shape)}, {tuple(w_down.shape)}")
    _precision.check_inputs(recipe, w_gate.dtype, w_gate.shape[1], recipe.block)
    with torch.no_grad():
        return _precision.expert_weights(recipe, w_gate.detach(), w_up.detach(), w_down.detach())


def _dense(t: Tensor) -> Tensor:
    """t itself where the kernels read it in place (contiguous, or a weight with dense rows: `weight_layout.dense_rows`,
    e.g. a half of a joined gate/up weight), else a contiguous copy (autograd sees the copy, so the gradient still
    reaches t)."""
    return t if t.is_contiguous() or (t.dim() == 3 and weight_layout.dense_rows(t)) else t.contiguous()


def moe(x, router_weights, topk_ids, w_gate, w_up, w_down, shared=None, *, group=None, config=None,
        swiglu_limit=None, expert_weights=None):
    """The MoE layer of docs/CONTRACT.md:
    y[t] = shared(x[t]) + sum_j router_weights[t, j] * expert_{topk_ids[t, j]}(x[t]).

    x [N, H]; router_weights [N, k] (differentiable; fp32, or bf16 / fp16 as a router may give them, computed in
    fp32; fp64 when x is fp64); topk_ids [N, k] int (int32 or int64; int8, uint8 and int16 are taken as int64;
    global expert ids in [0, E)); w_gate, w_up [E_local, I, H], w_down [E_local, H, I] (nn.Linear layout), or
    w_gate the joined gate/up weight [E_local, 2I, H] (every expert's gate rows, then its up rows: transformers'
    `gate_up_proj`) with w_up=None: read in place, its gradient one [E_local, 2I, H] tensor; strided views are
    copied to dense tensors, except weights whose rows are dense (read in place); shared = (ws_gate [Is, H],
    ws_up [Is, H], ws_down [H, Is]) or None; group: the expert-parallel process group (None: EP=1); config:
    `serval.Config`; swiglu_limit: before SwiGLU, the gate clamped to max=limit and up to [-limit, limit], in the
    routed experts and the shared expert alike; expert_weights: in an FP8 precision, `quantize_expert_weights(
    w_gate, w_up, w_down, precision)` made after the weights' last update (None: made once per version of the
    weights and kept, `serval.weight_cache`).
    Returns y [N, H] in x's dtype; differentiable in x, router_weights and every weight; bitwise
    deterministic; no host-device synchronisation. Bad input: a TypeError/ValueError naming the
    argument; expert ids out of range: see the module docstring (on CUDA, a NaN step and a
    ValueError in a later call, unless Config(debug=True)).
    """
    config = DEFAULT_CONFIG if config is None else config
    if not isinstance(config, Config):
        raise TypeError(f"config must be a serval.Config, got {type(config).__name__}")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be None or a torch.distributed.ProcessGroup (the expert-parallel group), got "
                        f"{type(group).__name__}")
    ep_size = 1 if group is None else group.size()
    validate_inputs(x, router_weights, topk_ids, w_gate, w_up, w_down, shared, swiglu_limit, ep_size)
    # the op and its kernels take dense rows and int32 / int64 ids
    x, router_weights, w_gate, w_down = (_dense(t) for t in (x, router_weights, w_gate, w_down))
    w_up = None if w_up is None else _dense(w_up)
    if router_weights.dtype in (torch.bfloat16, torch.float16):
        router_weights = router_weights.float()
    topk_ids = topk_ids.contiguous() if topk_ids.dtype in (torch.int32, torch.int64) else topk_ids.to(torch.int64)
    if shared is not None:
        shared = tuple(t.contiguous() for t in shared)
    gate, up = _gate_and_up(w_gate, w_up)
    recipe = precision.recipe_of(config.precision)
    if recipe is not None:
        precision.check_inputs(recipe, x.dtype, gate.shape[1], config.block_m)
    if expert_weights is not None:
        if recipe is None:
            raise ValueError("expert_weights is for the FP8 precisions (Config.precision 'mxfp8' or "
                             "'fp8_blockwise'); this call runs in bf16")
        precision.check_expert_weights(recipe, expert_weights, gate, w_down)
    elif recipe is not None and weight_cache.usable():
        expert_weights = weight_cache.expert_weights(recipe, gate, up, w_down)
    workspace_id = -1
    if ep_size > 1:
        num_tokens, top_k = topk_ids.shape
        workspace_id = functional.get_workspace(num_tokens, top_k, x.shape[1], w_gate.shape[0] * ep_size,
                                                device=x.device, config=config, group=group, dtype=x.dtype).id
    ws_gate, ws_up, ws_down = shared if shared is not None else (None, None, None)
    limit = None if swiglu_limit is None else float(swiglu_limit)
    outputs = torch.ops.serval.moe_forward(x, router_weights, topk_ids, w_gate, w_up, w_down, ws_gate, ws_up,
                                           ws_down, [] if expert_weights is None else expert_weights.tensors(),
                                           limit, config_id(config), workspace_id)
    return outputs[0]
