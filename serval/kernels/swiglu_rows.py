"""The SwiGLU forward and backward as passes over the routed rows, for the block-scaled FP8 path
(`serval.precision`), whose GEMMs store plain bf16 rows (no SwiGLU epilogue). The math is `swiglu.py`'s, as in the
BF16 epilogues. What a pass computes is written only quantized, both ways a later GEMM reads it, with the bits of
`serval.ops.quantize`: along the row (1 x B blocks, B the scale block) for the next GEMM and along tokens (B x 1) for
the weight gradient. No bf16 copy of h or d_gate_up is written, and no quantization pass reads one.

A program owns one B x B tile (B rows of one block of columns) and walks it in chunks of CHUNK rows, so that few
values are live at once (a whole 128 x 128 tile of them spills registers): the first sweep computes each chunk,
stores it along the row (a row's block lies in the chunk) and keeps each column's amax; where the along-tokens copy
is wanted a second sweep loads the chunk again (from L2), recomputes it with the same instructions and stores it
along tokens with the column scales. Tiles past the used rows (`expert_offsets[E]`, read on the device) are
skipped, as the GEMMs skip them.

* `swiglu_fp8`: from gate_up rows [R, 2I] (bf16): h = silu(gate) * up (rounded to bf16, as the BF16 epilogue
  stores it) quantized along I (the down GEMM's A) and along tokens (the w_down gradient's, kept for backward),
  and the gate/up pre-activations quantized along 2I into packed rows (what backward keeps).
* `swiglu_backward_fp8`: from the down dgrad d_h_raw [R, I] (bf16) and the kept gate/up pre-activations
  (dequantized here): d_gate_up quantized along 2I (the gate/up dgrad's A) and along tokens (the w_gate / w_up
  gradients'), and d_rw_rows[r] = <d_h_raw[r], h[r]> (fp32) in the order every BF16 down dgrad sums it
  (`swiglu.d_rw_group_sums` per 16 columns, then `triton_gemm.sum_partials` in column order): deterministic, and
  independent of the tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..plan import SWIGLU_ROWS_WARPS, swiglu_rows_chunk
from ..schedule import Schedule, packed_index
from ..values import QuantizedTensor
from . import common, quantize, swiglu as swiglu_math
from .gemm_tile import new_d_rw_partial
from .triton_gemm import sum_partials


@triton.jit
def _h(gate_up_ptr, rows, cols, row_ok, inter, swiglu_limit, HAS_LIMIT: tl.constexpr):
    """(gate, up, h) of rows x cols: the stored pre-activations (bf16) and h rounded to bf16, in fp32."""
    base = gate_up_ptr + rows.to(tl.int64)[:, None] * (2 * inter) + cols[None, :]
    gate = tl.load(base, mask=row_ok[:, None], other=0.0)
    up = tl.load(base + inter, mask=row_ok[:, None], other=0.0)
    h = common.to_dtype(swiglu_math.forward(gate, up, swiglu_limit, HAS_LIMIT), tl.bfloat16)
    return common.bf16_to_f32(gate), common.bf16_to_f32(up), common.bf16_to_f32(h)


@triton.jit
def _forward_kernel(gate_up_ptr, used_rows_ptr, packed_ptr, h_data_ptr, h_scale_ptr, h_tokens_ptr,
                    h_tokens_scale_ptr, kept_data_ptr, kept_scale_ptr, num_rows, inter, swiglu_limit,
                    HAS_LIMIT: tl.constexpr, TOKENS: tl.constexpr, B: tl.constexpr, CHUNK: tl.constexpr,
                    FP32_SCALE: tl.constexpr, EXACT_ROUND: tl.constexpr):
    row_block = tl.program_id(0)
    block = tl.program_id(1)
    if row_block * B < tl.load(used_rows_ptr):
        cols = block * B + tl.arange(0, B)
        num_blocks = inter // B
        amax = tl.zeros((1, B), dtype=tl.int32)
        for chunk in range(0, B, CHUNK):
            rows = row_block * B + chunk + tl.arange(0, CHUNK)
            row_ok = rows < num_rows
            gate, up, h = _h(gate_up_ptr, rows, cols, row_ok, inter, swiglu_limit, HAS_LIMIT)
            quantize.store_row_blocks(h, rows, block, row_ok, h_data_ptr, h_scale_ptr, inter, FP32_SCALE,
                                      EXACT_ROUND)
            # the kept pre-activations, in packed rows (padding rows hold no source and are not kept)
            packed = tl.load(packed_ptr + rows, mask=row_ok, other=-1)
            kept_ok = packed >= 0
            packed = tl.where(kept_ok, packed, 0)
            quantize.store_row_blocks(gate, packed, block, kept_ok, kept_data_ptr, kept_scale_ptr, 2 * inter,
                                      FP32_SCALE, EXACT_ROUND)
            quantize.store_row_blocks(up, packed, block + num_blocks, kept_ok, kept_data_ptr, kept_scale_ptr,
                                      2 * inter, FP32_SCALE, EXACT_ROUND)
            amax = tl.maximum(amax, tl.max(quantize.abs_bits(h), axis=0, keep_dims=True))
        if TOKENS:  # h along tokens: the chunks again, h recomputed with the same instructions
            for chunk in range(0, B, CHUNK):
                rows = row_block * B + chunk + tl.arange(0, CHUNK)
                row_ok = rows < num_rows
                _, _, h = _h(gate_up_ptr, rows, cols, row_ok, inter, swiglu_limit, HAS_LIMIT)
                quantize.store_token_blocks(h, amax, rows, row_block, block, row_ok, h_tokens_ptr,
                                            h_tokens_scale_ptr, num_rows, inter, FP32_SCALE, EXACT_ROUND)


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
def _d_gate_up(d_h_ptr, data_ptr, scale_ptr, packed_ptr, rw_ptr, rows, cols, row_ok, inter, swiglu_limit,
               HAS_LIMIT: tl.constexpr, B: tl.constexpr, FP32_SCALE: tl.constexpr):
    """(d_gate, d_up) of rows x cols (rounded to bf16, in fp32) and the d_rw terms, from the down dgrad's rows and
    the kept pre-activations (packed rows, dequantized)."""
    packed = tl.load(packed_ptr + rows, mask=row_ok, other=-1)
    rw = tl.load(rw_ptr + rows, mask=row_ok, other=0.0)
    source_mask = (row_ok & (packed >= 0))[:, None]
    packed = tl.where(packed >= 0, packed, 0)
    num_blocks = inter // B
    d_h_raw = tl.load(d_h_ptr + rows.to(tl.int64)[:, None] * inter + cols[None, :], mask=row_ok[:, None],
                      other=0.0).to(tl.float32)
    pre_gate = _dequantized(data_ptr, scale_ptr, packed, cols, 2 * num_blocks, source_mask, B, FP32_SCALE, 2 * inter)
    pre_up = _dequantized(data_ptr, scale_ptr, packed, cols + inter, 2 * num_blocks, source_mask, B, FP32_SCALE,
                          2 * inter)
    d_gate, d_up, _, d_rw_terms = swiglu_math.backward(d_h_raw, common.to_dtype(pre_gate, tl.bfloat16),
                                                       common.to_dtype(pre_up, tl.bfloat16), rw, swiglu_limit,
                                                       HAS_LIMIT)
    return common.bf16_to_f32(d_gate), common.bf16_to_f32(d_up), d_rw_terms


@triton.jit
def _backward_kernel(d_h_ptr, used_rows_ptr, data_ptr, scale_ptr, packed_ptr, rw_ptr, d_data_ptr, d_scale_ptr,
                     d_tokens_ptr, d_tokens_scale_ptr, d_rw_partial_ptr, num_rows, inter, swiglu_limit,
                     HAS_LIMIT: tl.constexpr, TOKENS: tl.constexpr, B: tl.constexpr, CHUNK: tl.constexpr,
                     FP32_SCALE: tl.constexpr, EXACT_ROUND: tl.constexpr):
    row_block = tl.program_id(0)
    block = tl.program_id(1)
    if row_block * B < tl.load(used_rows_ptr):
        cols = block * B + tl.arange(0, B)
        num_blocks = inter // B
        GROUPS: tl.constexpr = B // swiglu_math.D_RW_COLUMNS
        groups = block * GROUPS + tl.arange(0, GROUPS)
        amax_gate = tl.zeros((1, B), dtype=tl.int32)
        amax_up = tl.zeros((1, B), dtype=tl.int32)
        for chunk in range(0, B, CHUNK):
            rows = row_block * B + chunk + tl.arange(0, CHUNK)
            row_ok = rows < num_rows
            d_gate, d_up, d_rw_terms = _d_gate_up(d_h_ptr, data_ptr, scale_ptr, packed_ptr, rw_ptr, rows, cols,
                                                  row_ok, inter, swiglu_limit, HAS_LIMIT, B, FP32_SCALE)
            tl.store(d_rw_partial_ptr + rows.to(tl.int64)[:, None] * (inter // swiglu_math.D_RW_COLUMNS)
                     + groups[None, :], swiglu_math.d_rw_group_sums(d_rw_terms), mask=row_ok[:, None])
            quantize.store_row_blocks(d_gate, rows, block, row_ok, d_data_ptr, d_scale_ptr, 2 * inter, FP32_SCALE,
                                      EXACT_ROUND)
            quantize.store_row_blocks(d_up, rows, block + num_blocks, row_ok, d_data_ptr, d_scale_ptr, 2 * inter,
                                      FP32_SCALE, EXACT_ROUND)
            amax_gate = tl.maximum(amax_gate, tl.max(quantize.abs_bits(d_gate), axis=0, keep_dims=True))
            amax_up = tl.maximum(amax_up, tl.max(quantize.abs_bits(d_up), axis=0, keep_dims=True))
        if TOKENS:  # d_gate_up along tokens: the chunks again, recomputed with the same instructions
            for chunk in range(0, B, CHUNK):
                rows = row_block * B + chunk + tl.arange(0, CHUNK)
                row_ok = rows < num_rows
                d_gate, d_up, _ = _d_gate_up(d_h_ptr, data_ptr, scale_ptr, packed_ptr, rw_ptr, rows, cols, row_ok,
                                             inter, swiglu_limit, HAS_LIMIT, B, FP32_SCALE)
                quantize.store_token_blocks(d_gate, amax_gate, rows, row_block, block, row_ok, d_tokens_ptr,
                                            d_tokens_scale_ptr, num_rows, 2 * inter, FP32_SCALE, EXACT_ROUND)
                quantize.store_token_blocks(d_up, amax_up, rows, row_block, block + num_blocks, row_ok,
                                            d_tokens_ptr, d_tokens_scale_ptr, num_rows, 2 * inter, FP32_SCALE,
                                            EXACT_ROUND)


def _quantized_rows(num_rows: int, cols: int, block: int, fp32_scale: bool, device) -> QuantizedTensor:
    """An output buffer quantized along its rows: data E4M3 [num_rows, cols], scale [num_rows, cols / block]."""
    data, scale = quantize.empty_quantized((num_rows, cols), (num_rows, cols // block), fp32_scale, device)
    return QuantizedTensor(data, scale, (1, block), False)


def _quantized_tokens(num_rows: int, cols: int, block: int, fp32_scale: bool, device) -> QuantizedTensor:
    """An output buffer quantized along tokens, stored transposed: data E4M3 [cols, num_rows], scale [cols,
    cdiv(num_rows, block)] (as `serval.ops.quantize` with block (block, 1) and transpose)."""
    data, scale = quantize.empty_quantized((cols, num_rows), (cols, common.cdiv(num_rows, block)), fp32_scale,
                                           device)
    return QuantizedTensor(data, scale, (block, 1), True)


def _check_blocks(inter: int, block: int) -> None:
    if inter % block or block % 16:
        raise ValueError(f"swiglu_rows: I = {inter} must be a multiple of the scale block {block} (itself a multiple "
                         f"of 16)")


def swiglu_fp8(gate_up_rows: torch.Tensor, schedule: Schedule, swiglu_limit: float | None, block: int,
               scale_format: str, tokens: bool = True):
    """`serval.stages.swiglu_fp8` as one pass: (h quantized along I, h quantized along tokens (None unless
    `tokens`), the gate/up pre-activations quantized along 2I in packed rows [num_packed, 2I]); I a multiple of
    `block`. Rows past the used tiles are left unwritten."""
    num_rows, inter = gate_up_rows.shape[0], gate_up_rows.shape[1] // 2
    _check_blocks(inter, block)
    fp32_scale = scale_format == "fp32"
    device = gate_up_rows.device
    h_rows = _quantized_rows(num_rows, inter, block, fp32_scale, device)
    h_tokens = _quantized_tokens(num_rows, inter, block, fp32_scale, device) if tokens else None
    kept = _quantized_rows(schedule.num_packed, 2 * inter, block, fp32_scale, device)
    grid = (common.cdiv(num_rows, block), inter // block)
    if grid[0] and grid[1]:
        out_tokens = h_tokens if tokens else h_rows
        _forward_kernel[grid](gate_up_rows.contiguous(), schedule.expert_offsets[schedule.num_experts:],
                              packed_index(schedule), h_rows.data.view(torch.uint8), h_rows.scale,
                              out_tokens.data.view(torch.uint8), out_tokens.scale, kept.data.view(torch.uint8),
                              kept.scale, num_rows, inter, float(swiglu_limit or 0.0),
                              HAS_LIMIT=swiglu_limit is not None, TOKENS=tokens, B=block,
                              CHUNK=swiglu_rows_chunk(block, common.INTERPRET), FP32_SCALE=fp32_scale,
                              EXACT_ROUND=common.INTERPRET, num_warps=SWIGLU_ROWS_WARPS)
    return h_rows, h_tokens, kept


def swiglu_backward_fp8(d_h_raw: torch.Tensor, gate_up: QuantizedTensor, schedule: Schedule,
                        row_router_weights: torch.Tensor, swiglu_limit: float | None, tokens: bool = True):
    """`serval.stages.swiglu_backward_fp8` as one pass: (d_gate_up quantized along 2I as the kept gate_up is,
    d_gate_up quantized along tokens (None unless `tokens`), d_rw_rows fp32 [R], 0 past the used tiles)."""
    num_rows, inter = d_h_raw.shape
    block = gate_up.block[1]
    _check_blocks(inter, block)
    fp32_scale = gate_up.scale.dtype == torch.float32
    device = d_h_raw.device
    d_rows = _quantized_rows(num_rows, 2 * inter, block, fp32_scale, device)
    d_tokens = _quantized_tokens(num_rows, 2 * inter, block, fp32_scale, device) if tokens else None
    d_rw_partial = new_d_rw_partial(num_rows, inter, device)
    grid = (common.cdiv(num_rows, block), inter // block)
    if grid[0] and grid[1]:
        out_tokens = d_tokens if tokens else d_rows
        _backward_kernel[grid](
            d_h_raw.contiguous(), schedule.expert_offsets[schedule.num_experts:], gate_up.data, gate_up.scale,
            packed_index(schedule), row_router_weights.float().contiguous(), d_rows.data.view(torch.uint8),
            d_rows.scale, out_tokens.data.view(torch.uint8), out_tokens.scale, d_rw_partial, num_rows, inter,
            float(swiglu_limit or 0.0), HAS_LIMIT=swiglu_limit is not None, TOKENS=tokens, B=block,
            CHUNK=swiglu_rows_chunk(block, common.INTERPRET), FP32_SCALE=fp32_scale, EXACT_ROUND=common.INTERPRET,
            num_warps=SWIGLU_ROWS_WARPS)
    return d_rows, d_tokens, sum_partials(d_rw_partial, schedule)
