"""Standalone tensor ops: FP8 block quantization (`quantize`, and `mxfp8_quantize` of the contract), its
inverse (`dequantize`), and the two in one pass that keeps no quantized copy (`round_trip`).

Two formats, E4M3 elements (`torch.float8_e4m3fn`, largest normal 448) with one scale per block:
  * "e8m0": MXFP8 (OCP Microscaling): the scale is a power of two, stored as a biased exponent byte,
    2^(byte - 127).
  * "fp32": block-scaled FP8 as in DeepSeek-V3 / DeepGEMM: the scale is an fp32 number.
Blocks (source rows x source columns of the last two dims): (1, B) along the last dim, (B, 1) along the
second-to-last ("along tokens"), (B, B) 2-D (weights); B is 32 or 128.

The rule, bit for bit the same in the torch reference (`quantize(..., backend="torch")`, the CPU path) and
the Triton kernel (`serval.kernels.quantize`, the CUDA path):
  1. v = t rounded to bf16, round-to-nearest-even (with row_scale: v = bf16(fp32(t) * row_scale[:, None]),
     one fp32 product rounded once). Everything below is in fp32.
  2. amax = max |v| over the block. Edge blocks that are partial (R or C not a multiple of the block) take
     the max over the elements they have.
  3. e8m0: e = ceil(log2(amax / 448)), computed exactly (no division: amax = m * 2^p with m in [0.5, 1)
     gives e = p - 9 + (m > 0.875)), clamped to [-127, 127]; amax == 0 gives e = -127 (a zero block has
     a finite scale). The byte is e + 127 and q = v * 2^-e (exact). The block maximum lands in (224, 448]
     (below only where the clamp at -127 bites).
     fp32: s = max(amax, 1e-12) / 448 and q = v / s, both IEEE fp32 divisions rounded to nearest.
  4. data = q rounded to E4M3, round-to-nearest-even (E4M3 subnormals, steps of 2^-9, included),
     saturated to +-448.
  5. NaN or Inf: a block with a NaN or Inf in v (t's own, or a bf16 / row_scale product overflowing) gets
     a NaN scale (fp32) or byte 0xFF (e8m0, the E8M0 NaN), every element NaN (0x7F), and NaN dequantized
     values: NaN propagates, no host sync. `check_finite=True` instead raises a ValueError naming the
     argument (`t`, `row_scale`) when one holds a NaN or Inf, or when the bf16 rounding / row_scale
     product overflows; it synchronises with the host (a debug mode).
dequantize: data * scale (e8m0: 2^(byte - 127)), each scale expanded over its block: the IEEE fp32
product (exact for e8m0), then cast to the requested dtype.
"""

from __future__ import annotations

import torch

from .values import QuantizedTensor

E4M3_MAX = 448.0
BLOCKS = ((1, 32), (32, 1), (32, 32), (1, 128), (128, 1), (128, 128))
SCALE_FORMATS = ("e8m0", "fp32")
BACKENDS = ("auto", "torch", "triton")
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def quantize(t: torch.Tensor, *, block=(1, 32), scale_format: str = "e8m0", transpose: bool = False,
             row_scale: torch.Tensor | None = None, dequantized: bool = False, check_finite: bool = False,
             backend: str = "auto", out: tuple[torch.Tensor, torch.Tensor] | None = None,
             rows_of: tuple[torch.Tensor, int] | None = None) -> tuple[QuantizedTensor, torch.Tensor | None]:
    """Quantize t [R, C] or [E, R, C] (bf16, fp16 or fp32, any strides) to FP8 with one scale per block.

    Returns (QuantizedTensor, dequantized): dequantized (with `dequantized=True`, else None) holds the
    quantized values in t's orientation (never transposed), bf16 for "e8m0" (exact) and fp32 for "fp32",
    computed in the same pass. transpose=True stores data and scale with t's last two dims swapped
    (`quantize(t, block=(128, 1), transpose=True)`: data [C, R] with rows 128-blocked along R, the
    K-contiguous copy of a GEMM operand). row_scale: fp32 [R], 2-D t only (the rule's step 1).
    backend: "auto" runs the Triton kernel on CUDA tensors and the torch reference on CPU ones; "torch"
    the reference anywhere; "triton" the kernel (CUDA tensors, or CPU ones under TRITON_INTERPRET=1).
    out: (data, scale) tensors of the result's shapes and dtypes (views allowed, last dim contiguous) to write
    into, e.g. two halves of one buffer, so that joining quantized tensors costs no copy.
    rows_of: (row_source [R'] int, top_k), 2-D t only: quantize the R' rows t[row_source // top_k] (zeros where
    row_source is -1; the schedule's routed rows of tokens t) without making them first; row_scale is then [R'].
    The rule, NaN handling and check_finite: the module docstring.
    """
    return _quantize(t, block, scale_format, transpose, row_scale, dequantized, check_finite, backend, out, rows_of,
                     quantized=True)


