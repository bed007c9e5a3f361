"""`serval.MoE`: a drop-in mixture-of-experts block (router, routed SwiGLU experts, optional shared expert).

The router is a bias-free linear layer computed in fp32 (fp64 for an fp64 layer: the
router weights the layer takes have that dtype), autocast or not; scores are a softmax
over all experts (renormalised over the top-k by default off) or per-expert
sigmoids (renormalised by default on, as in DeepSeek-V3-style routers). Ties in
top-k are broken by torch.topk, which is deterministic for a given device.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from . import precision
from .api import FLOAT_DTYPES, check_swiglu_limit, moe, quantize_expert_weights
from .config import Config


def _autocast_enabled(device_type: str) -> bool:
    """Whether torch.autocast is on for this device type (False where autocast does not exist, e.g. meta)."""
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:
        return False


def _without_autocast(device_type: str):
    """A context with autocast off on this device type (nothing to turn off where autocast does not exist)."""
    return torch.autocast(device_type, enabled=False) if _autocast_enabled(device_type) else contextlib.nullcontext()


class MoE(nn.Module):
    """y = shared(x) + sum over the top-k experts of score * expert(x), for x [..., hidden_size].

    num_experts is the global expert count; with an expert-parallel `group` this rank holds
    num_experts / group.size() of them (expert e on rank e // E_local).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, *,
                 shared_intermediate_size: int | None = None, scoring: str = "softmax",
                 renormalize: bool | None = None, swiglu_limit: float | None = None,
                 config: Config | None = None, group=None, device=None, dtype=None):
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size),
                            ("num_experts", num_experts), ("top_k", top_k)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if shared_intermediate_size is not None and (isinstance(shared_intermediate_size, bool)
                                                     or not isinstance(shared_intermediate_size, int)
                                                     or shared_intermediate_size < 0):
            raise ValueError(f"shared_intermediate_size must be None or an int >= 0 (0: no shared expert), "
                             f"got {shared_intermediate_size!r}")
        check_swiglu_limit(swiglu_limit)
        if config is not None and not isinstance(config, Config):
            raise TypeError(f"config must be a serval.Config, got {type(config).__name__}")
        if dtype is not None and dtype not in FLOAT_DTYPES:
            raise ValueError(f"dtype must be None or one of {[str(d) for d in FLOAT_DTYPES]}, got {dtype}")
        if scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"scoring must be 'softmax' or 'sigmoid', got {scoring!r}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        recipe = precision.recipe_of((config or Config()).precision)
        if recipe is not None:  # the sizes now; the dtype (bf16, or autocast to it) at the call
            precision.check_sizes(recipe, intermediate_size, (config or Config()).block_m)
        ep_size = 1 if group is None else group.size()
        if num_experts % ep_size:
            raise ValueError(f"num_experts={num_experts} must be divisible by the EP group size {ep_size}")
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, top_k
        self.scoring = scoring
        self.renormalize = (scoring == "sigmoid") if renormalize is None else renormalize
        self.swiglu_limit, self.config, self.group = swiglu_limit, config or Config(), group
        factory = dict(device=device, dtype=dtype)
        local = num_experts // ep_size
        self.router = nn.Linear(hidden_size, num_experts, bias=False, **factory)
        self.w_gate = nn.Parameter(torch.empty(local, intermediate_size, hidden_size, **factory))
        self.w_up = nn.Parameter(torch.empty(local, intermediate_size, hidden_size, **factory))
        self.w_down = nn.Parameter(torch.empty(local, hidden_size, intermediate_size, **factory))
        self.shared = None
        if shared_intermediate_size:
            self.shared = nn.ModuleDict({
                "gate": nn.Linear(hidden_size, shared_intermediate_size, bias=False, **factory),
                "up": nn.Linear(hidden_size, shared_intermediate_size, bias=False, **factory),
                "down": nn.Linear(shared_intermediate_size, hidden_size, bias=False, **factory),
            })
        self.reset_parameters()

    def reset_parameters(self):
        """nn.Linear's default init for every expert matrix (uniform +-1/sqrt(fan_in)); a small router."""
        for w in (self.w_gate, self.w_up, self.w_down):
            bound = 1 / math.sqrt(w.shape[-1])
            nn.init.uniform_(w, -bound, bound)
        nn.init.normal_(self.router.weight, std=0.02)
        if self.shared is not None:
            for linear in self.shared.values():
                linear.reset_parameters()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(router_weights [N, k], topk_ids [N, k]) for tokens x [N, H]; the weights are fp32 (fp64 when x is
        fp64), as `serval.moe` takes them."""
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        with _without_autocast(x.device.type):  # autocast would run the router in bf16 / fp16
            logits = F.linear(x.to(dtype), self.router.weight.to(dtype))
            scores = logits.softmax(dim=-1) if self.scoring == "softmax" else logits.sigmoid()
        weights, ids = scores.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def quantize_expert_weights(self):
        """The routed experts' weights in the form the GEMMs of the module's FP8 precision read
        (`serval.quantize_expert_weights`): make them after each optimizer step and pass them to every
        micro-batch's forward (`expert_weights=`), so that the step quantizes the weights once."""
        return quantize_expert_weights(self.w_gate, self.w_up, self.w_down, self.config.precision)

    def forward(self, x: torch.Tensor, expert_weights=None) -> torch.Tensor:
        """y [..., hidden_size] for x [..., hidden_size] (the module's dtype and device); expert_weights: this
        step's `quantize_expert_weights()` (FP8 precisions; None: quantized in the call).

        Under torch.autocast (bf16) the experts run in bf16 on bf16 copies of the weights (x of any float dtype
        is cast), as autocast runs nn.Linear; the router stays in fp32. An empty batch gives an empty y (without
        an EP group; at EP every rank must pass the same number of tokens, at least one)."""
        compute_dtype = self._check_input(x)
        shape = x.shape
        tokens = x.reshape(-1, self.hidden_size)
        weights = [self.w_gate, self.w_up, self.w_down]
        if self.shared is not None:
            weights += [self.shared["gate"].weight, self.shared["up"].weight, self.shared["down"].weight]
        if tokens.shape[0] == 0 and (self.group is None or self.group.size() == 1):  # zero gradients to every parameter
            # (at EP a rank cannot know that the others are empty too: serval.moe raises on it, and the others
            # get their bounded peer timeout)
            return tokens.new_zeros(shape, dtype=compute_dtype) + sum(
                w[:0].sum() for w in [x, self.router.weight, *weights])
        router_weights, topk_ids = self.route(tokens)
        weights = [w.to(compute_dtype) for w in weights]
        with _without_autocast(x.device.type):
            y = moe(tokens.to(compute_dtype), router_weights, topk_ids, *weights[:3],
                    tuple(weights[3:]) if self.shared is not None else None, group=self.group, config=self.config,
                    swiglu_limit=self.swiglu_limit, expert_weights=expert_weights)
        return y.view(shape)

    def _check_input(self, x) -> torch.dtype:
        """The dtype the experts compute in: the parameters', or under torch.autocast its dtype. x must be a
        tensor [..., hidden_size] of that dtype (under autocast any float dtype), on the parameters' device
        (else the layer's checks would name its internal arguments, not x)."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor [..., hidden_size], got {type(x).__name__}")
        if x.dim() == 0 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x must have last dimension hidden_size = {self.hidden_size}, got shape {tuple(x.shape)}")
        weight = self.w_gate
        if weight.dtype not in FLOAT_DTYPES:
            raise TypeError(f"the module's parameters are {weight.dtype}; serval computes in "
                            f"{[str(d) for d in FLOAT_DTYPES]}: convert the module (e.g. .bfloat16())")
        if x.device != weight.device:
            raise ValueError(f"x must be on the device of the module's parameters ({weight.device}), got {x.device}")
        if _autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            if dtype not in FLOAT_DTYPES:
                raise TypeError(f"serval.MoE under torch.autocast(dtype={dtype}): serval computes in "
                                f"{[str(d) for d in FLOAT_DTYPES]}: autocast with dtype=torch.bfloat16")
            if not x.is_floating_point():
                raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
            return dtype
        if x.dtype != weight.dtype:
            raise TypeError(f"x must have the dtype of the module's parameters ({weight.dtype}), got {x.dtype}: "
                            f"convert x, or the module with .to({x.dtype})")
        return weight.dtype

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.w_gate.shape[1]}, "
                f"num_experts={self.num_experts}, top_k={self.top_k}, scoring={self.scoring}, "
                f"shared={self.shared is not None}")
