"""serval as an experts implementation of transformers (5.x): every MoE layer's routed experts on `serval.moe`.

Importing this module registers two names with transformers:

* the experts implementation "serval" in `transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS`, so that

      import serval.integrations.transformers
      model = AutoModelForCausalLM.from_pretrained(name, experts_implementation="serval")

  (or `model.set_experts_implementation("serval")`, or `use_serval(model, config)`) runs the routed experts of
  every layer whose experts module uses transformers' `@use_experts_implementation` on `serval.moe`. The model
  keeps its router (softmax or sigmoid, correction bias, group-limited top-k, scaling factors, the recorded
  router logits for the aux loss) and its shared expert; serval receives the chosen ids and weights.
* the expert-parallel implementation "serval" in transformers' `EPImplementationInterface`, so that
  `DistributedConfig(ep_size=P, ep_implementation="serval")` hands each rank's batch, with global expert ids,
  to `serval.moe(group=<the EP mesh's group>)`: serval moves the rows between the ranks itself (its pulls and
  pushes over symmetric memory on CUDA, shared memory on CPU), where transformers' all-to-all would.

The experts module's weights are read in place: `gate_up_proj` [E, 2I, H] (every expert's gate rows, then its up
rows) is passed whole as serval's joined gate/up weight, and its gradient comes back as one [E, 2I, H] tensor;
`down_proj` [E, H, I] is serval's w_down. Nothing is copied per call. In the FP8 precisions serval quantizes the
weights once per optimizer step by itself (`serval.weight_cache`).

Which `serval.Config` runs: the one `use_serval(model, config)` set on the model's experts modules, else
`serval.Config()` (bf16). Experts serval does not compute exactly are refused with the reason, never run
differently: biases, transposed or interleaved gate/up weights (GPT-OSS), a gating other than transformers'
default SwiGLU split, an activation other than SiLU, experts without a gate, a post-expert norm, and transformers'
own expert parallelism with local ids (use ep_implementation="serval").
"""

from __future__ import annotations

import torch
import transformers
from packaging.version import Version  # a requirement of transformers

from . import TRANSFORMERS_MIN


def check_transformers_version(version: str) -> None:
    """ImportError, naming the version needed and how to get it, unless transformers `version` has the experts and
    expert-parallel interfaces this module registers with (an older one fails deeper, on a missing submodule)."""
    if Version(version) < Version(TRANSFORMERS_MIN):
        raise ImportError(f"serval.integrations.transformers needs transformers>={TRANSFORMERS_MIN} (its experts "
                          f"and expert-parallel interfaces), found {version}: pip install 'serval[transformers]'")


check_transformers_version(transformers.__version__)

from transformers.distributed.expert_parallel import EPImplementation, EPImplementationInterface  # noqa: E402
from transformers.integrations import moe as transformers_moe  # noqa: E402

from ..api import moe  # noqa: E402
from ..config import DEFAULT_CONFIG, Config  # noqa: E402

NAME = "serval"
CONFIG_ATTRIBUTE = "serval_config"  # set on each experts module by `use_serval`
_SILU = ("silu", "swish")


