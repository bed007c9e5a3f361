"""Grouped GEMMs of the expert MLPs: one persistent Triton kernel over the schedule's M-tiles.

Every stage GEMM of the layer has the same shape: rows of an operand A, grouped by
expert into M-tiles (see `serval.schedule`), times the weight of the tile's expert:

    C[r, n] = sum_k A[r, k] * B_e[k, n],   e = tile_expert[r // block_m]

and differs only in where A comes from, how B_e is stored, and what happens to the
fp32 accumulator before it is stored. `_grouped_gemm_kernel` is that one kernel; its
constexpr switches select the variant, so the compiler specialises each use:

* A_GATHER: A rows come from a token tensor x [N, K] through `row_source` (token =
  source // k, padding rows read as zeros): the gather fused into the GEMM. Otherwise
  A is a materialised [R, K] buffer (read through TMA when USE_TMA).
* W_NK: the weight is stored [E, Nout, K] (nn.Linear layout, C = A @ W[e].T: the
  forward GEMMs); otherwise [E, K, Nout] (C = A @ W[e]: the data gradients, which use
  the forward weights transposed). Both are read in place, never copied.
* K_SPLIT: K runs over two weights, the first K columns of A against w0 and the next
  K against w1, into one accumulator (gate_up_dgrad: d_gate @ w_gate + d_up @ w_up).
* EPILOGUE: "store" (plain bf16 store, or with PUSH each row straight into its owner's slot over the
  peers' buffers: see below), "swiglu_fwd" (two accumulators, gate from w0
  and up from w1, stores gate_up and h = silu(gate) * up), "swiglu_bwd" (the down
  dgrad fused with the SwiGLU backward and the router-weight gradient). gate_up, kept
  for backward, is stored in packed rows (no padding rows; `serval.schedule.packed_index`)
  and read back from them: row-scattered, so always through pointers.
* USE_TMA: tensor descriptors (`tl.make_tensor_descriptor`, Hopper TMA) for the weights,
  a materialised A and the outputs; otherwise masked pointer loads/stores (the fallback
  for tensors TMA cannot address, i.e. rows or halves not 16-byte aligned, and a variant
  worth timing). Both paths run in Triton 3.9's interpreter.
* HAS_LIMIT: the SwiGLU clamps (swiglu_limit). EPI_SPLIT: the epilogue works on 1, 2
  or 4 column chunks of the tile (fewer live registers, smaller store staging).
  EPI_TMA_STORES: the epilogue's row-aligned stores (c, h) through TMA or through pointers.
  The kernel is not warp-specialised, so the epilogue is not overlapped with MMA work: each
  TMA store waits for the one before it to leave the shared staging buffer, and a TMA load
  there would be a full memory round trip the warps wait out (Triton waits right where it
  is issued; measured 2.16 vs 1.62 ms for the kimi-k2 dgrad), while pointer loads of chunk
  c + 1 (the packed gate/up reads) stay in flight while chunk c is computed, and pointer
  stores are fire-and-forget.
  FLATTEN: let the pipeliner overlap a tile's epilogue with the next tile's loads.
* PUSH (with "store", at expert parallelism): row r is written to slot `row_source[r]` of its owner's
  slot buffer, the owner found in a table of every rank's buffer address (`serval.transport`), instead of
  to c[r]: the combine's push fused into the GEMM that produces the rows (the down GEMM forward, the
  gate/up dgrad backward). The tile's rows go out over NVLink while later tiles compute, and the [R, C]
  rows are never written to memory and read back by a push kernel. Padding rows write nothing. Pointer
  stores (scattered rows, peers' memory: no TMA); PUSH_ALIGNED: 16-byte vectors (host-checked).
* PULL_PROGRAMS > 0 (at expert parallelism, the gate/up GEMM): the dispatch inside the GEMM. The first
  PULL_PROGRAMS programs are communication programs: they pull the A rows of M-tile after M-tile (in the
  order the compute programs take them) from the owners' token buffers into the [R, K] A buffer, and
  publish each M-tile with a flag (a proxy fence first: TMA reads what generic stores wrote; then release);
  the other programs compute, and wait for their tile's flag (acquire) before its K loop. So the pull runs
  under the GEMM instead of before it. Flags hold the call's epoch (a device counter bumped before each
  launch): never reset, CUDA-graph safe. A wait is bounded: past about 10 s the program prints the tile
  and traps (the CUDA context is lost, as when a transport barrier times out): an error, never a hang.
  Every program is resident at once (one per SM), and the pull programs have the lowest ids.
  UPCAST: fp32 dot operands (the interpreter's bf16 tl.dot is wrong; set it there only).

Persistent: the grid is one program per SM (NUM_PROGRAMS of them, fewer when the capacity
has fewer tiles); program p takes tiles p, p + NUM_PROGRAMS, ... of the used tiles only.
The used-tile count is read on the device (expert_offsets[E] // BLOCK_M): no host sync,
idle capacity costs nothing. Tiles are visited GROUP_M M-tiles at a time across all
N-tiles, so the SMs working at once share weight tiles (one expert's) and A tiles in L2.
Two programs per SM (128x128 tiles in half the shared memory and registers, so that one's
epilogue could run during the other's MMAs; a one-off variant, not kept) measured slower or
even on the H200 (2026-11-29, do_bench): kimi-k2 dgrad 1.62 vs 1.58 ms, gate/up dgrad
2.89 vs 2.64; qwen3-30b-a3b gate/up dgrad 1.21 vs 1.22. Also tried and not kept (H200, Triton
3.6, sustained load): Triton's automatic warp specialisation (`tl.range(warp_specialize=True)`)
compiles for sm_90 only with 4 warps and an unsplit epilogue, and then gave wrong results (relative
error ~1 or NaN) at half the speed; issuing the dgrad epilogue's first gate/up loads before the
K loop (to hide their latency; needs flatten off against spills): 1.89 vs 1.82 ms kimi-k2, 1.20
vs 1.09 qwen3-30b-a3b.

Determinism: every output element is written by exactly one program, the K loop runs
in one fixed order, no atomics; the router-weight gradient is reduced over N-tiles in a
fixed order by a second tiny kernel. Results do not depend on which SM ran a tile.

Tile configurations are fixed per (stage, device class) by `CONFIGS`, never tuned by
timing (timing-based choices could change the numbers between runs).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ..schedule import Schedule, packed_index
from ..transport import PeerSlots, PeerTokens
from . import common, cooperative, swiglu
from . import warp_specialized as warp_specialized_kernel
from .rows import gather as gather_rows

# ---------------------------------------------------------------- configuration


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """One launch configuration of the grouped GEMM (block_n is per accumulator)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    # let the pipeliner overlap one tile's epilogue with the next tile's loads
    flatten: bool = True
    # epilogue in column chunks of block_n // epi_split (1, 2 or 4)
    epi_split: int = 1
    # the epilogue's row-aligned stores through TMA (else pointer stores, which no later store waits for)
    epi_tma_stores: bool = True


