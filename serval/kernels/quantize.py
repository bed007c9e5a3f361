"""FP8 block quantization and its inverse (`serval.ops.quantize` / `dequantize` on CUDA tensors): two
memory-bound Triton kernels.

Each program takes one 2-D tile of one source matrix (the batch index E is grid axis 1) whose extent along a
blocked dimension equals the block size, so every block lies whole in one tile and its amax is one reduction
(no reshapes): (1, B) blocks use tiles [TR, B], (B, 1) tiles [B, TC], (B, B) tiles [B, B]. Constexpr variants:
block shape, scale format (E8M0 byte or fp32), transposed store (the tile is `tl.trans`-ed in registers so
that both the load and the store run along contiguous rows), a per-row scale, and the dequantized output (also
alone: a round trip that stores no quantized copy, `serval.ops.round_trip`).

The numerics are the rule in `serval.ops` (its docstring), done with explicit bit arithmetic wherever a cast
would round differently under the interpreter than on the GPU, so that the interpreter tests check the code
the GPU runs: amax is an integer max over |bits| (NaN-safe: a NaN's bits exceed Inf's), the E8M0 exponent
comes from amax's exponent and mantissa fields, bf16 rounding is the integer RNE trick. Two steps are cheaper
than their textbook form, because the kernel is bound by its instructions, not by memory, at 2 TB/s:
- x / scale (fp32 scales): one correctly rounded reciprocal per block and two fmas per element
  (`_div_by_block_scale`), the IEEE quotient without a division per element.
- e4m3 rounding: on the GPU the hardware conversion (cvt.rn.satfinite, exact round-to-nearest-even);
  under the interpreter, whose cast misrounds ties, the magic-number add (`_round_e4m3`) first
  (constexpr EXACT_ROUND); the GPU tests check the two against the same reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..plan import quantize_tiles
from . import common

_EXACT_ROUND: tl.constexpr = tl.constexpr(common.INTERPRET)  # `quantize_values`' EXACT_ROUND in jitted callers


@triton.jit
def _round_e4m3(q):
    """fp32 -> the nearest e4m3 value (RNE, subnormals included, saturated to +-448), still in fp32.
    Explicit rounding, not `.to(tl.float8e4nv)` alone: the interpreter's cast misrounds ties (and worse);
    the GPU's cvt.rn.satfinite would agree, but one code path keeps the interpreter tests meaningful.
    |q| + M - M with M = 1.5 * 2^(e + 20) rounds |q| (exponent e >= -6, the subnormal step 2^-9 below) to a
    multiple of 2^(e - 3) by IEEE round-to-nearest-even; the sign is put back afterwards (keeps -0)."""
    a = tl.minimum(tl.abs(q), 448.0)
    biased = tl.maximum(a.to(tl.int32, bitcast=True) >> 23, 121)  # 121: 2^-6, the smallest normal
    magic = (((biased + 20) << 23) | 0x400000).to(tl.float32, bitcast=True)
    r = (a + magic) - magic
    sign = q.to(tl.int32, bitcast=True) & (-2147483647 - 1)
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _div_by_block_scale(x, scale, recip):
    """x / scale for the e4m3 rounding, given recip = 1 / scale correctly rounded (one per block): q0 = x * recip
    is within an ulp of the quotient, the fma residual x - q0 * scale is exact, and one correction step rounds
    to the IEEE quotient (Markstein's theorem). That holds while nothing underflows; where the residual or the
    quotient does, the quotient is below 2^-10 and rounds to zero in e4m3 either way (no overflow: |q| <= 448).
    Taken on |x| with the sign put back, so -0 stays -0. Checked exhaustively on the GPU (tests/test_ops.py)."""
    a = tl.abs(x)
    q0 = a * recip
    q = tl.fma(-q0, scale, a)
    q = tl.fma(q, recip, q0)
    sign = x.to(tl.int32, bitcast=True) & (-2147483647 - 1)
    return (q.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def quantize_values(x, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, FP32_SCALE: tl.constexpr,
                    EXACT_ROUND: tl.constexpr):
    """`serval.ops`' rule, steps 2-5, on a tile x (fp32, already the bf16-rounded values) whose extent along a
    blocked dim equals the block: (e4m3 values, their bytes uint8, the stored scales, blocks with NaN / Inf).
    The scales are [TILE_R, 1] for (1, B) blocks, [1, TILE_C] for (B, 1), [1, 1] for (B, B); fp32, or the E8M0
    byte. Every kernel that quantizes (this module's, the SwiGLU row passes) calls it: one rule, one code."""
    # amax as an integer max over |bits|: exact, and NaN (bits above Inf's) cannot be dropped by the max
    abs_bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    if BLOCK_R == 1:
        amax_bits = tl.max(abs_bits, axis=1, keep_dims=True)  # [TILE_R, 1]
    elif BLOCK_C == 1:
        amax_bits = tl.max(abs_bits, axis=0, keep_dims=True)  # [1, TILE_C]
    else:
        amax_bits = tl.max(tl.max(abs_bits, axis=1, keep_dims=True), axis=0, keep_dims=True)  # [1, 1]
    bad = amax_bits >= 0x7F800000  # a NaN or Inf in the block

    if FP32_SCALE:
        amax = amax_bits.to(tl.float32, bitcast=True)
        scale = tl.math.div_rn(tl.maximum(amax, 1e-12), 448.0)
        q = _div_by_block_scale(x, scale, tl.math.div_rn(1.0, scale))  # bad blocks: written as NaN below
        scale = tl.where(bad, float("nan"), scale)
        stored_scale = scale
    else:
        # e = ceil(log2(amax / 448)) exactly: amax = m * 2^p, m in [0.5, 1) -> e = p - 9 + (m > 0.875);
        # from the fields: p = biased - 126, m > 0.875 <=> mantissa field > 0x600000. Zero and tiny -> -127.
        biased = amax_bits >> 23
        exp = tl.maximum(biased - 135 + ((amax_bits & 0x7FFFFF) > 0x600000).to(tl.int32), -127)
        exp = tl.where(bad, 0, exp)  # any finite value: the block is written as NaN below
        q = x * ((127 - exp) << 23).to(tl.float32, bitcast=True)  # 2^-exp, exact (exp <= 120)
        stored_scale = tl.where(bad, 255, exp + 127).to(tl.uint8)
    if EXACT_ROUND:
        e4m3 = _round_e4m3(q).to(tl.float8e4nv)  # exact: the value is already an e4m3 one
    else:
        e4m3 = q.to(tl.float8e4nv)  # cvt.rn.satfinite
    byte = tl.where(bad, 0x7F, e4m3.to(tl.uint8, bitcast=True).to(tl.int32)).to(tl.uint8)

    return e4m3, byte, stored_scale, bad


@triton.jit
def dequantized_values(e4m3, stored_scale, bad, FP32_SCALE: tl.constexpr):
    """The values `quantize_values`' outputs stand for: fp32 (fp32 scales) or bf16 (E8M0), NaN in bad blocks."""
    r = e4m3.to(tl.float32)
    if FP32_SCALE:
        deq = r * stored_scale
    else:
        # 2^exp (exp = -127: the subnormal 2^-127, bits 0x400000); r * 2^exp is exact in fp32, rounded once to bf16
        exp = stored_scale.to(tl.int32) - 127
        pow2 = tl.where(exp > -127, (exp + 127) << 23, 0x400000).to(tl.float32, bitcast=True)
        deq = common.round_bf16(r * pow2)
    deq = tl.where(bad, float("nan"), deq)
    if not FP32_SCALE:
        deq = common.f32_to_bf16(deq)
    return deq


@triton.jit
def e8m0_round_trip(x, BLOCK: tl.constexpr):
    """A bf16 tile x [ROWS, COLS] quantized in (1, BLOCK) blocks with E8M0 scales and dequantized, bf16: the bits
    `quantize(t, (1, BLOCK), "e8m0", dequantized=True)` gives for these elements when the tile's first column is
    a block boundary, COLS a multiple of BLOCK, and x holds zeros past t's last column (what the quantizer's
    masked loads read). The mxfp8 GEMM epilogues (`triton_gemm._gemm_tile` QUANT_BLOCK) store it."""
    ROWS: tl.constexpr = x.shape[0]
    COLS: tl.constexpr = x.shape[1]
    if COLS == BLOCK:  # one block per row: no reshape (a reshape moves the tile through shared memory)
        e4m3, _, stored_scale, bad = quantize_values(common.bf16_to_f32(x), 1, BLOCK, False, _EXACT_ROUND)
        return dequantized_values(e4m3, stored_scale, bad, False)
    else:
        blocks = tl.reshape(common.bf16_to_f32(x), (ROWS * (COLS // BLOCK), BLOCK))
        e4m3, _, stored_scale, bad = quantize_values(blocks, 1, BLOCK, False, _EXACT_ROUND)
        return tl.reshape(dequantized_values(e4m3, stored_scale, bad, False), (ROWS, COLS))


@triton.jit
def _quantize_kernel(t_ptr, stride_te, stride_tr, stride_tc, row_scale_ptr, row_source_ptr, top_k,
                     data_ptr, stride_de, stride_dr, scale_ptr, stride_se, stride_sr, deq_ptr, R, C, n_scale_r,
                     n_scale_c, n_tiles_c,
                     BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, TILE_R: tl.constexpr, TILE_C: tl.constexpr,
                     FP32_SCALE: tl.constexpr, TRANSPOSE: tl.constexpr, HAS_ROW_SCALE: tl.constexpr,
                     ROUND_INPUT: tl.constexpr, DEQUANTIZED: tl.constexpr, STORE_QUANTIZED: tl.constexpr,
                     GATHER: tl.constexpr, EXACT_ROUND: tl.constexpr):
    # scales per tile along rows / columns: 1 along a blocked dim (tile == block), the tile extent along the other
    SR: tl.constexpr = TILE_R // BLOCK_R
    SC: tl.constexpr = TILE_C // BLOCK_C
    pid = tl.program_id(0)
    e = tl.program_id(1).to(tl.int64)
    tile_r = pid // n_tiles_c
    tile_c = pid % n_tiles_c
    rows = tile_r * TILE_R + tl.arange(0, TILE_R)
    cols = tile_c * TILE_C + tl.arange(0, TILE_C)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    if GATHER:  # row r is t[row_source[r] // top_k], zeros where row_source[r] < 0
        source = tl.load(row_source_ptr + rows, mask=rows < R, other=-1)
        token = tl.where(source >= 0, source // top_k, 0)
        x = tl.load(t_ptr + e * stride_te + token.to(tl.int64)[:, None] * stride_tr + cols[None, :] * stride_tc,
                    mask=mask & (source >= 0)[:, None], other=0.0)
    else:
        x = tl.load(t_ptr + e * stride_te + rows.to(tl.int64)[:, None] * stride_tr + cols[None, :] * stride_tc,
                    mask=mask, other=0.0)
    if x.dtype == tl.bfloat16:
        x = common.bf16_to_f32(x)
    else:
        x = x.to(tl.float32)
    if HAS_ROW_SCALE:
        x = x * tl.load(row_scale_ptr + rows, mask=rows < R, other=0.0)[:, None]
    if ROUND_INPUT:
        x = common.round_bf16(x)

    e4m3, byte, stored_scale, bad = quantize_values(x, BLOCK_R, BLOCK_C, FP32_SCALE, EXACT_ROUND)

    out_rows = tile_r * SR + tl.arange(0, SR)
    out_cols = tile_c * SC + tl.arange(0, SC)
    scale_mask = (out_rows < n_scale_r)[:, None] & (out_cols < n_scale_c)[None, :]
    if STORE_QUANTIZED and TRANSPOSE:
        # [TILE_C, TILE_R] in registers: rows of TILE_R bytes along R, as contiguous as the load's rows along C
        tl.store(data_ptr + e * stride_de + cols.to(tl.int64)[:, None] * stride_dr + rows[None, :], tl.trans(byte),
                 mask=(cols < C)[:, None] & (rows < R)[None, :])
        tl.store(scale_ptr + e * stride_se + out_cols[None, :] * stride_sr + out_rows[:, None],
                 stored_scale, mask=scale_mask)
    elif STORE_QUANTIZED:
        tl.store(data_ptr + e * stride_de + rows.to(tl.int64)[:, None] * stride_dr + cols[None, :], byte, mask=mask)
        tl.store(scale_ptr + e * stride_se + out_rows[:, None] * stride_sr + out_cols[None, :],
                 stored_scale, mask=scale_mask)

    if DEQUANTIZED:
        deq = dequantized_values(e4m3, stored_scale, bad, FP32_SCALE)
        tl.store(deq_ptr + e * R * C + rows.to(tl.int64)[:, None] * C + cols[None, :], deq, mask=mask)


@triton.jit
def _both_layouts_kernel(t_ptr, stride_te, stride_tr, data_ptr, stride_de, stride_dr, scale_ptr, stride_se,
                         stride_sr, data_t_ptr, stride_dte, stride_dtr, scale_t_ptr, stride_ste, stride_str, R, C,
                         n_tiles_c, B: tl.constexpr, FP32_SCALE: tl.constexpr, EXACT_ROUND: tl.constexpr):
    """One B x B block of t[e] (bf16) quantized once and stored both ways: data[e, rows, cols] / scale[e, rb, cb]
    and data_t[e, cols, rows] / scale_t[e, cb, rb] (`quantize_both_layouts`)."""
    row_block = tl.program_id(0) // n_tiles_c
    col_block = tl.program_id(0) % n_tiles_c
    e = tl.program_id(1).to(tl.int64)
    rows = row_block * B + tl.arange(0, B)
    cols = col_block * B + tl.arange(0, B)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    x = tl.load(t_ptr + e * stride_te + rows.to(tl.int64)[:, None] * stride_tr + cols[None, :], mask=mask,
                other=0.0)
    _, byte, scale, _ = quantize_values(common.bf16_to_f32(x), B, B, FP32_SCALE, EXACT_ROUND)
    tl.store(data_ptr + e * stride_de + rows.to(tl.int64)[:, None] * stride_dr + cols[None, :], byte, mask=mask)
    tl.store(data_t_ptr + e * stride_dte + cols.to(tl.int64)[:, None] * stride_dtr + rows[None, :], tl.trans(byte),
             mask=(cols < C)[:, None] & (rows < R)[None, :])
    tl.store(scale_ptr + e * stride_se + row_block * stride_sr + col_block + tl.zeros_like(scale).to(tl.int64), scale)
    tl.store(scale_t_ptr + e * stride_ste + col_block * stride_str + row_block + tl.zeros_like(scale).to(tl.int64),
             scale)


def quantize_both_layouts(t: torch.Tensor, block: int, fp32_scale: bool, out, out_t) -> None:
    """t [E, R, C] bf16 quantized in block x block blocks, each read once and written both ways: into out =
    (data [E, R, C], scale [E, nR, nC]) and out_t = (data [E, C, R], scale [E, nC, nR]) (last dims contiguous;
    checked by `serval.ops.quantize_both_layouts`)."""
    num_e, R, C = t.shape
    n_tiles_r, n_tiles_c = common.cdiv(R, block), common.cdiv(C, block)
    (data, scale), (data_t, scale_t) = out, out_t
    if n_tiles_r and n_tiles_c and num_e:
        _both_layouts_kernel[(n_tiles_r * n_tiles_c, num_e)](
            t, t.stride(0), t.stride(1), data.view(torch.uint8), data.stride(0), data.stride(1), scale,
            scale.stride(0), scale.stride(1), data_t.view(torch.uint8), data_t.stride(0), data_t.stride(1), scale_t,
            scale_t.stride(0), scale_t.stride(1), R, C, n_tiles_c, B=block, FP32_SCALE=fp32_scale,
            EXACT_ROUND=common.INTERPRET, num_warps=quantize_tiles((block, block))[2])


def empty_quantized(data_shape, scale_shape, fp32_scale: bool, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Output buffers (`common.empty`) of a quantization: E4M3 data, and fp32 or E8M0 (uint8) scales."""
    if fp32_scale:
        scale = common.empty(scale_shape, torch.float32, device)
    else:
        scale = common.empty(scale_shape, torch.int8, device).view(torch.uint8)  # int8: poison -1 = 0xFF
    return common.empty(data_shape, torch.float8_e4m3fn, device), scale


def quantize(t: torch.Tensor, block: tuple[int, int], fp32_scale: bool, transpose: bool,
             row_scale: torch.Tensor | None, dequantized: bool, out=None, rows_of=None, quantized: bool = True):
    """The kernel on t [E, R, C] (any strides): (data float8_e4m3fn, scale uint8 or fp32, dequantized or None),
    data/scale [E, C, R] / [E, nC, nR] when transpose, else [E, R, C] / [E, nR, nC]; written into `out`'s
    (data, scale) views when given (last dims contiguous). rows_of = (row_source [R'], top_k): the rows
    t[row_source // top_k] (zeros where -1) in place of t's, R' of them. quantized False (with dequantized): the
    dequantized values only, data and scale None and never stored (`serval.ops.round_trip`). Arguments are checked
    by `serval.ops.quantize`."""
    num_e, R, C = t.shape
    if rows_of is not None:
        R = rows_of[0].shape[0]
    br, bc = block
    n_r, n_c = common.cdiv(R, br), common.cdiv(C, bc)
    device = t.device
    if out is not None:
        data, scale = out
    elif quantized:
        data, scale = empty_quantized((num_e, C, R) if transpose else (num_e, R, C),
                                      (num_e, n_c, n_r) if transpose else (num_e, n_r, n_c), fp32_scale, device)
    else:
        data, scale = None, None
    deq = common.empty((num_e, R, C), torch.float32 if fp32_scale else torch.bfloat16, device) if dequantized else None
    tile_r, tile_c, num_warps = quantize_tiles(block)
    n_tiles_c = common.cdiv(C, tile_c)
    grid = (common.cdiv(R, tile_r) * n_tiles_c, num_e)
    if grid[0] and num_e:
        _quantize_kernel[grid](
            t, t.stride(0), t.stride(1), t.stride(2), row_scale.contiguous() if row_scale is not None else t,
            rows_of[0] if rows_of is not None else t, rows_of[1] if rows_of is not None else 1,
            data.view(torch.uint8) if quantized else None, data.stride(0) if quantized else 0,
            data.stride(1) if quantized else 0, scale, scale.stride(0) if quantized else 0,
            scale.stride(1) if quantized else 0, deq if deq is not None else data, R, C, n_r, n_c, n_tiles_c,
            BLOCK_R=br, BLOCK_C=bc, TILE_R=tile_r, TILE_C=tile_c,
            FP32_SCALE=fp32_scale, TRANSPOSE=transpose, HAS_ROW_SCALE=row_scale is not None,
            ROUND_INPUT=t.dtype != torch.bfloat16 or row_scale is not None, DEQUANTIZED=dequantized,
            STORE_QUANTIZED=quantized, GATHER=rows_of is not None, EXACT_ROUND=common.INTERPRET,
            num_warps=num_warps,
        )
    return data, scale, deq


@triton.jit
def _dequantize_kernel(data_ptr, scale_ptr, out_ptr, R, C, n_scale_r, n_scale_c, n_tiles_c,
                       BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, TILE_R: tl.constexpr, TILE_C: tl.constexpr,
                       FP32_SCALE: tl.constexpr, OUT_BF16: tl.constexpr):
    """out = data * scale over one [TILE_R, TILE_C] tile of one batch entry (grid axis 1), in the stored
    orientation; the fp32 product, then (bf16 out) one round-to-nearest-even by bits."""
    pid = tl.program_id(0)
    e = tl.program_id(1).to(tl.int64)
    rows = (pid // n_tiles_c) * TILE_R + tl.arange(0, TILE_R)
    cols = (pid % n_tiles_c) * TILE_C + tl.arange(0, TILE_C)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    offsets = rows.to(tl.int64)[:, None] * C + cols[None, :]
    value = tl.load(data_ptr + e * R * C + offsets, mask=mask, other=0.0).to(tl.float32)
    scale_offsets = (rows // BLOCK_R)[:, None] * n_scale_c + (cols // BLOCK_C)[None, :]
    scale = tl.load(scale_ptr + e * n_scale_r * n_scale_c + scale_offsets, mask=mask, other=0)
    if not FP32_SCALE:  # 2^(byte - 127): byte 0 the subnormal 2^-127, 0xFF NaN
        byte = scale.to(tl.int32)
        bits = tl.where(byte == 0, 0x400000, byte << 23)
        scale = tl.where(byte == 255, float("nan"), bits.to(tl.float32, bitcast=True))
    out = value * scale
    if OUT_BF16:
        out = common.f32_to_bf16(common.round_bf16(out))
    tl.store(out_ptr + e * R * C + offsets, out, mask=mask)


def dequantize(data: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """The kernel on data [E, R, C] float8_e4m3fn and scale [E, ceil(R / block[0]), ceil(C / block[1])] (uint8
    E8M0 or fp32), both contiguous, block in the stored orientation: out [E, R, C] of dtype (bf16 or fp32).
    Arguments are checked by `serval.ops.dequantize`."""
    num_e, R, C = data.shape
    out = common.empty((num_e, R, C), dtype, data.device)
    tile_r, tile_c = 32, 256
    n_tiles_c = common.cdiv(C, tile_c)
    grid = (common.cdiv(R, tile_r) * n_tiles_c, num_e)
    if grid[0] and num_e:
        _dequantize_kernel[grid](data, scale, out, R, C,
                                 scale.shape[1], scale.shape[2], n_tiles_c, BLOCK_R=block[0], BLOCK_C=block[1],
                                 TILE_R=tile_r, TILE_C=tile_c, FP32_SCALE=scale.dtype == torch.float32,
                                 OUT_BF16=dtype == torch.bfloat16, num_warps=8)
    return out
