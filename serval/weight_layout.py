"""How the routed experts' gate and up projections are held, read and written: two [E, I, H] tensors, or one
[E, 2I, H] tensor with every expert's gate rows, then its up rows (transformers' `gate_up_proj`).

The layer runs on two [E, I, H] views either way. Held as one tensor, the views are its halves (`split`): each
expert's rows are contiguous, and the step from one expert to the next is 2I rows instead of I, which every
kernel takes as the weight's expert stride, so the joined weight is read in place (no copy per call). Its
gradient is written as one [E, 2I, H] tensor, the weight-gradient kernels storing each half into its half of it
(`grad_buffers`, `joined`), so nothing is stitched together afterwards either. The other expert weights
(w_down) are read through the same helpers, as contiguous ones.

A leaf module: torch only; the kernels, the stages, the layer and the integrations import it.
"""

from __future__ import annotations

import torch


def split(w_gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_gate, w_up): views of w_gate_up [E, 2I, H], rows [0, I) and [I, 2I) of every expert."""
    inter = w_gate_up.shape[1] // 2
    return w_gate_up[:, :inter], w_gate_up[:, inter:]


def expert_rows(w: torch.Tensor) -> int:
    """Rows from one expert's start to the next's in a weight view [E, A, B] whose rows are dense (stride(1) ==
    B, stride(2) == 1): A for a contiguous weight, 2I for a half of a joined gate/up weight."""
    return w.stride(0) // w.shape[2] if w.shape[0] > 1 else w.shape[1]


def dense_rows(w: torch.Tensor) -> bool:
    """Whether a weight view [E, A, B] has unit column stride, row stride B and an expert stride of whole rows
    (at least A of them): the layouts the kernels read in place."""
    num_experts, rows, cols = w.shape
    return (w.stride(2) == 1 or cols == 1) and (w.stride(1) == cols or rows == 1) and (
        num_experts == 1 or (w.stride(0) % cols == 0 and w.stride(0) >= rows * cols))


def as_rows(w: torch.Tensor) -> torch.Tensor:
    """A weight view [E, A, B] with dense rows (`dense_rows`) as one contiguous 2-D view [(E - 1) * S + A, B] from
    its first row (S = `expert_rows`): expert e's row a is row e * S + a. For the engines whose TMA descriptors
    are 2-D; for a half of a joined gate/up weight the rows in between belong to the other half."""
    num_experts, rows, cols = w.shape
    return w.as_strided(((num_experts - 1) * expert_rows(w) + rows, cols), (cols, 1))


def is_joined(w_gate: torch.Tensor, w_up: torch.Tensor) -> bool:
    """Whether w_gate and w_up are the two halves of one [E, 2I, H] tensor (`split` of it)."""
    num_experts, inter, hidden = w_gate.shape
    return (w_up.shape == w_gate.shape and w_up.dtype == w_gate.dtype and w_up.device == w_gate.device
            and w_gate.untyped_storage().data_ptr() == w_up.untyped_storage().data_ptr()
            and w_gate.stride() == w_up.stride() == (2 * inter * hidden, hidden, 1)
            and w_up.storage_offset() == w_gate.storage_offset() + inter * hidden)


def grad_buffers(w_gate: torch.Tensor, w_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised (d_w_gate, d_w_up) in the weights' layout: the halves of one [E, 2I, H] tensor when w_gate
    and w_up are the halves of one (`is_joined`), else two contiguous [E, I, H] tensors."""
    num_experts, inter, hidden = w_gate.shape
    if is_joined(w_gate, w_up):
        return split(torch.empty(num_experts, 2 * inter, hidden, dtype=w_gate.dtype, device=w_gate.device))
    return torch.empty_like(w_gate, memory_format=torch.contiguous_format), torch.empty_like(
        w_up, memory_format=torch.contiguous_format)


def joined(d_gate: torch.Tensor, d_up: torch.Tensor) -> torch.Tensor:
    """The [E, 2I, H] tensor whose halves d_gate and d_up are (`grad_buffers` of a joined weight)."""
    if not is_joined(d_gate, d_up):
        raise ValueError("d_gate and d_up must be the two halves of one [E, 2I, H] tensor")
    num_experts, inter, hidden = d_gate.shape
    return d_gate.as_strided((num_experts, 2 * inter, hidden), (2 * inter * hidden, hidden, 1))
