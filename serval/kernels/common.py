"""What every kernel module shares: interpreter detection, the target the plan is chosen for, the TMA
allocator, SM count, output allocation, the persistent grouped GEMMs' tile order.

Under TRITON_INTERPRET=1 (CPU CI) kernels run on numpy, where bf16 `tl.dot` is wrong: kernels take
`UPCAST=INTERPRET` and upcast dot operands to fp32 there, and skip TMA descriptors; and where the cast to bf16
truncates: outputs are rounded with `to_dtype`, as the GPU rounds them.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from ..plan import Target

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_INTERPRET: tl.constexpr = tl.constexpr(INTERPRET)

# Test hook: fill every kernel output with NaN before the kernel runs, so unwritten elements show.
POISON_OUTPUTS = os.environ.get("SERVAL_POISON_OUTPUTS", "0") == "1"


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host ints. Not triton.cdiv: on the host that is a constexpr-function call (about 2 us under
    Triton 3.6), and a layer step computes dozens of grids."""
    return -(-a // b)


def empty(shape, dtype, device) -> torch.Tensor:
    """An output buffer (NaN-filled, or int -1, when POISON_OUTPUTS is set)."""
    if POISON_OUTPUTS:
        return torch.full(shape, float("nan") if dtype.is_floating_point else -1, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int | None = None) -> int:
    if INTERPRET or not torch.cuda.is_available():
        return 4
    return torch.cuda.get_device_properties(device_index or 0).multi_processor_count


@functools.lru_cache(maxsize=None)
def target(device_index: int | None = None) -> Target:
    """The device the kernels run on, as `serval.plan.choose_plan` sees it."""
    capability = None
    if not INTERPRET and torch.cuda.is_available():
        capability = tuple(torch.cuda.get_device_capability(device_index))
    return Target(capability, ".".join(triton.__version__.split(".")[:2]), INTERPRET)


def supports_tma() -> bool:
    return target().tma


def _tma_workspace(size: int, alignment: int, stream):
    return torch.empty(size, device="cuda", dtype=torch.int8)


def install_tma_allocator() -> None:
    """Device-side tensor descriptors (`tl.make_tensor_descriptor`) need a scratch allocator.

    Triton keeps it in a context variable, so it is set before every launch: backward runs in
    autograd's own thread, where a setting made in the main thread is not seen.
    """
    triton.set_allocator(_tma_workspace)


@triton.jit
def round_bf16(x):
    """fp32 -> the nearest bf16 value (round to nearest even), still in fp32. Integer trick: the interpreter's
    `.to(tl.bfloat16)` truncates. NaN kept (the integer add could carry a NaN into Inf or wrap)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
    return tl.where(x == x, bits.to(tl.float32, bitcast=True), x)


@triton.jit
def bf16_to_f32(x):
    """bf16 -> fp32 by bits (the interpreter's cast loses bf16 subnormals; on the GPU it is this shift)."""
    return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def f32_to_bf16(x):
    """fp32 holding a bf16 value (`round_bf16`'s output) -> bf16 by bits, exact (the interpreter's cast loses
    subnormals)."""
    return (x.to(tl.int32, bitcast=True) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def to_dtype(x, DTYPE: tl.constexpr):
    """x.to(DTYPE) as the GPU rounds it (nearest even) in the interpreter too, whose cast to bf16 truncates (a
    bias of half an ulp per rounding); on the GPU this is the cast itself."""
    if _INTERPRET and DTYPE == tl.bfloat16:
        return f32_to_bf16(round_bf16(x.to(tl.float32)))
    else:
        return x.to(DTYPE)


@triton.jit
def tile_coords(tile_id, num_m_tiles, num_n_tiles, GROUP_M: tl.constexpr):
    """Grouped order: GROUP_M consecutive M-tiles sweep all N-tiles before the next group, so the SMs
    working at once share weight tiles (one expert's) and A tiles in L2. Also called from Gluon kernels."""
    tiles_per_group = GROUP_M * num_n_tiles
    first_m = (tile_id // tiles_per_group) * GROUP_M
    group_size = tl.minimum(num_m_tiles - first_m, GROUP_M)
    m_tile = first_m + (tile_id % tiles_per_group) % group_size
    n_tile = (tile_id % tiles_per_group) // group_size
    return m_tile, n_tile
