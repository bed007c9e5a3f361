"""The stages of the MoE layer, in torch ops: the portable path, and the contract of the kernels.

Forward and backward are each a short pipeline of stages over one `Schedule`
(see `serval.schedule`). This module implements every stage with torch ops, on
any device and dtype, with no host sync on a GPU (on CPU, where reading them is no sync, the GEMMs
torch._grouped_mm cannot run read the expert segments' bounds) and no floating-point scatter/atomics;
`serval.kernels` implements the same functions with Triton kernels, and
`serval.functional` composes whichever backend is chosen. Signatures and
numerics are shared, so a kernel can replace one stage at a time.

Shapes: N tokens, k slots, H hidden, I expert intermediate, E experts, R rows
(the schedule's capacity). `gate_up` is the gate/up pre-activation, gate in
columns [0, I), up in [I, 2I), kept for backward in *packed* rows [num_packed, 2I]
(the rows that hold a source, without the padding; `serval.schedule.packed_index`).
Reductions accumulate in fp32 (fp64 for fp64 inputs) and round once at the end.

Forward:   gather -> gate_up_swiglu -> down -> combine
Backward:  gather(d_y) -> down_dgrad_swiglu (d_h, SwiGLU backward, d_router_weights)
           -> gate_up_dgrad -> combine-transpose (sum_slots) ; weight_grad for every weight
"""

from __future__ import annotations

import torch

from .ops import dequantize, quantize
from .schedule import Schedule, packed_index, packed_rows
from .values import QuantizedTensor


# Whether down / gate_up_dgrad take `push_to` (write their rows into the EP owners' slots) and whether
# gate_up_swiglu takes `pull_from` (reads its rows from the owners' buffers): torch ops cannot address peer
# memory, so the layer pulls rows before these stages and pushes their rows after them. No stage runs a pass's
# two GEMMs as one launch (`fuses_forward` / `fuses_backward`, the kernels' `gate_up_down` /
# `down_dgrad_gate_up_dgrad`).
pushes_from_epilogue = False
pulls_in_gemm = False
pulls_in_dgrad = False
fuses_forward = False
fuses_backward = False
takes_windows = False  # the weight gradients take no windows: an EP pass takes every row at once (serval.macrobatch)


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _has_grouped_mm(*operands: torch.Tensor) -> bool:
    """Can torch._grouped_mm take these operands (its dtypes, devices, 16-byte aligned rows)?"""
    t = operands[0]
    if t.dtype == torch.bfloat16:
        ok = t.device.type == "cpu" or (t.device.type == "cuda" and torch.cuda.get_device_capability(t.device)[0] >= 9)
    else:
        ok = t.dtype == torch.float32 and t.device.type == "cpu"
    return ok and all(size * t.element_size() % 16 == 0 for op in operands for size in op.shape[-2:])


def _expert_masks(schedule: Schedule, device) -> torch.Tensor:
    """[E, R] bool: row r belongs to expert e's segment (padding rows included)."""
    rows = torch.arange(schedule.capacity, device=device)
    offsets = schedule.expert_offsets.to(device=device, dtype=torch.int64)
    return (rows[None, :] >= offsets[:-1, None]) & (rows[None, :] < offsets[1:, None])


def _host_segments(schedule: Schedule) -> list[tuple[int, int]]:
    """[(lo, hi)] of each expert's rows, read on the host: for CPU tensors only, where reading them is no sync."""
    offsets = schedule.expert_offsets.tolist()
    return list(zip(offsets[:-1], offsets[1:]))


def grouped_mm(a: torch.Tensor, w: torch.Tensor, schedule: Schedule) -> torch.Tensor:
    """out[r] = a[r] @ w[e(r)].T for each expert segment; a [R, K], w [E, Nout, K] -> [R, Nout]."""
    if _has_grouped_mm(a, w):
        return torch._grouped_mm(a, w.transpose(-2, -1), offs=schedule.expert_offsets[1:])
    # operands torch._grouped_mm does not take (fp64; rows that are not 16-byte multiples; fp32 on CUDA)
    out = a.new_zeros(a.shape[0], w.shape[1])
    if a.device.type == "cpu":  # each segment alone: the same GEMM wherever its rows sit (bitwise across EP sizes)
        for e, (lo, hi) in enumerate(_host_segments(schedule)):
            out[lo:hi] = a[lo:hi] @ w[e].T
        return out
    # on a GPU without a host sync: every expert on every row, selected per segment
    for e, mask in enumerate(_expert_masks(schedule, a.device)):
        out = torch.where(mask[:, None], a @ w[e].T, out)
    return out


