"""serval as torchtitan's routed experts (torchtitan 0.3): every MoE layer's `RoutedExperts` stage on `serval.moe`.

One line switches it on, in either of two places:

* in the trainer's config, through torchtitan's override registry (`torchtitan.config.override`: replacements of a
  Config in the config tree, applied after `update_from_config` and before the model is built):

      --override.imports serval.integrations.torchtitan.serval_routed_experts

  (in Python, `trainer_config.override.imports.append(...)` of that name), or with `serval.Config` fields as JSON:
  `--override.imports 'serval.integrations.torchtitan.serval_routed_experts={"precision": "mxfp8"}'`;
* on a built model, before torchtitan's parallelize step: `serval.integrations.torchtitan.apply(model, config)`.

Why the override registry and not `comm_backend`: torchtitan picks the token dispatcher by an if/elif over fixed
names (`make_token_dispatcher_config`), and a dispatcher only moves rows to and from torchtitan's `GroupedExperts`.
serval does the dispatch, the experts and the combine in one op, so it replaces the stage that holds all three,
`RoutedExperts`, whose Config the registry can swap.

What stays torchtitan's: the router (softmax or sigmoid, expert bias for the choice, group-limited routing,
route_norm, route_scale), the shared expert, the MoE wrapper (token counts for load balancing), and the experts'
module `routed_experts.inner_experts` (a plain `GroupedExperts`) with its parameters `w1_EFD`, `w3_EFD` [E, F, D]
and `w2_EDF` [E, D, F], so state-dict keys, the HF state-dict adapters, FSDP and the sharding config are unchanged.
Those parameters are serval's `w_gate`, `w_up` and `w_down` as they are (out x in, like nn.Linear). The function is
torchtitan's: `GroupedExperts` runs its GEMMs in bf16 whatever the parameters' dtype, and its combine scales each
expert's output by the token's score after the expert (torchtitan 0.3 has no option to scale the input instead),
so serval gets x and the weights in bf16 (no copy when they are bf16 already, as under FSDP's bf16 mixed
precision), y = sum_k score_k * expert_k(x), returned in x's dtype; the two agree to bf16 rounding (serval rounds
its SwiGLU once and sums a token's k outputs in fp32). `num_local_tokens_per_expert_E` and any padding are
torchtitan's dispatcher's business and have no effect on the result.

Expert parallelism: torchtitan's parallelize step shards the experts' parameters Shard(0) on the "ep" mesh axis
(DTensors, or plain local tensors under spmd_backend="spmd_types") and runs `RoutedExperts` as a local region on
each rank's tokens. `ServalRoutedExperts.parallelize` keeps that and records the "ep" axis's process group in place
of wiring torchtitan's dispatcher (no all-to-all, no DeepEP / HybridEP buffers: whatever `comm_backend` names is
never built, and the Config's `token_dispatcher` is None, so the trainer's CUDA-graph check at EP, which refuses
dispatchers that sync with the host, has nothing to refuse: serval does not sync); the forward calls
`serval.moe(..., group=<that group>)` with the rank's local expert weights and the router's global expert ids.
The Shard(0) layout is serval's: expert e on EP rank e // (E / EP).

Refused with a ValueError naming the reason: tensor parallelism without expert parallelism (torchtitan then shards
the experts' F dimension over TP: TP inside the experts); experts other than `GroupedExperts` itself
(torchtitan's Float8 / MXFP8 grouped-experts converters: use `serval.Config(precision=...)` instead; GPT-OSS's
experts, with biases and a clamped SwiGLU; the fused_swiglu override's joined `w13`); `apply` after parallelize.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torchtitan.config import derive, override
from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher
from torchtitan.protocols.module import Module

from ..api import moe
from ..config import DEFAULT_CONFIG
from ..config import Config as ServalConfig  # `Config` is each torchtitan module's own

COMPUTE_DTYPE = torch.bfloat16  # the dtype of GroupedExperts' grouped GEMMs, whatever the parameters' dtype


def check_experts(experts_class: type) -> None:
    """ValueError unless `experts_class` is torchtitan's `GroupedExperts` itself, the experts serval computes."""
    if experts_class is not GroupedExperts:
        raise ValueError(
            f"serval computes torchtitan's GroupedExperts (w1_EFD, w3_EFD, w2_EDF; w2 @ (silu(w1 @ x) * (w3 @ x)), no "
            f"bias) in its own precisions; the routed experts here are {experts_class.__qualname__}, which it does "
            "not compute: a torchtitan Float8 / MXFP8 grouped-experts converter (drop it and pass "
            "serval.Config(precision='mxfp8' or 'fp8_blockwise')), GPT-OSS's experts (biases, clamped SwiGLU) or "
            "the fused_swiglu override's joined w13")


