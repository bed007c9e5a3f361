"""Row movement between token order and the schedule's expert-grouped row order.

Two memory-bound kernels, each one program per (block of rows or tokens, block of H
columns), every output element written once, so bandwidth is all they need:

* `_gather_kernel`: rows[r] = t[token(r)] (zeros on padding rows): token order -> row order.
* `_sum_slots_kernel`: out[t] = shared[t] + sum_j w[t, j] * rows[source_row[t, j]]:
  row order -> token order. With HAS_WEIGHTS it is the combine (router weights), without
  it the combine's transpose for d_x (sum_slots). The k slots are summed in slot order in
  fp32 and rounded once, as the torch stages do: a fixed order, so deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..schedule import Schedule
from . import common

# 16-byte vectors along H; a few KB per load so that many loads are in flight per SM
GATHER_BLOCK_ROWS = 16
SUM_BLOCK_TOKENS = 8
BLOCK_H = 512


@triton.jit
def _gather_kernel(t_ptr, row_source_ptr, rows_ptr, num_rows, hidden, top_k, stride_t,
                   BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    source = tl.load(row_source_ptr + rows, mask=rows < num_rows, other=-1)
    token = tl.where(source >= 0, source // top_k, 0)
    col_ok = (cols < hidden)[None, :]
    values = tl.load(t_ptr + token.to(tl.int64)[:, None] * stride_t + cols[None, :],
                     mask=(source >= 0)[:, None] & col_ok, other=0.0)
    tl.store(rows_ptr + rows.to(tl.int64)[:, None] * hidden + cols[None, :], values,
             mask=(rows < num_rows)[:, None] & col_ok)


@triton.jit
def _sum_slots_kernel(rows_ptr, stride_rows, weights_ptr, source_row_ptr, shared_ptr, stride_shared,
                      out_ptr, num_tokens, hidden,
                      TOP_K: tl.constexpr, HAS_WEIGHTS: tl.constexpr, HAS_SHARED: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    token_ok = tokens < num_tokens
    mask = token_ok[:, None] & (cols < hidden)[None, :]
    if HAS_SHARED:
        total = tl.load(shared_ptr + tokens.to(tl.int64)[:, None] * stride_shared + cols[None, :],
                        mask=mask, other=0.0).to(tl.float32)
    else:
        total = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    # unrolled over the k slots: all k row loads can be in flight at once; the adds stay in slot order
    for j in tl.static_range(TOP_K):
        row = tl.load(source_row_ptr + tokens * TOP_K + j, mask=token_ok, other=0)
        value = tl.load(rows_ptr + row.to(tl.int64)[:, None] * stride_rows + cols[None, :],
                        mask=mask, other=0.0).to(tl.float32)
        if HAS_WEIGHTS:
            weight = tl.load(weights_ptr + tokens * TOP_K + j, mask=token_ok, other=0.0).to(tl.float32)
            value = weight[:, None] * value
        total = total + value
    tl.store(out_ptr + tokens.to(tl.int64)[:, None] * hidden + cols[None, :],
             common.to_dtype(total, out_ptr.dtype.element_ty), mask=mask)


def gather(t: torch.Tensor, schedule: Schedule) -> torch.Tensor:
    """rows[r] = t[token of row r] (zeros on padding rows); t [N, H] -> [R, H]."""
    t = t if t.stride(-1) == 1 else t.contiguous()
    num_rows, hidden = schedule.capacity, t.shape[1]
    rows = common.empty((num_rows, hidden), t.dtype, t.device)
    grid = (common.cdiv(num_rows, GATHER_BLOCK_ROWS), common.cdiv(hidden, BLOCK_H))
    _gather_kernel[grid](t, schedule.row_source, rows, num_rows, hidden, schedule.top_k, t.stride(0),
                         BLOCK_R=GATHER_BLOCK_ROWS, BLOCK_H=BLOCK_H, num_warps=4)
    return rows


def _sum_slots(rows, weights, schedule: Schedule, shared):
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    num_tokens, top_k = schedule.source_row.shape
    hidden = rows.shape[1]
    out = common.empty((num_tokens, hidden), rows.dtype, rows.device)
    if shared is not None and shared.stride(-1) != 1:
        shared = shared.contiguous()
    grid = (common.cdiv(num_tokens, SUM_BLOCK_TOKENS), common.cdiv(hidden, BLOCK_H))
    _sum_slots_kernel[grid](
        rows, rows.stride(0),
        weights.contiguous() if weights is not None else rows,
        schedule.source_row.contiguous(),
        shared if shared is not None else rows, shared.stride(0) if shared is not None else 0,
        out, num_tokens, hidden,
        TOP_K=top_k, HAS_WEIGHTS=weights is not None, HAS_SHARED=shared is not None,
        BLOCK_T=SUM_BLOCK_TOKENS, BLOCK_H=BLOCK_H, num_warps=4,
    )
    return out


def combine(expert_out, router_weights, schedule: Schedule, shared_out=None):
    """y[t] = shared_out[t] + sum_j router_weights[t, j] * expert_out[row(t, j)], summed in slot order."""
    return _sum_slots(expert_out, router_weights, schedule, shared_out)


def sum_slots(rows, schedule: Schedule, shared_rows=None):
    """d_x[t] = shared_rows[t] + sum_j rows[row(t, j)], summed in slot order (the combine's transpose)."""
    return _sum_slots(rows, None, schedule, shared_rows)
