"""The cooperative engine: a warp-specialised grouped GEMM in Gluon (sm_90, Triton 3.6) on cooperative
128 x 256 tiles, the tile shape SonicMoE's Hopper GEMMs run in. Two epilogues (EPILOGUE):

* "swiglu_fwd": gate/up + SwiGLU. The weight tile is w_gate's [128, 64] over w_up's, so [gate | up] is one
  N = 256 accumulator and each SwiGLU pair sits in one thread. Each consumer rounds its [64, 128] gate and
  up to bf16, computes h and stores the three (gate and up into their packed rows). With A_GATHER the
  loader gathers x's rows itself (cp.async), so no gather pass runs before it.
* "store": a plain bf16 store of the [128, 256] tile: down (W_NK: weights [E, N, K]) and the gate/up dgrad
  (weights [E, K, N], K_SPLIT: A's first K columns against w_gate, the next K against w_up, one
  accumulator).

Roles: a loader (one warp with TMA for A, or four warps gathering A with cp.async, each thread's copies
arriving on the stage's `ready` barrier by themselves) feeds a STAGES-deep ring of [128, 64] A and
[256, 64] / [64, 256] weight slots. Two consumer warp groups work on every tile together, rows 0-63 and
64-127 (cooperative: both read every stage; `empty` counts both). Against 128 x 128 tiles a stage carries
half the A bytes per flop, so a gathering loader has half the copies to issue per MMA cycle. The epilogue
is not overlapped with MMAs: the consumers store [64, EPI_N] column chunks with 16-byte pointer stores,
which leaves the shared memory to the ring.

The weights are read in place as 2-D TMA views (`serval.weight_layout.as_rows`): [E * N, K] with the tile at row
e * W_ROWS + n0 (an N-tile past N reads the next rows into columns the stores drop), or [E * K, N] with the
K-tile at row e * W_ROWS + k, so `gluon_common.takes` asks K % 64 == 0 there. W_ROWS is the rows from one
expert to the next: N or K for a contiguous weight, 2I for the halves of a joined gate/up weight (w_up's view
then starts I rows into it).

Determinism and results: as the Triton GEMM (K in BLOCK_K steps, one program per output element); every
output equals it bit for bit (tests/test_kernels_coop.py). The mbarrier waits need no time bound: every
arrival they wait for is made unconditionally by the same program.
"""

from __future__ import annotations


from ..weight_layout import as_rows, expert_rows
from ..plan import GluonConfig
from ..schedule import Schedule, packed_index
from . import common, gluon_common, swiglu

