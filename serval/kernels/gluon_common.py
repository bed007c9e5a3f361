"""What the Gluon engines (`gluon_cooperative`, `gluon_pingpong`) share: the version gate, TMA descriptors
of host tensors, register-tile helpers, and the operand checks.

Gluon is Triton's experimental layout-explicit language; its API moves between releases, so the Gluon
kernels are defined only under the Triton releases in `serval.plan.GLUON_VERSIONS` (`GLUON` below), and
run only on sm_90 (`available`). Gluon has no CPU interpreter: the kernels are checked on the H200, and
compiled for sm_90 without a GPU by tests/test_gluon_compile.py.
"""

from __future__ import annotations

import functools

import torch
import triton

from ..weight_layout import dense_rows
from ..plan import GLUON_VERSIONS
from ..schedule import Schedule
from . import common

# whether this Triton release is one the Gluon kernels were written against (they are defined only then)
GLUON = ".".join(triton.__version__.split(".")[:2]) in GLUON_VERSIONS


def available() -> bool:
    """Whether the Gluon engines can run here: an sm_90 GPU and a Triton release in GLUON_VERSIONS."""
    return common.target().gluon


if GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    @gluon.jit
    def halves(tile):
        """(tile[:, :N // 2], tile[:, N // 2:]): a register renaming in the wgmma layout."""
        BLOCK_M: gl.constexpr = tile.shape[0]
        BLOCK_N: gl.constexpr = tile.shape[1]
        return gl.split(tile.reshape([BLOCK_M, 2, BLOCK_N // 2]).permute((0, 2, 1)))

    @gluon.jit
    def column_chunks(tile, SPLIT: gl.constexpr):
        """The tile as a tuple of SPLIT (1, 2, 4 or 8) column chunks, left to right."""
        if SPLIT == 1:
            return (tile,)
        elif SPLIT == 2:
            return halves(tile)
        elif SPLIT == 4:
            left, right = halves(tile)
            c0, c1 = halves(left)
            c2, c3 = halves(right)
            return (c0, c1, c2, c3)
        else:
            left, right = halves(tile)
            q0, q1 = halves(left)
            q2, q3 = halves(right)
            c0, c1 = halves(q0)
            c2, c3 = halves(q1)
            c4, c5 = halves(q2)
            c6, c7 = halves(q3)
            return (c0, c1, c2, c3, c4, c5, c6, c7)

    @functools.lru_cache(maxsize=None)
    def _shared_layout(shape: tuple):
        return gl.NVMMASharedLayout.get_default_for(list(shape), gl.bfloat16)

    def descriptor(t: torch.Tensor, block: list):
        """A host-side TMA descriptor of a bf16 tensor in `block` boxes (the default NVMMA shared layout)."""
        return TensorDescriptor.from_tensor(t, block, _shared_layout(tuple(block)))


def takes(schedule: Schedule, *tensors: torch.Tensor, k: int | None = None, block_k: int = 64,
          split_at: int | None = None) -> bool:
    """Whether a Gluon engine runs here and takes these operands: bf16, TMA-addressable (16-byte aligned
    rows and bases; contiguous, or weights [E, *, *] with dense rows, `serval.weight_layout.dense_rows`), whole 128-row tiles, K a whole number of K-tiles where the weights are [E, K, N] (a
    K-tile of the 2-D weight view must not reach into the next expert), and split_at (the column where a
    [*, 2I] tensor is cut into two TMA views) 16-byte aligned."""
    if not available() or schedule.block_m % 128:
        return False
    for t in tensors:
        dense = t.is_contiguous() or (t.dim() == 3 and dense_rows(t) and (t.stride(0) * 2) % 16 == 0)
        if t.dtype != torch.bfloat16 or not dense or (t.shape[-1] * 2) % 16 or t.data_ptr() % 16:
            return False
    if split_at is not None and (split_at * 2) % 16:
        return False
    return k is None or k % block_k == 0