def weight_grad(a: torch.Tensor, b: torch.Tensor, schedule: Schedule) -> torch.Tensor:
    """dW[e] = a[seg e].T @ b[seg e], summed over the segment's rows; a [R, P], b [R, Q] -> [E, P, Q].

    An expert with no rows gets exact zeros.
    """
    if _has_grouped_mm(a, b):
        return torch._grouped_mm(a.t(), b, offs=schedule.expert_offsets[1:])
    if a.device.type == "cpu":  # each segment alone: the same sum wherever its rows sit (bitwise across EP sizes)
        out = a.new_zeros(schedule.num_experts, a.shape[1], b.shape[1])
        for e, (lo, hi) in enumerate(_host_segments(schedule)):
            if hi > lo:
                out[e] = a[lo:hi].t() @ b[lo:hi]
        return out
    # on a GPU without a host sync, over the whole buffer (its reduction order then depends on the buffer's size:
    # this path, fp32 and fp64 on the torch stages, is not bitwise across EP sizes). Rows past the used ones hold
    # whatever the producing stage left there: select, never multiply by 0
    masks = _expert_masks(schedule, a.device)[:, :, None]
    return torch.stack([torch.where(m, a, 0).t() @ torch.where(m, b, 0) for m in masks])


def gather(t: torch.Tensor, schedule: Schedule) -> torch.Tensor:
    """rows[r] = t[token of row r] (zeros on padding rows); t [N, H] -> [R, H]."""
    source = schedule.row_source.to(torch.int64)
    token = source.clamp(min=0) // schedule.top_k
    return torch.where((source >= 0)[:, None], t[token], 0).to(t.dtype)


def row_weights(router_weights: torch.Tensor, schedule: Schedule) -> torch.Tensor:
    """[R] router weight of each row (0 on padding rows)."""
    source = schedule.row_source.to(torch.int64)
    return torch.where(source >= 0, router_weights.reshape(-1)[source.clamp(min=0)], 0)


def _swiglu_parts(gate_up: torch.Tensor, swiglu_limit: float | None):
    """fp32 (clamped gate, clamped up, sigmoid(gate)) from the stored pre-activation."""
    acc = accumulator_dtype(gate_up.dtype)
    gate, up = gate_up.to(acc).chunk(2, dim=-1)
    if swiglu_limit is not None:
        gate = gate.clamp(max=swiglu_limit)
        up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
    return gate, up, torch.sigmoid(gate)


def swiglu(gate_up: torch.Tensor, swiglu_limit: float | None) -> torch.Tensor:
    """h = silu(gate) * up, computed in fp32 and rounded once to the input dtype."""
    gate, up, sig = _swiglu_parts(gate_up, swiglu_limit)
    return (gate * sig * up).to(gate_up.dtype)


# ---------------------------------------------------------------- forward

def gate_up_swiglu(x, w_gate, w_up, schedule: Schedule, swiglu_limit: float | None, *, a_rows=None):
    """Gather + grouped GEMM gate/up + SwiGLU: returns (gate_up packed [num_packed, 2I], kept for
    backward, and h [R, I]).

    a_rows: the rows already gathered (or, at EP, pulled from their owners); x is then not read.
    """
    a_rows = gather(x, schedule) if a_rows is None else a_rows
    gate_up = grouped_mm(a_rows, torch.cat([w_gate, w_up], dim=1), schedule)
    return gate_up[packed_rows(schedule)], swiglu(gate_up, swiglu_limit)


def down(h, w_down, schedule: Schedule):
    """Grouped GEMM down: o [R, H]."""
    return grouped_mm(h, w_down, schedule)


