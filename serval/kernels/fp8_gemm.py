"""Block-scaled FP8 grouped GEMMs of the MoE layer (the DeepSeek-V3 recipe): e4m3 operands, 1 x 128 activation
scale blocks, 128 x 128 weight scale blocks, fp32 scales, fp32 accumulation with the scales applied once per
128-wide K step, a bf16 result rounded once.

Operands (as `serval.ops.quantize` makes them; every data tensor K-contiguous, which fp8 wgmma needs):

* activation rows A: data float8_e4m3fn [R, K], scale fp32 [R, ceil(K / 128)];
* weights B: data float8_e4m3fn [E, N, K], scale fp32 [E, ceil(N / 128), ceil(K / 128)];
* "along tokens" operands (weight gradients): data [M, R], scale [M, ceil(R / 128)] (R = routed rows).

A partial last block (K or N not a multiple of 128) is allowed: its scale covers the elements that exist, and
loads past K read zeros. K must be a multiple of 16 (16-byte rows, what TMA addresses).

    grouped_gemm:  out[r, n]    = sum_kb (A[r, kb] . B[e(r), n, kb]) * a_scale[r, kb] * b_scale[e(r), n // 128, kb]
    weight_grad:   out[e, m, n] = sum_kb over expert e's rows (a[m, kb] . b[n, kb]) * a_scale[m, kb] * b_scale[n, kb]

Numerics, on every engine: each 128-wide K step's dot product is made from a zero accumulator (fp32), then
promoted once, `acc = fma(part, a_scale * b_scale, acc)` (the scale product in fp32 first), the K steps in
increasing order into one accumulator; no split-K, no atomics: bitwise identical run to run. weight_grad also runs
window by window over the rows (the macrobatch ring, `serval.schedule.windows`), the accumulator carried in fp32
from one window to the next as the bf16 weight gradient does (`serval.values.WgradWindow`): the same bits.

Engines:

* the Triton kernel here (`_fp8_gemm_kernel`): one persistent kernel, SEGMENT "rows" (grouped over the schedule's
  M-tiles: grouped_gemm) or "k" (the tile list is E x M-tiles x N-tiles, each tile looping over its expert's
  row segment read from `expert_offsets` on the device, whole 128-row blocks, no K mask: weight_grad; in a window
  only the window's experts' tiles);
  B_SCALE_GROUP 128 (weight blocks) or 1 (per-row scales of an along-tokens b). Pointer loads (no TMA), `tl.dot`
  on fp8 operands (sm_89+); below sm_89 the operands are widened to bf16 (exact) first; under the CPU interpreter
  to fp32 (fp8 loads work there: they are read as float8 directly, only the NaN encoding 0x7f reads as 480, which
  quantized data never holds). It is the correctness oracle of the Gluon engine and the path off Hopper.
* `gluon_fp8` (sm_90, Triton 3.6): warp-specialised TMA + wgmma, the promotion of one consumer warp group
  overlapping the other's wgmma (DeepGEMM's scheme). Chosen by `engine="auto"` where it runs and takes the
  operands (see `_gluon_takes`).

grouped_gemm leaves rows past the used tiles (rows >= expert_offsets[E]) unwritten, as the bf16 GEMMs do;
padding rows inside used tiles are written (zeros for zero padding rows). No host sync anywhere: the used-tile
count and the segments are read on the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import schedule as _schedule
from ..plan import GLUON_VERSIONS, fp8_triton_tiles
from ..schedule import Schedule
from . import common, gluon_common
from ..values import WgradWindow
from .weight_grad import check_outs, check_window

SCALE_BLOCK = 128  # elements per scale along K (and along N for the weights)
FP8 = torch.float8_e4m3fn
ENGINES = ("auto", "triton", "gluon")
# the window phase bits (serval.schedule) as kernel constants
_CARRY_IN: tl.constexpr = tl.constexpr(_schedule.CARRY_IN)
_CARRY_OUT: tl.constexpr = tl.constexpr(_schedule.CARRY_OUT)
_FINISH: tl.constexpr = tl.constexpr(_schedule.FINISH)


# ---------------------------------------------------------------- the Triton kernel

@triton.jit
def _window_experts(phase_ptr, num_experts, E_PAD: tl.constexpr):
    """(first, count) of the experts a weight-gradient window runs (CARRY_OUT or FINISH): a window is a range of
    rows, which lie in expert order, so they are a range of ids; the others' tiles are not dealt (in a window of a
    few experts among many, looping over every expert's empty tiles cost more than the window's work)."""
    ids = tl.arange(0, E_PAD)
    phase = tl.load(phase_ptr + ids, mask=ids < num_experts, other=0)
    active = (phase & (_CARRY_OUT | _FINISH)) != 0
    first = tl.min(tl.where(active, ids, E_PAD), axis=0)
    last = tl.max(tl.where(active, ids, -1), axis=0)
    return first, tl.maximum(last - first + 1, 0)


@triton.jit
def _fp8_gemm_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, out_ptr, phase_ptr, carry_in_ptr, carry_out_ptr,
    tile_expert_ptr, expert_offsets_ptr, num_experts, sched_block_m,
    M, N, K,
    stride_a, stride_as_m, stride_as_k,
    stride_b_e, stride_b, stride_bs_e, stride_bs_n, stride_bs_k,
    stride_out_e, stride_out_m,
    SEGMENT: tl.constexpr, B_SCALE_GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, UPCAST: tl.constexpr, WINDOW: tl.constexpr, E_PAD: tl.constexpr,
):
    """SEGMENT "rows": out[r, n] over the schedule's used M-tiles (M = R; A [R, K], B [E, N, K]).
    SEGMENT "k": out[e, m, n] for every expert, K = expert e's rows [offsets[e], offsets[e + 1]) of A [M, R] and
    B [N, R] (stride_b_e = stride_bs_e = 0). UPCAST: "fp32" (interpreter), "bf16" (no fp8 MMA), "" (fp8 tl.dot).
    WINDOW ("k" only): one window of the rows; phase_ptr [E] int32, carry_in_ptr / carry_out_ptr [M, N] fp32
    (see `weight_grad`); E_PAD: E rounded up to a power of two."""
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    if SEGMENT == "rows":
        num_m_tiles = tl.load(expert_offsets_ptr + num_experts) // BLOCK_M  # used tiles only: no host sync
        num_tiles = num_m_tiles * num_n_tiles
    else:
        num_m_tiles = tl.cdiv(M, BLOCK_M)
        first_expert = 0
        active_experts = num_experts
        if WINDOW:  # the window's experts only (rows lie in expert order: a range of ids)
            first_expert, active_experts = _window_experts(phase_ptr, num_experts, E_PAD)
        num_tiles = active_experts * num_m_tiles * num_n_tiles
    per_expert = num_m_tiles * num_n_tiles
    offs_k = tl.arange(0, BLOCK_K)

    for tile_id in range(tl.program_id(0), num_tiles, NUM_PROGRAMS):
        if SEGMENT == "rows":
            m_tile, n_tile = common.tile_coords(tile_id, num_m_tiles, num_n_tiles, GROUP_M)
            expert = tl.load(tile_expert_ptr + (m_tile * BLOCK_M) // sched_block_m)
            k_begin = 0
            k_end = K
        else:  # expert-major: programs running together share the expert's rows in L2
            expert = first_expert + tile_id // per_expert
            m_tile, n_tile = common.tile_coords(tile_id % per_expert, num_m_tiles, num_n_tiles, GROUP_M)
            # segments start and end on 128-row blocks (schedule.block_m % 128 == 0, checked on the host)
            k_begin = tl.multiple_of(tl.load(expert_offsets_ptr + expert), BLOCK_K)
            k_end = tl.multiple_of(tl.load(expert_offsets_ptr + expert + 1), BLOCK_K)
        rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < M
        col_ok = cols < N
        a_rows = a_ptr + rows.to(tl.int64) * stride_a
        b_cols = b_ptr + expert.to(tl.int64) * stride_b_e + cols.to(tl.int64) * stride_b
        sa_rows = a_scale_ptr + rows.to(tl.int64) * stride_as_m
        sb_cols = b_scale_ptr + expert.to(tl.int64) * stride_bs_e + (cols // B_SCALE_GROUP).to(tl.int64) * stride_bs_n

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if WINDOW:  # CARRY_IN: the sums continue from the previous window's (the flag bounds the rows: a scalar
            # bool and-ed into a tensor mask is rejected by the interpreter)
            phase = tl.load(phase_ptr + expert)
            carry = rows.to(tl.int64)[:, None] * N + cols[None, :]
            carry_rows = tl.where((phase & _CARRY_IN) != 0, M, 0)
            acc = tl.load(carry_in_ptr + carry, mask=(rows < carry_rows)[:, None] & col_ok[None, :], other=0.0)
        for k in range(k_begin, k_end, BLOCK_K):  # one K step = one scale block, in increasing order
            kb = k // BLOCK_K
            if SEGMENT == "rows":
                k_ok = (k + offs_k) < K  # a partial last K block reads zeros
            else:  # whole 128-row blocks inside the segment: no mask, so the loads vectorise
                k_ok = offs_k < BLOCK_K
            a = tl.load(a_rows[:, None] + (k + offs_k)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_cols[None, :] + (k + offs_k)[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            sa = tl.load(sa_rows + kb * stride_as_k, mask=row_ok, other=0.0)
            sb = tl.load(sb_cols + kb * stride_bs_k, mask=col_ok, other=0.0)
            if UPCAST == "fp32":  # interpreter: fp64 sums (numpy's fp32 matmul order depends on the layout)
                part = tl.dot(a.to(tl.float32).to(tl.float64), b.to(tl.float32).to(tl.float64)).to(tl.float32)
            elif UPCAST == "bf16":  # no fp8 MMA (before sm_89): e4m3 values are exact in bf16
                part = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
            else:
                part = tl.dot(a, b)
            acc = tl.fma(part, sa[:, None] * sb[None, :], acc)

        out_ptrs = (out_ptr + expert.to(tl.int64) * stride_out_e + rows.to(tl.int64)[:, None] * stride_out_m
                    + cols[None, :])
        if WINDOW:  # the fp32 sums to the next window's carry (CARRY_OUT) or the output (FINISH), or nothing
            if (phase & _CARRY_OUT) != 0:
                tl.store(carry_out_ptr + carry, acc, mask=row_ok[:, None] & col_ok[None, :])
            elif (phase & _FINISH) != 0:
                tl.store(out_ptrs, common.to_dtype(acc, tl.bfloat16), mask=row_ok[:, None] & col_ok[None, :])
        else:
            tl.store(out_ptrs, common.to_dtype(acc, tl.bfloat16), mask=row_ok[:, None] & col_ok[None, :])


# ---------------------------------------------------------------- checks


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check_fp8(name: str, t: torch.Tensor, ndim: int):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != FP8:
        raise ValueError(f"{name}: expected float8_e4m3fn data, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous (K-major), got strides {t.stride()}")


def _check_scale(name: str, t: torch.Tensor, shape: tuple, of: str):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise ValueError(f"{name}: expected float32 scales, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)} (one scale per 128 block of {of}), "
                         f"got {tuple(t.shape)}")


def _check_k(name: str, k: int):
    if k % 16:
        raise ValueError(f"{name}: the reduction length {k} must be a multiple of 16 (16-byte fp8 rows, as TMA "
                         f"addresses them); pad it with zeros")


def _check_devices(schedule: Schedule, **tensors):
    device = schedule.expert_offsets.device
    for name, t in tensors.items():
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, the schedule on {device}")


def _engine(engine: str, schedule: Schedule, *tensors: torch.Tensor) -> str:
    """The engine that runs: `engine`, or for "auto" Gluon where it runs and takes the operands, else Triton."""
    if engine not in ENGINES:
        raise ValueError(f"engine: expected one of {ENGINES}, got {engine!r}")
    gluon_ok = engine != "triton" and _gluon_takes(schedule, *tensors)
    if engine == "gluon" and not gluon_ok:
        raise ValueError(f"engine='gluon': the Gluon FP8 engine does not run here or does not take these operands "
                         f"(it needs an sm_90 GPU, Triton {'/'.join(GLUON_VERSIONS)}, contiguous 16-byte aligned "
                         f"operands on the GPU, and schedule.block_m % 128 == 0)")
    if engine == "auto":
        return "gluon" if gluon_ok else "triton"
    return engine


def _gluon_takes(schedule: Schedule, *tensors: torch.Tensor) -> bool:
    """Whether the Gluon engine runs here and takes these operands: TMA-addressable data (contiguous, 16-byte
    aligned bases; rows are 16-byte multiples since K % 16 == 0) and whole 128-row tiles of one expert."""
    if not gluon_common.available() or schedule.block_m % 128:
        return False
    return all(t.is_cuda and t.is_contiguous() and t.data_ptr() % 16 == 0 for t in tensors)


def _upcast(device: torch.device) -> str:
    if common.INTERPRET or device.type != "cuda":
        return "fp32"
    return "" if torch.cuda.get_device_capability(device) >= (8, 9) else "bf16"


def _triton_tiles(segment: str, m_block_limit: int | None) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): `serval.plan.fp8_triton_tiles`, BLOCK_M halved until it divides
    m_block_limit (the schedule's block_m, grouped over rows)."""
    tiles = fp8_triton_tiles(segment, common.INTERPRET)
    block_m = tiles.block_m
    if m_block_limit is not None:
        while block_m > 16 and m_block_limit % block_m:
            block_m //= 2
        if m_block_limit % block_m:
            raise ValueError(f"schedule.block_m={m_block_limit} must be a multiple of 16 for the FP8 grouped GEMM")
    return block_m, tiles.block_n, tiles.num_warps, tiles.num_stages


