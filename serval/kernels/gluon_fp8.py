"""The Hopper engine of the block-scaled FP8 grouped GEMMs (`serval.kernels.fp8_gemm`), in Gluon (sm_90, Triton 3.6).

Numerics are `fp8_gemm`'s: per 128-wide K step a zero-started fp8 wgmma `part` [rows, BLOCK_N], promoted once
into the fp32 accumulator, `acc = fma(part, a_scale[rows] * b_scale[cols], acc)`, K steps ascending, bf16 out
rounded once; the same instruction sequence as the Triton engine's `tl.dot` + `tl.fma`, so the two are meant to
agree bit for bit (checked on the H200 by tests/test_kernels_fp8.py).

Roles (warp-specialised, as `gluon_cooperative`): one TMA loader warp fills a STAGES-deep ring of [128, 128] A
and [BLOCK_N, 128] B fp8 slots (both K-major, as fp8 wgmma on Hopper needs; every operand of the recipe is
K-contiguous for that reason). Two consumer warp groups own rows 0-63 and 64-127 of each 128-row tile
(cooperative: both read every stage, `empty` counts both). Per K step each consumer issues its async wgmma
from a zero accumulator, loads this step's scales while it runs, waits, releases the slot, then promotes
on the CUDA cores. The two consumers drift apart by themselves, so while one promotes the other's wgmma keeps
the tensor cores busy: DeepGEMM's way of keeping the promotion off the critical path. Registers: BLOCK_N = 128
gives 64 accumulator + 64 partial fp32 per thread (setmaxnreg 232 for the consumers).

SEGMENT "rows" (grouped_gemm): tiles over the schedule's used M-tiles (count read on the device), weights read as
the 2-D TMA view [E * N, K] (an N-tile past N reads the next expert's rows into columns the stores drop; the
last expert's are zero-filled). B_SCALE_GROUP = 128 with BLOCK_N dividing 128: one weight scale per tile and
step (a scalar). SEGMENT "k" (weight_grad): tiles E x M-tiles x N-tiles (expert-major), each looping over its
expert's rows [offsets[e], offsets[e + 1]) read from the device table by both roles; A [M, R] and B [N, R];
per-row b scales (B_SCALE_GROUP = 1, a vector per step); an expert with no rows stores zeros. WINDOW (one window
of the rows, the macrobatch ring's): a tile of the CARRY_IN expert starts from its fp32 carry (pointer loads into
the accumulator's layout), one of the CARRY_OUT expert stores its fp32 sums to the next carry, and only FINISH
experts store the output (see `serval.kernels.weight_grad`); only the window's experts' tiles are dealt (a range
of ids, read from the phases on the device). The host hands
the kernel the "k" scales transposed to [R/128, rows padded to whole tiles], so a step's [128] a scales and
[BLOCK_N] b scales are contiguous runs: the loader brings them into the ring slot with the step's operands by
TMA, and the consumers read them from shared memory (from global memory their latency stalled the promotion).
"rows" reads its two per-row scales a thread and step from global memory.

Epilogue: [64, EPI_N] column chunks converted to bf16 and stored with 16-byte pointer stores (no shared
memory taken from the ring). The mbarrier waits need no time bound: every arrival they wait for is made
unconditionally by the same program.
"""

from __future__ import annotations

import functools

import triton

from .. import schedule as _schedule
from ..plan import Fp8GluonConfig, fp8_gluon_config
from ..schedule import Schedule
from . import common, gluon_common

BLOCK_M = 128
BLOCK_K = 128  # one scale block per K step
SM90_SHARED = 232448  # bytes of shared memory a block may use on sm_90


def _check_config(config: Fp8GluonConfig) -> None:
    """ValueError unless the config's ring of stages fits sm_90's shared memory beside the epilogue's layout
    conversions (each stage: fp8 operands and, for weight_grad, fp32 scales)."""
    stage_bytes = (BLOCK_M + config.block_n) * (BLOCK_K + 4)
    if config.stages * stage_bytes > SM90_SHARED - 10240:
        raise ValueError(f"Fp8GluonConfig.stages={config.stages}: {stage_bytes} B a stage does not fit sm_90's "
                         f"shared memory with room for the epilogue's layout conversions")