if gluon_common.GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)

    from .gluon_common import column_chunks, descriptor, halves

    @gluon.jit
    def _loader(a_desc, w0_desc, w1_desc, a_bufs, w_bufs, ready, empty, tile_expert_ptr, sched_block_m, num_tiles,
                num_m_tiles, num_n_tiles, N_OUT, K, W_ROWS, x_ptr, row_source_ptr, top_k, EPILOGUE: gl.constexpr,
                W_NK: gl.constexpr, K_SPLIT: gl.constexpr, A_GATHER: gl.constexpr, GROUP_M: gl.constexpr,
                STAGES: gl.constexpr, NUM_PROGRAMS: gl.constexpr):
        BLOCK_M: gl.constexpr = a_bufs.shape[1]
        BLOCK_K: gl.constexpr = a_bufs.shape[2]
        BLOCK_N: gl.constexpr = w_bufs.shape[1] if W_NK else w_bufs.shape[2]
        TILE_N: gl.constexpr = BLOCK_N // 2 if EPILOGUE == "swiglu_fwd" else BLOCK_N  # output columns per tile
        VEC: gl.constexpr = 128 // a_desc.dtype.primitive_bitwidth  # 16-byte copies
        gather_layout: gl.constexpr = gl.BlockedLayout([1, VEC], [32 * VEC // BLOCK_K, BLOCK_K // VEC],
                                                       [gl.num_warps(), 1], [1, 0])
        w_bytes: gl.constexpr = w0_desc.block_type.nbytes * (BLOCK_N // TILE_N)
        if A_GATHER:
            # K (x's row length) is a multiple of VEC (host-checked: 16-byte rows); rewritten so that the compiler
            # sees it too, else it cannot prove a row's start or its column mask 16-byte uniform and cp.async,
            # which copies at least 4 bytes, fails to compile where K % 16 != 0
            K = K // VEC * VEC
        k_steps = gl.cdiv(K, BLOCK_K)
        a_steps = 2 * k_steps if K_SPLIT else k_steps  # K_SPLIT: A's columns run over both weights' K
        count = 0
        for tile_id in range(gl.program_id(0), num_tiles, NUM_PROGRAMS):
            m_tile, n_tile = common.tile_coords(tile_id, num_m_tiles, num_n_tiles, GROUP_M)
            m0 = m_tile * BLOCK_M
            n0 = n_tile * TILE_N
            expert = gl.load(tile_expert_ptr + m0 // sched_block_m)
            if A_GATHER:  # x rows (token = row_source // top_k), zeros on padding rows
                source = gl.load(row_source_ptr + m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, gather_layout)))
                row_ok = source >= 0
                x_rows = x_ptr + gl.where(row_ok, source // top_k, 0).to(gl.int64) * K
                cols = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, gather_layout))
            for kk in range(a_steps):
                slot = count % STAGES
                mbarrier.wait(empty.index(slot), ((count // STAGES) & 1) ^ 1)
                w_slot = w_bufs.index(slot)
                if A_GATHER:
                    mbarrier.expect(ready.index(slot), w_bytes)
                else:
                    mbarrier.expect(ready.index(slot), a_desc.block_type.nbytes + w_bytes)
                    tma.async_copy_global_to_shared(a_desc, [m0, kk * BLOCK_K], ready.index(slot), a_bufs.index(slot))
                if EPILOGUE == "swiglu_fwd":  # w_gate's tile over w_up's
                    w_coords = [expert * W_ROWS + n0, kk * BLOCK_K]
                    tma.async_copy_global_to_shared(w0_desc, w_coords, ready.index(slot), w_slot.slice(0, TILE_N))
                    tma.async_copy_global_to_shared(w1_desc, w_coords, ready.index(slot), w_slot.slice(TILE_N, TILE_N))
                elif W_NK:
                    tma.async_copy_global_to_shared(w0_desc, [expert * W_ROWS + n0, kk * BLOCK_K], ready.index(slot),
                                                    w_slot)
                elif K_SPLIT:
                    if kk < k_steps:
                        tma.async_copy_global_to_shared(w0_desc, [expert * W_ROWS + kk * BLOCK_K, n0], ready.index(slot),
                                                        w_slot)
                    else:
                        tma.async_copy_global_to_shared(w1_desc, [expert * W_ROWS + (kk - k_steps) * BLOCK_K, n0],
                                                        ready.index(slot), w_slot)
                else:
                    tma.async_copy_global_to_shared(w0_desc, [expert * W_ROWS + kk * BLOCK_K, n0], ready.index(slot),
                                                    w_slot)
                if A_GATHER:
                    k_cols = kk * BLOCK_K + cols
                    async_copy.async_copy_global_to_shared(a_bufs.index(slot), x_rows[:, None] + k_cols[None, :],
                                                           mask=row_ok[:, None] & (k_cols < K)[None, :])
                    async_copy.mbarrier_arrive(ready.index(slot), increment_count=False)
                count += 1

    @gluon.jit
    def _consumer(a_bufs, w_bufs, ready, empty, num_tiles, num_m_tiles, num_n_tiles, N_OUT, K, packed_ptr,
                  gate_up_ptr, out_ptr, swiglu_limit, CONSUMER: gl.constexpr, EPILOGUE: gl.constexpr,
                  W_NK: gl.constexpr, K_SPLIT: gl.constexpr, HAS_LIMIT: gl.constexpr, EPI_SPLIT: gl.constexpr,
                  GROUP_M: gl.constexpr, STAGES: gl.constexpr, NUM_PROGRAMS: gl.constexpr):
        BLOCK_M: gl.constexpr = a_bufs.shape[1]
        BLOCK_K: gl.constexpr = a_bufs.shape[2]
        BLOCK_N: gl.constexpr = w_bufs.shape[1] if W_NK else w_bufs.shape[2]
        TILE_N: gl.constexpr = BLOCK_N // 2 if EPILOGUE == "swiglu_fwd" else BLOCK_N
        HALF_M: gl.constexpr = BLOCK_M // 2  # this consumer's rows of the tile
        EPI_N: gl.constexpr = TILE_N // EPI_SPLIT
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BLOCK_N, 16])
        chunk_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                               instr_shape=[16, EPI_N, 16])
        VEC: gl.constexpr = 8  # bf16, 16-byte stores
        store_layout: gl.constexpr = gl.BlockedLayout([1, VEC], [32 * VEC // EPI_N, EPI_N // VEC], [4, 1], [1, 0])
        k_steps = gl.cdiv(K, BLOCK_K)
        a_steps = 2 * k_steps if K_SPLIT else k_steps
        count = 0
        for tile_id in range(gl.program_id(0), num_tiles, NUM_PROGRAMS):
            m_tile, n_tile = common.tile_coords(tile_id, num_m_tiles, num_n_tiles, GROUP_M)
            r0 = m_tile * BLOCK_M + CONSUMER * HALF_M
            n0 = n_tile * TILE_N
            acc = gl.zeros((HALF_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
            prev_slot = 0
            for kk in range(a_steps):
                slot = count % STAGES
                mbarrier.wait(ready.index(slot), (count // STAGES) & 1)
                a = a_bufs.index(slot).slice(CONSUMER * HALF_M, HALF_M)
                if W_NK:
                    b = w_bufs.index(slot).permute((1, 0))
                else:
                    b = w_bufs.index(slot)
                acc = warpgroup_mma(a, b, acc, is_async=True)
                acc = warpgroup_mma_wait(1, deps=(acc,))  # the previous step's MMA has retired: free its slot
                mbarrier.arrive(empty.index(prev_slot), pred=kk > 0)
                prev_slot = slot
                count += 1
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(empty.index(prev_slot))

            rows = r0 + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, store_layout))
            out_rows = out_ptr + rows.to(gl.int64)[:, None] * N_OUT
            if EPILOGUE == "swiglu_fwd":
                # gate_up is kept rounded; h is computed from the rounded values, as the Triton GEMM does
                packed = gl.load(packed_ptr + rows)
                gate_acc, up_acc = halves(acc)
                gate_chunks = column_chunks(gate_acc, EPI_SPLIT)
                up_chunks = column_chunks(up_acc, EPI_SPLIT)
                for c in gl.static_range(EPI_SPLIT):
                    gate = gl.convert_layout(gate_chunks[c], chunk_layout, assert_trivial=True).to(gl.bfloat16)
                    up = gl.convert_layout(up_chunks[c], chunk_layout, assert_trivial=True).to(gl.bfloat16)
                    h = swiglu.forward(gate, up, swiglu_limit, HAS_LIMIT).to(gl.bfloat16)
                    cols = n0 + c * EPI_N + gl.arange(0, EPI_N, layout=gl.SliceLayout(0, store_layout))
                    col_ok = (cols < N_OUT)[None, :]
                    packed_ptrs = gate_up_ptr + packed.to(gl.int64)[:, None] * (2 * N_OUT) + cols[None, :]
                    packed_mask = (packed >= 0)[:, None] & col_ok
                    gl.store(packed_ptrs, gl.convert_layout(gate, store_layout), mask=packed_mask)
                    gl.store(packed_ptrs + N_OUT, gl.convert_layout(up, store_layout), mask=packed_mask)
                    gl.store(out_rows + cols[None, :], gl.convert_layout(h, store_layout), mask=col_ok)
            else:
                chunks = column_chunks(acc, EPI_SPLIT)
                for c in gl.static_range(EPI_SPLIT):
                    value = gl.convert_layout(chunks[c], chunk_layout, assert_trivial=True).to(gl.bfloat16)
                    cols = n0 + c * EPI_N + gl.arange(0, EPI_N, layout=gl.SliceLayout(0, store_layout))
                    gl.store(out_rows + cols[None, :], gl.convert_layout(value, store_layout),
                             mask=(cols < N_OUT)[None, :])

    @gluon.jit
    def _cooperative_kernel(a_desc, w0_desc, w1_desc, tile_expert_ptr, expert_offsets_ptr, num_experts,
                            sched_block_m, N_OUT, K, W_ROWS, x_ptr, row_source_ptr, top_k, packed_ptr, gate_up_ptr, out_ptr,
                            swiglu_limit, EPILOGUE: gl.constexpr, W_NK: gl.constexpr, K_SPLIT: gl.constexpr,
                            A_GATHER: gl.constexpr, HAS_LIMIT: gl.constexpr, EPI_SPLIT: gl.constexpr,
                            GROUP_M: gl.constexpr, STAGES: gl.constexpr, NUM_PROGRAMS: gl.constexpr,
                            CONSUMER_REGS: gl.constexpr, LOADER_WARPS: gl.constexpr, LOADER_REGS: gl.constexpr):
        """See the module docstring; out_ptr is h ("swiglu_fwd") or C ("store"), [R, N_OUT] either way."""
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        dtype: gl.constexpr = a_desc.dtype
        a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
        if EPILOGUE == "swiglu_fwd":  # [gate | up]: two [TILE_N, BLOCK_K] boxes
            w_bufs = gl.allocate_shared_memory(dtype, [STAGES, 2 * w0_desc.block_type.shape[0], BLOCK_K],
                                               w0_desc.layout)
        else:
            w_box: gl.constexpr = w0_desc.block_type.shape
            w_bufs = gl.allocate_shared_memory(dtype, [STAGES, w_box[0], w_box[1]], w0_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):  # ready: the TMA bytes' expect, and each gathering thread's arrival
            mbarrier.init(ready.index(i), count=1 + (LOADER_WARPS * 32 if A_GATHER else 0))
            mbarrier.init(empty.index(i), count=2)  # both consumers
        fence_async_shared()
        num_m_tiles = gl.load(expert_offsets_ptr + num_experts) // BLOCK_M  # used tiles only, no host sync
        BLOCK_N: gl.constexpr = w_bufs.shape[1] if W_NK else w_bufs.shape[2]
        num_n_tiles = gl.cdiv(N_OUT, BLOCK_N // 2 if EPILOGUE == "swiglu_fwd" else BLOCK_N)
        num_tiles = num_m_tiles * num_n_tiles
        gl.warp_specialize([
            (_consumer, (a_bufs, w_bufs, ready, empty, num_tiles, num_m_tiles, num_n_tiles, N_OUT, K, packed_ptr,
                         gate_up_ptr, out_ptr, swiglu_limit, 0, EPILOGUE, W_NK, K_SPLIT, HAS_LIMIT, EPI_SPLIT,
                         GROUP_M, STAGES, NUM_PROGRAMS)),
            (_consumer, (a_bufs, w_bufs, ready, empty, num_tiles, num_m_tiles, num_n_tiles, N_OUT, K, packed_ptr,
                         gate_up_ptr, out_ptr, swiglu_limit, 1, EPILOGUE, W_NK, K_SPLIT, HAS_LIMIT, EPI_SPLIT,
                         GROUP_M, STAGES, NUM_PROGRAMS)),
            (_loader, (a_desc, w0_desc, w1_desc, a_bufs, w_bufs, ready, empty, tile_expert_ptr, sched_block_m,
                       num_tiles, num_m_tiles, num_n_tiles, N_OUT, K, W_ROWS, x_ptr, row_source_ptr, top_k, EPILOGUE,
                       W_NK,
                       K_SPLIT, A_GATHER, GROUP_M, STAGES, NUM_PROGRAMS)),
        ], [4, LOADER_WARPS], [CONSUMER_REGS, LOADER_REGS])


def _launch(a, w0, w1, *, schedule: Schedule, n_out: int, k: int, epilogue: str, w_nk: bool, k_split: bool,
            gather: bool, out, config: GluonConfig, swiglu_limit=None, gate_up=None):
    """w0, w1: the weights [E, N, K] if w_nk, else [E, K, N], rows dense and one layout (`serval.weight_layout`), read
    as 2-D TMA views; a: rows [R, K] (K_SPLIT: [R, 2K]) or, gathering, the tokens."""
    w_rows = expert_rows(w0)
    w0, w1 = as_rows(w0), as_rows(w1)
    block_m, block_k, block_n = 128, 64, 256
    tile_n = block_n // 2 if epilogue == "swiglu_fwd" else block_n
    w_box = [tile_n, block_k] if w_nk else [block_k, block_n]
    num_tiles = (schedule.capacity // block_m) * common.cdiv(n_out, tile_n)
    num_programs = max(1, min(common.num_sms(a.device.index), num_tiles))
    _cooperative_kernel[(num_programs,)](
        descriptor(a, [block_m, block_k]), descriptor(w0, w_box), descriptor(w1, w_box),
        schedule.tile_expert, schedule.expert_offsets, schedule.num_experts, schedule.block_m, n_out, k, w_rows, a,
        schedule.row_source, schedule.top_k, packed_index(schedule) if gate_up is not None else schedule.row_source,
        gate_up if gate_up is not None else out, out, float(swiglu_limit) if swiglu_limit is not None else 0.0,
        EPILOGUE=epilogue, W_NK=w_nk, K_SPLIT=k_split, A_GATHER=gather, HAS_LIMIT=swiglu_limit is not None,
        EPI_SPLIT=config.epi_split, GROUP_M=config.group_m, STAGES=config.stages, NUM_PROGRAMS=num_programs,
        CONSUMER_REGS=232, LOADER_WARPS=4 if gather else 1, LOADER_REGS=40, num_warps=4, maxnreg=168)


def gate_up_swiglu(x, w_gate, w_up, schedule: Schedule, swiglu_limit, config: GluonConfig, *, gather: bool):
    """Gate/up + SwiGLU on the cooperative engine.

    x bf16: the gathered rows [R, H], or with gather=True the tokens [N, H], gathered by the loader
    (cp.async); w_gate, w_up bf16 [E, I, H]. Returns gate_up bf16 [num_packed, 2I] (packed rows) and
    h bf16 [R, I]."""
    _, inter, hidden = w_gate.shape
    gate_up = common.empty((schedule.num_packed, 2 * inter), x.dtype, x.device)
    h = common.empty((schedule.capacity, inter), x.dtype, x.device)
    _launch(x, w_gate, w_up, schedule=schedule,
            n_out=inter, k=hidden, epilogue="swiglu_fwd", w_nk=True, k_split=False, gather=gather, out=h,
            config=config, swiglu_limit=swiglu_limit, gate_up=gate_up)
    return gate_up, h


def down(h, w_down, schedule: Schedule, config: GluonConfig):
    """The down GEMM on the cooperative engine: h bf16 [R, I], w_down bf16 [E, H, I] -> o bf16 [R, H] =
    h @ w_down[e].T."""
    _, hidden, inter = w_down.shape
    out = common.empty((schedule.capacity, hidden), h.dtype, h.device)
    _launch(h, w_down, w_down, schedule=schedule, n_out=hidden, k=inter, epilogue="store", w_nk=True, k_split=False,
            gather=False, out=out, config=config)
    return out


def gate_up_dgrad(d_gate_up, w_gate, w_up, schedule: Schedule, config: GluonConfig):
    """The gate/up dgrad on the cooperative engine: d_gate_up bf16 [R, 2I], w_gate, w_up bf16 [E, I, H] ->
    d_x_rows bf16 [R, H] = d_gate @ w_gate[e] + d_up @ w_up[e], one accumulation over K = 2I."""
    _, inter, hidden = w_gate.shape
    out = common.empty((schedule.capacity, hidden), d_gate_up.dtype, d_gate_up.device)
    _launch(d_gate_up, w_gate, w_up, schedule=schedule, n_out=hidden, k=inter, epilogue="store", w_nk=False, k_split=True, gather=False,
            out=out, config=config)
    return out
