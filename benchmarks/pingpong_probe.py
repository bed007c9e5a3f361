"""Probe for the next kernel step: a warp-specialised ping-pong grouped GEMM in Gluon (sm_90), `down` stage.

    python benchmarks/pingpong_probe.py [--soak 1]      # H200 with Triton 3.6 (Gluon's API moves between versions)

serval's Triton kernels run each tile's epilogue between its MMAs (Triton 3.6 has no working warp
specialisation for them on sm_90; grouped_gemm's docstring). This kernel is the structure that would
overlap them: a 1-warp TMA loader fills a ring of STAGES (A, W) tile pairs guarded by mbarriers; two
consumer warp groups (4 warps, 232 registers each) take alternate tiles of the program's list, so one
runs its epilogue (here a TMA store) while the other's wgmmas run. The consumers run their K loops in
tile order (the `turn` barriers): mbarrier waits see only a phase's parity, so a consumer a whole tile
ahead of the ring would pass a wait meant for a later phase (found the hard way: wrong results, crashes).

Not used by serval yet: with a plain store epilogue it only matches the Triton kernel (see BENCHMARKS.md);
the payoff is expected where the epilogue is heavy (the SwiGLU-backward dgrad). The script checks it
bitwise against serval's `down` (same fp32 accumulation order) on small cases that put several tiles on one
program, then times both on the SPEC shapes. Its mbarrier waits are unbounded (serval's rule: every wait has a
bound): a probe, not a kernel of the layer.
"""
import argparse
import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


