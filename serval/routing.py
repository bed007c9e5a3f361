"""Token-choice routing as pure functions over tensors, and the two load-balancing helpers a trainer needs.

- `route`: router logits [N, E] -> `RouterOutput` (the logits, the weights and global expert ids of each token's
  top-k, tokens per expert): softmax or sigmoid scores, an optional correction bias that moves the choice only
  (DeepSeek-V3's auxiliary-loss-free balancing), group-limited top-k, renormalisation and a scaling factor.
- `load_balancing_loss`: the Switch Transformer auxiliary loss in the form transformers computes it (Mixtral,
  Qwen-MoE, OLMoE: `load_balancing_loss_func`).
- `update_correction_bias`: the auxiliary-loss-free bias update in the form torchtitan applies before each
  optimizer step, bias += rate * sign(mean load - load), centred.

Nothing here syncs the host (no `.item()`, no data-dependent shapes), and every count is an integer sum, so the
results are the same bits run to run on any device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

SCORINGS = ("softmax", "sigmoid")
# added to a token's sum of chosen scores before dividing by it, as DeepSeek-V3 (transformers, torchtitan) does:
# a token whose sigmoid scores all underflow gets zero weights, not NaN; a sum above ~1e-13 is unchanged in fp32
RENORMALIZE_EPS = 1e-20


class RouterOutput(NamedTuple):
    """What the router decided for N tokens over E experts."""

    logits: torch.Tensor  # [N, E]: the router's linear output (what `load_balancing_loss` takes)
    weights: torch.Tensor  # [N, k] fp32 (fp64 for fp64 logits): each chosen expert's weight, differentiable
    ids: torch.Tensor  # [N, k] int64: the chosen global expert ids, in descending order of the choice score
    tokens_per_expert: torch.Tensor  # [E] int64: how many of the N tokens chose each expert


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_positive_finite(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a positive finite float, got {value!r}")


def check_routing_arguments(num_experts: int, top_k: int, *, scoring: str, renormalize: bool,
                            num_groups: int | None, topk_groups: int | None, routed_scaling_factor: float) -> None:
    """Raise a ValueError naming the first routing argument that is not valid for num_experts experts."""
    if not _is_int(num_experts) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if not _is_int(top_k) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an int in [1, num_experts={num_experts}], got {top_k!r}")
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
    if not isinstance(renormalize, bool):
        raise ValueError(f"renormalize must be a bool, got {renormalize!r}")
    if (num_groups is None) != (topk_groups is None):
        raise ValueError(f"num_groups and topk_groups must be given together (group-limited top-k) or both None, "
                         f"got num_groups={num_groups!r}, topk_groups={topk_groups!r}")
    if num_groups is not None:
        if not _is_int(num_groups) or num_groups < 1 or num_experts % num_groups or num_experts // num_groups < 2:
            raise ValueError(f"num_groups must be a positive int dividing num_experts={num_experts} into groups of at "
                             f"least 2 experts (a group scores as the sum of its top 2), got {num_groups!r}")
        group_size = num_experts // num_groups
        if not _is_int(topk_groups) or not 1 <= topk_groups <= num_groups or topk_groups * group_size < top_k:
            raise ValueError(f"topk_groups must be an int in [1, num_groups={num_groups}] whose groups hold at least "
                             f"top_k={top_k} experts ({group_size} per group), got {topk_groups!r}")
    _check_positive_finite("routed_scaling_factor", routed_scaling_factor)


def _check_logits(name: str, logits) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        dtype = f", {logits.dtype}" if isinstance(logits, torch.Tensor) else ""
        raise ValueError(f"{name} must be a floating-point tensor [N, num_experts], got {shape}{dtype}")


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    """Scores are computed in fp32 (fp64 for fp64 logits): a bf16 softmax would move the choice and the loss."""
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _count_per_expert(ids: torch.Tensor, num_experts: int, per_token: torch.Tensor | None = None) -> torch.Tensor:
    """[E] int64: how many (token, slot) pairs of ids [N, k] name each expert, counting token t per_token[t] times
    (None: once). An integer scatter-add: its atomics are exact, so the count is the same in any order."""
    flat = ids.reshape(-1)
    ones = torch.ones_like(flat) if per_token is None else per_token.to(torch.int64).repeat_interleave(ids.shape[1])
    return torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, ones)


def route(logits: torch.Tensor, top_k: int, *, scoring: str = "softmax", renormalize: bool = True,
          correction_bias: torch.Tensor | None = None, num_groups: int | None = None, topk_groups: int | None = None,
          routed_scaling_factor: float = 1.0) -> RouterOutput:
    """Each token's top_k experts and their weights from router logits [N, E].

    scores = softmax(logits) over the experts, or sigmoid(logits) per expert (in fp32; fp64 for fp64 logits).
    The choice ranks scores + correction_bias ([E], None: no bias); with num_groups, the E experts form num_groups
    contiguous groups of E / num_groups, each group ranks by the sum of its two best biased scores, and the choice
    is among the experts of the topk_groups best groups only (DeepSeek-V3's group-limited routing). The weights
    are the chosen experts' unbiased scores, divided by their sum (+1e-20) when renormalize, times
    routed_scaling_factor. Ties are broken by torch.topk (deterministic on a given device).

    Presets: Mixtral / Qwen3-MoE: the defaults; Qwen2-MoE / OLMoE: renormalize=False; DeepSeek-V3:
    scoring="sigmoid", correction_bias, num_groups=n_group, topk_groups=topk_group, routed_scaling_factor.
    """
    _check_logits("logits", logits)
    num_experts = logits.shape[1]
    check_routing_arguments(num_experts, top_k, scoring=scoring, renormalize=renormalize, num_groups=num_groups,
                            topk_groups=topk_groups, routed_scaling_factor=routed_scaling_factor)
    if correction_bias is not None and (not isinstance(correction_bias, torch.Tensor)
                                        or correction_bias.shape != (num_experts,)
                                        or not correction_bias.is_floating_point()
                                        or correction_bias.device != logits.device):
        got = (f"{tuple(correction_bias.shape)} {correction_bias.dtype} on {correction_bias.device}"
               if isinstance(correction_bias, torch.Tensor) else type(correction_bias).__name__)
        raise ValueError(f"correction_bias must be None or a floating-point tensor [num_experts={num_experts}] on "
                         f"{logits.device}, got {got}")
    dtype = _compute_dtype(logits)
    scores = logits.to(dtype).softmax(dim=-1) if scoring == "softmax" else logits.to(dtype).sigmoid()
    with torch.no_grad():  # the choice: integer ids, no gradient
        choice = scores if correction_bias is None else scores + correction_bias.to(dtype)
        if num_groups is not None:
            grouped = choice.unflatten(-1, (num_groups, num_experts // num_groups))
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            kept = torch.zeros_like(group_scores, dtype=torch.bool)
            kept.scatter_(1, group_scores.topk(topk_groups, dim=-1).indices, True)
            choice = grouped.masked_fill(~kept.unsqueeze(-1), -math.inf).flatten(-2)
        ids = choice.topk(top_k, dim=-1).indices
        tokens_per_expert = _count_per_expert(ids, num_experts)
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + RENORMALIZE_EPS)
    return RouterOutput(logits, weights * routed_scaling_factor, ids, tokens_per_expert)


def load_balancing_loss(router_logits: torch.Tensor | Sequence[torch.Tensor], top_k: int,
                        attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The Switch Transformer auxiliary loss, E * sum_e f_e * P_e, as transformers' `load_balancing_loss_func`.

    router_logits: one layer's logits [N, E] or a sequence of every layer's (as transformers records them); each
    token's probabilities are softmax(logits) and its experts their top_k, whatever scoring the router used.
    Over all layers' tokens, f_e = (tokens choosing expert e) / tokens (the f_e sum to top_k) and P_e = the mean
    probability of expert e. attention_mask (optional, [batch, seq] or any shape of N elements, the same for
    every layer): only the tokens where it is nonzero count. The loss is fp32 (fp64 for fp64 logits),
    differentiable through P; it needs at least one counted token (none gives NaN).
    """
    layers = [router_logits] if isinstance(router_logits, torch.Tensor) else list(router_logits)
    if not layers:
        raise ValueError("router_logits must be a tensor [N, num_experts] or a non-empty sequence of them")
    for i, logits in enumerate(layers):
        _check_logits(f"router_logits[{i}]", logits)
    num_tokens, num_experts = layers[0].shape
    device = layers[0].device
    for i, logits in enumerate(layers):
        if logits.shape != layers[0].shape or logits.device != device:
            raise ValueError(f"router_logits[{i}] must have the shape and device of router_logits[0] "
                             f"({tuple(layers[0].shape)} on {device}), got {tuple(logits.shape)} on {logits.device}")
    if not _is_int(top_k) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an int in [1, num_experts={num_experts}], got {top_k!r}")
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor)
                                       or attention_mask.numel() != num_tokens):
        got = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        raise ValueError(f"attention_mask must be None or a tensor of N = {num_tokens} elements (the router logits' "
                         f"rows), got {got}")
    dtype = _compute_dtype(layers[0])
    counted = None if attention_mask is None else attention_mask.reshape(-1).to(device) != 0
    chosen = torch.zeros(num_experts, dtype=torch.int64, device=device)
    probability_sum = torch.zeros(num_experts, dtype=dtype, device=device)
    for logits in layers:  # one layer's [N, E] at a time: memory does not grow with the layers
        probabilities = logits.to(dtype).softmax(dim=-1)
        ids = probabilities.topk(top_k, dim=-1).indices
        chosen = chosen + _count_per_expert(ids, num_experts, counted)
        if counted is not None:
            probabilities = probabilities * counted.unsqueeze(-1)
        probability_sum = probability_sum + probabilities.sum(dim=0)
    tokens = len(layers) * (num_tokens if counted is None else counted.sum())
    return num_experts * ((chosen.to(dtype) / tokens) * (probability_sum / tokens)).sum()