def _local(weight: torch.Tensor) -> torch.Tensor:
    """The rank's shard of an expert weight: a DTensor's local tensor (differentiable), a plain tensor itself."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


class ServalRoutedExperts(RoutedExperts):
    """torchtitan's routed-experts stage (dispatch, experts, combine) as one `serval.moe` call, with the module's
    own `inner_experts` parameters and, once parallelized with EP, the EP mesh's process group. Its Config is
    torchtitan's with `serval_config` (the `serval.Config` of every call) and no token dispatcher (None: serval moves
    the rows, with no host sync, so torchtitan's checks of its dispatchers, e.g. for CUDA graphs at EP, have none
    to refuse)."""

    @dataclass(kw_only=True, slots=True)
    class Config(RoutedExperts.Config):
        token_dispatcher: LocalTokenDispatcher.Config | None = None
        serval_config: ServalConfig = DEFAULT_CONFIG

    def __init__(self, config: Config):
        Module.__init__(self)  # not RoutedExperts.__init__, which builds a token dispatcher
        check_experts(type(config.inner_experts)._owner)
        self.inner_experts = config.inner_experts.build()
        self.serval_config = config.serval_config
        self.ep_group = None

    def parallelize(self, parallel_dims) -> None:
        """torchtitan's sharding of the experts and its local region (`Module.parallelize`), then the EP group;
        torchtitan's dispatcher is not wired (RoutedExperts.parallelize would give it the EP mesh)."""
        if parallel_dims.tp_enabled and not parallel_dims.ep_enabled:
            raise ValueError(
                f"serval does not run tensor parallelism inside the routed experts: tensor_parallel_degree = "
                f"{parallel_dims.tp} with expert_parallel_degree = 1 shards the experts' F dimension over TP; "
                "set expert_parallel_degree > 1 (then TP shards the MoE's tokens) or tensor_parallel_degree = 1")
        Module.parallelize(self, parallel_dims)
        ep_mesh = parallel_dims.get_optional_mesh("ep")
        self.ep_group = None if ep_mesh is None else ep_mesh.get_group()

    def forward(self, x_BLD: torch.Tensor, topk_scores_BLK: torch.Tensor, topk_expert_ids_BLK: torch.Tensor,
                num_local_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        """x_BLD [B, L, D] (this rank's tokens), topk_scores_BLK [B, L, K] (the router's scores), topk_expert_ids_BLK
        [B, L, K] (global expert ids) -> the routed experts' output [B, L, D] in x's dtype. The per-expert token
        counts size torchtitan's all-to-all; serval's schedule counts its rows itself, so they are not read (the
        argument stays: the local region declares a placement per positional argument of RoutedExperts.forward)."""
        batch, length, dim = x_BLD.shape
        top_k = topk_scores_BLK.shape[-1]
        experts = self.inner_experts
        w_gate, w_up, w_down = (_local(w) for w in (experts.w1_EFD, experts.w3_EFD, experts.w2_EDF))
        ep_size = 1 if self.ep_group is None else self.ep_group.size()
        if w_gate.shape[0] * ep_size != experts.num_experts:
            raise ValueError(
                f"the routed experts' local weights hold {w_gate.shape[0]} experts (w1_EFD's local shape "
                f"{tuple(w_gate.shape)}) on each of {ep_size} EP rank(s), but the layer has num_experts = "
                f"{experts.num_experts}: the weights must be sharded Shard(0) over the EP mesh, as torchtitan's "
                "parallelize step does")
        y = moe(x_BLD.reshape(batch * length, dim).to(COMPUTE_DTYPE), topk_scores_BLK.reshape(-1, top_k),
                topk_expert_ids_BLK.reshape(-1, top_k), w_gate.to(COMPUTE_DTYPE), w_up.to(COMPUTE_DTYPE),
                w_down.to(COMPUTE_DTYPE), group=self.ep_group, config=self.serval_config)
        return y.to(x_BLD.dtype).view(batch, -1, dim)


@override(target=RoutedExperts.Config, exact=True,
          description="serval: the routed experts' dispatch, SwiGLU experts and combine in one serval.moe call")
def serval_routed_experts(config: RoutedExperts.Config, **serval_config_fields) -> ServalRoutedExperts.Config:
    """torchtitan override factory: every `RoutedExperts.Config` of the tree becomes a `ServalRoutedExperts.Config`
    with `serval.Config(**serval_config_fields)` (the override entry's kwargs) and no token dispatcher. ValueError
    for experts serval does not compute (`check_experts`), before anything is built."""
    check_experts(type(config.inner_experts)._owner)
    return derive(config, ServalRoutedExperts.Config, token_dispatcher=None,
                  serval_config=ServalConfig(**serval_config_fields))


def apply(model: torch.nn.Module, config: ServalConfig | None = None) -> torch.nn.Module:
    """Run every MoE layer's routed experts of a built torchtitan `model` on serval with `config` (None:
    `serval.Config()`), before torchtitan's parallelize step; returns the model. Each `RoutedExperts` becomes a
    `ServalRoutedExperts` in place (its class; its parameters, state-dict keys and sharding config unchanged, its
    unused token dispatcher dropped); a layer already on serval takes the new config. ValueError, naming the
    layer, if one is parallelized already or has experts serval does not compute, before anything changes."""
    if config is not None and not isinstance(config, ServalConfig):
        raise TypeError(f"config must be None or a serval.Config, got {type(config).__name__}")
    layers = [(name, m) for name, m in model.named_modules() if type(m) in (RoutedExperts, ServalRoutedExperts)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no torchtitan RoutedExperts module (an MoE layer's "
                         "routed_experts)")
    for name, layer in layers:
        name = name or type(layer).__name__
        if layer._parallelized:
            raise ValueError(f"{name}: apply(model) must run before torchtitan's parallelize step (the module's "
                             "forward is wrapped there, and the EP group recorded)")
        try:
            check_experts(type(layer.inner_experts))
        except ValueError as error:
            raise ValueError(f"{name}: {error}") from None
    for _, layer in layers:
        if type(layer) is RoutedExperts:
            layer.__class__ = ServalRoutedExperts
            del layer.token_dispatcher
            layer.ep_group = None
        layer.serval_config = DEFAULT_CONFIG if config is None else config
    return model
