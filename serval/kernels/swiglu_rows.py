"""The SwiGLU forward and backward as row passes, for the block-scaled FP8 path (`serval.precision`), whose
GEMMs store plain bf16 rows (no SwiGLU epilogue). The math is `swiglu.py`'s, as in the BF16 epilogues.

One kernel per direction, with a constexpr switch between bf16 outputs and outputs quantized in the same pass
(the fp8_blockwise recipe: E4M3, fp32 scales, 1 x 128 blocks along a row and 128 x 1 along tokens). A
quantizing program takes [128 rows, 128 columns] tiles, which hold whole blocks in both directions (expert
segments start at multiples of 128 rows), rounds its results to bf16 as the bf16 outputs are rounded, and
quantizes them with `quantize.quantize_tile`: the bits of `serval.ops.quantize` on the bf16 outputs, without
writing and re-reading them (each quantized copy saves a pass over [R, I] or [R, 2I] bf16).

* `swiglu`: h bf16 [R, I] = silu(gate) * up from gate_up rows bf16 [R, 2I], one program per block of rows and
  columns.
* `swiglu_quantized`: the same pass, one program per [128, 128] tile of h, writing the gate/up pre-activations
  quantized along 2I into their packed rows (what backward keeps), h quantized along I (the down GEMM's
  operand) and h quantized along tokens (stored [I, R], the w_down gradient's operand), instead of h.
* `swiglu_backward_fp8`: from the down dgrad d_h_raw [R, I] (bf16) and the kept gate/up pre-activations
  (E4M3 in packed rows with one scale per 1 x SCALE_BLOCK block, dequantized here): d_gate_up [R, 2I] (bf16) and
  d_rw_rows[r] = <d_h_raw[r], h[r]> (fp32), one program per 128 rows walking the columns in order (a fixed
  summation order: deterministic). Each 128-column chunk is taken twice in a row, for its d_gate then its
  d_up (the second time from the cache): a quantizing program then holds one [128, 128] tile to quantize both
  ways at a time, not two (registers: no spills to speak of at 8 warps on sm_90).
* `swiglu_backward_quantized`: the same pass writing d_gate_up quantized along 2I (the gate/up dgrad's operand)
  and along tokens (stored [2I, R], the w_gate / w_up gradients' operand) instead of d_gate_up.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..ops import QuantizedTensor
from ..schedule import Schedule, packed_index
from . import common, swiglu as swiglu_math
from .quantize import bf16_to_f32, quantize_tile

BLOCK_ROWS = 16  # swiglu's bf16 tile
BLOCK_COLS = 256
BLOCK = 128  # the fp8_blockwise block: the quantizing tiles (both directions) and the backward's column step
NUM_WARPS = 8  # [128, 128] tiles: 64 elements a thread


@triton.jit
def _store_along_rows(v, data_ptr, scale_ptr, rows, cols, row_len, col_block, row_ok, BLOCK_C: tl.constexpr):
    """v fp32 [rows, BLOCK_C] (bf16 values), one 1 x BLOCK_C block per row, quantized into data uint8
    [*, row_len] at (rows, cols) and its scales fp32 [*, row_len / BLOCK_C] at (rows, col_block), where row_ok."""
    byte, scale, _, _, _ = quantize_tile(v, 1, BLOCK_C, True)
    tl.store(data_ptr + rows.to(tl.int64)[:, None] * row_len + cols[None, :], byte, mask=row_ok[:, None])
    tl.store(scale_ptr + rows.to(tl.int64)[:, None] * (row_len // BLOCK_C) + col_block, scale, mask=row_ok[:, None])


@triton.jit
def _store_along_tokens(v, data_ptr, scale_ptr, rows, cols, num_rows, row_block, row_ok, BLOCK_R: tl.constexpr):
    """v fp32 [BLOCK_R, cols] (bf16 values), one BLOCK_R x 1 block per column, quantized and stored transposed:
    data uint8 [*, num_rows] at (cols, rows) where row_ok, scales fp32 [*, cdiv(num_rows, BLOCK_R)] at
    (cols, row_block)."""
    byte, scale, _, _, _ = quantize_tile(v, BLOCK_R, 1, True)
    tl.store(data_ptr + cols.to(tl.int64)[:, None] * num_rows + rows[None, :], tl.trans(byte), mask=row_ok[None, :])
    tl.store(scale_ptr + cols[None, :] * tl.cdiv(num_rows, BLOCK_R) + row_block, scale)


@triton.jit
def _forward_kernel(gate_up_ptr, h_ptr, h_scale_ptr, h_tokens_ptr, h_tokens_scale_ptr, packed_ptr, kept_ptr,
                    kept_scale_ptr, num_rows, inter, swiglu_limit, HAS_LIMIT: tl.constexpr,
                    QUANTIZED: tl.constexpr, H_ROWS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr):
    pid_r = tl.program_id(0)
    pid_i = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
    row_ok = rows < num_rows
    mask = row_ok[:, None] & (cols < inter)[None, :]
    base = gate_up_ptr + rows.to(tl.int64)[:, None] * (2 * inter) + cols[None, :]
    gate = tl.load(base, mask=mask, other=0.0)
    up = tl.load(base + inter, mask=mask, other=0.0)
    h = swiglu_math.forward(gate, up, swiglu_limit, HAS_LIMIT).to(gate_up_ptr.dtype.element_ty)
    if QUANTIZED:  # [BLOCK, BLOCK] tiles, I a multiple of BLOCK: every column is in range
        # the pre-activations along 2I (gate, then up: each tile one block per row) into their packed rows,
        # first: gate and up are dead before h's two copies are made (fewer registers)
        packed = tl.load(packed_ptr + rows, mask=row_ok, other=-1)
        has_source = packed >= 0
        _store_along_rows(bf16_to_f32(gate), kept_ptr, kept_scale_ptr, packed, cols, 2 * inter, pid_i, has_source,
                          BLOCK_I)
        _store_along_rows(bf16_to_f32(up), kept_ptr, kept_scale_ptr, packed, cols + inter, 2 * inter,
                          pid_i + inter // BLOCK_I, has_source, BLOCK_I)
        v = bf16_to_f32(h)
        if H_ROWS:
            _store_along_rows(v, h_ptr, h_scale_ptr, rows, cols, inter, pid_i, row_ok, BLOCK_I)
        _store_along_tokens(v, h_tokens_ptr, h_tokens_scale_ptr, rows, cols, num_rows, pid_r, row_ok, BLOCK_R)
    else:
        tl.store(h_ptr + rows.to(tl.int64)[:, None] * inter + cols[None, :], h, mask=mask)


@triton.jit
def _dequantized(data_ptr, scale_ptr, packed, col0, num_blocks, source_ok, col_ok, SCALE_BLOCK: tl.constexpr,
                 E8M0: tl.constexpr, ROW_SCALE: tl.constexpr, BLOCK_I: tl.constexpr, row_len):
    """The fp32 values of columns [col0, col0 + BLOCK_I) of packed rows (zeros where not source_ok / col_ok);
    ROW_SCALE: the columns lie in one scale block (one scale load per row)."""
    cols = col0 + tl.arange(0, BLOCK_I)
    mask = source_ok[:, None] & col_ok[None, :]
    value = tl.load(data_ptr + packed.to(tl.int64)[:, None] * row_len + cols[None, :], mask=mask, other=0.0)
    if ROW_SCALE:
        scale = tl.load(scale_ptr + packed.to(tl.int64) * num_blocks + col0 // SCALE_BLOCK, mask=source_ok,
                        other=0)[:, None]
    else:
        scale = tl.load(scale_ptr + packed.to(tl.int64)[:, None] * num_blocks + (cols // SCALE_BLOCK)[None, :],
                        mask=mask, other=0)
    if E8M0:
        scale = tl.exp2(scale.to(tl.float32) - 127.0)
    return value.to(tl.float32) * scale


@triton.jit
def _backward_kernel(d_h_ptr, data_ptr, scale_ptr, packed_ptr, rw_ptr, d_gate_up_ptr, d_scale_ptr, d_tokens_ptr,
                     d_tokens_scale_ptr, d_rw_ptr, num_rows, inter, num_blocks, swiglu_limit,
                     SCALE_BLOCK: tl.constexpr, E8M0: tl.constexpr, ROW_SCALE: tl.constexpr, HAS_LIMIT: tl.constexpr,
                     QUANTIZED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_rows
    packed = tl.load(packed_ptr + rows, mask=row_ok, other=-1)
    rw = tl.load(rw_ptr + rows, mask=row_ok, other=0.0)
    has_source = packed >= 0  # False on rows past num_rows too
    packed = tl.where(has_source, packed, 0)
    d_rw = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for j in range(2 * tl.cdiv(inter, BLOCK_I)):  # each column chunk twice: its d_gate, then its d_up
        c = j // 2 * BLOCK_I
        half = j % 2  # 0: d_gate, 1: d_up
        cols = c + tl.arange(0, BLOCK_I)
        col_ok = cols < inter
        mask = row_ok[:, None] & col_ok[None, :]
        d_h_raw = tl.load(d_h_ptr + rows.to(tl.int64)[:, None] * inter + cols[None, :], mask=mask,
                          other=0.0).to(tl.float32)
        pre_gate = _dequantized(data_ptr, scale_ptr, packed, c, num_blocks, has_source, col_ok, SCALE_BLOCK, E8M0,
                                ROW_SCALE, BLOCK_I, 2 * inter)
        pre_up = _dequantized(data_ptr, scale_ptr, packed, c + inter, num_blocks, has_source, col_ok, SCALE_BLOCK,
                              E8M0, ROW_SCALE, BLOCK_I, 2 * inter)
        d_gate, d_up, _, d_rw_part = swiglu_math.backward(d_h_raw, pre_gate.to(tl.bfloat16), pre_up.to(tl.bfloat16),
                                                          rw, swiglu_limit, HAS_LIMIT)
        d_half = tl.where(half == 0, d_gate, d_up)
        out_cols = cols + half * inter
        if QUANTIZED:  # I a multiple of BLOCK_I == BLOCK_R: every column is in range, each tile one block per row
            v = bf16_to_f32(d_half)
            _store_along_rows(v, d_gate_up_ptr, d_scale_ptr, rows, out_cols, 2 * inter, (c + half * inter) // BLOCK_I,
                              row_ok, BLOCK_I)
            _store_along_tokens(v, d_tokens_ptr, d_tokens_scale_ptr, rows, out_cols, num_rows, pid, row_ok, BLOCK_R)
        else:
            tl.store(d_gate_up_ptr + rows.to(tl.int64)[:, None] * (2 * inter) + out_cols[None, :], d_half, mask=mask)
        d_rw += tl.where(half == 0, d_rw_part, 0.0)  # + 0.0 is exact: d_rw is never -0
    tl.store(d_rw_ptr + rows, d_rw, mask=row_ok)


def _check_quantized(what: str, dtype: torch.dtype, inter: int) -> None:
    if dtype != torch.bfloat16 or inter % BLOCK:
        raise ValueError(f"swiglu_rows.{what}: takes bf16 rows with I a multiple of {BLOCK} (whole 1 x {BLOCK} "
                         f"blocks), got {dtype} and I = {inter}")


def _empty_quantized(rows: int, cols: int, transpose: bool, device) -> QuantizedTensor:
    """An output QuantizedTensor of a [rows, cols] source, blocks 1 x BLOCK (or BLOCK x 1, stored transposed)."""
    if transpose:
        return QuantizedTensor(common.empty((cols, rows), torch.float8_e4m3fn, device),
                               common.empty((cols, triton.cdiv(rows, BLOCK)), torch.float32, device), (BLOCK, 1), True)
    return QuantizedTensor(common.empty((rows, cols), torch.float8_e4m3fn, device),
                           common.empty((rows, triton.cdiv(cols, BLOCK)), torch.float32, device), (1, BLOCK), False)


def swiglu(gate_up_rows: torch.Tensor, swiglu_limit: float | None) -> torch.Tensor:
    """h bf16 [R, I] = silu(gate) * up of gate_up_rows bf16 [R, 2I], as `serval.stages.swiglu`."""
    num_rows, inter = gate_up_rows.shape[0], gate_up_rows.shape[1] // 2
    h = common.empty((num_rows, inter), gate_up_rows.dtype, gate_up_rows.device)
    grid = (triton.cdiv(num_rows, BLOCK_ROWS), triton.cdiv(inter, BLOCK_COLS))
    if grid[0] and grid[1]:
        _forward_kernel[grid](gate_up_rows, h, h, h, h, h, h, h, num_rows, inter, float(swiglu_limit or 0.0),
                              HAS_LIMIT=swiglu_limit is not None, QUANTIZED=False, H_ROWS=True,
                              BLOCK_R=BLOCK_ROWS, BLOCK_I=BLOCK_COLS)
    return h


def swiglu_quantized(gate_up_rows: torch.Tensor, schedule: Schedule, swiglu_limit: float | None, *,
                     h_rows: bool = True) -> tuple[QuantizedTensor | None, QuantizedTensor, QuantizedTensor]:
    """`serval.stages.swiglu_quantized` as one pass over gate_up_rows bf16 [R, 2I] (I % 128 == 0):
    (h along I: E4M3 [R, I], fp32 scales [R, I/128], or None without `h_rows`; h along tokens: E4M3 [I, R],
    fp32 scales [I, ceil(R/128)]; the pre-activations along 2I in packed rows: E4M3 [num_packed, 2I], fp32
    scales [num_packed, 2I/128]). Packed rows past the used ones (only at EP) are not written (never read)."""
    num_rows, inter = gate_up_rows.shape[0], gate_up_rows.shape[1] // 2
    _check_quantized("swiglu_quantized", gate_up_rows.dtype, inter)
    device = gate_up_rows.device
    h_q = _empty_quantized(num_rows, inter, False, device) if h_rows else None
    h_tokens = _empty_quantized(num_rows, inter, True, device)
    kept = _empty_quantized(schedule.num_packed, 2 * inter, False, device)
    grid = (triton.cdiv(num_rows, BLOCK), inter // BLOCK)
    if grid[0] and grid[1]:
        h_data, h_scale = (h_q.data.view(torch.uint8), h_q.scale) if h_rows else (h_tokens.scale, h_tokens.scale)
        _forward_kernel[grid](gate_up_rows, h_data, h_scale, h_tokens.data.view(torch.uint8), h_tokens.scale,
                              packed_index(schedule), kept.data.view(torch.uint8), kept.scale, num_rows, inter,
                              float(swiglu_limit or 0.0), HAS_LIMIT=swiglu_limit is not None, QUANTIZED=True,
                              H_ROWS=h_rows, BLOCK_R=BLOCK, BLOCK_I=BLOCK, num_warps=NUM_WARPS)
    return h_q, h_tokens, kept


def _backward(d_h_raw: torch.Tensor, gate_up: QuantizedTensor, schedule: Schedule, row_router_weights: torch.Tensor,
              swiglu_limit: float | None, quantized: bool):
    """Both backward passes: ((d_gate_up bf16,) or (along 2I, along tokens) QuantizedTensors, d_rw_rows)."""
    num_rows, inter = d_h_raw.shape
    device = d_h_raw.device
    if quantized:
        _check_quantized("swiglu_backward_quantized", d_h_raw.dtype, inter)
        outs = (_empty_quantized(num_rows, 2 * inter, False, device), _empty_quantized(num_rows, 2 * inter, True,
                                                                                       device))
        pointers = (outs[0].data.view(torch.uint8), outs[0].scale, outs[1].data.view(torch.uint8), outs[1].scale)
    else:
        outs = (common.empty((num_rows, 2 * inter), torch.bfloat16, device),)
        pointers = (outs[0],) * 4
    d_rw_rows = common.empty((num_rows,), torch.float32, device)
    block = gate_up.block[1]
    if num_rows:
        _backward_kernel[(triton.cdiv(num_rows, BLOCK),)](
            d_h_raw, gate_up.data, gate_up.scale, packed_index(schedule), row_router_weights.float().contiguous(),
            *pointers, d_rw_rows, num_rows, inter, gate_up.scale.shape[1], float(swiglu_limit or 0.0),
            SCALE_BLOCK=block, E8M0=gate_up.scale.dtype == torch.uint8,
            ROW_SCALE=block % BLOCK == 0 and inter % BLOCK == 0, HAS_LIMIT=swiglu_limit is not None,
            QUANTIZED=quantized, BLOCK_R=BLOCK, BLOCK_I=BLOCK, num_warps=NUM_WARPS)
    return (*outs, d_rw_rows)


def swiglu_backward_fp8(d_h_raw: torch.Tensor, gate_up: QuantizedTensor, schedule: Schedule,
                        row_router_weights: torch.Tensor, swiglu_limit: float | None):
    """`serval.stages.swiglu_backward_fp8` as one row pass: (d_gate_up bf16 [R, 2I], d_rw_rows fp32 [R])."""
    return _backward(d_h_raw, gate_up, schedule, row_router_weights, swiglu_limit, quantized=False)


def swiglu_backward_quantized(d_h_raw: torch.Tensor, gate_up: QuantizedTensor, schedule: Schedule,
                              row_router_weights: torch.Tensor, swiglu_limit: float | None):
    """`serval.stages.swiglu_backward_quantized` as one row pass over d_h_raw bf16 [R, I] (I % 128 == 0):
    (d_gate_up along 2I: E4M3 [R, 2I], fp32 scales [R, 2I/128]; d_gate_up along tokens: E4M3 [2I, R], fp32
    scales [2I, ceil(R/128)]; d_rw_rows fp32 [R]), the bits of `swiglu_backward_fp8` then `serval.ops.quantize`."""
    return _backward(d_h_raw, gate_up, schedule, row_router_weights, swiglu_limit, quantized=True)