@torch.no_grad()
def update_correction_bias(correction_bias: torch.Tensor | Sequence[torch.Tensor],
                           tokens_per_expert: torch.Tensor | Sequence[torch.Tensor], update_rate: float, *,
                           group: dist.ProcessGroup | None = None) -> None:
    """Auxiliary-loss-free load balancing: correction_bias += centred(update_rate * sign(mean load - load)).

    correction_bias: a layer's bias [E] (e.g. `serval.MoE.correction_bias`), updated in place, or a sequence of
    every layer's; tokens_per_expert: the matching counts [E] (e.g. `RouterOutput.tokens_per_expert` summed over
    a step's micro-batches), not changed. With `group`, the counts are first summed over its ranks (one
    all-reduce for all layers): pass the ranks whose tokens share the biases (data and expert parallel), so that
    every replica makes the same update. Under-loaded experts gain update_rate, over-loaded ones lose it; the
    update is centred (its mean over the experts removed), as torchtitan does, so the biases' mean stays put.
    """
    biases = [correction_bias] if isinstance(correction_bias, torch.Tensor) else list(correction_bias)
    counts = [tokens_per_expert] if isinstance(tokens_per_expert, torch.Tensor) else list(tokens_per_expert)
    if not biases or len(biases) != len(counts):
        raise ValueError(f"correction_bias and tokens_per_expert must be two tensors or two sequences of the same "
                         f"non-zero length, got {len(biases)} and {len(counts)}")
    _check_positive_finite("update_rate", update_rate)
    for i, (bias, count) in enumerate(zip(biases, counts)):
        if not isinstance(bias, torch.Tensor) or bias.dim() != 1 or not bias.is_floating_point():
            raise ValueError(f"correction_bias[{i}] must be a floating-point tensor [num_experts], got "
                             f"{tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__}")
        if not isinstance(count, torch.Tensor) or count.shape != bias.shape or count.is_complex():
            raise ValueError(f"tokens_per_expert[{i}] must be a real tensor of correction_bias[{i}]'s shape "
                             f"{tuple(bias.shape)}, got "
                             f"{tuple(count.shape) if isinstance(count, torch.Tensor) else type(count).__name__}")
    device = biases[0].device
    # a new tensor (the caller's counts stay as they are); float64 holds integer counts exactly, so the
    # all-reduce's sum does not depend on its order
    loads = torch.stack([count.to(device=device, dtype=torch.float64) for count in counts])
    if group is not None:
        dist.all_reduce(loads, group=group)
    for bias, load in zip(biases, loads.float()):  # torchtitan's fp32 counts, one layer at a time: its bits
        delta = update_rate * torch.sign(load.mean() - load)
        bias.add_((delta - delta.mean()).to(bias.device))