if gluon_common.GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .gluon_common import column_chunks

    # the window phase bits (serval.schedule) as kernel constants
    CARRY_IN: gl.constexpr = gl.constexpr(_schedule.CARRY_IN)
    CARRY_OUT: gl.constexpr = gl.constexpr(_schedule.CARRY_OUT)
    FINISH: gl.constexpr = gl.constexpr(_schedule.FINISH)

    @gluon.jit
    def _tile(tile_id, tile_expert_ptr, expert_offsets_ptr, sched_block_m, num_m_tiles, num_n_tiles, K,
              first_expert, SEGMENT: gl.constexpr, GROUP_M: gl.constexpr, BLOCK_M: gl.constexpr):
        """(expert, m_tile, n_tile, k_begin, k_end) of work item tile_id; loader and consumers agree on it. "k":
        experts from first_expert on (a window's first)."""
        if SEGMENT == "rows":
            m_tile, n_tile = common.tile_coords(tile_id, num_m_tiles, num_n_tiles, GROUP_M)
            expert = gl.load(tile_expert_ptr + (m_tile * BLOCK_M) // sched_block_m)
            k_begin = 0
            k_end = K
        else:
            per_expert = num_m_tiles * num_n_tiles
            expert = first_expert + tile_id // per_expert
            m_tile, n_tile = common.tile_coords(tile_id % per_expert, num_m_tiles, num_n_tiles, GROUP_M)
            k_begin = gl.load(expert_offsets_ptr + expert)
            k_end = gl.load(expert_offsets_ptr + expert + 1)
        return expert, m_tile, n_tile, k_begin, k_end

    @gluon.jit
    def _window_experts(phase_ptr, num_experts, E_PAD: gl.constexpr):
        """As `fp8_gemm._window_experts`: (first, count) of the experts a weight-gradient window runs."""
        ids = gl.arange(0, E_PAD, layout=gl.BlockedLayout([1], [32], [4], [0]))
        phase = gl.load(phase_ptr + ids, mask=ids < num_experts, other=0)
        active = (phase & (CARRY_OUT | FINISH)) != 0
        first = gl.min(gl.where(active, ids, E_PAD), axis=0)
        last = gl.max(gl.where(active, ids, -1), axis=0)
        return first, gl.maximum(last - first + 1, 0)

    @gluon.jit
    def _loader(a_desc, b_desc, sa_desc, sb_desc, a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty, tile_expert_ptr,
                expert_offsets_ptr, sched_block_m, num_tiles, num_m_tiles, num_n_tiles, N, K, first_expert,
                stride_as_k, stride_bs_k, SEGMENT: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                NUM_PROGRAMS: gl.constexpr):
        BLOCK_M: gl.constexpr = a_bufs.shape[1]
        BLOCK_N: gl.constexpr = b_bufs.shape[1]
        BLOCK_K: gl.constexpr = a_bufs.shape[2]
        if SEGMENT == "rows":
            stage_bytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
        else:  # and the step's a and b scales, [BLOCK_M] and [BLOCK_N] fp32
            stage_bytes: gl.constexpr = (a_desc.block_type.nbytes + b_desc.block_type.nbytes
                                         + sa_desc.block_type.nbytes + sb_desc.block_type.nbytes)
        count = 0
        for tile_id in range(gl.program_id(0), num_tiles, NUM_PROGRAMS):
            expert, m_tile, n_tile, k_begin, k_end = _tile(tile_id, tile_expert_ptr, expert_offsets_ptr,
                                                           sched_block_m, num_m_tiles, num_n_tiles, K, first_expert,
                                                           SEGMENT, GROUP_M, BLOCK_M)
            m0 = m_tile * BLOCK_M
            if SEGMENT == "rows":
                b_row = expert * N + n_tile * BLOCK_N  # the [E * N, K] view
            else:
                b_row = n_tile * BLOCK_N
            for k in range(k_begin, k_end, BLOCK_K):
                slot = count % STAGES
                mbarrier.wait(empty.index(slot), ((count // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(slot), stage_bytes)
                tma.async_copy_global_to_shared(a_desc, [m0, k], ready.index(slot), a_bufs.index(slot))
                tma.async_copy_global_to_shared(b_desc, [b_row, k], ready.index(slot), b_bufs.index(slot))
                if SEGMENT == "k":
                    kb = k // BLOCK_K
                    tma.async_copy_global_to_shared(sa_desc, [kb * stride_as_k + m0], ready.index(slot),
                                                    sa_bufs.index(slot))
                    tma.async_copy_global_to_shared(sb_desc, [kb * stride_bs_k + b_row], ready.index(slot),
                                                    sb_bufs.index(slot))
                count += 1

    @gluon.jit
    def _consumer(a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty, a_scale_ptr, b_scale_ptr, out_ptr, phase_ptr,
                  carry_in_ptr, carry_out_ptr, tile_expert_ptr, expert_offsets_ptr, sched_block_m, num_tiles,
                  num_m_tiles, num_n_tiles, M, N, K, first_expert, stride_as_m, stride_as_k, stride_bs_e,
                  stride_bs_n, stride_bs_k, stride_out_e, stride_out_m,
                  CONSUMER: gl.constexpr, SEGMENT: gl.constexpr, B_SCALE_GROUP: gl.constexpr,
                  EPI_SPLIT: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                  NUM_PROGRAMS: gl.constexpr, WINDOW: gl.constexpr):
        BLOCK_M: gl.constexpr = a_bufs.shape[1]
        BLOCK_N: gl.constexpr = b_bufs.shape[1]
        BLOCK_K: gl.constexpr = a_bufs.shape[2]
        HALF_M: gl.constexpr = BLOCK_M // 2  # this consumer's rows of the tile
        EPI_N: gl.constexpr = BLOCK_N // EPI_SPLIT
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BLOCK_N, 32])
        chunk_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                               instr_shape=[16, EPI_N, 32])
        row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
        col_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
        VEC: gl.constexpr = 8  # bf16, 16-byte stores
        store_layout: gl.constexpr = gl.BlockedLayout([1, VEC], [32 * VEC // EPI_N, EPI_N // VEC], [4, 1], [1, 0])
        count = 0
        part = gl.zeros((HALF_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)  # the wgmma's registers
        for tile_id in range(gl.program_id(0), num_tiles, NUM_PROGRAMS):
            expert, m_tile, n_tile, k_begin, k_end = _tile(tile_id, tile_expert_ptr, expert_offsets_ptr,
                                                           sched_block_m, num_m_tiles, num_n_tiles, K, first_expert,
                                                           SEGMENT, GROUP_M, BLOCK_M)
            r0 = m_tile * BLOCK_M + CONSUMER * HALF_M
            n0 = n_tile * BLOCK_N
            if SEGMENT == "rows":  # per-row a scales, one b scale per tile and step
                sa_ptrs = a_scale_ptr + (r0 + gl.arange(0, HALF_M, layout=row_layout)).to(gl.int64) * stride_as_m
                sb_ptrs = b_scale_ptr + expert.to(gl.int64) * stride_bs_e + (n0 // B_SCALE_GROUP) * stride_bs_n
            acc = gl.zeros((HALF_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
            out_rows_end = M
            if WINDOW:  # "k": CARRY_IN starts the sums from the previous window's fp32 carry [M, N]
                phase = gl.load(phase_ptr + expert)
                carry_rows = r0 + gl.arange(0, HALF_M, layout=row_layout)
                carry_cols = n0 + gl.arange(0, BLOCK_N, layout=col_layout)
                carry = carry_rows[:, None] * N + carry_cols[None, :]
                carry_ok = (carry_rows < M)[:, None] & (carry_cols < N)[None, :]
                if (phase & CARRY_IN) != 0:
                    acc = gl.load(carry_in_ptr + carry, mask=carry_ok, other=0.0)
                out_rows_end = M * ((phase & FINISH) != 0).to(gl.int32)  # the output only where FINISH
            for k in range(k_begin, k_end, BLOCK_K):
                slot = count % STAGES
                mbarrier.wait(ready.index(slot), (count // STAGES) & 1)
                a = a_bufs.index(slot).slice(CONSUMER * HALF_M, HALF_M)
                b = b_bufs.index(slot).permute((1, 0))
                part = warpgroup_mma(a, b, part, use_acc=False, is_async=True)
                # this step's scales load while its wgmma runs: "rows" from global memory (two per thread,
                # L2-resident), "k" from the ring slot the loader filled (a vector of BLOCK_N per step)
                if SEGMENT == "rows":
                    kb = k // BLOCK_K
                    sa = gl.load(sa_ptrs + kb * stride_as_k)
                    sb = gl.load(sb_ptrs + kb * stride_bs_k)
                    part = warpgroup_mma_wait(0, deps=(part,))
                    scale = (sa * sb)[:, None]
                else:
                    sa = sa_bufs.index(slot).slice(CONSUMER * HALF_M, HALF_M).load(row_layout)
                    sb = sb_bufs.index(slot).load(col_layout)
                    part = warpgroup_mma_wait(0, deps=(part,))
                    scale = sa[:, None] * sb[None, :]
                mbarrier.arrive(empty.index(slot))  # the slot is free before the promotion runs
                acc = gl.fma(part, scale, acc)
                count += 1

            if WINDOW:  # CARRY_OUT: the fp32 sums to the next window's carry, not the output
                if (phase & CARRY_OUT) != 0:
                    gl.store(carry_out_ptr + carry, acc, mask=carry_ok)
            out_rows_ids = r0 + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, store_layout))
            out_rows = (out_ptr + expert.to(gl.int64) * stride_out_e
                        + out_rows_ids.to(gl.int64)[:, None] * stride_out_m)
            out_row_ok = (out_rows_ids < out_rows_end)[:, None]
            chunks = column_chunks(acc, EPI_SPLIT)
            for c in gl.static_range(EPI_SPLIT):
                value = gl.convert_layout(chunks[c], chunk_layout, assert_trivial=True).to(gl.bfloat16)
                out_cols = n0 + c * EPI_N + gl.arange(0, EPI_N, layout=gl.SliceLayout(0, store_layout))
                gl.store(out_rows + out_cols[None, :], gl.convert_layout(value, store_layout),
                         mask=out_row_ok & (out_cols < N)[None, :])

    @gluon.jit
    def _fp8_kernel(a_desc, b_desc, sa_desc, sb_desc, a_scale_ptr, b_scale_ptr, out_ptr, phase_ptr, carry_in_ptr,
                    carry_out_ptr, tile_expert_ptr,
                    expert_offsets_ptr, num_experts, sched_block_m, M, N, K, stride_as_m, stride_as_k,
                    stride_bs_e, stride_bs_n, stride_bs_k, stride_out_e, stride_out_m, SEGMENT: gl.constexpr,
                    B_SCALE_GROUP: gl.constexpr, EPI_SPLIT: gl.constexpr, GROUP_M: gl.constexpr,
                    STAGES: gl.constexpr, NUM_PROGRAMS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                    LOADER_REGS: gl.constexpr, WINDOW: gl.constexpr, E_PAD: gl.constexpr):
        """See the module docstring. "rows": M = R rows, K = K, out [R, N]. "k": M rows of a [M, R], N rows of
        b [N, R], K = R, out [E, M, N]; WINDOW: one window of the rows, phase_ptr [E] int32, carries [M, N] fp32,
        E_PAD: E rounded up to a power of two."""
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
        if SEGMENT == "k":  # the scales ride in the ring with their step's operands
            sa_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], sa_desc.layout)
            sb_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N], sb_desc.layout)
        else:
            sa_bufs = a_bufs
            sb_bufs = b_bufs
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)  # the loader's expect + the TMA bytes
            mbarrier.init(empty.index(i), count=2)  # both consumers
        fence_async_shared()
        num_n_tiles = gl.cdiv(N, BLOCK_N)
        if SEGMENT == "rows":
            num_m_tiles = gl.load(expert_offsets_ptr + num_experts) // BLOCK_M  # used tiles only, no host sync
            num_tiles = num_m_tiles * num_n_tiles
        else:
            num_m_tiles = gl.cdiv(M, BLOCK_M)
            num_tiles = num_experts * num_m_tiles * num_n_tiles
        first_expert = 0
        if WINDOW:  # the window's experts only (rows lie in expert order: a range of ids)
            first_expert, active_experts = _window_experts(phase_ptr, num_experts, E_PAD)
            num_tiles = active_experts * num_m_tiles * num_n_tiles
        gl.warp_specialize([
            (_consumer, (a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty, a_scale_ptr, b_scale_ptr, out_ptr,
                         phase_ptr, carry_in_ptr, carry_out_ptr, tile_expert_ptr, expert_offsets_ptr, sched_block_m,
                         num_tiles, num_m_tiles, num_n_tiles, M, N, K, first_expert, stride_as_m, stride_as_k,
                         stride_bs_e, stride_bs_n, stride_bs_k, stride_out_e, stride_out_m, 0, SEGMENT, B_SCALE_GROUP,
                         EPI_SPLIT, GROUP_M, STAGES, NUM_PROGRAMS, WINDOW)),
            (_consumer, (a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty, a_scale_ptr, b_scale_ptr, out_ptr,
                         phase_ptr, carry_in_ptr, carry_out_ptr, tile_expert_ptr, expert_offsets_ptr, sched_block_m,
                         num_tiles, num_m_tiles, num_n_tiles, M, N, K, first_expert, stride_as_m, stride_as_k,
                         stride_bs_e, stride_bs_n, stride_bs_k, stride_out_e, stride_out_m, 1, SEGMENT, B_SCALE_GROUP,
                         EPI_SPLIT, GROUP_M, STAGES, NUM_PROGRAMS, WINDOW)),
            (_loader, (a_desc, b_desc, sa_desc, sb_desc, a_bufs, b_bufs, sa_bufs, sb_bufs, ready, empty,
                       tile_expert_ptr, expert_offsets_ptr, sched_block_m, num_tiles, num_m_tiles, num_n_tiles, N,
                       K, first_expert, stride_as_k, stride_bs_k, SEGMENT, GROUP_M, STAGES, NUM_PROGRAMS)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])

    @functools.lru_cache(maxsize=None)
    def _fp8_layout(shape: tuple):
        return gl.NVMMASharedLayout.get_default_for(list(shape), gl.float8e4nv)

    def _descriptor(t, block: list):
        """A host-side TMA descriptor of an fp8 tensor in `block` boxes (128-byte swizzle, K-major)."""
        return TensorDescriptor.from_tensor(t, block, _fp8_layout(tuple(block)))

    def _scale_descriptor(t, block: int):
        """A host-side TMA descriptor of a flat fp32 scale table in runs of `block` (no swizzle)."""
        return TensorDescriptor.from_tensor(t.view(-1), [block], gl.NVMMASharedLayout(0, 32, rank=1))


def _launch(a2d, b2d, a_scale, b_scale, out, schedule: Schedule, *, segment: str, m: int, n: int, k: int,
            a_scale_strides: tuple, b_scale_strides: tuple, b_scale_group: int, out_strides: tuple, num_tiles_max: int,
            config: Fp8GluonConfig, window=None):
    num_programs = max(1, min(common.num_sms(a2d.device.index), num_tiles_max))
    a_desc, b_desc = _descriptor(a2d, [BLOCK_M, BLOCK_K]), _descriptor(b2d, [config.block_n, BLOCK_K])
    if segment == "k":  # [KB, rows padded] tables: a step's scales of a tile are one contiguous run
        sa_desc, sb_desc = _scale_descriptor(a_scale, BLOCK_M), _scale_descriptor(b_scale, config.block_n)
    else:
        sa_desc, sb_desc = a_desc, b_desc  # not read
    phase, carry_in, carry_out = (None,) * 3 if window is None else (window.expert_phase, window.carry_in,
                                                                      window.carry_out)
    _fp8_kernel[(num_programs,)](
        a_desc, b_desc, sa_desc, sb_desc, a_scale, b_scale, out, phase, carry_in, carry_out,
        schedule.tile_expert, schedule.expert_offsets, schedule.num_experts, schedule.block_m, m, n, k,
        *a_scale_strides, *b_scale_strides, *out_strides,
        SEGMENT=segment, B_SCALE_GROUP=b_scale_group, EPI_SPLIT=config.epi_split, GROUP_M=config.group_m,
        STAGES=config.stages, NUM_PROGRAMS=num_programs, CONSUMER_REGS=232, LOADER_REGS=40, WINDOW=window is not None,
        E_PAD=triton.next_power_of_2(schedule.num_experts), num_warps=4, maxnreg=168)


def grouped_gemm(a_data, a_scale, b_data, b_scale, schedule: Schedule, out, config: Fp8GluonConfig | None = None):
    """`fp8_gemm.grouped_gemm` on this engine (operands already checked there): writes out bf16 [R, N]."""
    num_rows, k = a_data.shape
    num_experts, n, _ = b_data.shape
    config = config or fp8_gluon_config(n)
    _check_config(config)
    if num_rows == 0 or n == 0:
        return out
    num_tiles_max = (num_rows // BLOCK_M) * common.cdiv(n, config.block_n)
    _launch(a_data, b_data.view(num_experts * n, k), a_scale, b_scale, out, schedule, segment="rows", m=num_rows,
            n=n, k=k, a_scale_strides=tuple(a_scale.stride()), b_scale_strides=tuple(b_scale.stride()),
            b_scale_group=128, out_strides=(0, out.stride(0)), num_tiles_max=num_tiles_max, config=config)
    return out


def weight_grad(a_data, a_scale, b_data, b_scale, schedule: Schedule, out, config: Fp8GluonConfig | None = None,
                window=None):
    """`fp8_gemm.weight_grad` on this engine (operands and `window` already checked there): writes out bf16
    [E, M, N] (with a window: its FINISH experts' gradients, and the CARRY_OUT expert's sums to its carry)."""
    m, num_rows = a_data.shape
    n = b_data.shape[0]
    config = config or fp8_gluon_config(n, weight_grad=True)
    _check_config(config)
    if out.numel() == 0:
        return out
    num_tiles_max = schedule.num_experts * common.cdiv(m, BLOCK_M) * common.cdiv(n, config.block_n)
    # both operands' per-row scales as [R/128, rows padded to whole tiles] (zeros past M and N), so a K step's
    # scales for a tile are one contiguous run and the kernel loads them without masks
    a_scale_t = _scales_by_step(a_scale, BLOCK_M)
    b_scale_t = _scales_by_step(b_scale, config.block_n)
    _launch(a_data, b_data, a_scale_t, b_scale_t, out, schedule, segment="k", m=m, n=n, k=num_rows,
            a_scale_strides=(1, a_scale_t.stride(0)), b_scale_strides=(0, 1, b_scale_t.stride(0)),
            b_scale_group=1, out_strides=(out.stride(0), out.stride(1)), num_tiles_max=num_tiles_max,
            config=config, window=window)
    return out


def _scales_by_step(scale, tile: int):
    """scale fp32 [M, KB] -> [KB, M rounded up to a multiple of tile], zeros past M (one copy kernel where M is
    a multiple of tile, as the layer's M and N are; else a fill too)."""
    rows, steps = scale.shape
    padded = common.cdiv(rows, tile) * tile
    if padded == rows:
        return scale.t().contiguous()
    out = scale.new_zeros(steps, padded)
    out[:, :rows] = scale.t()
    return out