def check_experts(experts: torch.nn.Module) -> None:
    """ValueError unless serval computes these experts exactly (see the module docstring); names the reason."""
    kind = type(experts).__name__
    if not getattr(experts, "has_gate", True):
        raise ValueError(f"serval computes gated (SwiGLU) experts: {kind} has no gate (has_gate=False)")
    if getattr(experts, "has_bias", False):
        raise ValueError(f"serval's experts have no biases: {kind} has has_bias=True (e.g. GPT-OSS)")
    if getattr(experts, "is_transposed", False):
        raise ValueError(f"serval reads gate_up_proj as [E, 2I, H]: {kind} stores it transposed (is_transposed=True)")
    if not getattr(experts, "is_concatenated", True):
        raise ValueError(f"serval reads gate_up_proj with every expert's gate rows, then its up rows: {kind} "
                         "interleaves them (is_concatenated=False)")
    if getattr(experts, "has_post_expert_norm", False):
        raise ValueError(f"serval's experts have no post-expert norm: {kind} has has_post_expert_norm=True")
    if getattr(type(experts), "_apply_gate", transformers_moe._default_apply_gate) is not \
            transformers_moe._default_apply_gate:
        raise ValueError(f"serval computes silu(gate) * up: {kind} has its own gating (_apply_gate), e.g. GPT-OSS's "
                         "clamped alpha-SwiGLU")
    act = str(getattr(experts.config, "hidden_act", "silu")).lower()
    if act not in _SILU:
        raise ValueError(f"serval computes silu(gate) * up: {kind} uses the activation {act!r} (config.hidden_act)")
    for name, shape_of in (("gate_up_proj", 3), ("down_proj", 3)):
        weight = getattr(experts, name, None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != shape_of:
            raise ValueError(f"serval reads {kind}.{name} as a 3-D expert weight, got "
                             f"{None if weight is None else tuple(weight.shape)}")


def _config(experts: torch.nn.Module) -> Config:
    return getattr(experts, CONFIG_ATTRIBUTE, None) or DEFAULT_CONFIG


def experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts implementation "serval": transformers' experts call, `fn(experts, hidden_states [T, H],
    top_k_index [T, k] (global ids), top_k_weights [T, k]) -> [T, H]`, on `serval.moe` with the module's own
    `gate_up_proj` (joined) and `down_proj`."""
    check_experts(self)
    if getattr(self, "_is_expert_parallel", False):
        raise ValueError("serval runs expert parallelism itself, from global expert ids: load the model with "
                         "DistributedConfig(ep_implementation='serval') (transformers' other EP implementations "
                         "call the experts with local ids)")
    out = moe(hidden_states, top_k_weights, top_k_index, self.gate_up_proj, None, self.down_proj,
              config=_config(self))
    return out.to(hidden_states.dtype)


class ServalEP(EPImplementation):
    """The expert-parallel implementation "serval": each rank hands its batch, with global expert ids, to
    `serval.moe(group=<the EP mesh's process group>)`, which pulls every row an expert needs from the rank that
    holds its token and pushes the results back (no all-to-all, no host sync). Every rank of the group must pass
    the same number of tokens (serval checks it, naming the sizes). Weights: the rank's local shards, as
    transformers' EP style hands them (`gate_up_proj` [E/P, 2I, H], `down_proj` [E/P, H, I]), expert e on rank
    e // (E/P)."""

    def __init__(self, experts: torch.nn.Module, ep_mesh, tp_mesh):
        super().__init__(experts, ep_mesh, tp_mesh)
        check_experts(experts)
        self.experts = experts
        self.group = ep_mesh.get_group()

    def __call__(self, hidden_states, top_k_index, top_k_weights):
        experts = self.experts
        out = moe(hidden_states, top_k_weights, top_k_index, experts.gate_up_proj, None, experts.down_proj,
                  group=self.group, config=_config(experts))
        return out.to(hidden_states.dtype)


def use_serval(model: torch.nn.Module, config: Config | None = None) -> torch.nn.Module:
    """Run `model`'s routed experts on serval with `config` (None: `serval.Config()`): sets the experts
    implementation "serval" and the Config on every experts module; returns the model. ValueError (naming the
    module and the reason) if an experts module is one serval does not compute exactly, before anything changes."""
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"config must be None or a serval.Config, got {type(config).__name__}")
    experts_modules = [(name, m) for name, m in model.named_modules() if hasattr(m, "gate_up_proj")
                       and hasattr(m, "down_proj") and hasattr(m, "has_gate")]
    if not experts_modules:
        raise ValueError(f"{type(model).__name__} has no experts module that uses transformers' experts "
                         "implementations (@use_experts_implementation)")
    for name, experts in experts_modules:
        try:
            check_experts(experts)
        except ValueError as error:
            raise ValueError(f"{name}: {error}") from None
    model.set_experts_implementation(NAME)
    for _, experts in experts_modules:
        setattr(experts, CONFIG_ATTRIBUTE, config)
    return model


transformers_moe.ALL_EXPERTS_FUNCTIONS.register(NAME, experts_forward)
EPImplementationInterface.register(NAME, ServalEP)