# The choice, per stage (Hopper; block_m is capped at the schedule's block_m):
# * start from ENVIRONMENT.md's Triton 3.6 H200 measurement: persistent TMA, 128x256x64, 8 warps,
#   3 stages reached 676-699 TFLOP/s on these shapes: down and gate_up_dgrad use it as is.
# * gate_up_swiglu has two accumulators (gate, up): 128x128 each is the same 128 fp32 registers per
#   thread as one 128x256 (128x256 each spilled ~1 KB in an sm_90 compile with Triton 3.6).
# * down_dgrad_swiglu's epilogue (SwiGLU backward) holds several fp32 temporaries per element: a
#   128x128 tile in one piece spilled 2 KB; in 4 column chunks (epi_split=4) it compiles to 255
#   registers and no spill.
# * flatten (overlap the epilogue with the next tile's loads) on the plain-store stages; off where
#   the epilogue is large or the K loop is two loops: on, gate_up_swiglu ran 31-40% slower and
#   gate_up_dgrad even or up to 1% slower (H200, sustained load, BENCHMARKS.md ninth session); the
#   fused-gather forward also lost its cp.async pipelining with it in the sm_90 compile.
# benchmarks/kernel_stages.py times the alternatives on the H200; change an entry only with its numbers.
CONFIGS = {
    "hopper": {
        # H200, 2026-11-29: pointer stores (gate, up and h no longer wait on each other's TMA store), GEMM
        # alone: 731 vs 653 TFLOP/s (kimi-k2), 659 vs 600 (qwen3-30b-a3b) in one burst run, even in a later
        # one. 3 stages, not 4: under sustained load (the power cap) 3 was ahead in both kernel_stages --soak
        # runs (kimi-k2 3.01 / 3.03 vs 3.08 / 3.10 ms, qwen3-30b-a3b 1.47 / 1.50 vs 1.48 / 1.58) and in the
        # whole layer, two interleaved runs each (results/h200_layer_variants.txt: routed forward+backward
        # 14.97 vs 15.15 ms kimi-k2, 7.59 vs 7.66 qwen3-30b-a3b), though 4 won do_bench bursts (707 vs 636).
        "gate_up_swiglu": TileConfig(128, 128, 64, num_stages=3, flatten=False, epi_tma_stores=False),
        # the epilogue in 2 column chunks: 721 vs 663 (kimi-k2), 674 vs 663 (qwen3-30b-a3b)
        "down": TileConfig(128, 256, 64, epi_split=2),
        # the epilogue reads gate/up with pointer loads (chunk c + 1's in flight during chunk c's math; a TMA
        # load was waited for where it was issued: 8 round trips a tile) and stores with pointers, 4 stages:
        # 596 vs 446 TFLOP/s for the former TMA epilogue, 3 stages (kimi-k2); 419 vs 287 (qwen3-30b-a3b).
        # TMA stores: 592 / 387; 5 stages: 528 / 430; TMA loads and stores at 4 stages: 540 / 318
        "down_dgrad_swiglu": TileConfig(128, 128, 64, num_stages=4, epi_split=4, epi_tma_stores=False),
        "gate_up_dgrad": TileConfig(128, 256, 64, flatten=False),
    },
    # fp32 operands on the GPU (exact fp32 dots on the FMA units, for checks, not speed): small tiles;
    # 64x64x32 spilled kilobytes in the sm_90 compile, 32x64x16 compiles without spills
    "hopper_fp32": {stage: TileConfig(32, 64, 16, num_warps=4, num_stages=2, flatten=False)
                    for stage in ("gate_up_swiglu", "down", "down_dgrad_swiglu", "gate_up_dgrad")},
    # CPU interpreter: small tiles so that tests exercise partial N/K tiles on tiny shapes
    "interpret": {
        "gate_up_swiglu": TileConfig(32, 32, 32, group_m=2),
        "down": TileConfig(32, 32, 32, group_m=2),
        "down_dgrad_swiglu": TileConfig(32, 32, 32, group_m=2, epi_split=2),
        "gate_up_dgrad": TileConfig(32, 32, 32, group_m=2),
    },
}


def default_config(stage: str, dtype: torch.dtype = torch.bfloat16) -> TileConfig:
    if common.INTERPRET:
        return CONFIGS["interpret"][stage]
    return CONFIGS["hopper_fp32" if dtype == torch.float32 else "hopper"][stage]


# ---------------------------------------------------------------- kernel pieces


@triton.jit
def _load_a(a_desc, a_row_ptrs, a_row_valid, m0, k, col0, K,
            BLOCK_K: tl.constexpr, A_POINTERS: tl.constexpr):
    """A[rows, col0 + k : col0 + k + BLOCK_K], zeros past K and on invalid (padding) rows."""
    if A_POINTERS:
        offs_k = k + tl.arange(0, BLOCK_K)
        mask = a_row_valid[:, None] & (offs_k < K)[None, :]
        return tl.load(a_row_ptrs[:, None] + (col0 + offs_k)[None, :], mask=mask, other=0.0)
    else:
        # the descriptor's shape ends at column K of this half, so TMA zero-fills past it
        return a_desc.load([m0, k])


