"""The SwiGLU forward and backward as row passes, for the block-scaled FP8 path (`serval.precision`), whose
GEMMs store plain bf16 rows (no SwiGLU epilogue). The math is `swiglu.py`'s, as in the BF16 epilogues.

* `swiglu`: h [R, I] = silu(gate) * up from gate_up rows [R, 2I] (bf16), one program per block of rows and
  columns.
* `swiglu_backward_fp8`: from the down dgrad d_h_raw [R, I] (bf16) and the kept gate/up pre-activations
  (E4M3 in packed rows with one scale per 1 x SCALE_BLOCK block, dequantized here): d_gate_up [R, 2I] (bf16) and
  d_rw_rows[r] = <d_h_raw[r], h[r]> (fp32), one program per block of rows walking the columns in order (a fixed
  summation order: deterministic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..ops import QuantizedTensor
from ..schedule import Schedule, packed_index
from . import common, swiglu as swiglu_math

BLOCK_ROWS = 16
BLOCK_COLS = 256


@triton.jit
def _forward_kernel(gate_up_ptr, h_ptr, num_rows, inter, swiglu_limit, HAS_LIMIT: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (rows < num_rows)[:, None] & (cols < inter)[None, :]
    base = gate_up_ptr + rows.to(tl.int64)[:, None] * (2 * inter) + cols[None, :]
    gate = tl.load(base, mask=mask, other=0.0)
    up = tl.load(base + inter, mask=mask, other=0.0)
    h = swiglu_math.forward(gate, up, swiglu_limit, HAS_LIMIT)
    tl.store(h_ptr + rows.to(tl.int64)[:, None] * inter + cols[None, :], common.to_dtype(h, h_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _dequantized(data_ptr, scale_ptr, packed, cols, num_blocks, mask, SCALE_BLOCK: tl.constexpr,
                 E8M0: tl.constexpr, row_len):
    value = tl.load(data_ptr + packed.to(tl.int64)[:, None] * row_len + cols[None, :], mask=mask, other=0.0)
    scale = tl.load(scale_ptr + packed.to(tl.int64)[:, None] * num_blocks + (cols // SCALE_BLOCK)[None, :],
                    mask=mask, other=0)
    if E8M0:
        scale = tl.exp2(scale.to(tl.float32) - 127.0)
    return value.to(tl.float32) * scale


@triton.jit
def _backward_kernel(d_h_ptr, data_ptr, scale_ptr, packed_ptr, rw_ptr, d_gate_up_ptr, d_rw_ptr, num_rows, inter,
                     num_blocks, swiglu_limit, SCALE_BLOCK: tl.constexpr, E8M0: tl.constexpr,
                     HAS_LIMIT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_rows
    packed = tl.load(packed_ptr + rows, mask=row_ok, other=-1)
    rw = tl.load(rw_ptr + rows, mask=row_ok, other=0.0)
    has_source = packed >= 0
    packed = tl.where(has_source, packed, 0)
    d_rw = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for c in range(0, inter, BLOCK_I):
        cols = c + tl.arange(0, BLOCK_I)
        mask = row_ok[:, None] & (cols < inter)[None, :]
        source_mask = mask & has_source[:, None]
        d_h_raw = tl.load(d_h_ptr + rows.to(tl.int64)[:, None] * inter + cols[None, :], mask=mask,
                          other=0.0).to(tl.float32)
        pre_gate = _dequantized(data_ptr, scale_ptr, packed, cols, num_blocks, source_mask, SCALE_BLOCK, E8M0,
                                2 * inter)
        pre_up = _dequantized(data_ptr, scale_ptr, packed, cols + inter, num_blocks, source_mask, SCALE_BLOCK, E8M0,
                              2 * inter)
        d_gate, d_up, _, d_rw_terms = swiglu_math.backward(d_h_raw, common.to_dtype(pre_gate, tl.bfloat16),
                                                           common.to_dtype(pre_up, tl.bfloat16), rw, swiglu_limit,
                                                           HAS_LIMIT)
        out = d_gate_up_ptr + rows.to(tl.int64)[:, None] * (2 * inter) + cols[None, :]
        tl.store(out, d_gate, mask=mask)
        tl.store(out + inter, d_up, mask=mask)
        d_rw += tl.sum(d_rw_terms, axis=1)
    tl.store(d_rw_ptr + rows, d_rw, mask=row_ok)


def swiglu(gate_up_rows: torch.Tensor, swiglu_limit: float | None) -> torch.Tensor:
    """h bf16 [R, I] = silu(gate) * up of gate_up_rows bf16 [R, 2I], as `serval.stages.swiglu`."""
    num_rows, inter = gate_up_rows.shape[0], gate_up_rows.shape[1] // 2
    h = common.empty((num_rows, inter), gate_up_rows.dtype, gate_up_rows.device)
    grid = (triton.cdiv(num_rows, BLOCK_ROWS), triton.cdiv(inter, BLOCK_COLS))
    _forward_kernel[grid](gate_up_rows, h, num_rows, inter, float(swiglu_limit or 0.0),
                          HAS_LIMIT=swiglu_limit is not None, BLOCK_R=BLOCK_ROWS, BLOCK_I=BLOCK_COLS)
    return h


def swiglu_backward_fp8(d_h_raw: torch.Tensor, gate_up: QuantizedTensor, schedule: Schedule,
                        row_router_weights: torch.Tensor, swiglu_limit: float | None):
    """`serval.stages.swiglu_backward_fp8` as one row pass: (d_gate_up bf16 [R, 2I], d_rw_rows fp32 [R])."""
    num_rows, inter = d_h_raw.shape
    d_gate_up = common.empty((num_rows, 2 * inter), torch.bfloat16, d_h_raw.device)
    d_rw_rows = common.empty((num_rows,), torch.float32, d_h_raw.device)
    block = gate_up.block[1]
    _backward_kernel[(triton.cdiv(num_rows, BLOCK_ROWS),)](
        d_h_raw, gate_up.data, gate_up.scale, packed_index(schedule), row_router_weights.float().contiguous(),
        d_gate_up, d_rw_rows, num_rows, inter, gate_up.scale.shape[1], float(swiglu_limit or 0.0),
        SCALE_BLOCK=block, E8M0=gate_up.scale.dtype == torch.uint8, HAS_LIMIT=swiglu_limit is not None,
        BLOCK_R=BLOCK_ROWS, BLOCK_I=BLOCK_COLS)
    return d_gate_up, d_rw_rows
