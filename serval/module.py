"""`serval.MoE`: a drop-in mixture-of-experts block (router, routed SwiGLU experts, optional shared expert).

It owns the block's parameters (the router's linear layer, the routed experts, the shared expert) and its
correction-bias buffer, and the input checks that name x. The router's linear layer runs in fp32 (fp64 for an
fp64 block: the router weights `serval.moe` takes have that dtype), autocast or not; the routing from its logits is
`serval.routing.route`, the experts `serval.moe`.
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
from .routing import RouterOutput, check_routing_arguments, route


def _autocast_enabled(device_type: str) -> bool:
    """Whether torch.autocast is on for this device type (False where autocast does not exist, e.g. meta)."""
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:
        return False


def _without_autocast(device_type: str):
    """A context with autocast off on this device type (nothing to turn off where autocast does not exist)."""
    return torch.autocast(device_type, enabled=False) if _autocast_enabled(device_type) else contextlib.nullcontext()


AUTOCAST_INPUTS = "x of any float dtype under torch.autocast(device_type, dtype=torch.bfloat16)"
ACCEPTED_INPUTS = f"x in the module's dtype (bf16, fp32 or fp64), or {AUTOCAST_INPUTS}"
FP8_ACCEPTED_INPUTS = f"bf16 x with bf16 parameters, or {AUTOCAST_INPUTS}"  # an FP8 precision quantizes bf16


class MoE(nn.Module):
    """y = shared(x) + sum over the top-k experts of weight * expert(x), for x [..., hidden_size].

    Args:
        hidden_size: H, the size of a token.
        intermediate_size: I, the hidden size of each routed expert's SwiGLU MLP.
        num_experts: E, the global number of routed experts; with an expert-parallel `group` this rank holds
            E / group.size() of them (expert e on rank e // E_local).
        top_k: k, the experts each token is routed to.
        shared_intermediate_size: the hidden size of a shared SwiGLU expert applied to every token (None or 0: none).
        scoring: "softmax" (over all experts; Mixtral, Qwen-MoE, OLMoE) or "sigmoid" (per expert; DeepSeek-V3).
        renormalize: divide the k chosen scores by their sum (+1e-20); default True (Mixtral, Qwen3-MoE,
            DeepSeek-V3); False keeps the raw scores (Qwen2-MoE, OLMoE).
        correction_bias: keep a buffer `correction_bias` [E] (zeros, fp32; fp64 for an fp64 block) added to the scores
            for choosing the experts only: the weights stay the unbiased scores (DeepSeek-V3's auxiliary-loss-free
            balancing). It is saved in the state dict, has no gradient, and `serval.routing.update_correction_bias`
            updates it from the counts in `RouterOutput.tokens_per_expert`. Like every float buffer it takes the dtype
            `.to(dtype)` gives; an fp32 block under autocast keeps it in fp32.
        num_groups, topk_groups: group-limited top-k (DeepSeek-V3's n_group, topk_group): the E experts form
            num_groups contiguous groups, each ranked by the sum of its 2 best (biased) scores, and a token chooses
            among the experts of its topk_groups best groups only. Both or neither.
        routed_scaling_factor: multiplies the routed experts' weights (after renormalisation); default 1.0.
        swiglu_limit: clamp inside every SwiGLU (routed and shared): gate at most limit, up within +-limit; None: off.
        config: the `serval.Config` of the routed experts (kernels, precision, EP knobs); None: `serval.Config()`.
        group: the expert-parallel process group (None: every expert on this rank).
        device, dtype: of the parameters (dtype: bf16, fp32 or fp64; an FP8 `config.precision` computes in bf16:
            bf16 parameters, or others under torch.autocast(device_type, dtype=torch.bfloat16)).

    forward(x) returns y; forward(x, return_router_output=True) returns (y, `serval.routing.RouterOutput`) for the
    trainer: the router logits for `serval.routing.load_balancing_loss`, the weights and ids, the tokens per
    expert for `serval.routing.update_correction_bias`.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, *,
                 shared_intermediate_size: int | None = None, scoring: str = "softmax", renormalize: bool = True,
                 correction_bias: bool = False, num_groups: int | None = None, topk_groups: int | None = None,
                 routed_scaling_factor: float = 1.0, swiglu_limit: float | None = None,
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
        check_routing_arguments(num_experts, top_k, scoring=scoring, renormalize=renormalize, num_groups=num_groups,
                                topk_groups=topk_groups, routed_scaling_factor=routed_scaling_factor)
        if not isinstance(correction_bias, bool):
            raise ValueError(f"correction_bias must be a bool (True: keep a correction-bias buffer), "
                             f"got {correction_bias!r}")
        check_swiglu_limit(swiglu_limit)
        if config is not None and not isinstance(config, Config):
            raise TypeError(f"config must be a serval.Config, got {type(config).__name__}")
        if dtype is not None and dtype not in FLOAT_DTYPES:
            raise ValueError(f"dtype must be None or one of {[str(d) for d in FLOAT_DTYPES]}, got {dtype}")
        recipe = precision.recipe_of((config or Config()).precision)
        if recipe is not None:  # the sizes now; the dtype (bf16, or autocast to it) at the call
            precision.check_sizes(recipe, intermediate_size, (config or Config()).block_m)
        ep_size = 1 if group is None else group.size()
        if num_experts % ep_size:
            raise ValueError(f"num_experts={num_experts} must be divisible by the EP group size {ep_size}")
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, top_k
        self.scoring, self.renormalize, self.routed_scaling_factor = scoring, renormalize, routed_scaling_factor
        self.num_groups, self.topk_groups = num_groups, topk_groups
        self.swiglu_limit, self.config, self.group = swiglu_limit, config or Config(), group
        factory = dict(device=device, dtype=dtype)
        local = num_experts // ep_size
        self.router = nn.Linear(hidden_size, num_experts, bias=False, **factory)
        self.register_buffer("correction_bias", torch.zeros(
            num_experts, device=device, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
            if correction_bias else None)
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
        """nn.Linear's default init for every expert matrix (uniform +-1/sqrt(fan_in)); a small router; a zero
        correction bias."""
        for w in (self.w_gate, self.w_up, self.w_down):
            bound = 1 / math.sqrt(w.shape[-1])
            nn.init.uniform_(w, -bound, bound)
        nn.init.normal_(self.router.weight, std=0.02)
        if self.correction_bias is not None:
            with torch.no_grad():
                self.correction_bias.zero_()
        if self.shared is not None:
            for linear in self.shared.values():
                linear.reset_parameters()

    def _router_output(self, tokens: torch.Tensor) -> RouterOutput:
        """The routing of tokens [N, H]: the router's logits in fp32 (fp64 when the tokens are fp64), then
        `serval.routing.route` with the module's options."""
        dtype = torch.float64 if tokens.dtype == torch.float64 else torch.float32
        with _without_autocast(tokens.device.type):  # autocast would run the router in bf16 / fp16
            logits = F.linear(tokens.to(dtype), self.router.weight.to(dtype))
            return route(logits, self.top_k, scoring=self.scoring, renormalize=self.renormalize,
                         correction_bias=self.correction_bias, num_groups=self.num_groups,
                         topk_groups=self.topk_groups, routed_scaling_factor=self.routed_scaling_factor)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(router_weights [N, k], topk_ids [N, k]) for tokens x [N, H]: the weights are fp32 (fp64 when x is
        fp64), as `serval.moe` takes them; the ids are global expert ids."""
        output = self._router_output(x)
        return output.weights, output.ids

    def quantize_expert_weights(self):
        """The routed experts' weights in the form the GEMMs of the module's FP8 precision read
        (`serval.quantize_expert_weights`): make them after each optimizer step and pass them to every
        micro-batch's forward (`expert_weights=`), so that the step quantizes the weights once."""
        return quantize_expert_weights(self.w_gate, self.w_up, self.w_down, self.config.precision)

    def forward(self, x: torch.Tensor, expert_weights=None, *, return_router_output: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, RouterOutput]:
        """y [..., hidden_size] for x [..., hidden_size] (the module's dtype and device); expert_weights: this
        step's `quantize_expert_weights()` (FP8 precisions; None: quantized in the call). With
        return_router_output, (y, RouterOutput) over x's N = x.numel() / hidden_size tokens: logits [N, E] fp32,
        weights [N, k], global expert ids [N, k] and this rank's tokens per expert [E] (int64).

        Under torch.autocast (bf16) the experts run in bf16 on bf16 copies of the weights (x of any float dtype
        is cast), as autocast runs nn.Linear; the router stays in fp32. An empty batch gives an empty y (without
        an EP group; at EP every rank must pass the same number of tokens, at least one)."""
        compute_dtype = self._check_input(x)
        shape = x.shape
        tokens = x.reshape(-1, self.hidden_size)
        router_output = self._router_output(tokens)
        weights = [self.w_gate, self.w_up, self.w_down]
        if self.shared is not None:
            weights += [self.shared["gate"].weight, self.shared["up"].weight, self.shared["down"].weight]
        if tokens.shape[0] == 0 and (self.group is None or self.group.size() == 1):  # zero gradients to every parameter
            # (at EP a rank cannot know that the others are empty too: serval.moe raises on it, and the others
            # get their bounded peer timeout)
            y = tokens.new_zeros(shape, dtype=compute_dtype) + sum(
                w[:0].sum() for w in [x, self.router.weight, *weights])
        else:
            weights = [w.to(compute_dtype) for w in weights]
            with _without_autocast(x.device.type):
                y = moe(tokens.to(compute_dtype), router_output.weights, router_output.ids, *weights[:3],
                        tuple(weights[3:]) if self.shared is not None else None, group=self.group,
                        config=self.config, swiglu_limit=self.swiglu_limit, expert_weights=expert_weights)
            y = y.view(shape)
        return (y, router_output) if return_router_output else y

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
        fp8 = precision.recipe_of(self.config.precision) is not None
        if fp8 and weight.dtype != torch.bfloat16:
            raise TypeError(f"serval.MoE with precision={self.config.precision!r} takes {FP8_ACCEPTED_INPUTS}; its "
                            f"parameters are {weight.dtype}: convert the module with .bfloat16() and x with "
                            f"x.to(torch.bfloat16), or call it under torch.autocast(device_type, dtype=torch.bfloat16)")
        if x.dtype != weight.dtype:
            # the module's dtype may change only to one it computes in; else x must change (or autocast)
            module_advice = f", or the module with .to({x.dtype})" if x.dtype in FLOAT_DTYPES and not fp8 else ""
            raise TypeError(f"x must have the dtype of the module's parameters ({weight.dtype}), got {x.dtype}: "
                            f"serval.MoE takes {FP8_ACCEPTED_INPUTS if fp8 else ACCEPTED_INPUTS}; convert x with "
                            f"x.to({weight.dtype}){module_advice}")
        return weight.dtype

    def extra_repr(self) -> str:
        shared = None if self.shared is None else self.shared["gate"].weight.shape[0]
        ep_size = 1 if self.group is None else self.group.size()
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.w_gate.shape[1]}, "
                f"num_experts={self.num_experts}, top_k={self.top_k}, shared_intermediate_size={shared}, "
                f"scoring={self.scoring}, renormalize={self.renormalize}, "
                f"correction_bias={self.correction_bias is not None}, num_groups={self.num_groups}, "
                f"topk_groups={self.topk_groups}, routed_scaling_factor={self.routed_scaling_factor}, "
                f"swiglu_limit={self.swiglu_limit}, precision={self.config.precision}, ep_size={ep_size}")