@gluon.jit
def _tile_coords(tile_id, num_m_tiles, num_n_tiles, GROUP_M: gl.constexpr):
    tiles_per_group = GROUP_M * num_n_tiles
    first_m = (tile_id // tiles_per_group) * GROUP_M
    group_size = gl.minimum(num_m_tiles - first_m, GROUP_M)
    m_tile = first_m + (tile_id % tiles_per_group) % group_size
    n_tile = (tile_id % tiles_per_group) // group_size
    return m_tile, n_tile


@gluon.jit
def _loader(a_desc, w_desc, a_bufs, w_bufs, ready, empty, tile_expert_ptr, sched_block_m, num_tiles,
            num_m_tiles, num_n_tiles, N_OUT, K, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
            NUM_PROGRAMS: gl.constexpr):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    k_steps = gl.cdiv(K, BLOCK_K)
    count = 0
    for tile_id in range(gl.program_id(0), num_tiles, NUM_PROGRAMS):
        m_tile, n_tile = _tile_coords(tile_id, num_m_tiles, num_n_tiles, GROUP_M)
        m0 = m_tile * BLOCK_M
        expert = gl.load(tile_expert_ptr + m0 // sched_block_m)
        # w is addressed as [E * N_OUT, K]: with N_OUT % BLOCK_N != 0 a last N-tile would read the next
        # expert's rows into output columns past N_OUT, which the TMA store clips
        w_row = expert * N_OUT + n_tile * BLOCK_N
        for kk in range(k_steps):
            slot = count % STAGES
            mbarrier.wait(empty.index(slot), ((count // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(slot), a_desc.block_type.nbytes + w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [m0, kk * BLOCK_K], ready.index(slot), a_bufs.index(slot))
            tma.async_copy_global_to_shared(w_desc, [w_row, kk * BLOCK_K], ready.index(slot), w_bufs.index(slot))
            count += 1


@gluon.jit
def _consumer(c_desc, a_bufs, w_bufs, ready, empty, turn, c_bufs, num_tiles, num_m_tiles, num_n_tiles, K,
              CONSUMER: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, NUM_PROGRAMS: gl.constexpr):
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.shape[2]
    dtype: gl.constexpr = c_desc.dtype
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    c_smem = c_bufs.index(CONSUMER)
    k_steps = gl.cdiv(K, BLOCK_K)
    seq = CONSUMER  # index of the tile in the program's list: the ring position follows from it
    for tile_id in range(gl.program_id(0) + CONSUMER * NUM_PROGRAMS, num_tiles, 2 * NUM_PROGRAMS):
        m_tile, n_tile = _tile_coords(tile_id, num_m_tiles, num_n_tiles, GROUP_M)
        count = seq * k_steps
        # mainloops in the program's tile order: a consumer never waits on a ring slot more than one phase
        # ahead (mbarrier waits see phase parity only)
        mbarrier.wait(turn.index(CONSUMER), ((seq // 2) & 1) ^ (1 - CONSUMER))
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
        prev_slot = 0
        for kk in range(k_steps):
            slot = count % STAGES
            mbarrier.wait(ready.index(slot), (count // STAGES) & 1)
            acc = warpgroup_mma(a_bufs.index(slot), w_bufs.index(slot).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(1, deps=(acc,))  # the previous step's MMA has retired: free its slot
            mbarrier.arrive(empty.index(prev_slot), pred=kk > 0)
            prev_slot = slot
            count += 1
        mbarrier.arrive(turn.index(1 - CONSUMER))
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index(prev_slot))
        tma.store_wait(0)  # this consumer's previous tile has left c_smem
        gl.thread_barrier()
        c_smem.store(acc.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [m_tile * BLOCK_M, n_tile * BLOCK_N], c_smem)
        seq += 2
    tma.store_wait(0)


@gluon.jit
def _consumer0(c_desc, a_bufs, w_bufs, ready, empty, turn, c_bufs, num_tiles, num_m_tiles, num_n_tiles, K,
               GROUP_M: gl.constexpr, STAGES: gl.constexpr, NUM_PROGRAMS: gl.constexpr):
    _consumer(c_desc, a_bufs, w_bufs, ready, empty, turn, c_bufs, num_tiles, num_m_tiles, num_n_tiles, K,
              0, GROUP_M, STAGES, NUM_PROGRAMS)


@gluon.jit
def _consumer1(c_desc, a_bufs, w_bufs, ready, empty, turn, c_bufs, num_tiles, num_m_tiles, num_n_tiles, K,
               GROUP_M: gl.constexpr, STAGES: gl.constexpr, NUM_PROGRAMS: gl.constexpr):
    _consumer(c_desc, a_bufs, w_bufs, ready, empty, turn, c_bufs, num_tiles, num_m_tiles, num_n_tiles, K,
              1, GROUP_M, STAGES, NUM_PROGRAMS)


@gluon.jit
def pingpong_kernel(a_desc, w_desc, c_desc, tile_expert_ptr, expert_offsets_ptr, num_experts, sched_block_m,
                    N_OUT, K, GROUP_M: gl.constexpr, STAGES: gl.constexpr, NUM_PROGRAMS: gl.constexpr,
                    CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    dtype: gl.constexpr = a_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    w_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    c_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_M, BLOCK_N], c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()

    num_m_tiles = gl.load(expert_offsets_ptr + num_experts) // BLOCK_M
    num_n_tiles = gl.cdiv(N_OUT, BLOCK_N)
    num_tiles = num_m_tiles * num_n_tiles
    gl.warp_specialize([
        (_consumer0, (c_desc, a_bufs, w_bufs, ready, empty, turn, c_bufs, num_tiles, num_m_tiles, num_n_tiles, K,
                      GROUP_M, STAGES, NUM_PROGRAMS)),
        (_consumer1, (c_desc, a_bufs, w_bufs, ready, empty, turn, c_bufs, num_tiles, num_m_tiles, num_n_tiles, K,
                      GROUP_M, STAGES, NUM_PROGRAMS)),
        (_loader, (a_desc, w_desc, a_bufs, w_bufs, ready, empty, tile_expert_ptr, sched_block_m, num_tiles,
                   num_m_tiles, num_n_tiles, N_OUT, K, GROUP_M, STAGES, NUM_PROGRAMS)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


def descriptors(a, w2d, out, BM, BN, BK):
    lay = lambda shape: gl.NVMMASharedLayout.get_default_for(shape, gl.bfloat16)
    return (TensorDescriptor.from_tensor(a, [BM, BK], lay([BM, BK])),
            TensorDescriptor.from_tensor(w2d, [BN, BK], lay([BN, BK])),
            TensorDescriptor.from_tensor(out, [BM, BN], lay([BM, BN])))


def down_pingpong(h, w_down, schedule, BM=128, BN=128, BK=64, STAGES=4, GROUP_M=8, num_programs=None,
                  consumer_regs=232, loader_regs=40, maxnreg=168):
    """o [R, H] = h @ w_down[e].T as serval.kernels.grouped_gemm.down. maxnreg 168 x 12 warps fills the
    register file; the consumers get 232 each, the loader 40."""
    E, H, I = w_down.shape
    out = torch.empty(schedule.capacity, H, dtype=h.dtype, device=h.device)
    a_desc, w_desc, c_desc = descriptors(h, w_down.view(E * H, I), out, BM, BN, BK)
    if num_programs is None:
        num_programs = torch.cuda.get_device_properties(h.device).multi_processor_count
    pingpong_kernel[(num_programs,)](a_desc, w_desc, c_desc, schedule.tile_expert, schedule.expert_offsets, E,
                                     schedule.block_m, H, I, GROUP_M, STAGES, num_programs, consumer_regs, loader_regs,
                                     num_warps=4, maxnreg=maxnreg)
    return out


def check_small():
    """Several tiles per program and consumer, ring shorter than the K loop, three experts: bitwise."""
    from serval.kernels import grouped_gemm as gg
    from serval.schedule import build_schedule

    torch.manual_seed(0)
    E, H, I, N = 3, 256, 256, 256
    schedule = build_schedule((torch.arange(N, device="cuda") % E)[:, None], E, 128)
    h = torch.randn(schedule.capacity, I, device="cuda").to(torch.bfloat16)
    w = (torch.randn(E, H, I, device="cuda") * I**-0.5).to(torch.bfloat16)
    used = int(schedule.expert_offsets[-1])
    ref = gg.down(h, w, schedule)[:used]
    for kw in (dict(num_programs=1), dict(STAGES=2, num_programs=1), dict(STAGES=3, num_programs=3), {}):
        out = down_pingpong(h, w, schedule, **kw)[:used]
        print(f"small check {kw}: {'bitwise equal' if torch.equal(out, ref) else 'MISMATCH'}")
        assert torch.equal(out, ref)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", default=["qwen3-30b-a3b", "kimi-k2"])
    parser.add_argument("--soak", type=float, default=1.0)
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("pingpong_probe: needs a Hopper GPU (sm_90); not run")
        return 0
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from kernel_stages import SHAPES, make_inputs, timer

    from serval.kernels import grouped_gemm as gg

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    check_small()
    run_timed = timer(False, args.soak)
    for name in args.shapes:
        shape = SHAPES[name]
        data = make_inputs(shape, torch.device("cuda"), 128)
        schedule, w = data["schedule"], data["w_down"]
        h = torch.randn(schedule.capacity, shape["inter"], device="cuda").to(torch.bfloat16)
        used = int(schedule.expert_offsets[-1])
        ref = gg.down(h, w, schedule)
        flops = 2 * shape["tokens"] * shape["top_k"] * shape["hidden"] * shape["inter"]
        variants = {"triton (serval)": lambda: gg.down(h, w, schedule)}
        for stages in (4, 5):
            variants[f"gluon ping-pong S{stages}"] = lambda s=stages: down_pingpong(h, w, schedule, STAGES=s)
        for label, fn in variants.items():
            same = torch.equal(fn()[:used], ref[:used])
            ms = run_timed(fn)
            print(f"{name:14s} down  {label:22s} {ms:7.3f} ms {flops / ms / 1e9:6.1f} TFLOP/s  "
                  f"{'bitwise equal to serval' if same else 'MISMATCH'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