def combine(expert_out, router_weights, schedule: Schedule, shared_out=None):
    """y[t] = shared_out[t] + sum_j router_weights[t, j] * expert_out[row(t, j)], summed in slot order."""
    acc = accumulator_dtype(expert_out.dtype)
    token_rows = expert_out[schedule.source_row.to(torch.int64)].to(acc)  # [N, k, H]
    y = shared_out.to(acc) if shared_out is not None else torch.zeros_like(token_rows[:, 0])
    for j in range(schedule.top_k):
        y = y + router_weights[:, j, None].to(acc) * token_rows[:, j]
    return y.to(expert_out.dtype)


# ---------------------------------------------------------------- backward

def unpacked(packed: torch.Tensor, schedule: Schedule) -> torch.Tensor:
    """Packed rows [num_packed, C] (`serval.schedule.packed_index`) back to rows [R, C], zeros on padding rows."""
    index = packed_index(schedule).to(torch.int64)[:, None]
    return torch.where(index >= 0, packed[index.clamp(min=0).squeeze(1)], 0)


def down_dgrad_swiglu(d_y_rows, w_down, gate_up, router_weights, schedule: Schedule, swiglu_limit: float | None):
    """d_h = rw * (d_y_row @ w_down), then the SwiGLU backward and the router-weight gradient.

    d_router_weights[t, j] = <d_y[t], expert_out[row]> = <d_y_row @ w_down, h>: a per-row dot of
    the unscaled down dgrad with h, so expert outputs are never kept for backward.
    gate_up: packed [num_packed, 2I], as gate_up_swiglu keeps it.
    Returns (d_gate_up [R, 2I], h_weighted = rw * h [R, I] for the w_down gradient, d_rw_rows [R] fp32).
    """
    acc = accumulator_dtype(gate_up.dtype)
    gate_up = unpacked(gate_up, schedule)
    d_h_raw = grouped_mm(d_y_rows, w_down.transpose(1, 2), schedule).to(acc)
    return swiglu_backward(d_h_raw, gate_up, row_weights(router_weights, schedule), swiglu_limit, gate_up.dtype)


def swiglu_backward(d_h_raw, gate_up, row_router_weights, swiglu_limit: float | None, dtype):
    """The SwiGLU backward of rows: d_h_raw [R, I] (the unscaled down dgrad), gate_up [R, 2I] (the
    pre-activations), row_router_weights [R]; computed in gate_up's accumulator dtype.
    Returns (d_gate_up [R, 2I] and h_weighted = rw * h [R, I] in `dtype`, d_rw_rows = <d_h_raw, h> [R] fp32),
    h rounded to `dtype` first, exactly the h the forward fed to the down GEMM."""
    acc = accumulator_dtype(gate_up.dtype)
    d_h_raw = d_h_raw.to(acc)
    gate, up, sig = _swiglu_parts(gate_up, swiglu_limit)
    silu = gate * sig
    h = (silu * up).to(dtype).to(acc)
    d_rw_rows = (d_h_raw * h).sum(dim=-1)
    rw = row_router_weights.to(acc)[:, None]
    d_h = d_h_raw * rw
    d_gate = d_h * up * sig * (1 + gate * (1 - sig))
    d_up = d_h * silu
    if swiglu_limit is not None:
        # compared in the accumulator dtype, as the forward clamped (a bf16 compare would round the limit)
        pre_gate, pre_up = gate_up.to(acc).chunk(2, dim=-1)
        d_gate = d_gate * (pre_gate <= swiglu_limit)
        d_up = d_up * ((pre_up >= -swiglu_limit) & (pre_up <= swiglu_limit))
    d_gate_up = torch.cat([d_gate, d_up], dim=-1).to(dtype)
    return d_gate_up, (h * rw).to(dtype), d_rw_rows


def gate_up_dgrad(d_gate_up, w_gate, w_up, schedule: Schedule):
    """d_x_rows = d_gate @ w_gate + d_up @ w_up, one GEMM with K = 2I: [R, H]."""
    return grouped_mm(d_gate_up, torch.cat([w_gate, w_up], dim=1).transpose(1, 2), schedule)


def sum_slots(rows, schedule: Schedule, shared_rows=None):
    """d_x[t] = shared_rows[t] + sum_j rows[row(t, j)], summed in slot order (the combine's transpose)."""
    acc = accumulator_dtype(rows.dtype)
    token_rows = rows[schedule.source_row.to(torch.int64)].to(acc)
    out = shared_rows.to(acc) if shared_rows is not None else torch.zeros_like(token_rows[:, 0])
    for j in range(schedule.top_k):
        out = out + token_rows[:, j]
    return out.to(rows.dtype)


