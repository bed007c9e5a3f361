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


def moe_fp8(x, router_weights, topk_ids, w_gate, w_up, w_down, d_y, *, precision: str, block_m: int = 128,
            swiglu_limit=None):
    """An emulation of the routed experts in an FP8 precision (`serval.precision`): every operand quantized
    where the recipe quantizes it, dequantized, and multiplied in float64; each GEMM's output rounded to
    bf16 as the layer writes it. Forward and an explicit backward for output gradient d_y (no shared expert).

    The blocks along tokens follow the layer's row layout (`serval.schedule`: expert segments in source
    order, padded to block_m), which is part of the recipe. Returns (y, d_x, d_router_weights, d_w_gate,
    d_w_up, d_w_down), y and the gradients in float64.
    """
    from .ops import dequantize, quantize
    from .precision import RECIPES
    from .schedule import build_schedule

    recipe = RECIPES[precision]
    f64, bf16 = torch.float64, torch.bfloat16
    num_experts, inter, _ = w_gate.shape
    schedule = build_schedule(topk_ids, num_experts, block_m)
    source = schedule.row_source.long()
    used = (source >= 0)[:, None]
    x_rows = torch.where(used, x[source.clamp(min=0) // topk_ids.shape[1]], 0)
    rw_rows = torch.where(used[:, 0], router_weights.reshape(-1)[source.clamp(min=0)], 0).double()
    offsets = schedule.expert_offsets.tolist()
    segments = [(e, offsets[e], offsets[e + 1]) for e in range(num_experts)]

    def q(t, block, transpose=False, **kwargs):  # fake-quantized values in t's layout, float64
        deq = dequantize(quantize(t, block=block, scale_format=recipe.scale_format, transpose=transpose,
                                  **kwargs)[0], f64)
        return deq.transpose(-2, -1) if transpose else deq

    def weight(w, k_dim):
        if recipe.fp8_gemm:
            return q(w, recipe.weight_block)
        return q(w, (1, recipe.block) if k_dim == 2 else (recipe.block, 1))

    def rows(t):
        return q(t, (1, recipe.block))

    def tokens(t, **kwargs):
        return q(t, (recipe.block, 1), **kwargs)

    def grouped(a, w):  # out[r] = a[r] @ w[e(r)].T, rounded to bf16
        out = a.new_zeros(a.shape[0], w.shape[1])
        for e, lo, hi in segments:
            out[lo:hi] = a[lo:hi] @ w[e].T
        return out.to(bf16)

    def wgrad(a, b):  # dW[e] = a[seg].T @ b[seg], rounded to bf16
        return torch.stack([a[lo:hi].T @ b[lo:hi] for _, lo, hi in segments]).to(bf16)

    def parts(gate_up):
        gate, up = gate_up.double().chunk(2, dim=-1)
        if swiglu_limit is not None:
            gate, up = gate.clamp(max=swiglu_limit), up.clamp(min=-swiglu_limit, max=swiglu_limit)
        return gate, up, torch.sigmoid(gate)

    gate_up = grouped(rows(x_rows), torch.cat([weight(w_gate, 2), weight(w_up, 2)], dim=1))
    gate, up, sig = parts(gate_up)
    h = (gate * sig * up).to(bf16)
    out = grouped(rows(h), weight(w_down, 2))
    y = (out.double() * rw_rows[:, None])[schedule.source_row.long()].sum(dim=1)

    d_y_rows = torch.where(used, d_y[source.clamp(min=0) // topk_ids.shape[1]], 0)
    d_h_raw = grouped(rows(d_y_rows), weight(w_down.transpose(1, 2), 2)).double()
    kept = rows(gate_up).to(bf16)  # the kept pre-activations: quantized, dequantized to bf16
    gate, up, sig = parts(kept)
    h_back = (gate * sig * up).to(bf16).double()
    d_rw_rows = (d_h_raw * h_back).sum(-1)
    d_h = d_h_raw * rw_rows[:, None]
    d_gate = d_h * up * sig * (1 + gate * (1 - sig))
    d_up = d_h * gate * sig
    if swiglu_limit is not None:
        pre_gate, pre_up = kept.double().chunk(2, dim=-1)
        d_gate = d_gate * (pre_gate <= swiglu_limit)
        d_up = d_up * ((pre_up >= -swiglu_limit) & (pre_up <= swiglu_limit))
    d_gate_up = torch.cat([d_gate, d_up], dim=-1).to(bf16)
    w_gate_up_t = torch.cat([weight(w_gate.transpose(1, 2), 2), weight(w_up.transpose(1, 2), 2)], dim=2)
    d_x_rows = grouped(rows(d_gate_up), w_gate_up_t).double()
    d_x = d_x_rows[schedule.source_row.long()].sum(dim=1)
    d_router_weights = d_rw_rows[schedule.source_row.long()]
    d_w_down = wgrad(tokens(d_y_rows, row_scale=rw_rows.float()), tokens(h))
    d_w_gate_up = wgrad(tokens(d_gate_up), tokens(x_rows))
    d_w_gate, d_w_up = d_w_gate_up.double().chunk(2, dim=1)
    return y, d_x, d_router_weights, d_w_gate, d_w_up, d_w_down.double()