@triton.jit
def _load_w(w_desc, w_ptr, expert, n0, k, N_OUT, K,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, W_NK: tl.constexpr, USE_TMA: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] tile of B_e at (k, n0), zeros outside [K, N_OUT]."""
    if USE_TMA:
        # 3-D descriptors [E, *, *]: out-of-range rows/cols of one expert read as zeros, never the next expert
        if W_NK:
            return w_desc.load([expert, n0, k]).reshape(BLOCK_N, BLOCK_K).T
        else:
            return w_desc.load([expert, k, n0]).reshape(BLOCK_K, BLOCK_N)
    else:
        offs_k = k + tl.arange(0, BLOCK_K)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask = (offs_k < K)[:, None] & (offs_n < N_OUT)[None, :]
        base = w_ptr + expert.to(tl.int64) * N_OUT * K
        if W_NK:
            ptrs = base + offs_n[None, :] * K + offs_k[:, None]
        else:
            ptrs = base + offs_k[:, None] * N_OUT + offs_n[None, :]
        return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _mma(a, b, acc, UPCAST: tl.constexpr):
    if UPCAST:  # interpreter: bf16 tl.dot is wrong there, fp32 is exact enough
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if a.dtype == tl.float32:  # fp32 operands mean fp32 products (never TF32), as the torch stages compute
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _store_tile(desc, ptr, stride, value, m0, n0, n_limit, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                USE_TMA: tl.constexpr):
    """Store a [BLOCK_M, BLOCK_N] tile at (m0, n0) of a row-major matrix whose columns end at n_limit."""
    if USE_TMA:
        desc.store([m0, n0], value)
    else:
        rows = m0 + tl.arange(0, BLOCK_M)
        cols = n0 + tl.arange(0, BLOCK_N)
        ptrs = ptr + rows.to(tl.int64)[:, None] * stride + cols[None, :]
        tl.store(ptrs, value, mask=(cols < n_limit)[None, :])


@triton.jit
def _packed_tile_ptrs(ptr, packed, n0, n_limit, BLOCK_N: tl.constexpr):
    """Pointers and mask of the gate half's [rows, BLOCK_N] tile at column n0 of a packed [num_packed,
    2 n_limit] gate_up (+ n_limit: the up half): row r of the tile is packed row packed[r]; padding rows
    (packed -1) and columns past n_limit are masked off."""
    cols = n0 + tl.arange(0, BLOCK_N)
    ptrs = ptr + packed.to(tl.int64)[:, None] * (2 * n_limit) + cols[None, :]
    return ptrs, (packed >= 0)[:, None] & (cols < n_limit)[None, :]


@triton.jit
def _split_columns(tile, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(tile[:, :BLOCK_N // 2], tile[:, BLOCK_N // 2:])."""
    return tl.split(tile.reshape(BLOCK_M, 2, BLOCK_N // 2).permute(0, 2, 1))


@triton.jit
def _column_chunks(tile, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
    """The tile as a tuple of SPLIT (1, 2 or 4) column chunks, left to right."""
    if SPLIT == 1:
        return (tile,)
    elif SPLIT == 2:
        return _split_columns(tile, BLOCK_M, BLOCK_N)
    else:
        left, right = _split_columns(tile, BLOCK_M, BLOCK_N)
        left0, left1 = _split_columns(left, BLOCK_M, BLOCK_N // 2)
        right0, right1 = _split_columns(right, BLOCK_M, BLOCK_N // 2)
        return (left0, left1, right0, right1)


@triton.jit
def _swiglu_bwd_chunk(d_h_raw, pre_gate, pre_up, rw, m0, n0, n_limit, c0_desc, c1_desc, h_desc,
                      c_ptr, stride_c, h_ptr, swiglu_limit,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LIMIT: tl.constexpr, USE_TMA: tl.constexpr):
    """swiglu.backward of one [BLOCK_M, BLOCK_N] chunk of the down dgrad, stored (d_gate, d_up into
    d_gate_up's halves, h_weighted); returns its d_rw row partials."""
    d_gate, d_up, h_weighted, d_rw_part = swiglu.backward(d_h_raw, pre_gate, pre_up, rw, swiglu_limit, HAS_LIMIT)
    _store_tile(c1_desc, c_ptr + n_limit, stride_c, d_up, m0, n0, n_limit, BLOCK_M, BLOCK_N, USE_TMA)
    _store_tile(c0_desc, c_ptr, stride_c, d_gate, m0, n0, n_limit, BLOCK_M, BLOCK_N, USE_TMA)
    _store_tile(h_desc, h_ptr, n_limit, h_weighted, m0, n0, n_limit, BLOCK_M, BLOCK_N, USE_TMA)
    return d_rw_part


@triton.jit
def _pull_tiles(table_ptr, row_source_ptr, a_ptr, stride_a, flags_ptr, epoch, num_m_tiles, slots_per_rank, top_k, K,
                BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, PULL_PROGRAMS: tl.constexpr, ALIGNED: tl.constexpr,
                PROXY_FENCE: tl.constexpr):
    """A communication program: M-tiles p, p + PULL_PROGRAMS, ... of A pulled from the owners' token buffers
    (zeros on padding rows), each published with flag = epoch once all its rows are stored."""
    for m_tile in range(tl.program_id(0), num_m_tiles, PULL_PROGRAMS):
        rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        source = tl.load(row_source_ptr + rows).to(tl.int64)
        valid = source >= 0
        peer = common.peer_rows(table_ptr, tl.where(valid, source, 0), valid, slots_per_rank, K, top_k,
                                True, ALIGNED, a_ptr.dtype.element_ty)
        for c0 in range(0, K, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            values = tl.load(peer[:, None] + cols[None, :], mask=valid[:, None] & (cols < K)[None, :], other=0.0)
            tl.store(a_ptr + rows.to(tl.int64)[:, None] * stride_a + cols[None, :], values, mask=(cols < K)[None, :])
        if PROXY_FENCE:  # the compute programs read these rows with TMA (the async proxy): order them for it
            tl.inline_asm_elementwise("fence.proxy.async.global;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
        tl.debug_barrier()  # every thread's stores are done before the flag's release
        tl.atomic_xchg(flags_ptr + m_tile, epoch, sem="release", scope="gpu")


# spins of about a microsecond each: a wait gives up after ~10 s
MAX_SPINS = tl.constexpr(1 << 23)


@triton.jit
def _wait_for_rows(flag_ptr, epoch, m_tile):
    """Wait (bounded) until a communication program has published M-tile m_tile of this call.

    The int32 atomic_add of 0 is an acquire load of the flag (Triton compiles it to ld.acquire.gpu), not an
    accumulation: no floating-point value is ever summed atomically."""
    seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
    spins = 0
    while (seen < epoch) & (spins < MAX_SPINS):
        seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
        spins += 1
    if seen < epoch:
        tl.device_print("serval: timed out waiting for the pulled rows of M-tile ", m_tile)
        tl.inline_asm_elementwise("trap;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


# ---------------------------------------------------------------- the kernel


@triton.jit
def _grouped_gemm_kernel(
    # A operand: x [N, K] (A_GATHER) or rows [R, K_total]
    a_ptr, stride_a, row_source_ptr, top_k, num_rows,
    # PUSH: the peers' slot buffers [slots_per_rank, N_OUT], one int64 address per rank
    push_table_ptr, slots_per_rank,
    # PULL_PROGRAMS: the owners' token buffers [N, K] (one int64 address per rank), a flag per M-tile, the epoch
    pull_table_ptr, pull_slots_per_rank, pull_flags_ptr, pull_epoch_ptr,
    # schedule
    tile_expert_ptr, expert_offsets_ptr, num_experts, sched_block_m,
    # weights: w0 (and w1 for swiglu_fwd / K_SPLIT), [E, N_OUT, K] if W_NK else [E, K, N_OUT]
    w0_ptr, w1_ptr,
    # outputs: c [R, N_OUT] (store), packed gate_up [num_packed, 2 N_OUT] (swiglu_fwd) or d_gate_up
    # [R, 2 N_OUT] (swiglu_bwd); h [R, N_OUT] (swiglu)
    c_ptr, stride_c, h_ptr,
    # swiglu: each row's packed index [R]; swiglu_bwd: gate_up packed [num_packed, 2 N_OUT], router weights
    # [N * k], d_rw partials [R, num_n_tiles]
    packed_ptr, gate_up_ptr, router_weights_ptr, d_rw_partial_ptr,
    N_OUT, K, swiglu_limit,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    A_GATHER: tl.constexpr, W_NK: tl.constexpr, K_SPLIT: tl.constexpr, EPILOGUE: tl.constexpr,
    HAS_LIMIT: tl.constexpr, USE_TMA: tl.constexpr, UPCAST: tl.constexpr, FLATTEN: tl.constexpr,
    EPI_SPLIT: tl.constexpr, EPI_TMA_STORES_CFG: tl.constexpr, PUSH: tl.constexpr, PUSH_ALIGNED: tl.constexpr,
    PULL_PROGRAMS: tl.constexpr, PULL_ALIGNED: tl.constexpr, PULL_BLOCK_C: tl.constexpr, PROXY_FENCE: tl.constexpr,
):
    DUAL: tl.constexpr = EPILOGUE == "swiglu_fwd"  # two accumulators: gate (w0) and up (w1)
    SWIGLU: tl.constexpr = EPILOGUE != "store"  # outputs c and h are [*, 2 N_OUT] and [R, N_OUT]
    A_POINTERS: tl.constexpr = A_GATHER or not USE_TMA
    EPI_N: tl.constexpr = BLOCK_N // EPI_SPLIT  # width of the epilogue's column chunks
    EPI_TMA_STORES: tl.constexpr = USE_TMA and EPI_TMA_STORES_CFG
    dtype = w0_ptr.dtype.element_ty

    # used tiles only: the count lives on the device, no host sync
    num_m_tiles = tl.load(expert_offsets_ptr + num_experts) // BLOCK_M
    num_n_tiles = tl.cdiv(N_OUT, BLOCK_N)
    num_tiles = num_m_tiles * num_n_tiles

    if USE_TMA:
        if W_NK:
            w0_desc = tl.make_tensor_descriptor(w0_ptr, shape=[num_experts, N_OUT, K], strides=[N_OUT * K, K, 1],
                                                block_shape=[1, BLOCK_N, BLOCK_K])
            w1_desc = tl.make_tensor_descriptor(w1_ptr, shape=[num_experts, N_OUT, K], strides=[N_OUT * K, K, 1],
                                                block_shape=[1, BLOCK_N, BLOCK_K])
        else:
            w0_desc = tl.make_tensor_descriptor(w0_ptr, shape=[num_experts, K, N_OUT], strides=[K * N_OUT, N_OUT, 1],
                                                block_shape=[1, BLOCK_K, BLOCK_N])
            w1_desc = tl.make_tensor_descriptor(w1_ptr, shape=[num_experts, K, N_OUT], strides=[K * N_OUT, N_OUT, 1],
                                                block_shape=[1, BLOCK_K, BLOCK_N])
        # the second half of a split-K A (and of every [R, 2 N_OUT] tensor) is its own descriptor, so that
        # TMA bounds each half at its own last column (the host checks the halves are 16-byte aligned)
        if A_GATHER:
            a0_desc = a_ptr
        else:
            a0_desc = tl.make_tensor_descriptor(a_ptr, shape=[num_rows, K], strides=[stride_a, 1],
                                                block_shape=[BLOCK_M, BLOCK_K])
        if K_SPLIT:
            a1_desc = tl.make_tensor_descriptor(a_ptr + K, shape=[num_rows, K], strides=[stride_a, 1],
                                                block_shape=[BLOCK_M, BLOCK_K])
        else:
            a1_desc = a0_desc
        if DUAL or PUSH:  # c is the packed gate_up, or the peers' slots: pointer stores only
            c0_desc = c_ptr
        else:
            c0_desc = tl.make_tensor_descriptor(c_ptr, shape=[num_rows, N_OUT], strides=[stride_c, 1],
                                                block_shape=[BLOCK_M, EPI_N])
        if EPILOGUE == "swiglu_bwd":
            c1_desc = tl.make_tensor_descriptor(c_ptr + N_OUT, shape=[num_rows, N_OUT], strides=[stride_c, 1],
                                                block_shape=[BLOCK_M, EPI_N])
        else:
            c1_desc = c0_desc
        if SWIGLU:
            h_desc = tl.make_tensor_descriptor(h_ptr, shape=[num_rows, N_OUT], strides=[N_OUT, 1],
                                               block_shape=[BLOCK_M, EPI_N])
        else:
            h_desc = c0_desc
    else:  # pointer path: the "descriptors" are unused placeholders
        w0_desc = w0_ptr
        w1_desc = w1_ptr
        a0_desc = a_ptr
        a1_desc = a_ptr
        c0_desc = c_ptr
        c1_desc = c_ptr
        h_desc = h_ptr

    first_tile = tl.program_id(0)
    if PULL_PROGRAMS > 0:
        epoch = tl.load(pull_epoch_ptr)
        if tl.program_id(0) < PULL_PROGRAMS:
            _pull_tiles(pull_table_ptr, row_source_ptr, a_ptr, stride_a, pull_flags_ptr, epoch, num_m_tiles,
                        pull_slots_per_rank, top_k, K, BLOCK_M, PULL_BLOCK_C, PULL_PROGRAMS, PULL_ALIGNED, PROXY_FENCE)
        first_tile = tl.where(tl.program_id(0) < PULL_PROGRAMS, num_tiles, tl.program_id(0) - PULL_PROGRAMS)
    for tile_id in tl.range(first_tile, num_tiles, NUM_PROGRAMS - PULL_PROGRAMS, flatten=FLATTEN):
        m_tile, n_tile = common.tile_coords(tile_id, num_m_tiles, num_n_tiles, GROUP_M)
        m0 = m_tile * BLOCK_M
        n0 = n_tile * BLOCK_N
        if PULL_PROGRAMS > 0:
            _wait_for_rows(pull_flags_ptr + m_tile, epoch, m_tile)
        expert = tl.load(tile_expert_ptr + m0 // sched_block_m)
        rows = m0 + tl.arange(0, BLOCK_M)

        # per-row A addresses for the pointer path (the gather: token = source // k, padding rows read zeros)
        if A_GATHER:
            source = tl.load(row_source_ptr + rows)
            a_row_valid = source >= 0
            a_row = tl.where(a_row_valid, source // top_k, 0)
        else:
            a_row_valid = rows < num_rows
            a_row = rows
        a_row_ptrs = a_ptr + a_row.to(tl.int64) * stride_a

        acc0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            a = _load_a(a0_desc, a_row_ptrs, a_row_valid, m0, k, 0, K, BLOCK_K, A_POINTERS)
            b = _load_w(w0_desc, w0_ptr, expert, n0, k, N_OUT, K, BLOCK_N, BLOCK_K, W_NK, USE_TMA)
            acc0 = _mma(a, b, acc0, UPCAST)
            if DUAL:
                b1 = _load_w(w1_desc, w1_ptr, expert, n0, k, N_OUT, K, BLOCK_N, BLOCK_K, W_NK, USE_TMA)
                acc1 = _mma(a, b1, acc1, UPCAST)
        if K_SPLIT:  # the same accumulator continues over A's second K columns against w1
            for k in range(0, K, BLOCK_K):
                a = _load_a(a1_desc, a_row_ptrs, a_row_valid, m0, k, K, K, BLOCK_K, A_POINTERS)
                b = _load_w(w1_desc, w1_ptr, expert, n0, k, N_OUT, K, BLOCK_N, BLOCK_K, W_NK, USE_TMA)
                acc0 = _mma(a, b, acc0, UPCAST)

        # ------------------------------------------------ epilogues, EPI_SPLIT column chunks at a time
        # (smaller store staging in shared memory; for swiglu_bwd, fewer live fp32 temporaries: unsplit it spilled)
        chunks0 = _column_chunks(acc0, BLOCK_M, BLOCK_N, EPI_SPLIT)
        if EPILOGUE == "store" and PUSH:
            source = tl.load(row_source_ptr + rows).to(tl.int64)
            valid = source >= 0
            slot_rows = common.peer_rows(push_table_ptr, tl.where(valid, source, 0), valid, slots_per_rank, N_OUT,
                                         1, False, PUSH_ALIGNED, dtype)
            for c in tl.static_range(EPI_SPLIT):
                cols = n0 + c * EPI_N + tl.arange(0, EPI_N)
                tl.store(slot_rows[:, None] + cols[None, :], chunks0[c].to(dtype),
                         mask=valid[:, None] & (cols < N_OUT)[None, :])
        elif EPILOGUE == "store":
            for c in tl.static_range(EPI_SPLIT):
                _store_tile(c0_desc, c_ptr, stride_c, chunks0[c].to(dtype), m0, n0 + c * EPI_N, N_OUT,
                            BLOCK_M, EPI_N, EPI_TMA_STORES)

        elif EPILOGUE == "swiglu_fwd":
            chunks1 = _column_chunks(acc1, BLOCK_M, BLOCK_N, EPI_SPLIT)
            packed = tl.load(packed_ptr + rows)
            for c in tl.static_range(EPI_SPLIT):
                # gate_up is stored rounded (packed: kept for backward); h is computed from the rounded
                # values, as the torch stage does
                gate = chunks0[c].to(dtype)
                up = chunks1[c].to(dtype)
                ptrs, mask = _packed_tile_ptrs(c_ptr, packed, n0 + c * EPI_N, N_OUT, EPI_N)
                tl.store(ptrs, gate, mask=mask)
                tl.store(ptrs + N_OUT, up, mask=mask)
                h = swiglu.forward(gate, up, swiglu_limit, HAS_LIMIT)
                _store_tile(h_desc, h_ptr, N_OUT, h.to(dtype), m0, n0 + c * EPI_N, N_OUT, BLOCK_M, EPI_N,
                            EPI_TMA_STORES)

        else:  # "swiglu_bwd": acc0 = d_y_rows @ w_down[e], the unscaled d_h
            source = tl.load(row_source_ptr + rows)
            rw = tl.load(router_weights_ptr + source, mask=source >= 0, other=0.0)
            # the packed gate/up of chunk c + 1 is loaded before chunk c is computed: the loads stay in
            # flight meanwhile; padding rows read zeros
            packed = tl.load(packed_ptr + rows)
            ptrs, mask = _packed_tile_ptrs(gate_up_ptr, packed, n0, N_OUT, EPI_N)
            g_next = tl.load(ptrs, mask=mask, other=0.0)
            u_next = tl.load(ptrs + N_OUT, mask=mask, other=0.0)
            d_rw_part = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for c in tl.static_range(EPI_SPLIT):  # the row partials are added in column order
                gate = g_next
                up = u_next
                if c + 1 < EPI_SPLIT:
                    ptrs, mask = _packed_tile_ptrs(gate_up_ptr, packed, n0 + (c + 1) * EPI_N, N_OUT, EPI_N)
                    g_next = tl.load(ptrs, mask=mask, other=0.0)
                    u_next = tl.load(ptrs + N_OUT, mask=mask, other=0.0)
                d_rw_part += _swiglu_bwd_chunk(chunks0[c], gate, up, rw, m0, n0 + c * EPI_N, N_OUT,
                                               c0_desc, c1_desc, h_desc, c_ptr, stride_c, h_ptr, swiglu_limit,
                                               BLOCK_M, EPI_N, HAS_LIMIT, EPI_TMA_STORES)
            tl.store(d_rw_partial_ptr + rows.to(tl.int64) * num_n_tiles + n_tile, d_rw_part)


@triton.jit
def _sum_partials_kernel(partial_ptr, out_ptr, expert_offsets_ptr, num_experts, num_rows, num_cols,
                         BLOCK_R: tl.constexpr):
    """out[r] = sum_j partial[r, j], j ascending (one fixed order); 0 on rows past the used tiles."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    used = rows < tl.load(expert_offsets_ptr + num_experts)
    total = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for j in range(0, num_cols):
        total += tl.load(partial_ptr + rows.to(tl.int64) * num_cols + j, mask=used, other=0.0)
    tl.store(out_ptr + rows, total, mask=rows < num_rows)


# ---------------------------------------------------------------- host side


def _tma_compatible(*tensors_and_offsets) -> bool:
    """TMA needs 16-byte aligned bases (each half of a split tensor too) and row strides."""
    for t, col_offset in tensors_and_offsets:
        if t.stride(-1) != 1:
            return False
        if any((s * t.element_size()) % 16 for s in t.stride()[:-1]):
            return False
        if (t.data_ptr() + col_offset * t.element_size()) % 16:
            return False
    return True


def _check(a: torch.Tensor, *weights: torch.Tensor):
    """bf16 (the fast path), fp16, or fp32 (exact fp32 dot products: slow on the GPU, for checks), all one dtype."""
    for t in (a, *weights):
        if t.dtype not in (torch.bfloat16, torch.float16, torch.float32) or t.dtype != a.dtype:
            raise TypeError(f"the Triton grouped GEMM takes bf16, fp16 or fp32 operands of one dtype, "
                            f"got {[t.dtype for t in (a, *weights)]}")


def _launch(*, a, weights, out, h, schedule: Schedule, n_out: int, k: int, a_gather: bool, w_nk: bool,
            k_split: bool, epilogue: str, config: TileConfig, use_tma: bool | None, swiglu_limit=None,
            packed=None, gate_up=None, router_weights=None, d_rw_partial=None, push_to: PeerSlots | None = None,
            pull_from: PeerTokens | None = None, pull_programs: int = 0):
    """Launch the persistent grid for one stage; returns nothing (outputs are written in place: `out`, or
    with push_to the peers' slot buffers, `out` then unused)."""
    w0, w1 = weights[0], weights[-1]
    block_m = min(config.block_m, schedule.block_m)
    if schedule.block_m % block_m:
        raise ValueError(f"tile rows {block_m} must divide the schedule's block_m {schedule.block_m}")
    if use_tma is None:
        use_tma = common.supports_tma()
    if use_tma:  # the packed gate_up (swiglu_fwd's out, swiglu_bwd's gate_up) is never a TMA operand
        operands = [(w0, 0), (w1, 0)]
        if epilogue == "store" and push_to is None:
            operands += [(out, 0)]
        if epilogue == "swiglu_bwd":
            operands += [(out, 0), (out, n_out)]
        if h is not None:
            operands += [(h, 0)]
        if not a_gather:
            operands += [(a, 0)] + ([(a, k)] if k_split else [])
        use_tma = _tma_compatible(*operands)
    if use_tma and not common.INTERPRET:
        common.install_tma_allocator()

    num_n_tiles = triton.cdiv(n_out, config.block_n)
    max_tiles = (schedule.capacity // block_m) * num_n_tiles
    num_programs = max(1, min(common.num_sms(a.device.index), max_tiles))
    dummy = out  # stands in for pointers a variant does not use
    pull = (dummy, 0, dummy, dummy)
    if pull_from is not None:
        pull_programs = max(1, min(pull_programs, common.num_sms(a.device.index) - 1))
        num_programs = common.num_sms(a.device.index)  # every program resident at once, pull programs first
        flags, epoch = _pull_flags(a.device, schedule.capacity // block_m)
        epoch.add_(1)
        pull = (pull_from.table, pull_from.num_tokens * pull_from.top_k, flags, epoch)
    _grouped_gemm_kernel[(num_programs,)](
        a, a.stride(0), schedule.row_source, schedule.top_k, schedule.capacity,
        push_to.table if push_to is not None else dummy, push_to.num_slots if push_to is not None else 0,
        *pull,
        schedule.tile_expert, schedule.expert_offsets, schedule.num_experts, schedule.block_m,
        w0, w1,
        out, out.stride(0), h if h is not None else dummy,
        packed if packed is not None else dummy, gate_up if gate_up is not None else dummy,
        router_weights if router_weights is not None else dummy,
        d_rw_partial if d_rw_partial is not None else dummy,
        n_out, k, float(swiglu_limit) if swiglu_limit is not None else 0.0,
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        NUM_PROGRAMS=num_programs,
        A_GATHER=a_gather, W_NK=w_nk, K_SPLIT=k_split, EPILOGUE=epilogue,
        HAS_LIMIT=swiglu_limit is not None, USE_TMA=use_tma, UPCAST=common.INTERPRET, FLATTEN=config.flatten,
        EPI_SPLIT=config.epi_split, EPI_TMA_STORES_CFG=config.epi_tma_stores, PUSH=push_to is not None,
        PUSH_ALIGNED=push_to is not None and push_to.aligned,
        PULL_PROGRAMS=pull_programs if pull_from is not None else 0,
        PULL_ALIGNED=pull_from is not None and pull_from.aligned,
        PULL_BLOCK_C=min(PULL_BLOCK_C, triton.next_power_of_2(k)), PROXY_FENCE=use_tma and not common.INTERPRET,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


_PULL_FLAGS: dict = {}


def _pull_flags(device: torch.device, num_m_tiles: int):
    """(flags [>= num_m_tiles] int32, epoch [1] int32) of the in-GEMM pull on this device: allocated on first
    use (zeros) and kept, so flags only ever hold past epochs. Larger capacities get new flags (zeros < epoch)."""
    flags, epoch = _PULL_FLAGS.get(device, (None, None))
    if flags is None or flags.numel() < num_m_tiles:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("serval: the dispatch flags are first needed inside CUDA graph capture; run the "
                               "layer once before capturing")
        flags = torch.zeros(max(num_m_tiles, 1), dtype=torch.int32, device=device)
        epoch = epoch if epoch is not None else torch.zeros(1, dtype=torch.int32, device=device)
        _PULL_FLAGS[device] = flags, epoch
    return flags, epoch


# Forward A operand: ENVIRONMENT.md measured gather kernel + TMA GEMM (673 / 550 TFLOP/s with the gather,
# kimi / qwen3) ahead of the gather fused into the GEMM's pointer loads (588 / 514); re-measured by
# benchmarks/kernel_stages.py. A warp-specialised loader gathering with cp.async was slower still (BENCHMARKS.md,
# seventh session).
FUSED_GATHER = False

# Forward gate/up at EP=1 on sm_90 up to this hidden size: the cooperative kernel whose loader gathers x's rows
# (serval.kernels.cooperative), no gather pass. H200, 2026-11-29, routed forward + backward, three interleaved
# rounds at the power cap (BENCHMARKS.md, eleventh session): qwen3-30b-a3b (H 2048) 7.473 -> 7.394 ms,
# qwen3.5-397b (4096) 7.035 -> 7.000, kimi-k2 (7168) 14.576 -> 14.702 (slower: there the gathering loader costs
# more than the pass). 0: off.
COOPERATIVE_GATHER_MAX_HIDDEN = 4096


# At EP the gate/up GEMM can pull its rows itself with this many communication programs (0: the transport's pull
# kernel runs before it). Off: on two H200s (kimi-k2, EP=2, forward) it took 10.3-10.9 ms with 8, 16 or 32 of
# them, 256 or 512 columns a step, the proxy fence on either side, against 8.55-8.62 ms with the pull kernel
# first (BENCHMARKS.md, eighth session). Where that goes (ninth session, stamps): the pull keeps ahead (16
# programs alone move 324 GB/s, the pull kernel 335; the compute tiles wait ~1.5% of the kernel), but the
# GEMM on 116 SMs takes 4.8-5.1 ms against 4.35-4.57 on 132, its tiles run ~10% slower while the pull shares
# HBM, and one rank ran at 1550 MHz against the other's 1790 (the barriers make both wait for it): 7.5 ms
# against 5.5 for pull kernel + GEMM. Kept, tested, as the start of the communication programs of the fused
# kernel.
PULL_PROGRAMS = 0
# columns a communication program copies per step (BLOCK_M rows at a time)
PULL_BLOCK_C = 256


def gate_up_swiglu(x, w_gate, w_up, schedule: Schedule, swiglu_limit: float | None, *,
                   fused_gather: bool | None = None, a_rows: torch.Tensor | None = None,
                   pull_from: PeerTokens | None = None, config: TileConfig | None = None,
                   use_tma: bool | None = None):
    """Gather + grouped GEMM gate/up + SwiGLU: (gate_up packed [num_packed, 2I], h [R, I]), as stages.

    fused_gather: gather x rows inside the GEMM (A_GATHER) instead of a gather kernel + TMA reads of the
    gathered rows (default FUSED_GATHER). a_rows: the already gathered rows (= rows.gather(x, schedule)); without
    them, on sm_90 up to H = COOPERATIVE_GATHER_MAX_HIDDEN, the cooperative kernel's loader gathers them.
    pull_from: at EP, the owners' token buffers: PULL_PROGRAMS of the GEMM's programs pull the rows from them
    while the others compute (x is then not read; see PULL_PROGRAMS in the module docstring).
    """
    _check(x, w_gate, w_up)
    num_rows, (_, inter, hidden) = schedule.capacity, w_gate.shape
    fused = FUSED_GATHER if fused_gather is None else fused_gather
    if pull_from is not None:
        if a_rows is not None or pull_from.cols != hidden or pull_from.dtype != x.dtype:
            raise ValueError(f"pull_from: token buffers of [{pull_from.cols}] {pull_from.dtype} columns (x: [{hidden}] "
                             f"{x.dtype}), and no a_rows")
        a_rows = common.empty((num_rows, hidden), x.dtype, x.device)
    elif (a_rows is None and not fused and config is None and use_tma is None
          and hidden <= COOPERATIVE_GATHER_MAX_HIDDEN and cooperative.takes(schedule, x, w_gate, w_up)):
        return cooperative.gate_up_swiglu(x, w_gate, w_up, schedule, swiglu_limit, gather=True)
    elif a_rows is None and not fused:
        a_rows = gather_rows(x, schedule)
    gate_up = common.empty((schedule.num_packed, 2 * inter), x.dtype, x.device)
    h = common.empty((num_rows, inter), x.dtype, x.device)
    a = a_rows if a_rows is not None else x
    _launch(a=a.contiguous(), weights=(w_gate.contiguous(), w_up.contiguous()), out=gate_up, h=h,
            schedule=schedule, n_out=inter, k=hidden, a_gather=a_rows is None, w_nk=True, k_split=False,
            epilogue="swiglu_fwd", config=config or default_config("gate_up_swiglu", x.dtype), use_tma=use_tma,
            swiglu_limit=swiglu_limit, packed=packed_index(schedule), pull_from=pull_from,
            pull_programs=PULL_PROGRAMS)
    return gate_up, h


# The plain-store GEMMs at EP=1 on the cooperative kernel (serval.kernels.cooperative: 128 x 256 tiles, a TMA
# loader warp, two consumer warp groups) wherever it takes the operands; bitwise the same results. At EP, where
# they push their rows from the epilogue (below), the Triton kernel runs them. H200, 2026-11-29, routed forward +
# backward, three interleaved rounds at the power cap, ms, Triton -> cooperative for both (BENCHMARKS.md, twelfth
# session): qwen3-30b-a3b 7.350 -> 7.242, qwen3.5-397b 6.839 -> 6.725, kimi-k2 14.581 -> 14.443, glm-5 24.022 ->
# 23.868, deepseek-v4-pro 15.614 -> 15.551. The gain is the gate/up dgrad's (alone: 1.374-1.443 -> 1.316-1.317 ms
# on qwen3-30b-a3b); down runs as fast either way.
COOPERATIVE_STORE = {"down": True, "gate_up_dgrad": True}

# At EP the down GEMM (forward) and the gate/up dgrad (backward) store their rows into the owners' slots
# themselves (PUSH) instead of handing them to the transport's push kernel. BENCHMARKS.md has the EP=2 A/B.
PUSH_FROM_EPILOGUE = True


def down(h, w_down, schedule: Schedule, *, config: TileConfig | None = None, use_tma: bool | None = None,
         push_to: PeerSlots | None = None):
    """Grouped GEMM down: o [R, H] = h @ w_down[e].T; with push_to, row r goes to its owner's slot
    row_source[r] instead (see PUSH) and nothing is returned."""
    _check(h, w_down)
    hidden, inter = w_down.shape[1:]
    if (push_to is None and config is None and use_tma is None and COOPERATIVE_STORE["down"]
            and cooperative.takes(schedule, h, w_down)):
        return cooperative.down(h, w_down, schedule)
    out = _output(schedule, hidden, h, push_to)
    _launch(a=h.contiguous(), weights=(w_down.contiguous(),), out=out, h=None, schedule=schedule,
            n_out=hidden, k=inter, a_gather=False, w_nk=True, k_split=False, epilogue="store",
            config=config or default_config("down", h.dtype), use_tma=use_tma, push_to=push_to)
    return None if push_to is not None else out


def _output(schedule: Schedule, cols: int, like: torch.Tensor, push_to: PeerSlots | None):
    """A "store" stage's [R, cols] output, or (pushing) a stand-in the kernel never touches."""
    if push_to is None:
        return common.empty((schedule.capacity, cols), like.dtype, like.device)
    if push_to.cols != cols or push_to.dtype != like.dtype:
        raise ValueError(f"push_to: slot buffers of [{push_to.cols}] {push_to.dtype} columns, the GEMM makes "
                         f"[{cols}] {like.dtype}")
    return like


# The down dgrad on the ping-pong kernel (serval.kernels.warp_specialized) wherever it takes the operands.
# H200, 2026-11-29, sustained load, ms, Triton kernel -> ping-pong (BENCHMARKS.md): qwen3-30b-a3b 1.09 -> 0.92,
# qwen3.5-397b 0.91 -> 0.83, kimi-k2 1.99 -> 1.71 (sixth session); glm-5 3.42 -> 2.89, deepseek-v4-pro
# 2.20 -> 1.86 (fifth session, before swiglu.sigmoid). Bitwise the same results either way.
WARP_SPECIALIZED = True


def down_dgrad_swiglu(d_y_rows, w_down, gate_up, router_weights, schedule: Schedule, swiglu_limit: float | None,
                      *, config: TileConfig | None = None, use_tma: bool | None = None,
                      warp_specialized: bool | None = None):
    """d_h = rw * (d_y_row @ w_down[e]), SwiGLU backward and the router-weight gradient, in one GEMM epilogue.

    gate_up: packed [num_packed, 2I], as gate_up_swiglu returns it.
    Returns (d_gate_up [R, 2I], h_weighted = rw * h [R, I], d_rw_rows [R] fp32), as stages.down_dgrad_swiglu.
    warp_specialized: run the GEMM on `warp_specialized`'s ping-pong kernel (its epilogue overlaps the other
    consumer's MMAs); default: WARP_SPECIALIZED, where that kernel takes the operands (sm_90, Triton 3.6,
    bf16, TMA-aligned, H % 64 == 0) and neither config nor use_tma asks for this kernel's variants. Same
    d_gate_up and h_weighted bit for bit; d_rw_rows within float rounding (its row sums run in another
    register layout), each deterministic.
    """
    _check(d_y_rows, w_down, gate_up)
    if gate_up.shape != (schedule.num_packed, 2 * w_down.shape[2]):
        raise ValueError(f"gate_up must be the packed pre-activations [{schedule.num_packed}, "
                         f"{2 * w_down.shape[2]}] (schedule.num_packed, 2I), got {tuple(gate_up.shape)}")
    hidden, inter = w_down.shape[1:]
    num_rows = schedule.capacity
    router_weights = router_weights.contiguous().view(-1).float()
    if warp_specialized is None:
        warp_specialized = (WARP_SPECIALIZED and config is None and use_tma is None
                            and warp_specialized_kernel.takes(schedule, d_y_rows, w_down, gate_up, k=hidden,
                                                              split_at=inter))
    if warp_specialized:
        d_gate_up, h_weighted, d_rw_partial = warp_specialized_kernel.down_dgrad_swiglu_partials(
            d_y_rows.contiguous(), w_down.contiguous(), gate_up.contiguous(), router_weights, schedule, swiglu_limit)
        return d_gate_up, h_weighted, _sum_partials(d_rw_partial, schedule)
    config = config or default_config("down_dgrad_swiglu", gate_up.dtype)
    num_n_tiles = triton.cdiv(inter, config.block_n)
    d_gate_up = common.empty((num_rows, 2 * inter), gate_up.dtype, gate_up.device)
    h_weighted = common.empty((num_rows, inter), gate_up.dtype, gate_up.device)
    d_rw_partial = common.empty((num_rows, num_n_tiles), torch.float32, gate_up.device)
    _launch(a=d_y_rows.contiguous(), weights=(w_down.contiguous(),), out=d_gate_up, h=h_weighted,
            schedule=schedule, n_out=inter, k=hidden, a_gather=False, w_nk=False, k_split=False,
            epilogue="swiglu_bwd", config=config, use_tma=use_tma, swiglu_limit=swiglu_limit,
            packed=packed_index(schedule), gate_up=gate_up.contiguous(), router_weights=router_weights,
            d_rw_partial=d_rw_partial)
    return d_gate_up, h_weighted, _sum_partials(d_rw_partial, schedule)


def _sum_partials(d_rw_partial, schedule: Schedule):
    """d_rw_rows [R] fp32: each row's partials summed over its N-tiles in ascending order."""
    num_rows, num_n_tiles = d_rw_partial.shape
    d_rw_rows = common.empty((num_rows,), torch.float32, d_rw_partial.device)
    block_r = 128
    _sum_partials_kernel[(triton.cdiv(num_rows, block_r),)](
        d_rw_partial, d_rw_rows, schedule.expert_offsets, schedule.num_experts, num_rows, num_n_tiles,
        BLOCK_R=block_r)
    return d_rw_rows


def gate_up_dgrad(d_gate_up, w_gate, w_up, schedule: Schedule, *, config: TileConfig | None = None,
                  use_tma: bool | None = None, push_to: PeerSlots | None = None):
    """d_x_rows [R, H] = d_gate @ w_gate[e] + d_up @ w_up[e]: one accumulation over K = 2I; with push_to,
    pushed into the owners' slots instead (see down)."""
    _check(d_gate_up, w_gate, w_up)
    inter, hidden = w_gate.shape[1:]
    if (push_to is None and config is None and use_tma is None and COOPERATIVE_STORE["gate_up_dgrad"]
            and cooperative.takes(schedule, d_gate_up, w_gate, w_up, k=inter)):
        return cooperative.gate_up_dgrad(d_gate_up, w_gate, w_up, schedule)
    out = _output(schedule, hidden, d_gate_up, push_to)
    _launch(a=d_gate_up.contiguous(), weights=(w_gate.contiguous(), w_up.contiguous()), out=out, h=None,
            schedule=schedule, n_out=hidden, k=inter, a_gather=False, w_nk=False, k_split=True,
            epilogue="store", config=config or default_config("gate_up_dgrad", d_gate_up.dtype), use_tma=use_tma,
            push_to=push_to)
    return None if push_to is not None else out