def round_trip(t: torch.Tensor, *, block=(1, 32), scale_format: str = "e8m0", row_scale: torch.Tensor | None = None,
               backend: str = "auto", rows_of: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """`quantize(t, ..., dequantized=True)`'s dequantized values, bit for bit, without the quantized copy: no E4M3
    data or scales are stored (the kernel) or kept (the reference). What GEMMs that run in bf16 on quantized
    operands read (mxfp8 on Hopper, `serval.precision`); arguments as `quantize`'s."""
    return _quantize(t, block, scale_format, False, row_scale, True, False, backend, None, rows_of,
                     quantized=False)[1]


def _quantize(t, block, scale_format, transpose, row_scale, dequantized, check_finite, backend, out, rows_of,
              quantized: bool):
    """`quantize`, and with quantized False `round_trip` ((None, dequantized))."""
    if rows_of is not None:
        row_source, top_k = rows_of
        if (not isinstance(t, torch.Tensor) or t.dim() != 2 or not isinstance(row_source, torch.Tensor)
                or row_source.dim() != 1 or row_source.dtype not in (torch.int32, torch.int64)
                or row_source.device != t.device or not isinstance(top_k, int) or top_k < 1):
            raise ValueError("quantize: rows_of must be (row_source: a 1-D int tensor on t's device, top_k: an int "
                             ">= 1) with a 2-D t")
        if not (backend == "triton" or (backend == "auto" and t.is_cuda)):  # the reference: make the rows
            token = row_source.long().clamp(min=0) // top_k
            t = torch.where((row_source >= 0)[:, None], t[token], 0).to(t.dtype)
            rows_of = None
    rows = rows_of[0].shape[0] if rows_of is not None else (  # of the matrix quantized (t is checked next)
        t.shape[-2] if isinstance(t, torch.Tensor) and t.dim() >= 2 else 0)
    block = _check(t, block, scale_format, transpose, row_scale, backend, rows)
    if out is not None:
        _check_out(t, block, scale_format, transpose, out, rows)
    if check_finite:
        if not torch.isfinite(t).all():
            raise ValueError("quantize: t holds NaN or Inf (check_finite=True)")
        if row_scale is not None and not torch.isfinite(row_scale).all():
            raise ValueError("quantize: row_scale holds NaN or Inf (check_finite=True)")
    use_triton = backend == "triton" or (backend == "auto" and t.is_cuda)
    squeeze = t.dim() == 2
    t3 = t.unsqueeze(0) if squeeze else t
    out3 = None if out is None else tuple(o.unsqueeze(0) if squeeze else o for o in out)
    if use_triton:
        from .kernels.quantize import quantize as quantize_kernel

        data, scale, deq = quantize_kernel(t3, block, scale_format == "fp32", transpose, row_scale, dequantized,
                                           out3, rows_of, quantized)
    else:
        data, scale, deq = _quantize_torch(t3, block, scale_format, transpose, row_scale, dequantized)
        if out3 is not None:
            data, scale = out3[0].copy_(data), out3[1].copy_(scale)
    if squeeze:
        deq = deq[0] if deq is not None else None
    if not quantized:
        return None, deq
    if squeeze:
        data, scale = data[0], scale[0]
    if check_finite:
        bad = scale.isnan().any() if scale_format == "fp32" else (scale == 255).any()
        if bad:
            raise ValueError("quantize: t, rounded to bf16" + (" and scaled by row_scale" if row_scale is not None
                             else "") + ", overflows to Inf (check_finite=True)")
    return QuantizedTensor(data, scale, block, bool(transpose)), deq


def quantize_both_layouts(t: torch.Tensor, *, block=(128, 128), scale_format: str = "fp32", backend: str = "auto",
                          out: tuple[torch.Tensor, torch.Tensor] | None = None,
                          out_t: tuple[torch.Tensor, torch.Tensor] | None = None
                          ) -> tuple[QuantizedTensor, QuantizedTensor]:
    """t [R, C] or [E, R, C] (bf16) quantized in square blocks (B, B), each block read once and stored both ways:
    `quantize(t, block=block, scale_format=scale_format)` and the same with transpose=True, bit for bit (a square
    block has one scale in either orientation). The FP8 GEMMs read an expert weight both ways (forward: K = its
    last dim; dgrad: K = its middle one). out / out_t: (data, scale) to write each into, as `quantize`'s out."""
    block = _check(t, block, scale_format, False, None, backend, t.shape[-2] if isinstance(t, torch.Tensor)
                   and t.dim() >= 2 else 0)
    if block[0] != block[1] or t.dtype != torch.bfloat16:
        raise ValueError(f"quantize_both_layouts: needs square blocks and a bf16 t, got block {block}, {t.dtype}")
    rows = t.shape[-2]
    for o, transpose in ((out, False), (out_t, True)):
        if o is not None:
            _check_out(t, block, scale_format, transpose, o, rows)
    if not (backend == "triton" or (backend == "auto" and t.is_cuda)):
        q = quantize(t, block=block, scale_format=scale_format, backend="torch", out=out)[0]
        q_t = quantize(t, block=block, scale_format=scale_format, transpose=True, backend="torch", out=out_t)[0]
        return q, q_t
    from .kernels.quantize import empty_quantized, quantize_both_layouts as both_layouts_kernel

    squeeze = t.dim() == 2
    t3 = t.unsqueeze(0) if squeeze else t
    num_e, cols = t3.shape[0], t3.shape[2]
    n_r, n_c = -(-rows // block[0]), -(-cols // block[1])
    fp32_scale = scale_format == "fp32"
    outs = []
    layouts = ((out, ((num_e, rows, cols), (num_e, n_r, n_c))), (out_t, ((num_e, cols, rows), (num_e, n_c, n_r))))
    for o, shapes in layouts:
        outs.append(empty_quantized(*shapes, fp32_scale, t.device) if o is None else
                    tuple(x.unsqueeze(0) if squeeze else x for x in o))
    both_layouts_kernel(t3 if t3.stride(-1) == 1 else t3.contiguous(), block[0], fp32_scale, *outs)
    (data, scale), (data_t, scale_t) = ((x[0] if squeeze else x for x in o) for o in outs)
    return QuantizedTensor(data, scale, block, False), QuantizedTensor(data_t, scale_t, block, True)


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32, *, backend: str = "auto") -> torch.Tensor:
    """data * scale in the stored orientation (data's shape), each scale expanded over its block: the IEEE fp32
    product data.float() * scale (exact for e8m0), then cast to dtype (bf16: exact for e8m0 barring bf16
    subnormals, one round-to-nearest-even there). backend as `quantize`'s: "auto" runs the Triton kernel on
    CUDA tensors (bf16 or fp32 out, contiguous data and scale), the torch reference otherwise."""
    if backend not in BACKENDS:
        raise ValueError(f"dequantize: backend must be one of {BACKENDS}, got {backend!r}")
    br, bc = q.block[::-1] if q.transposed else q.block
    kernel_takes = (dtype in (torch.bfloat16, torch.float32) and q.data.dim() in (2, 3)
                    and q.data.is_contiguous() and q.scale.is_contiguous())
    if backend == "triton" or (backend == "auto" and q.data.is_cuda and kernel_takes):
        if not kernel_takes:
            raise ValueError("dequantize: backend='triton' takes 2-D or 3-D contiguous data and scale, bf16 or "
                             f"fp32 out; got data {tuple(q.data.shape)}, out {dtype}")
        from .kernels.quantize import dequantize as dequantize_kernel

        squeeze = q.data.dim() == 2
        data, scale = (q.data.unsqueeze(0), q.scale.unsqueeze(0)) if squeeze else (q.data, q.scale)
        out = dequantize_kernel(data, scale, (br, bc), dtype)
        return out[0] if squeeze else out
    *batch, rows, cols = q.data.shape
    n_r, n_c = q.scale.shape[-2:]
    if q.scale.dtype == torch.uint8:
        # 2^(byte - 127) from fp32 bits; byte 0 is the subnormal 2^-127, byte 0xFF the E8M0 NaN
        bits = torch.where(q.scale == 0, 0x400000, q.scale.to(torch.int32) << 23)
        scale = torch.where(q.scale == 255, float("nan"), bits.view(torch.float32))
    else:
        scale = q.scale.float()
    values = torch.nn.functional.pad(q.data.float(), (0, n_c * bc - cols, 0, n_r * br - rows))
    values = values.reshape(*batch, n_r, br, n_c, bc) * scale[..., :, None, :, None]
    return values.reshape(*batch, n_r * br, n_c * bc)[..., :rows, :cols].to(dtype)


def _check(t, block, scale_format, transpose, row_scale, backend, rows) -> tuple[int, int]:
    if not isinstance(t, torch.Tensor) or t.dim() not in (2, 3) or t.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"quantize: t must be a 2-D [R, C] or 3-D [E, R, C] bf16/fp16/fp32 tensor, got "
                         f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}"
                         f"{' ' + str(t.dtype) if isinstance(t, torch.Tensor) else ''}")
    try:
        block = tuple(int(b) for b in block)
    except (TypeError, ValueError):
        block = None
    if block not in BLOCKS:
        raise ValueError(f"quantize: block must be one of {BLOCKS} (rows, cols of t's last two dims), got {block}")
    if scale_format not in SCALE_FORMATS:
        raise ValueError(f"quantize: scale_format must be one of {SCALE_FORMATS}, got {scale_format!r}")
    if not isinstance(transpose, bool):
        raise ValueError(f"quantize: transpose must be a bool, got {transpose!r}")
    if backend not in BACKENDS:
        raise ValueError(f"quantize: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "triton" and not t.is_cuda:
        from .kernels.common import INTERPRET

        if not INTERPRET:
            raise ValueError(f"quantize: backend='triton' needs a CUDA tensor t (or TRITON_INTERPRET=1), got t on "
                             f"{t.device}")
    if row_scale is not None:
        if t.dim() != 2:
            raise ValueError(f"quantize: row_scale needs a 2-D t [R, C], got t of shape {tuple(t.shape)}")
        if (not isinstance(row_scale, torch.Tensor) or row_scale.dtype != torch.float32
                or row_scale.shape != (rows,) or row_scale.device != t.device):
            raise ValueError(f"quantize: row_scale must be an fp32 tensor of shape [R] = ({rows},) on "
                             f"{t.device}, got " + (f"{row_scale.dtype} {tuple(row_scale.shape)} on {row_scale.device}"
                                                    if isinstance(row_scale, torch.Tensor) else repr(row_scale)))
    return block


def _check_out(t, block, scale_format, transpose, out, rows) -> None:
    """ValueError unless `out` is (data, scale) of the shapes and dtypes quantize makes, last dims contiguous."""
    *batch, _, cols = t.shape
    n_r, n_c = -(-rows // block[0]), -(-cols // block[1])
    shapes = ((*batch, cols, rows), (*batch, n_c, n_r)) if transpose else ((*batch, rows, cols), (*batch, n_r, n_c))
    dtypes = (torch.float8_e4m3fn, torch.uint8 if scale_format == "e8m0" else torch.float32)
    ok = isinstance(out, (tuple, list)) and len(out) == 2 and all(
        isinstance(o, torch.Tensor) and tuple(o.shape) == shape and o.dtype == dtype and o.device == t.device
        and o.stride(-1) == 1 for o, shape, dtype in zip(out, shapes, dtypes))
    if not ok:
        raise ValueError(f"quantize: out must be (data, scale): {dtypes[0]} {shapes[0]} and {dtypes[1]} {shapes[1]} "
                         f"on {t.device}, last dims contiguous")


def _quantize_torch(t, block, scale_format, transpose, row_scale, dequantized):
    """The reference on t [E, R, C]: (data, scale, dequantized or None), as `serval.kernels.quantize.quantize`."""
    if row_scale is None:
        v = t.to(torch.bfloat16).float()
    else:
        v = (t.float() * row_scale[:, None]).to(torch.bfloat16).float()
    num_e, rows, cols = v.shape
    br, bc = block
    n_r, n_c = -(-rows // br), -(-cols // bc)
    # pad partial edge blocks with zeros (|0| never raises an amax) and view the blocks as dims 2 and 4
    blocks = torch.nn.functional.pad(v, (0, n_c * bc - cols, 0, n_r * br - rows)).reshape(num_e, n_r, br, n_c, bc)
    amax = blocks.abs().amax(dim=(2, 4))  # [E, nR, nC]; a NaN propagates
    bad = ~torch.isfinite(amax)
    if scale_format == "e8m0":
        mantissa, exponent = torch.frexp(amax)  # amax = m * 2^p, m in [0.5, 1)
        exp = exponent - 9 + (mantissa > 0.875).to(exponent.dtype)  # ceil(log2(amax / 448)), exactly
        exp = torch.where(amax > 0, exp, -127).clamp(-127, 127)
        inv_scale = ((127 - exp).to(torch.int32) << 23).view(torch.float32)  # 2^-exp (exp <= 120: normal)
        q = blocks * inv_scale[:, :, None, :, None]
        scale = torch.where(bad, 255, exp + 127).to(torch.uint8)
    else:
        # divided by a tensor: torch on CUDA turns a division by a Python scalar into a product with its
        # reciprocal, which is not the rule's IEEE division
        s = amax.clamp_min(1e-12) / torch.full_like(amax, E4M3_MAX)
        scale = torch.where(bad, float("nan"), s)
        q = blocks / scale[:, :, None, :, None]
    q = q.reshape(num_e, n_r * br, n_c * bc)[:, :rows, :cols]
    data = q.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    bad_elements = bad.repeat_interleave(br, dim=1)[:, :rows].repeat_interleave(bc, dim=2)[:, :, :cols]
    data = data.view(torch.uint8).masked_fill(bad_elements, 0x7F).view(torch.float8_e4m3fn)
    deq = None
    if dequantized:
        deq = dequantize(QuantizedTensor(data, scale, block, False), torch.bfloat16 if scale_format == "e8m0"
                         else torch.float32)
        deq = deq.masked_fill(bad_elements, float("nan"))
    if transpose:
        data, scale = data.transpose(1, 2).contiguous(), scale.transpose(1, 2).contiguous()
    return data, scale, deq


def mxfp8_quantize(t: torch.Tensor, rowwise: bool = True, colwise: bool = False):
    """OCP MX FP8 of a 2-D tensor (docs/CONTRACT.md): (rowwise, colwise), each a QuantizedTensor in the "e8m0"
    format or None: rowwise with blocks of 32 along the last dim, colwise along the first (what a GEMM's A
    operand and the weight gradient's need)."""
    if not (rowwise or colwise):
        raise ValueError("mxfp8_quantize: ask for rowwise=True, colwise=True or both")
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        raise ValueError(f"mxfp8_quantize: t must be a 2-D tensor, got {getattr(t, 'shape', type(t).__name__)}")
    if t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"mxfp8_quantize: t must be bf16, fp16 or fp32, got {str(t.dtype).replace('torch.', '')}")
    row = quantize(t, block=(1, 32))[0] if rowwise else None
    col = quantize(t, block=(32, 1))[0] if colwise else None
    return row, col
