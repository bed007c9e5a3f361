"""The ping-pong engine: a warp-specialised grouped GEMM in Gluon (sm_90, Triton 3.6) for the down dgrad
fused with the SwiGLU backward, whose large epilogue runs beside the other consumer's MMAs.

The Triton GEMM (`triton_gemm`) runs each tile's epilogue between its own MMAs, so that SM's tensor cores
idle while the epilogue loads, computes and stores. This kernel is the same grouped GEMM over the
schedule's M-tiles with three warp roles per program:

* a loader warp issues TMA loads of (A, W) K-tiles into a ring of STAGES shared-memory slots, each
  guarded by a `ready` (bytes landed) and an `empty` (MMA retired) mbarrier;
* two consumer warp groups (4 warps, 232 registers per thread each) take alternate tiles of the
  program's list (ping-pong): one runs its epilogue while the other's wgmmas run. They run their K loops
  in tile order (the `turn` barriers): an mbarrier wait sees only a phase's parity, so a consumer a
  whole tile ahead of the ring would pass a wait meant for a later phase.

Layouts: A (d_y_rows) is a row-major [R, K] buffer read through TMA. The weight w_down [E, H, I] =
[E, K, N] is read in place as one 2-D TMA view [E * K, N], the tile at row e * K + k (so K must be a
whole number of K-tiles: `gluon_common.takes`).

The epilogue (d_h_raw = d_y_rows @ w_down[e]): the SwiGLU backward and the router-weight gradient's row
partials (`swiglu.backward`, as in the Triton GEMM). The program's epilogues take turns (`epi_turn`) on
one set of tile buffers (gate, up, h: 96 KB beside a 4-stage ring): TMA brings the tile's packed gate and
up in (a tile's rows that hold a source come first, with consecutive packed indices), fetched by the
previous epilogue so that they land during this tile's K loop; the accumulator is processed in EPI_SPLIT
column chunks of its wgmma layout (fewer live fp32 temporaries), each chunk's outputs overwriting its
inputs in place (every thread writes the elements it read: no barrier) and filling h; TMA stores take
the tile out. The router-weight gradient's row partials, one per 16 columns, are summed in the order
`swiglu.d_rw_group_sums` fixes for every engine, and over a row's groups by `triton_gemm.sum_partials`.

Determinism: one program writes each output element, the K loop has one order (BLOCK_K steps, wgmma),
no atomics; d_gate_up, h_weighted and the router-weight gradient's partials equal the Triton GEMM's bit for
bit. The mbarrier waits need no time bound: every arrival they wait for is made unconditionally by the same
program (TMA completion, a sibling warp's progress), as in any software-pipelined GEMM; serval's bound applies
to waits on other programs and GPUs.
"""

from __future__ import annotations

from ..plan import GluonConfig
from ..schedule import Schedule, packed_index
from . import common, gluon_common, swiglu
from .gemm_tile import check_d_rw_chunks, new_d_rw_partial