# ---------------------------------------------------------------- public API


def grouped_gemm(a_data: torch.Tensor, a_scale: torch.Tensor, b_data: torch.Tensor, b_scale: torch.Tensor,
                 schedule: Schedule, *, out: torch.Tensor | None = None, engine: str = "auto",
                 config=None) -> torch.Tensor:
    """out bf16 [R, N] (R = schedule.capacity): out[r, n] = sum_kb (a[r, kb-block] . b[e(r), n, kb-block])
    * a_scale[r, kb] * b_scale[e(r), n // 128, kb], e(r) the expert of row r's tile.

    a_data float8_e4m3fn [R, K], a_scale fp32 [R, ceil(K/128)]; b_data float8_e4m3fn [E, N, K], b_scale fp32
    [E, ceil(N/128), ceil(K/128)]; K % 16 == 0. Rows past the used tiles (>= expert_offsets[E]) are left
    unwritten. `out`: an optional bf16 [R, N] contiguous buffer to write into. `engine`: "auto" (Gluon where it
    runs and takes the operands, else Triton), "triton" or "gluon"; `config`: a `serval.plan.Fp8GluonConfig` for
    the Gluon engine (default: `serval.plan.fp8_gluon_config`)."""
    _check_fp8("a_data", a_data, 2)
    _check_fp8("b_data", b_data, 3)
    num_rows, k = a_data.shape
    num_experts, n, kb_ = b_data.shape
    if num_rows != schedule.capacity:
        raise ValueError(f"a_data has {num_rows} rows, the schedule's capacity is {schedule.capacity}")
    if num_experts != schedule.num_experts:
        raise ValueError(f"b_data has {num_experts} experts, the schedule {schedule.num_experts}")
    if kb_ != k:
        raise ValueError(f"b_data: K={kb_} does not match a_data's K={k}")
    _check_k("a_data", k)
    _check_scale("a_scale", a_scale, (num_rows, _cdiv(k, SCALE_BLOCK)), "K per row")
    _check_scale("b_scale", b_scale, (num_experts, _cdiv(n, SCALE_BLOCK), _cdiv(k, SCALE_BLOCK)), "N x K")
    if out is None:
        out = common.empty((num_rows, n), torch.bfloat16, a_data.device)
    elif (out.dtype != torch.bfloat16 or tuple(out.shape) != (num_rows, n) or not out.is_contiguous()):
        raise ValueError(f"out: expected a contiguous bfloat16 [{num_rows}, {n}] tensor, got {out.dtype} "
                         f"{tuple(out.shape)} strides {out.stride()}")
    _check_devices(schedule, a_data=a_data, a_scale=a_scale, b_data=b_data, b_scale=b_scale, out=out)
    if _engine(engine, schedule, a_data, b_data, out) == "gluon":
        from . import gluon_fp8
        gluon_fp8.grouped_gemm(a_data, a_scale, b_data, b_scale, schedule, out, config)
        return out
    if num_rows == 0 or n == 0:
        return out
    block_m, block_n, num_warps, num_stages = _triton_tiles("rows", schedule.block_m)
    max_tiles = (num_rows // block_m) * _cdiv(n, block_n)
    num_programs = max(1, min(common.num_sms(a_data.device.index), max_tiles))
    _fp8_gemm_kernel[(num_programs,)](
        a_data, a_scale, b_data, b_scale, out, None, None, None,
        schedule.tile_expert, schedule.expert_offsets, num_experts, schedule.block_m,
        num_rows, n, k,
        a_data.stride(0), a_scale.stride(0), a_scale.stride(1),
        b_data.stride(0), b_data.stride(1), b_scale.stride(0), b_scale.stride(1), b_scale.stride(2),
        0, out.stride(0),
        SEGMENT="rows", B_SCALE_GROUP=SCALE_BLOCK, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=SCALE_BLOCK,
        GROUP_M=8, NUM_PROGRAMS=num_programs, UPCAST=_upcast(a_data.device), WINDOW=False, E_PAD=1,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def weight_grad(a_data: torch.Tensor, a_scale: torch.Tensor, b_data: torch.Tensor, b_scale: torch.Tensor,
                schedule: Schedule, *, engine: str = "auto", config=None,
                window: WgradWindow | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """out bf16 [E, M, N]: out[e, m, n] = sum over expert e's rows, in 128-row steps kb (ascending),
    (a[m, kb-block] . b[n, kb-block]) * a_scale[m, kb] * b_scale[n, kb]; an expert with no rows gets zeros.

    a_data float8_e4m3fn [M, R] + a_scale fp32 [M, R/128]; b_data float8_e4m3fn [N, R] + b_scale fp32 [N, R/128]
    (R = schedule.capacity, rows along the last, contiguous, dimension; padding rows zero). Needs
    schedule.block_m % 128 == 0 (no 128-row block straddles two experts).
    `window`: one window of the rows (`serval.values.WgradWindow` with one output, carries [M, N] fp32; the schedule
    and the operands are the window's): the sums of an expert with rows before the window start from carry_in,
    those of one with rows after it go to carry_out, and only the window's FINISH experts are written, into
    window.outs[0], which is returned. The window launches in row order give the one launch's bits (the same
    K steps, in order, on the same fp32 accumulator). `out` (no window): the [E, M, N] bf16 tensor to write, rows
    dense (e.g. a half of a joined gate/up gradient, `serval.weight_layout.grad_buffers`); None: a new one."""
    _check_fp8("a_data", a_data, 2)
    _check_fp8("b_data", b_data, 2)
    m, num_rows = a_data.shape
    n = b_data.shape[0]
    if num_rows != schedule.capacity:
        raise ValueError(f"a_data has {num_rows} routed rows (last dimension), the schedule's capacity is "
                         f"{schedule.capacity}")
    if b_data.shape[1] != num_rows:
        raise ValueError(f"b_data has {b_data.shape[1]} routed rows (last dimension), a_data {num_rows}")
    if schedule.block_m % SCALE_BLOCK:
        raise ValueError(f"schedule.block_m={schedule.block_m}: the FP8 weight gradient needs a multiple of 128 "
                         f"(expert segments must start on 128-row scale blocks)")
    _check_k("a_data", num_rows)
    _check_scale("a_scale", a_scale, (m, _cdiv(num_rows, SCALE_BLOCK)), "routed rows per row of a")
    _check_scale("b_scale", b_scale, (n, _cdiv(num_rows, SCALE_BLOCK)), "routed rows per row of b")
    num_experts = schedule.num_experts
    if window is None and out is None:
        out = common.empty((num_experts, m, n), torch.bfloat16, a_data.device)
    elif window is None:
        check_outs("out", (out,), torch.bfloat16, num_experts, m, n)
    else:
        check_window(window, a_data.device, torch.bfloat16, num_experts, m, n, 1)
        out = window.outs[0]
    _check_devices(schedule, a_data=a_data, a_scale=a_scale, b_data=b_data, b_scale=b_scale, out=out)
    # the output is written with pointer stores (its rows dense, `check_outs`): not a TMA operand
    if _engine(engine, schedule, a_data, b_data) == "gluon":
        from . import gluon_fp8
        gluon_fp8.weight_grad(a_data, a_scale, b_data, b_scale, schedule, out, config, window)
        return out
    if out.numel() == 0:
        return out
    block_m, block_n, num_warps, num_stages = _triton_tiles("k", None)
    max_tiles = num_experts * _cdiv(m, block_m) * _cdiv(n, block_n)
    num_programs = max(1, min(common.num_sms(a_data.device.index), max_tiles))
    phase, carry_in, carry_out = (None,) * 3 if window is None else (window.expert_phase, window.carry_in,
                                                                      window.carry_out)
    _fp8_gemm_kernel[(num_programs,)](
        a_data, a_scale, b_data, b_scale, out, phase, carry_in, carry_out,
        schedule.tile_expert, schedule.expert_offsets, num_experts, schedule.block_m,
        m, n, num_rows,
        a_data.stride(0), a_scale.stride(0), a_scale.stride(1),
        0, b_data.stride(0), 0, b_scale.stride(0), b_scale.stride(1),
        out.stride(0), out.stride(1),
        SEGMENT="k", B_SCALE_GROUP=1, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=SCALE_BLOCK,
        GROUP_M=8, NUM_PROGRAMS=num_programs, UPCAST=_upcast(a_data.device), WINDOW=window is not None,
        E_PAD=triton.next_power_of_2(num_experts),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
