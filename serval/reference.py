"""The numerics oracle: the semantics of the MoE layer (docs/CONTRACT.md) in plain PyTorch.

Any device, any floating dtype (float64 included), differentiable by autograd.
Written for clarity, not speed: every expert is applied to every token and the
result is masked, so there are no data-dependent shapes and no index_add.
Every fast path in serval is tested against this module.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(gate: torch.Tensor, up: torch.Tensor, swiglu_limit: float | None = None) -> torch.Tensor:
    """silu(gate) * up, with the gate clamped to max=limit and up to [-limit, limit] when a limit is given."""
    if swiglu_limit is not None:
        gate = gate.clamp(max=swiglu_limit)
        up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
    return F.silu(gate) * up


def mlp(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
        swiglu_limit: float | None = None) -> torch.Tensor:
    """One SwiGLU expert, nn.Linear layout: w_gate, w_up [I, H], w_down [H, I]."""
    return swiglu(x @ w_gate.T, x @ w_up.T, swiglu_limit) @ w_down.T


def moe(x, router_weights, topk_ids, w_gate, w_up, w_down, shared=None, *, group=None, config=None,
        swiglu_limit=None):
    """y[t] = shared(x[t]) + sum_j router_weights[t, j] * expert_{topk_ids[t, j]}(x[t]).

    EP=1 only (`group` must be None); `config` is accepted for signature parity and ignored.
    swiglu_limit clamps the SwiGLU of the routed experts and of the shared expert alike.
    """
    if group is not None:
        raise ValueError("serval.reference.moe computes the EP=1 layer: pass group=None (concatenate the batch)")
    num_experts = w_gate.shape[0]
    y = torch.zeros_like(x)
    for e in range(num_experts):
        # weight of expert e for each token: sum over the slots that picked it (0 if none)
        weight_e = (router_weights * (topk_ids == e).to(router_weights.dtype)).sum(dim=1, keepdim=True)
        y = y + weight_e.to(x.dtype) * mlp(x, w_gate[e], w_up[e], w_down[e], swiglu_limit)
    if shared is not None:
        y = y + mlp(x, *shared, swiglu_limit=swiglu_limit)
    return y