if gluon_common.GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from .gluon_common import column_chunks, descriptor

    @gluon.jit
    def _loader(a_desc, w_desc, a_bufs, w_bufs, ready, empty, tile_expert_ptr, sched_block_m, num_tiles,
                num_m_tiles, num_n_tiles, K, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                NUM_PROGRAMS: gl.constexpr, BLOCK_N: gl.constexpr):
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        k_steps = gl.cdiv(K, BLOCK_K)
        count = 0
        for tile_id in range(gl.program_id(0), num_tiles, NUM_PROGRAMS):
            m_tile, n_tile = common.tile_coords(tile_id, num_m_tiles, num_n_tiles, GROUP_M)
            m0 = m_tile * BLOCK_M
            n0 = n_tile * BLOCK_N
            expert = gl.load(tile_expert_ptr + m0 // sched_block_m)
            for kk in range(k_steps):
                slot = count % STAGES
                mbarrier.wait(empty.index(slot), ((count // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(slot), a_desc.block_type.nbytes + w_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(a_desc, [m0, kk * BLOCK_K], ready.index(slot), a_bufs.index(slot))
                tma.async_copy_global_to_shared(w_desc, [expert * K + kk * BLOCK_K, n0], ready.index(slot),
                                                w_bufs.index(slot))
                count += 1

    @gluon.jit
    def _fetch_pre_activations(gate_desc, up_desc, gate_bufs, up_bufs, ready, packed_ptr, m0, n0):
        """TMA loads of the packed gate and up of the tile at (m0, n0) in two column halves: a tile's rows
        that hold a source come first, with consecutive packed indices from packed[m0]."""
        HALF_N: gl.constexpr = gate_desc.block_type.shape[1]
        first_packed = gl.load(packed_ptr + m0)
        mbarrier.expect(ready, 4 * gate_desc.block_type.nbytes)
        for half in gl.static_range(2):
            tma.async_copy_global_to_shared(gate_desc, [first_packed, n0 + half * HALF_N], ready,
                                            gate_bufs.index(half))
            tma.async_copy_global_to_shared(up_desc, [first_packed, n0 + half * HALF_N], ready,
                                            up_bufs.index(half))

    @gluon.jit
    def _chunk(bufs, c: gl.constexpr, EPI_N: gl.constexpr):
        """Column chunk c ([BLOCK_M, EPI_N]) of a tile kept as two [BLOCK_M, BLOCK_N // 2] halves."""
        HALF_N: gl.constexpr = bufs.shape[2]
        return bufs.index(c * EPI_N // HALF_N).slice(c * EPI_N % HALF_N, EPI_N, dim=1)

    @gluon.jit
    def _consumer(a_bufs, w_bufs, ready, empty, turn, gate_desc, gate_bufs, up_desc, dg_desc, du_desc, hw_desc,
                  up_bufs, h_bufs, epi_ready, epi_turn, num_tiles, num_m_tiles, num_n_tiles, K, row_source_ptr,
                  packed_ptr, router_weights_ptr, d_rw_partial_ptr, num_groups, swiglu_limit,
                  CONSUMER: gl.constexpr, HAS_LIMIT: gl.constexpr,
                  EPI_SPLIT: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                  NUM_PROGRAMS: gl.constexpr, BLOCK_N: gl.constexpr):
        BLOCK_M: gl.constexpr = a_bufs.shape[1]
        BLOCK_K: gl.constexpr = a_bufs.shape[2]
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BLOCK_N, 16])
        # the epilogue works on [BLOCK_M, EPI_N] column chunks of the accumulator, in place
        EPI_N: gl.constexpr = BLOCK_N // EPI_SPLIT
        chunk_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                               instr_shape=[16, EPI_N, 16])
        row_layout: gl.constexpr = gl.SliceLayout(1, chunk_layout)
        k_steps = gl.cdiv(K, BLOCK_K)
        seq = CONSUMER  # index of the tile in the program's list: the ring position follows from it
        for tile_id in range(gl.program_id(0) + CONSUMER * NUM_PROGRAMS, num_tiles, 2 * NUM_PROGRAMS):
            m_tile, n_tile = common.tile_coords(tile_id, num_m_tiles, num_n_tiles, GROUP_M)
            m0 = m_tile * BLOCK_M
            n0 = n_tile * BLOCK_N
            count = seq * k_steps
            # the epilogue's row data, loaded before the K loop
            rows = m0 + gl.arange(0, BLOCK_M, layout=row_layout)
            source = gl.load(row_source_ptr + rows)
            rw = gl.load(router_weights_ptr + source, mask=source >= 0, other=0.0)
            row_ok = gl.load(packed_ptr + rows) >= 0
            if seq == 0:  # the program's first epilogue fetches its own gate/up (later ones: see below)
                _fetch_pre_activations(gate_desc, up_desc, gate_bufs, up_bufs, epi_ready, packed_ptr, m0, n0)
            mbarrier.wait(turn.index(CONSUMER), ((seq // 2) & 1) ^ (1 - CONSUMER))
            acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
            prev_slot = 0
            for kk in range(k_steps):
                slot = count % STAGES
                mbarrier.wait(ready.index(slot), (count // STAGES) & 1)
                acc = warpgroup_mma(a_bufs.index(slot), w_bufs.index(slot), acc, is_async=True)
                acc = warpgroup_mma_wait(1, deps=(acc,))  # the previous step's MMA has retired: free its slot
                mbarrier.arrive(empty.index(prev_slot), pred=kk > 0)
                prev_slot = slot
                count += 1
            mbarrier.arrive(turn.index(1 - CONSUMER))
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(empty.index(prev_slot))

            # acc = d_y_rows @ w_down[e], the unscaled d_h. The program's epilogues take turns (epi_turn) on one
            # set of tile buffers: the tile's gate and up arrive by TMA (fetched by the previous epilogue, so they
            # land during this tile's K loop), each column chunk's outputs overwrite its inputs in place (every
            # thread writes exactly the elements it read, no barrier needed) and fill h_bufs, and the tile leaves
            # by TMA stores.
            mbarrier.wait(epi_turn.index(CONSUMER), ((seq // 2) & 1) ^ (1 - CONSUMER))
            mbarrier.wait(epi_ready, seq & 1)
            chunks = column_chunks(acc, EPI_SPLIT)
            for c in gl.static_range(EPI_SPLIT):
                gate_c = _chunk(gate_bufs, c, EPI_N)
                up_c = _chunk(up_bufs, c, EPI_N)
                d_h_raw = gl.convert_layout(chunks[c], chunk_layout, assert_trivial=True)
                # padding rows read their pre-activations as zeros, as the Triton kernel's masked loads do
                pre_gate = gate_c.load(chunk_layout)
                pre_gate = gl.where(row_ok[:, None], pre_gate, gl.zeros_like(pre_gate))
                pre_up = up_c.load(chunk_layout)
                pre_up = gl.where(row_ok[:, None], pre_up, gl.zeros_like(pre_up))
                d_gate, d_up, h_weighted, d_rw_terms = swiglu.backward(d_h_raw, pre_gate, pre_up, rw, swiglu_limit,
                                                                       HAS_LIMIT)
                gate_c.store(d_gate)
                up_c.store(d_up)
                _chunk(h_bufs, c, EPI_N).store(h_weighted)
                # the router-weight gradient's partials, one per 16 columns in swiglu's fixed tree: its first
                # levels within each thread, its last two, (q0 + q2) + (q1 + q3) with q_l in lane l of a quad, as
                # gl.sum's butterfly (xor 2, then xor 1; the same bits by commutativity), which uses no shared
                # memory (the kernel has none to spare). tests/test_gluon_pingpong.py checks the bits on the GPU.
                sums = gl.sum(swiglu.d_rw_group_quads(d_rw_terms), axis=2)  # stored from the lanes that hold them
                groups = (n0 + c * EPI_N) // 16 + gl.arange(0, EPI_N // 16,
                                                            layout=gl.SliceLayout(0, sums.type.layout))
                group_rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, sums.type.layout))
                gl.store(d_rw_partial_ptr + group_rows.to(gl.int64)[:, None] * num_groups + groups[None, :], sums,
                         mask=(groups < num_groups)[None, :])
            fence_async_shared()
            gl.thread_barrier()
            for half in gl.static_range(2):
                col = n0 + half * (BLOCK_N // 2)
                tma.async_copy_shared_to_global(dg_desc, [m0, col], gate_bufs.index(half))
                tma.async_copy_shared_to_global(du_desc, [m0, col], up_bufs.index(half))
                tma.async_copy_shared_to_global(hw_desc, [m0, col], h_bufs.index(half))
            tma.store_wait(0)  # the buffers are read out: the next tile's gate/up can come in
            gl.thread_barrier()
            next_tile = tile_id + NUM_PROGRAMS
            if next_tile < num_tiles:
                next_m, next_n = common.tile_coords(next_tile, num_m_tiles, num_n_tiles, GROUP_M)
                _fetch_pre_activations(gate_desc, up_desc, gate_bufs, up_bufs, epi_ready, packed_ptr,
                                       next_m * BLOCK_M, next_n * BLOCK_N)
            mbarrier.arrive(epi_turn.index(1 - CONSUMER))
            seq += 2

    @gluon.jit
    def _pingpong_kernel(a_desc, w_desc, gate_desc, up_desc, dg_desc, du_desc, hw_desc, tile_expert_ptr,
                         expert_offsets_ptr, num_experts, sched_block_m, N_OUT, K, row_source_ptr, packed_ptr,
                         router_weights_ptr, d_rw_partial_ptr, swiglu_limit, HAS_LIMIT: gl.constexpr,
                         EPI_SPLIT: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                         NUM_PROGRAMS: gl.constexpr, BLOCK_N: gl.constexpr,
                         CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr):
        """gate_desc / up_desc: the packed gate / up halves [num_packed, N_OUT]; dg_desc / du_desc: the d_gate /
        d_up halves of d_gate_up [R, N_OUT]; hw_desc: h_weighted [R, N_OUT]; all in [BLOCK_M, BLOCK_N // 2]
        boxes."""
        BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
        dtype: gl.constexpr = a_desc.dtype
        a_bufs = gl.allocate_shared_memory(dtype, [STAGES, a_desc.block_type.shape[0], a_desc.block_type.shape[1]],
                                           a_desc.layout)
        w_bufs = gl.allocate_shared_memory(dtype, [STAGES, w_desc.block_type.shape[0], w_desc.block_type.shape[1]],
                                           w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        # the epilogue's gate, up and h tile buffers (two column halves each, one TMA box), which the program's
        # epilogues use in turn (epi_turn); epi_ready: the tile's gate and up have landed
        gate_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_M, BLOCK_N // 2], gate_desc.layout)
        up_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_M, BLOCK_N // 2], up_desc.layout)
        h_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_M, BLOCK_N // 2], hw_desc.layout)
        epi_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        epi_turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(epi_turn.index(i), count=1)
        mbarrier.init(epi_ready, count=1)
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        fence_async_shared()

        # used tiles only: the count lives on the device, no host sync
        num_m_tiles = gl.load(expert_offsets_ptr + num_experts) // BLOCK_M
        num_n_tiles = gl.cdiv(N_OUT, BLOCK_N)
        num_tiles = num_m_tiles * num_n_tiles
        num_groups = gl.cdiv(N_OUT, 16)  # the router-weight gradient's partials per row
        gl.warp_specialize([
            (_consumer, (a_bufs, w_bufs, ready, empty, turn, gate_desc, gate_bufs, up_desc, dg_desc, du_desc,
                         hw_desc, up_bufs, h_bufs, epi_ready, epi_turn, num_tiles, num_m_tiles, num_n_tiles, K,
                         row_source_ptr, packed_ptr, router_weights_ptr, d_rw_partial_ptr, num_groups, swiglu_limit,
                         0, HAS_LIMIT, EPI_SPLIT, GROUP_M, STAGES, NUM_PROGRAMS, BLOCK_N)),
            (_consumer, (a_bufs, w_bufs, ready, empty, turn, gate_desc, gate_bufs, up_desc, dg_desc, du_desc,
                         hw_desc, up_bufs, h_bufs, epi_ready, epi_turn, num_tiles, num_m_tiles, num_n_tiles, K,
                         row_source_ptr, packed_ptr, router_weights_ptr, d_rw_partial_ptr, num_groups, swiglu_limit,
                         1, HAS_LIMIT, EPI_SPLIT, GROUP_M, STAGES, NUM_PROGRAMS, BLOCK_N)),
            (_loader, (a_desc, w_desc, a_bufs, w_bufs, ready, empty, tile_expert_ptr, sched_block_m, num_tiles,
                       num_m_tiles, num_n_tiles, K, GROUP_M, STAGES, NUM_PROGRAMS, BLOCK_N)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


# maxnreg 168 x 12 warps fills the register file; setmaxnreg then gives the consumers 232 each, the loader 40
_LAUNCH = dict(num_warps=4, maxnreg=168)


def down_dgrad_swiglu_partials(d_y_rows, w_down, gate_up, router_weights, schedule: Schedule, swiglu_limit,
                               config: GluonConfig, *, block_n: int = 128, block_k: int = 64):
    """The down dgrad + SwiGLU backward on the ping-pong engine, 128 x block_n tiles.

    d_y_rows bf16 [R, H]; w_down bf16 [E, H, I]; gate_up bf16 [num_packed, 2I] (packed); router_weights
    fp32 [N * k] (by source). Returns d_gate_up bf16 [R, 2I], h_weighted bf16 [R, I] and the router-weight
    gradient's row partials fp32 [R, ceil(I / 16)] (`triton_gemm.sum_partials` adds them)."""
    num_experts, hidden, inter = w_down.shape
    num_rows, block_m = schedule.capacity, 128
    num_n_tiles = common.cdiv(inter, block_n)
    check_d_rw_chunks("pingpong", block_n, config.epi_split)
    d_gate_up = common.empty((num_rows, 2 * inter), gate_up.dtype, gate_up.device)
    h_weighted = common.empty((num_rows, inter), gate_up.dtype, gate_up.device)
    d_rw_partial = new_d_rw_partial(num_rows, inter, gate_up.device)
    views = (gate_up[:, :inter], gate_up[:, inter:], d_gate_up[:, :inter], d_gate_up[:, inter:], h_weighted)
    max_tiles = (schedule.capacity // block_m) * num_n_tiles
    num_programs = max(1, min(common.num_sms(d_y_rows.device.index), max_tiles))
    _pingpong_kernel[(num_programs,)](
        descriptor(d_y_rows, [block_m, block_k]),
        descriptor(w_down.view(num_experts * hidden, inter), [block_k, block_n]),
        *(descriptor(t, [block_m, block_n // 2]) for t in views), schedule.tile_expert, schedule.expert_offsets,
        schedule.num_experts, schedule.block_m, inter, hidden, schedule.row_source, packed_index(schedule),
        router_weights, d_rw_partial, float(swiglu_limit) if swiglu_limit is not None else 0.0,
        HAS_LIMIT=swiglu_limit is not None, EPI_SPLIT=config.epi_split, GROUP_M=config.group_m, STAGES=config.stages,
        NUM_PROGRAMS=num_programs, BLOCK_N=block_n, CONSUMER_REGS=232, LOADER_REGS=40, **_LAUNCH)
    return d_gate_up, h_weighted, d_rw_partial