def gate_up_weight_grad(d_gate_up, x, schedule: Schedule, *, x_rows=None, out=None):
    """(d_w_gate, d_w_up) [E, I, H] each = d_gate_up[seg].T @ x_rows[seg] (x regathered, not kept,
    unless the rows are given); written into `out` (d_w_gate, d_w_up) where given (`serval.weight_layout.grad_buffers`:
    the kernels write there directly, this path copies)."""
    x_rows = gather(x, schedule) if x_rows is None else x_rows
    d_w_gate, d_w_up = weight_grad(d_gate_up, x_rows, schedule).chunk(2, dim=1)
    if out is not None:
        return out[0].copy_(d_w_gate), out[1].copy_(d_w_up)
    return d_w_gate.clone(), d_w_up.clone()  # two tensors that own their memory, as the kernels return


def down_weight_grad(d_y_rows, h_weighted, schedule: Schedule):
    """d_w_down [E, H, I] = d_y_rows[seg].T @ (rw * h)[seg]."""
    return weight_grad(d_y_rows, h_weighted, schedule)


# ---------------------------------------------------------------- block-scaled FP8 GEMMs (serval.precision)

def fp8_grouped_gemm(a: QuantizedTensor, b: QuantizedTensor, schedule: Schedule) -> torch.Tensor:
    """out[r] = a[r] @ b[e(r)].T from block-scaled FP8 operands, a [R, K], b [E, N, K] (K-contiguous, as
    `serval.ops.quantize` stores them): dequantized to fp32 and multiplied in fp32; bf16 [R, N]."""
    return grouped_mm(dequantize(a), dequantize(b), schedule).to(torch.bfloat16)


def _rows_quantized(t: torch.Tensor, block: int, scale_format: str, rows_of=None) -> QuantizedTensor:
    return quantize(t, block=(1, block), scale_format=scale_format, rows_of=rows_of)[0]


def swiglu_fp8(gate_up_rows, schedule: Schedule, swiglu_limit: float | None, block: int, scale_format: str):
    """The SwiGLU forward of the block-scaled FP8 path, from gate_up rows [R, 2I] (bf16): (h bf16 [R, I],
    h quantized along I, the gate/up pre-activations quantized along 2I in packed rows [num_packed, 2I]),
    1 x block blocks of scale_format."""
    h = swiglu(gate_up_rows, swiglu_limit)
    kept = _rows_quantized(gate_up_rows, block, scale_format, rows_of=(packed_rows(schedule), 1))
    return h, _rows_quantized(h, block, scale_format), kept


def swiglu_backward_fp8(d_h_raw, gate_up: QuantizedTensor, schedule: Schedule, row_router_weights,
                        swiglu_limit: float | None):
    """The SwiGLU backward of the block-scaled FP8 path: d_h_raw [R, I] (the down dgrad, bf16) and the kept
    pre-activations (quantized, packed rows), dequantized to bf16. Returns (d_gate_up bf16 [R, 2I], d_gate_up
    quantized along 2I in the kept copy's blocks and scale format, d_rw_rows fp32 [R])."""
    gate_up_rows = unpacked(dequantize(gate_up, torch.bfloat16), schedule)
    d_gate_up, _, d_rw_rows = swiglu_backward(d_h_raw, gate_up_rows, row_router_weights, swiglu_limit,
                                              torch.bfloat16)
    scale_format = "fp32" if gate_up.scale.dtype == torch.float32 else "e8m0"
    return d_gate_up, _rows_quantized(d_gate_up, gate_up.block[1], scale_format), d_rw_rows


def fp8_weight_grad(a: QuantizedTensor, b: QuantizedTensor, schedule: Schedule, out=None) -> torch.Tensor:
    """dW[e] = sum over expert e's rows of a[:, r] b[:, r]^T from operands stored along tokens, a [M, R],
    b [N, R]: dequantized to fp32, multiplied in fp32; bf16 [E, M, N] (written into `out` where given)."""
    grad = weight_grad(dequantize(a).t(), dequantize(b).t(), schedule).to(torch.bfloat16)
    return grad if out is None else out.copy_(grad)
