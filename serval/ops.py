"""Standalone tensor ops: OCP MX FP8 quantisation (`mxfp8_quantize`) and its inverse.

MXFP8 (OCP Microscaling v1.0): blocks of 32 consecutive elements share one
power-of-two scale stored as E8M0 (a biased exponent byte, 2^(byte - 127));
elements are FP8 E4M3 (largest normal 448). The scale is the smallest power of
two with amax / scale <= 448, i.e. 2^ceil(log2(amax / 448)), so the block maximum
lands in (224, 448] and nothing saturates. (OCP's example rule,
2^(floor(log2(amax)) - 8), clips block values in (448, 512) x scale to 448;
rounding the scale up, as NVIDIA's MXFP8 training recipes do, avoids that.)
Row-wise blocks run along the last dimension, column-wise along the first
(what a GEMM's A and B^T operands need for the forward and the weight gradient).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

MX_BLOCK = 32
E4M3_MAX = 448.0


class MXFP8Tensor(NamedTuple):
    """data: float8_e4m3fn, same shape as the input; scale: uint8 E8M0, one per 32-block along `dim`."""

    data: torch.Tensor
    scale: torch.Tensor
    dim: int


def _quantize_last_dim(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = t.float().reshape(*t.shape[:-1], t.shape[-1] // MX_BLOCK, MX_BLOCK)
    ratio = blocks.abs().amax(dim=-1) / E4M3_MAX
    mantissa, exponent = torch.frexp(ratio)  # ratio = m * 2^e, m in [0.5, 1): ceil(log2(ratio)) = e - (m == 0.5)
    shared_exp = exponent - (mantissa == 0.5).to(exponent.dtype)
    shared_exp = torch.where(ratio > 0, shared_exp, -127).clamp(-127, 127)
    scaled = blocks * torch.exp2(-shared_exp.float())[..., None]
    data = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).reshape(t.shape)
    return data, (shared_exp + 127).to(torch.uint8)


def mxfp8_quantize(t: torch.Tensor, rowwise: bool = True, colwise: bool = False):
    """Quantise a 2-D tensor to MXFP8: returns (rowwise MXFP8Tensor or None, colwise MXFP8Tensor or None)."""
    if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.dtype.is_floating_point:
        raise ValueError(f"mxfp8_quantize: t must be a 2-D floating tensor, got {getattr(t, 'shape', t)}")
    if not (rowwise or colwise):
        raise ValueError("mxfp8_quantize: ask for rowwise, colwise or both")
    row = col = None
    if rowwise:
        if t.shape[1] % MX_BLOCK:
            raise ValueError(f"mxfp8_quantize rowwise: t.shape[1] must be a multiple of {MX_BLOCK}, got {t.shape[1]}")
        row = MXFP8Tensor(*_quantize_last_dim(t), dim=1)
    if colwise:
        if t.shape[0] % MX_BLOCK:
            raise ValueError(f"mxfp8_quantize colwise: t.shape[0] must be a multiple of {MX_BLOCK}, got {t.shape[0]}")
        data, scale = _quantize_last_dim(t.t())
        col = MXFP8Tensor(data.t(), scale.t(), dim=0)
    return row, col


def mxfp8_dequantize(q: MXFP8Tensor) -> torch.Tensor:
    """fp32 values of an MXFP8Tensor."""
    scale = torch.exp2(q.scale.float() - 127).repeat_interleave(MX_BLOCK, dim=q.dim)
    return q.data.float() * scale
