"""The SwiGLU forward and backward as row passes, for the block-scaled FP8 path (`serval.precision`), whose
GEMMs store plain bf16 rows (no SwiGLU epilogue). The math is `swiglu.py`'s, as in the BF16 epilogues; each pass
also quantizes its outputs along the row (1 x SCALE_BLOCK blocks, `quantize.quantize_values`: the bits of
`serval.ops.quantize`), so no separate quantization pass reads them again. One program takes BLOCK_ROWS rows and
one scale block of columns at a time, so each block's amax is one reduction.

* `swiglu_fp8`: from gate_up rows [R, 2I] (bf16): h [R, I] = silu(gate) * up (bf16, for the along-tokens copy),
  h quantized along I (the down GEMM's A), and the gate/up pre-activations quantized along 2I into packed rows
  (what backward keeps).
* `swiglu_backward_fp8`: from the down dgrad d_h_raw [R, I] (bf16) and the kept gate/up pre-activations
  (dequantized here): d_gate_up [R, 2I] (bf16, for the along-tokens copy), d_gate_up quantized along 2I (the
  gate/up dgrad's A), and d_rw_rows[r] = <d_h_raw[r], h[r]> (fp32), the program walking a row block's columns in
  order (a fixed summation order: deterministic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..schedule import Schedule, packed_index
from ..values import QuantizedTensor
from . import common, quantize, swiglu as swiglu_math

BLOCK_ROWS = 16  # rows a program (a [16, 128] tile, 4 warps): the fastest of a sweep on the H200 (reports)


@triton.jit
def _store_quantized(values, data_ptr, scale_ptr, rows, cols, block, row_ok, row_len, num_blocks,
                     SCALE_BLOCK: tl.constexpr, FP32_SCALE: tl.constexpr, EXACT_ROUND: tl.constexpr):
    """values [BLOCK_R, SCALE_BLOCK] (bf16) quantized as one 1 x SCALE_BLOCK block a row, stored at data[rows, cols]
    ([*, row_len] bytes) and scale[rows, block] ([*, num_blocks])."""
    _, byte, scale, _ = quantize.quantize_values(common.bf16_to_f32(values), 1, SCALE_BLOCK, FP32_SCALE,
                                                 EXACT_ROUND)
    rows64 = rows.to(tl.int64)
    tl.store(data_ptr + rows64[:, None] * row_len + cols[None, :], byte, mask=row_ok[:, None])
    tl.store(scale_ptr + rows64[:, None] * num_blocks + block, scale, mask=row_ok[:, None])


@triton.jit
def _forward_kernel(gate_up_ptr, h_ptr, packed_ptr, h_data_ptr, h_scale_ptr, kept_data_ptr, kept_scale_ptr,
                    num_rows, inter, swiglu_limit, HAS_LIMIT: tl.constexpr, BLOCK_R: tl.constexpr,
                    SCALE_BLOCK: tl.constexpr, FP32_SCALE: tl.constexpr, EXACT_ROUND: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    block = tl.program_id(1)
    cols = block * SCALE_BLOCK + tl.arange(0, SCALE_BLOCK)
    row_ok = rows < num_rows
    base = gate_up_ptr + rows.to(tl.int64)[:, None] * (2 * inter) + cols[None, :]
    gate = tl.load(base, mask=row_ok[:, None], other=0.0)
    up = tl.load(base + inter, mask=row_ok[:, None], other=0.0)
    h = common.to_dtype(swiglu_math.forward(gate, up, swiglu_limit, HAS_LIMIT), h_ptr.dtype.element_ty)
    tl.store(h_ptr + rows.to(tl.int64)[:, None] * inter + cols[None, :], h, mask=row_ok[:, None])
    num_blocks = inter // SCALE_BLOCK
    _store_quantized(h, h_data_ptr, h_scale_ptr, rows, cols, block, row_ok, inter, num_blocks, SCALE_BLOCK,
                     FP32_SCALE, EXACT_ROUND)
    # the kept pre-activations, in packed rows (padding rows hold no source and are not kept)
    packed = tl.load(packed_ptr + rows, mask=row_ok, other=-1)
    kept_ok = packed >= 0
    packed = tl.where(kept_ok, packed, 0)
    _store_quantized(gate, kept_data_ptr, kept_scale_ptr, packed, cols, block, kept_ok, 2 * inter, 2 * num_blocks,
                     SCALE_BLOCK, FP32_SCALE, EXACT_ROUND)
    _store_quantized(up, kept_data_ptr, kept_scale_ptr, packed, cols + inter, block + num_blocks, kept_ok,
                     2 * inter, 2 * num_blocks, SCALE_BLOCK, FP32_SCALE, EXACT_ROUND)


@triton.jit
def _dequantized(data_ptr, scale_ptr, packed, cols, num_blocks, mask, SCALE_BLOCK: tl.constexpr,
                 FP32_SCALE: tl.constexpr, row_len):
    value = tl.load(data_ptr + packed.to(tl.int64)[:, None] * row_len + cols[None, :], mask=mask, other=0.0)
    scale = tl.load(scale_ptr + packed.to(tl.int64)[:, None] * num_blocks + (cols // SCALE_BLOCK)[None, :],
                    mask=mask, other=0)
    if not FP32_SCALE:
        scale = tl.exp2(scale.to(tl.float32) - 127.0)
    return value.to(tl.float32) * scale


@triton.jit
def _backward_kernel(d_h_ptr, data_ptr, scale_ptr, packed_ptr, rw_ptr, d_gate_up_ptr, d_data_ptr, d_scale_ptr,
                     d_rw_ptr, num_rows, inter, swiglu_limit, SCALE_BLOCK: tl.constexpr, FP32_SCALE: tl.constexpr,
                     EXACT_ROUND: tl.constexpr, HAS_LIMIT: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_rows
    packed = tl.load(packed_ptr + rows, mask=row_ok, other=-1)
    rw = tl.load(rw_ptr + rows, mask=row_ok, other=0.0)
    has_source = packed >= 0
    packed = tl.where(has_source, packed, 0)
    num_blocks = inter // SCALE_BLOCK
    d_rw = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for block in range(0, num_blocks):
        cols = block * SCALE_BLOCK + tl.arange(0, SCALE_BLOCK)
        mask = row_ok[:, None]
        source_mask = (row_ok & has_source)[:, None]
        d_h_raw = tl.load(d_h_ptr + rows.to(tl.int64)[:, None] * inter + cols[None, :], mask=mask,
                          other=0.0).to(tl.float32)
        pre_gate = _dequantized(data_ptr, scale_ptr, packed, cols, 2 * num_blocks, source_mask, SCALE_BLOCK,
                                FP32_SCALE, 2 * inter)
        pre_up = _dequantized(data_ptr, scale_ptr, packed, cols + inter, 2 * num_blocks, source_mask, SCALE_BLOCK,
                              FP32_SCALE, 2 * inter)
        d_gate, d_up, _, d_rw_terms = swiglu_math.backward(d_h_raw, common.to_dtype(pre_gate, tl.bfloat16),
                                                           common.to_dtype(pre_up, tl.bfloat16), rw, swiglu_limit,
                                                           HAS_LIMIT)
        out = d_gate_up_ptr + rows.to(tl.int64)[:, None] * (2 * inter) + cols[None, :]
        tl.store(out, d_gate, mask=mask)
        tl.store(out + inter, d_up, mask=mask)
        _store_quantized(d_gate, d_data_ptr, d_scale_ptr, rows, cols, block, row_ok, 2 * inter, 2 * num_blocks,
                         SCALE_BLOCK, FP32_SCALE, EXACT_ROUND)
        _store_quantized(d_up, d_data_ptr, d_scale_ptr, rows, cols + inter, block + num_blocks, row_ok, 2 * inter,
                         2 * num_blocks, SCALE_BLOCK, FP32_SCALE, EXACT_ROUND)
        d_rw += tl.sum(d_rw_terms, axis=1)
    tl.store(d_rw_ptr + rows, d_rw, mask=row_ok)


def _quantized_rows(num_rows: int, cols: int, block: int, fp32_scale: bool, device) -> QuantizedTensor:
    """An output buffer quantized along its rows: data E4M3 [num_rows, cols], scale [num_rows, cols / block]."""
    data, scale = quantize.empty_quantized((num_rows, cols), (num_rows, cols // block), fp32_scale, device)
    return QuantizedTensor(data, scale, (1, block), False)


def _check_blocks(inter: int, block: int) -> None:
    if inter % block:
        raise ValueError(f"swiglu_rows: I = {inter} must be a multiple of the scale block {block}")


def swiglu_fp8(gate_up_rows: torch.Tensor, schedule: Schedule, swiglu_limit: float | None, block: int,
               scale_format: str):
    """`serval.stages.swiglu_fp8` as one row pass: (h bf16 [R, I], h quantized along I, the gate/up
    pre-activations quantized along 2I in packed rows [num_packed, 2I]); I a multiple of `block`."""
    num_rows, inter = gate_up_rows.shape[0], gate_up_rows.shape[1] // 2
    _check_blocks(inter, block)
    fp32_scale = scale_format == "fp32"
    device = gate_up_rows.device
    h = common.empty((num_rows, inter), gate_up_rows.dtype, device)
    h_rows = _quantized_rows(num_rows, inter, block, fp32_scale, device)
    kept = _quantized_rows(schedule.num_packed, 2 * inter, block, fp32_scale, device)
    grid = (common.cdiv(num_rows, BLOCK_ROWS), inter // block)
    if grid[0] and grid[1]:
        _forward_kernel[grid](gate_up_rows.contiguous(), h, packed_index(schedule), h_rows.data.view(torch.uint8),
                              h_rows.scale, kept.data.view(torch.uint8), kept.scale, num_rows, inter,
                              float(swiglu_limit or 0.0), HAS_LIMIT=swiglu_limit is not None, BLOCK_R=BLOCK_ROWS,
                              SCALE_BLOCK=block, FP32_SCALE=fp32_scale, EXACT_ROUND=common.INTERPRET, num_warps=4)
    return h, h_rows, kept


def swiglu_backward_fp8(d_h_raw: torch.Tensor, gate_up: QuantizedTensor, schedule: Schedule,
                        row_router_weights: torch.Tensor, swiglu_limit: float | None):
    """`serval.stages.swiglu_backward_fp8` as one row pass: (d_gate_up bf16 [R, 2I], d_gate_up quantized along
    2I as the kept gate_up is, d_rw_rows fp32 [R])."""
    num_rows, inter = d_h_raw.shape
    block = gate_up.block[1]
    _check_blocks(inter, block)
    fp32_scale = gate_up.scale.dtype == torch.float32
    device = d_h_raw.device
    d_gate_up = common.empty((num_rows, 2 * inter), torch.bfloat16, device)
    d_gate_up_rows = _quantized_rows(num_rows, 2 * inter, block, fp32_scale, device)
    d_rw_rows = common.empty((num_rows,), torch.float32, device)
    if num_rows:
        _backward_kernel[(common.cdiv(num_rows, BLOCK_ROWS),)](
            d_h_raw, gate_up.data, gate_up.scale, packed_index(schedule), row_router_weights.float().contiguous(),
            d_gate_up, d_gate_up_rows.data.view(torch.uint8), d_gate_up_rows.scale, d_rw_rows, num_rows, inter,
            float(swiglu_limit or 0.0), SCALE_BLOCK=block, FP32_SCALE=fp32_scale, EXACT_ROUND=common.INTERPRET,
            HAS_LIMIT=swiglu_limit is not None, BLOCK_R=BLOCK_ROWS, num_warps=4)
    return d_gate_up, d_gate_up_rows, d_rw_rows
