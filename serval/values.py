"""The small value types that pass between the layers: quantized tensors, the weight gradients' window arguments,
and the flags a kernel's programs synchronise on. A leaf module (torch only): the kernels, `serval.ops`,
`serval.precision`, the macrobatch ring and the workspace all import it, so none of them imports another for a
type.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch


class QuantizedTensor(NamedTuple):
    """An FP8 block-quantized tensor (`serval.ops.quantize`).

    data: torch.float8_e4m3fn; scale: torch.uint8 (E8M0, 2^(byte - 127)) or torch.float32, one per block;
    block: (rows, cols) of the *source* tensor's last two dims sharing one scale; transposed: data and scale
    hold the source with its last two dims swapped, contiguous (data [..., C, R], scale [..., nC, nR]);
    else data [..., R, C], scale [..., nR, nC], with nR = ceil(R / block[0]) and nC = ceil(C / block[1]).
    """

    data: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]
    transposed: bool


@dataclasses.dataclass(frozen=True)
class WgradWindow:
    """One window's launch of a weight-gradient kernel (`serval.kernels.weight_grad.grouped_wgrad`, and the FP8
    ones; see `serval.schedule.windows`; the schedule passed is the window's).

    A caller loops over the windows in row order with the same `outs`, swapping the carries each time
    (window j: carry_in = buf[j % 2], carry_out = buf[(j + 1) % 2]), and reads `outs` after the last window.
    At most one expert per window has CARRY_IN and one CARRY_OUT (possibly the same one): the carries hold one
    expert's sums, and they are separate buffers because the CARRY_OUT expert's tiles may be written while
    another program still reads the CARRY_IN expert's.
    """

    expert_phase: torch.Tensor  # [E] int32: serval.schedule.CARRY_IN | CARRY_OUT | FINISH
    carry_in: torch.Tensor  # [P, Q] fp32 (row out * P_OUT + p), read for the CARRY_IN expert
    carry_out: torch.Tensor  # [P, Q] fp32, written for the CARRY_OUT expert
    # num_outputs [E, P_OUT, Q] in a's dtype, rows dense, one layout (the halves of a joined gate/up gradient, or
    # contiguous tensors), written for FINISH experts
    outs: tuple[torch.Tensor, ...]


class PullFlags(NamedTuple):
    """The flags of a GEMM that pulls its own rows (`serval.kernels.in_gemm_pull`): one int32 per M-tile, set to
    the call's epoch once the tile's rows are in, and the epoch (int32 [1]), bumped on the device per launch."""

    flags: torch.Tensor
    epoch: torch.Tensor


def new_pull_flags(num_m_tiles: int, device) -> PullFlags:
    """Zeros for up to num_m_tiles M-tiles: allocate once per workspace, before any CUDA graph capture, and reuse
    (the flags only ever hold past epochs)."""
    return PullFlags(torch.zeros(max(num_m_tiles, 1), dtype=torch.int32, device=device),
                     torch.zeros(1, dtype=torch.int32, device=device))


class Sync(NamedTuple):
    """A fused pass's synchronisation state (`serval.kernels.fused_pass`), allocated once by `new_sync` and reused
    by every launch: counters int32 [2] (task ids of even / odd epochs), flags int32 [2, num_flags] (per M-tile,
    even / odd epochs), epoch int32 [1]."""

    counters: torch.Tensor
    flags: torch.Tensor
    epoch: torch.Tensor


def new_sync(num_m_tiles: int, device) -> Sync:
    """Zeros for launches of up to `num_m_tiles` M-tiles (schedule.capacity // block_m, plus the shared expert's
    schedule's with one): allocate once, before any CUDA graph capture, and reuse; launches never need it reset."""
    if not isinstance(num_m_tiles, int) or isinstance(num_m_tiles, bool) or num_m_tiles < 0:
        raise ValueError(f"new_sync: num_m_tiles must be an int >= 0, got {num_m_tiles!r}")
    return Sync(torch.zeros(2, dtype=torch.int32, device=device),
                torch.zeros(2, max(num_m_tiles, 1), dtype=torch.int32, device=device),
                torch.zeros(1, dtype=torch.int32, device=device))
