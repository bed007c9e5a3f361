"""The Triton engine: one persistent grouped-GEMM kernel over the schedule's M-tiles, for every GEMM stage.

Every stage GEMM of the layer has the same shape: rows of an operand A, grouped by expert into M-tiles
(see `serval.schedule`), times the weight of the tile's expert:

    C[r, n] = sum_k A[r, k] * B_e[k, n],   e = tile_expert[r // block_m]

and differs only in how B_e is stored and what happens to the fp32 accumulator before it is stored.
`_grouped_gemm_kernel` is that one kernel; its constexpr switches select the variant, so the compiler
specialises each use:

* W_NK: the weight is stored [E, Nout, K] (nn.Linear layout, C = A @ W[e].T: the forward GEMMs);
  otherwise [E, K, Nout] (C = A @ W[e]: the data gradients, which use the forward weights transposed).
  Both are read in place, never copied.
* K_SPLIT: K runs over two weights, the first K columns of A against w0 and the next K against w1, into
  one accumulator (gate_up_dgrad: d_gate @ w_gate + d_up @ w_up).
* EPILOGUE: "store" (a plain store, or with PUSH each row straight into its owner's slot), "swiglu_fwd"
  (two accumulators, gate from w0 and up from w1; stores gate_up and h = silu(gate) * up), "swiglu_bwd"
  (the down dgrad fused with the SwiGLU backward and the router-weight gradient's row partials).
  gate_up, kept for backward, is stored in packed rows (no padding rows; `serval.schedule.packed_index`)
  and read back from them: row-scattered, so always through pointers.
* USE_TMA: tensor descriptors (Hopper TMA) for the weights, A and the row-aligned outputs; otherwise
  masked pointer loads and stores (tensors TMA cannot address: rows or halves not 16-byte aligned).
* EPI_SPLIT: the epilogue works on 1, 2 or 4 column chunks of the tile (fewer live registers, smaller
  store staging). EPI_TMA_STORES: the row-aligned stores (c, h) through TMA or through pointers (pointer
  stores are fire-and-forget; a TMA store waits for the one before it to leave the staging buffer, and the
  kernel is not warp-specialised, so nothing else runs meanwhile). FLATTEN: let the pipeliner overlap a
  tile's epilogue with the next tile's loads.
* PUSH (with "store", at expert parallelism): row r is written to slot `row_source[r]` of its owner's slot
  buffer, the owner found in a table of every rank's buffer address (`serval.peers`), instead of to c[r]:
  the combine's push fused into the GEMM that makes the rows (down forward, the gate/up dgrad backward).
  The rows leave over NVLink while later tiles compute and are never written locally and read back.
  Padding rows write nothing. Pointer stores (scattered rows in peers' memory: no TMA); PUSH_ALIGNED:
  16-byte vectors (host-checked).
* PULL_PROGRAMS > 0 (at expert parallelism, the gate/up GEMM and the down dgrad): the dispatch inside the
  GEMM: the first PULL_PROGRAMS programs pull A's rows (x's, d_y's) M-tile by M-tile from the owners' token
  buffers and publish each with a flag the compute programs wait for (`in_gemm_pull`). PRINT_TIMEOUTS: a wait
  that times out prints its M-tile before the trap (set under the interpreter only: a printf anywhere in the
  kernel makes ptxas serialize its wgmma).
* UPCAST: fp32 dot operands (the interpreter's bf16 tl.dot is wrong; set there only).
* QUANT_BLOCK (`_gemm_tile` only, 0 here; `fused_pass` in mxfp8): the SwiGLU epilogues also store the E8M0 round
  trip of what the pass's next GEMM reads (`quantize.e8m0_round_trip`).

One output tile's work, its K loop and epilogue, is `_gemm_tile` (with `_descriptors`, the tensor descriptors it
uses): the persistent loop below calls it per tile, and so does the fused pass (`fused_pass`), for the two
variants of each pass, so that both compute every element with the same code.

Persistent: the grid is one program per SM (fewer when the capacity has fewer tiles); program p takes
tiles p, p + NUM_PROGRAMS, ... of the used tiles only. The used-tile count is read on the device
(expert_offsets[E] // BLOCK_M): no host sync, idle capacity costs nothing. Tiles are visited GROUP_M
M-tiles at a time across all N-tiles (`common.tile_coords`), so the SMs working at once share weight
tiles (one expert's) and A tiles in L2.

Determinism: every output element is written by exactly one program, the K loop runs in one fixed order,
no atomics; the router-weight gradient's row partials (one per 16 columns, each summed in the fixed tree of
`swiglu.d_rw_group_sums`) are added in column order by a second small kernel (`sum_partials`), so its bits do
not depend on the tiles or the engine either. Results do not depend on which SM ran a tile. Tile configurations
come from the `serval.plan.KernelPlan`, never from timing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import peers
from ..weight_layout import dense_rows
from ..peers import PeerSlots
from ..plan import TileConfig
from ..schedule import Schedule, packed_index
from . import common, in_gemm_pull, quantize, swiglu

# ---------------------------------------------------------------- kernel pieces


@triton.jit
def _load_a(a_desc, a_row_ptrs, a_row_valid, m0, k, col0, K,
            BLOCK_K: tl.constexpr, USE_TMA: tl.constexpr):
    """A[rows, col0 + k : col0 + k + BLOCK_K], zeros past K and on rows past the buffer."""
    if not USE_TMA:
        offs_k = k + tl.arange(0, BLOCK_K)
        mask = a_row_valid[:, None] & (offs_k < K)[None, :]
        return tl.load(a_row_ptrs[:, None] + (col0 + offs_k)[None, :], mask=mask, other=0.0)
    else:
        # the descriptor's shape ends at column K of this half, so TMA zero-fills past it
        return a_desc.load([m0, k])


@triton.jit
def _load_w(w_desc, w_ptr, expert, n0, k, stride_we, N_OUT, K,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, W_NK: tl.constexpr, USE_TMA: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] tile of B_e at (k, n0), zeros outside [K, N_OUT]; expert e's weight starts
    e * stride_we elements into w (rows dense: `serval.weight_layout.dense_rows`)."""
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
        base = w_ptr + expert.to(tl.int64) * stride_we
        if W_NK:
            ptrs = base + offs_n[None, :] * K + offs_k[:, None]
        else:
            ptrs = base + offs_k[:, None] * N_OUT + offs_n[None, :]
        return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _mma(a, b, acc, UPCAST: tl.constexpr):
    if UPCAST:  # interpreter: bf16 tl.dot is wrong there, and numpy's fp32 matmul sums in an order that depends
        # on the operands' layout (EP != EP=1 bits): fp64 products and sums, rounded once per K step
        return acc + tl.dot(a.to(tl.float64), b.to(tl.float64)).to(tl.float32)
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
                      c_ptr, stride_c, h_ptr, d_rw_partial_ptr, deq_ptr, swiglu_limit,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LIMIT: tl.constexpr, USE_TMA: tl.constexpr,
                      QUANT_BLOCK: tl.constexpr):
    """swiglu.backward of one [BLOCK_M, BLOCK_N] chunk of the down dgrad, stored (d_gate, d_up into
    d_gate_up's halves, h_weighted, and the router-weight gradient's partials, one per 16 columns, into
    d_rw_partial [R, ceil(n_limit / 16)]; QUANT_BLOCK: d_gate and d_up also E8M0-quantized and dequantized
    into deq's halves)."""
    d_gate, d_up, h_weighted, d_rw_terms = swiglu.backward(d_h_raw, pre_gate, pre_up, rw, swiglu_limit, HAS_LIMIT)
    _store_tile(c1_desc, c_ptr + n_limit, stride_c, d_up, m0, n0, n_limit, BLOCK_M, BLOCK_N, USE_TMA)
    _store_tile(c0_desc, c_ptr, stride_c, d_gate, m0, n0, n_limit, BLOCK_M, BLOCK_N, USE_TMA)
    if QUANT_BLOCK > 0:
        _store_tile(deq_ptr, deq_ptr + n_limit, stride_c, quantize.e8m0_round_trip(d_up, QUANT_BLOCK), m0, n0,
                    n_limit, BLOCK_M, BLOCK_N, False)
        _store_tile(deq_ptr, deq_ptr, stride_c, quantize.e8m0_round_trip(d_gate, QUANT_BLOCK), m0, n0, n_limit,
                    BLOCK_M, BLOCK_N, False)
    _store_tile(h_desc, h_ptr, n_limit, h_weighted, m0, n0, n_limit, BLOCK_M, BLOCK_N, USE_TMA)
    num_groups = tl.cdiv(n_limit, 16)
    groups = n0 // 16 + tl.arange(0, BLOCK_N // 16)
    rows = m0 + tl.arange(0, BLOCK_M)
    tl.store(d_rw_partial_ptr + rows.to(tl.int64)[:, None] * num_groups + groups[None, :],
             swiglu.d_rw_group_sums(d_rw_terms), mask=(groups < num_groups)[None, :])


# ---------------------------------------------------------------- one output tile (shared with fused_pass)


@triton.jit
def _descriptors(a_ptr, stride_a, num_rows, w0_ptr, w1_ptr, stride_we, c_ptr, stride_c, h_ptr, num_experts,
                 N_OUT, K,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EPI_N: tl.constexpr,
                 W_NK: tl.constexpr, K_SPLIT: tl.constexpr, EPILOGUE: tl.constexpr, PUSH: tl.constexpr,
                 USE_TMA: tl.constexpr):
    """(a0, a1, w0, w1, c0, c1, h): the tensor descriptors `_gemm_tile` reads and writes through with USE_TMA (the
    plain pointers where a variant uses none, and on the pointer path, where they are unused placeholders).
    stride_we: the weights' expert stride (elements), the same for w0 and w1."""
    if USE_TMA:
        if W_NK:
            w0_desc = tl.make_tensor_descriptor(w0_ptr, shape=[num_experts, N_OUT, K], strides=[stride_we, K, 1],
                                                block_shape=[1, BLOCK_N, BLOCK_K])
            w1_desc = tl.make_tensor_descriptor(w1_ptr, shape=[num_experts, N_OUT, K], strides=[stride_we, K, 1],
                                                block_shape=[1, BLOCK_N, BLOCK_K])
        else:
            w0_desc = tl.make_tensor_descriptor(w0_ptr, shape=[num_experts, K, N_OUT], strides=[stride_we, N_OUT, 1],
                                                block_shape=[1, BLOCK_K, BLOCK_N])
            w1_desc = tl.make_tensor_descriptor(w1_ptr, shape=[num_experts, K, N_OUT], strides=[stride_we, N_OUT, 1],
                                                block_shape=[1, BLOCK_K, BLOCK_N])
        # the second half of a split-K A (and of every [R, 2 N_OUT] tensor) is its own descriptor, so that
        # TMA bounds each half at its own last column (the host checks the halves are 16-byte aligned)
        a0_desc = tl.make_tensor_descriptor(a_ptr, shape=[num_rows, K], strides=[stride_a, 1],
                                            block_shape=[BLOCK_M, BLOCK_K])
        if K_SPLIT:
            a1_desc = tl.make_tensor_descriptor(a_ptr + K, shape=[num_rows, K], strides=[stride_a, 1],
                                                block_shape=[BLOCK_M, BLOCK_K])
        else:
            a1_desc = a0_desc
        if EPILOGUE == "swiglu_fwd" or PUSH:  # c is the packed gate_up, or the peers' slots: pointer stores only
            c0_desc = c_ptr
        else:
            c0_desc = tl.make_tensor_descriptor(c_ptr, shape=[num_rows, N_OUT], strides=[stride_c, 1],
                                                block_shape=[BLOCK_M, EPI_N])
        if EPILOGUE == "swiglu_bwd":
            c1_desc = tl.make_tensor_descriptor(c_ptr + N_OUT, shape=[num_rows, N_OUT], strides=[stride_c, 1],
                                                block_shape=[BLOCK_M, EPI_N])
        else:
            c1_desc = c0_desc
        if EPILOGUE != "store":
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
    return a0_desc, a1_desc, w0_desc, w1_desc, c0_desc, c1_desc, h_desc


@triton.jit
def _gemm_tile(
    descs, m_tile, n_tile,
    a_ptr, stride_a, num_rows, row_source_ptr, push_table_ptr, slots_per_rank,
    tile_expert_ptr, sched_block_m, w0_ptr, w1_ptr, stride_we, c_ptr, stride_c, h_ptr,
    packed_ptr, gate_up_ptr, router_weights_ptr, d_rw_partial_ptr, deq_ptr, N_OUT, K, swiglu_limit,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    W_NK: tl.constexpr, K_SPLIT: tl.constexpr, EPILOGUE: tl.constexpr, HAS_LIMIT: tl.constexpr,
    USE_TMA: tl.constexpr, UPCAST: tl.constexpr, EPI_SPLIT: tl.constexpr, EPI_TMA_STORES: tl.constexpr,
    PUSH: tl.constexpr, PUSH_ALIGNED: tl.constexpr, QUANT_BLOCK: tl.constexpr,
):
    """One output tile (m_tile, n_tile) of a `_grouped_gemm_kernel` variant: its K loop and its epilogue. `descs`:
    `_descriptors` of the same variant. The arguments are the kernel's (see there); EPI_TMA_STORES here is already
    USE_TMA and the config's choice. Inlined by the compiler into every kernel that calls it: the persistent
    grouped GEMM below and `fused_pass`. QUANT_BLOCK > 0 (`fused_pass` in mxfp8): the SwiGLU epilogues also store
    their output that the next GEMM reads (forward h [R, N_OUT], backward d_gate_up [R, 2 N_OUT]) quantized in
    (1, QUANT_BLOCK) blocks with E8M0 scales and dequantized (`quantize.e8m0_round_trip`), into deq_ptr (same
    layout, pointer stores); EPI_N must be a multiple of QUANT_BLOCK."""
    a0_desc, a1_desc, w0_desc, w1_desc, c0_desc, c1_desc, h_desc = descs
    DUAL: tl.constexpr = EPILOGUE == "swiglu_fwd"  # two accumulators: gate (w0) and up (w1)
    EPI_N: tl.constexpr = BLOCK_N // EPI_SPLIT  # width of the epilogue's column chunks
    dtype = w0_ptr.dtype.element_ty
    m0 = m_tile * BLOCK_M
    n0 = n_tile * BLOCK_N
    expert = tl.load(tile_expert_ptr + m0 // sched_block_m)
    rows = m0 + tl.arange(0, BLOCK_M)

    # per-row A addresses for the pointer path
    a_row_valid = rows < num_rows
    a_row_ptrs = a_ptr + rows.to(tl.int64) * stride_a

    acc0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = _load_a(a0_desc, a_row_ptrs, a_row_valid, m0, k, 0, K, BLOCK_K, USE_TMA)
        b = _load_w(w0_desc, w0_ptr, expert, n0, k, stride_we, N_OUT, K, BLOCK_N, BLOCK_K, W_NK, USE_TMA)
        acc0 = _mma(a, b, acc0, UPCAST)
        if DUAL:
            b1 = _load_w(w1_desc, w1_ptr, expert, n0, k, stride_we, N_OUT, K, BLOCK_N, BLOCK_K, W_NK, USE_TMA)
            acc1 = _mma(a, b1, acc1, UPCAST)
    if K_SPLIT:  # the same accumulator continues over A's second K columns against w1
        for k in range(0, K, BLOCK_K):
            a = _load_a(a1_desc, a_row_ptrs, a_row_valid, m0, k, K, K, BLOCK_K, USE_TMA)
            b = _load_w(w1_desc, w1_ptr, expert, n0, k, stride_we, N_OUT, K, BLOCK_N, BLOCK_K, W_NK, USE_TMA)
            acc0 = _mma(a, b, acc0, UPCAST)

    # ------------------------------------------------ epilogues, EPI_SPLIT column chunks at a time
    # (smaller store staging in shared memory; for swiglu_bwd, fewer live fp32 temporaries: unsplit it spilled)
    chunks0 = _column_chunks(acc0, BLOCK_M, BLOCK_N, EPI_SPLIT)
    if EPILOGUE == "store" and PUSH:
        source = tl.load(row_source_ptr + rows).to(tl.int64)
        valid = source >= 0
        slot_rows = peers.peer_rows(push_table_ptr, tl.where(valid, source, 0), valid, slots_per_rank, N_OUT,
                                     1, False, PUSH_ALIGNED, dtype)
        for c in tl.static_range(EPI_SPLIT):
            cols = n0 + c * EPI_N + tl.arange(0, EPI_N)
            tl.store(slot_rows[:, None] + cols[None, :], common.to_dtype(chunks0[c], dtype),
                     mask=valid[:, None] & (cols < N_OUT)[None, :])
    elif EPILOGUE == "store":
        for c in tl.static_range(EPI_SPLIT):
            _store_tile(c0_desc, c_ptr, stride_c, common.to_dtype(chunks0[c], dtype), m0, n0 + c * EPI_N, N_OUT,
                        BLOCK_M, EPI_N, EPI_TMA_STORES)

    elif EPILOGUE == "swiglu_fwd":
        chunks1 = _column_chunks(acc1, BLOCK_M, BLOCK_N, EPI_SPLIT)
        packed = tl.load(packed_ptr + rows)
        for c in tl.static_range(EPI_SPLIT):
            # gate_up is stored rounded (packed: kept for backward); h is computed from the rounded
            # values, as the torch stage does
            gate = common.to_dtype(chunks0[c], dtype)
            up = common.to_dtype(chunks1[c], dtype)
            ptrs, mask = _packed_tile_ptrs(c_ptr, packed, n0 + c * EPI_N, N_OUT, EPI_N)
            tl.store(ptrs, gate, mask=mask)
            tl.store(ptrs + N_OUT, up, mask=mask)
            h = common.to_dtype(swiglu.forward(gate, up, swiglu_limit, HAS_LIMIT), dtype)
            _store_tile(h_desc, h_ptr, N_OUT, h, m0, n0 + c * EPI_N, N_OUT, BLOCK_M, EPI_N, EPI_TMA_STORES)
            if QUANT_BLOCK > 0:  # the down GEMM's A in mxfp8 (h stays for the along-tokens copy kept for backward)
                _store_tile(deq_ptr, deq_ptr, N_OUT, quantize.e8m0_round_trip(h, QUANT_BLOCK), m0, n0 + c * EPI_N,
                            N_OUT, BLOCK_M, EPI_N, False)

    else:  # "swiglu_bwd": acc0 = d_y_rows @ w_down[e], the unscaled d_h
        source = tl.load(row_source_ptr + rows)
        rw = tl.load(router_weights_ptr + source, mask=source >= 0, other=0.0)
        # the packed gate/up of chunk c + 1 is loaded before chunk c is computed: the loads stay in
        # flight meanwhile; padding rows read zeros
        packed = tl.load(packed_ptr + rows)
        ptrs, mask = _packed_tile_ptrs(gate_up_ptr, packed, n0, N_OUT, EPI_N)
        g_next = tl.load(ptrs, mask=mask, other=0.0)
        u_next = tl.load(ptrs + N_OUT, mask=mask, other=0.0)
        for c in tl.static_range(EPI_SPLIT):
            gate = g_next
            up = u_next
            if c + 1 < EPI_SPLIT:
                ptrs, mask = _packed_tile_ptrs(gate_up_ptr, packed, n0 + (c + 1) * EPI_N, N_OUT, EPI_N)
                g_next = tl.load(ptrs, mask=mask, other=0.0)
                u_next = tl.load(ptrs + N_OUT, mask=mask, other=0.0)
            _swiglu_bwd_chunk(chunks0[c], gate, up, rw, m0, n0 + c * EPI_N, N_OUT, c0_desc, c1_desc, h_desc,
                              c_ptr, stride_c, h_ptr, d_rw_partial_ptr, deq_ptr, swiglu_limit, BLOCK_M, EPI_N,
                              HAS_LIMIT, EPI_TMA_STORES, QUANT_BLOCK)


# ---------------------------------------------------------------- the kernel


@triton.jit
def _grouped_gemm_kernel(
    # A operand: rows [R, K_total]; row_source [R] (the pull's and the push's sources)
    a_ptr, stride_a, row_source_ptr, top_k, num_rows,
    # PUSH: the peers' slot buffers [slots_per_rank, N_OUT], one int64 address per rank
    push_table_ptr, slots_per_rank,
    # PULL_PROGRAMS: the owners' token buffers [N, K] (one int64 address per rank), a flag per M-tile, the epoch
    # and (PULL_KEEP_RAW) the [R, K] buffer of the rows as pulled, where A gets them round-tripped (PULL_QUANT_BLOCK)
    pull_table_ptr, pull_slots_per_rank, pull_flags_ptr, pull_epoch_ptr, pull_raw_ptr,
    # schedule
    tile_expert_ptr, expert_offsets_ptr, num_experts, sched_block_m,
    # weights: w0 (and w1 for swiglu_fwd / K_SPLIT), [E, N_OUT, K] if W_NK else [E, K, N_OUT], rows dense, expert e
    # at e * stride_we
    w0_ptr, w1_ptr, stride_we,
    # outputs: c [R, N_OUT] (store), packed gate_up [num_packed, 2 N_OUT] (swiglu_fwd) or d_gate_up
    # [R, 2 N_OUT] (swiglu_bwd); h [R, N_OUT] (swiglu)
    c_ptr, stride_c, h_ptr,
    # swiglu: each row's packed index [R]; swiglu_bwd: gate_up packed [num_packed, 2 N_OUT], router weights
    # [N * k], d_rw partials [R, ceil(N_OUT / 16)]
    packed_ptr, gate_up_ptr, router_weights_ptr, d_rw_partial_ptr,
    N_OUT, K, swiglu_limit,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    W_NK: tl.constexpr, K_SPLIT: tl.constexpr, EPILOGUE: tl.constexpr,
    HAS_LIMIT: tl.constexpr, USE_TMA: tl.constexpr, UPCAST: tl.constexpr, FLATTEN: tl.constexpr,
    EPI_SPLIT: tl.constexpr, EPI_TMA_STORES_CFG: tl.constexpr, PUSH: tl.constexpr, PUSH_ALIGNED: tl.constexpr,
    PULL_PROGRAMS: tl.constexpr, PULL_ALIGNED: tl.constexpr, PULL_BLOCK_C: tl.constexpr, PROXY_FENCE: tl.constexpr,
    PRINT_TIMEOUTS: tl.constexpr, PULL_QUANT_BLOCK: tl.constexpr, PULL_KEEP_RAW: tl.constexpr,
):
    EPI_N: tl.constexpr = BLOCK_N // EPI_SPLIT  # width of the epilogue's column chunks
    EPI_TMA_STORES: tl.constexpr = USE_TMA and EPI_TMA_STORES_CFG

    # used tiles only: the count lives on the device, no host sync
    num_m_tiles = tl.load(expert_offsets_ptr + num_experts) // BLOCK_M
    num_n_tiles = tl.cdiv(N_OUT, BLOCK_N)
    num_tiles = num_m_tiles * num_n_tiles

    descs = _descriptors(a_ptr, stride_a, num_rows, w0_ptr, w1_ptr, stride_we, c_ptr, stride_c, h_ptr, num_experts,
                         N_OUT, K, BLOCK_M, BLOCK_N, BLOCK_K, EPI_N, W_NK, K_SPLIT, EPILOGUE, PUSH, USE_TMA)

    first_tile = tl.program_id(0)
    if PULL_PROGRAMS > 0:
        epoch = tl.load(pull_epoch_ptr)
        if tl.program_id(0) < PULL_PROGRAMS:
            in_gemm_pull.pull_tiles(pull_table_ptr, row_source_ptr, a_ptr, stride_a, pull_flags_ptr, epoch, num_m_tiles,
                                    pull_slots_per_rank, top_k, K, pull_raw_ptr, BLOCK_M, PULL_BLOCK_C, PULL_PROGRAMS,
                                    PULL_ALIGNED, PROXY_FENCE, PULL_QUANT_BLOCK, PULL_KEEP_RAW)
        first_tile = tl.where(tl.program_id(0) < PULL_PROGRAMS, num_tiles, tl.program_id(0) - PULL_PROGRAMS)
    for tile_id in tl.range(first_tile, num_tiles, NUM_PROGRAMS - PULL_PROGRAMS, flatten=FLATTEN):
        m_tile, n_tile = common.tile_coords(tile_id, num_m_tiles, num_n_tiles, GROUP_M)
        if PULL_PROGRAMS > 0:
            in_gemm_pull.wait_for_rows(pull_flags_ptr + m_tile, epoch, m_tile, PRINT_TIMEOUTS)
        _gemm_tile(descs, m_tile, n_tile,
                   a_ptr, stride_a, num_rows, row_source_ptr, push_table_ptr, slots_per_rank,
                   tile_expert_ptr, sched_block_m, w0_ptr, w1_ptr, stride_we, c_ptr, stride_c, h_ptr,
                   packed_ptr, gate_up_ptr, router_weights_ptr, d_rw_partial_ptr, c_ptr, N_OUT, K, swiglu_limit,
                   BLOCK_M, BLOCK_N, BLOCK_K, W_NK, K_SPLIT, EPILOGUE, HAS_LIMIT, USE_TMA, UPCAST, EPI_SPLIT,
                   EPI_TMA_STORES, PUSH, PUSH_ALIGNED, 0)


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


def weights_in_place(*weights: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], int]:
    """(weights, their expert stride in elements): the weights as given where their rows are dense and they share
    one layout (`serval.weight_layout.dense_rows`: a contiguous weight, or the halves of a joined gate/up weight), which
    the kernels read in place; else contiguous copies."""
    if not (all(dense_rows(w) for w in weights) and len({w.stride() for w in weights}) == 1):
        weights = tuple(w.contiguous() for w in weights)
    w = weights[0]
    return weights, w.stride(0) if w.shape[0] > 1 else w.shape[1] * w.shape[2]


def _check(a: torch.Tensor, *weights: torch.Tensor):
    """bf16 (the fast path), fp16, or fp32 (exact fp32 dot products: slow on the GPU, for checks), all one dtype."""
    for t in (a, *weights):
        if t.dtype not in (torch.bfloat16, torch.float16, torch.float32) or t.dtype != a.dtype:
            raise TypeError(f"the Triton grouped GEMM takes bf16, fp16 or fp32 operands of one dtype, "
                            f"got {[t.dtype for t in (a, *weights)]}")


def _launch(*, a, weights, out, h, schedule: Schedule, n_out: int, k: int, w_nk: bool, k_split: bool,
            epilogue: str, tiles: TileConfig, use_tma: bool, swiglu_limit=None, packed=None, gate_up=None,
            router_weights=None, d_rw_partial=None, push_to: PeerSlots | None = None,
            pull: in_gemm_pull.Pull | None = None):
    """Launch the persistent grid for one stage; outputs are written in place (`out`, or with push_to the
    peers' slot buffers, `out` then unused). use_tma: TMA where every operand allows it."""
    weights, stride_we = weights_in_place(*weights)
    w0, w1 = weights[0], weights[-1]
    block_m = min(tiles.block_m, schedule.block_m)
    if schedule.block_m % block_m:
        raise ValueError(f"tile rows {block_m} must divide the schedule's block_m {schedule.block_m}")
    if use_tma:  # the packed gate_up (swiglu_fwd's out, swiglu_bwd's gate_up) is never a TMA operand
        operands = [(w0, 0), (w1, 0), (a, 0)] + ([(a, k)] if k_split else [])
        if epilogue == "store" and push_to is None:
            operands += [(out, 0)]
        if epilogue == "swiglu_bwd":
            operands += [(out, 0), (out, n_out)]
        if h is not None:
            operands += [(h, 0)]
        use_tma = _tma_compatible(*operands)
    if use_tma and not common.INTERPRET:
        common.install_tma_allocator()

    num_n_tiles = common.cdiv(n_out, tiles.block_n)
    max_tiles = (schedule.capacity // block_m) * num_n_tiles
    num_programs = max(1, min(common.num_sms(a.device.index), max_tiles))
    dummy = out  # stands in for pointers a variant does not use
    pull_args, pull_programs, pull_block_c, pull_aligned = (dummy, 0, dummy, dummy, dummy), 0, 16, False
    quant_block, keep_raw = 0, False
    if pull is not None:
        pull_programs = max(1, min(pull.programs, common.num_sms(a.device.index) - 1))
        num_programs = common.num_sms(a.device.index)  # every program resident at once, pull programs first
        if pull.flags.numel() < schedule.capacity // block_m:
            raise ValueError(f"pull flags: {pull.flags.numel()} flags for {schedule.capacity // block_m} M-tiles")
        pull.epoch.add_(1)
        quant_block, keep_raw = pull.quant_block, pull.raw_rows is not None
        pull_args = (pull.source.table, pull.source.num_tokens * pull.source.top_k, pull.flags, pull.epoch,
                     pull.raw_rows if keep_raw else dummy)
        pull_block_c = in_gemm_pull.step_columns(pull.block_c, quant_block, k)
        pull_aligned = pull.source.aligned
    _grouped_gemm_kernel[(num_programs,)](
        a, a.stride(0), schedule.row_source, schedule.top_k, schedule.capacity,
        push_to.table if push_to is not None else dummy, push_to.num_slots if push_to is not None else 0,
        *pull_args,
        schedule.tile_expert, schedule.expert_offsets, schedule.num_experts, schedule.block_m,
        w0, w1, stride_we,
        out, out.stride(0), h if h is not None else dummy,
        packed if packed is not None else dummy, gate_up if gate_up is not None else dummy,
        router_weights if router_weights is not None else dummy,
        d_rw_partial if d_rw_partial is not None else dummy,
        n_out, k, float(swiglu_limit) if swiglu_limit is not None else 0.0,
        BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m,
        NUM_PROGRAMS=num_programs,
        W_NK=w_nk, K_SPLIT=k_split, EPILOGUE=epilogue,
        HAS_LIMIT=swiglu_limit is not None, USE_TMA=use_tma, UPCAST=common.INTERPRET, FLATTEN=tiles.flatten,
        EPI_SPLIT=tiles.epi_split, EPI_TMA_STORES_CFG=tiles.epi_tma_stores, PUSH=push_to is not None,
        PUSH_ALIGNED=push_to is not None and push_to.aligned,
        PULL_PROGRAMS=pull_programs, PULL_ALIGNED=pull_aligned, PULL_BLOCK_C=pull_block_c,
        PROXY_FENCE=use_tma and not common.INTERPRET, PRINT_TIMEOUTS=common.INTERPRET,
        PULL_QUANT_BLOCK=quant_block, PULL_KEEP_RAW=keep_raw, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )


def _output(schedule: Schedule, cols: int, like: torch.Tensor, push_to: PeerSlots | None):
    """A "store" stage's [R, cols] output, or (pushing) a stand-in the kernel never touches."""
    if push_to is None:
        return common.empty((schedule.capacity, cols), like.dtype, like.device)
    if push_to.cols != cols or push_to.dtype != like.dtype:
        raise ValueError(f"push_to: slot buffers of [{push_to.cols}] {push_to.dtype} columns, the GEMM makes "
                         f"[{cols}] {like.dtype}")
    return like


# ---------------------------------------------------------------- the stages on this engine


def gate_up_swiglu(a_rows, w_gate, w_up, schedule: Schedule, swiglu_limit: float | None, tiles: TileConfig,
                   use_tma: bool, *, pull: in_gemm_pull.Pull | None = None):
    """Gate/up GEMM + SwiGLU.

    a_rows [R, H]: the schedule's rows of x (with `pull`, an empty buffer the GEMM's communication programs
    fill from the owners' token buffers); w_gate, w_up [E, I, H]; all one dtype. Returns gate_up
    [num_packed, 2I] (packed rows, kept for backward) and h = SwiGLU(gate, up) [R, I]."""
    _check(a_rows, w_gate, w_up)
    _, inter, hidden = w_gate.shape
    gate_up = common.empty((schedule.num_packed, 2 * inter), a_rows.dtype, a_rows.device)
    h = common.empty((schedule.capacity, inter), a_rows.dtype, a_rows.device)
    _launch(a=a_rows.contiguous(), weights=(w_gate, w_up), out=gate_up, h=h,
            schedule=schedule, n_out=inter, k=hidden, w_nk=True, k_split=False, epilogue="swiglu_fwd", tiles=tiles,
            use_tma=use_tma, swiglu_limit=swiglu_limit, packed=packed_index(schedule), pull=pull)
    return gate_up, h


def down(h, w_down, schedule: Schedule, tiles: TileConfig, use_tma: bool, *, push_to: PeerSlots | None = None):
    """Down GEMM: h [R, I], w_down [E, H, I] -> o [R, H] = h @ w_down[e].T; with push_to, row r goes to its
    owner's slot row_source[r] instead (PUSH) and nothing is returned."""
    _check(h, w_down)
    hidden, inter = w_down.shape[1:]
    out = _output(schedule, hidden, h, push_to)
    _launch(a=h.contiguous(), weights=(w_down,), out=out, h=None, schedule=schedule, n_out=hidden,
            k=inter, w_nk=True, k_split=False, epilogue="store", tiles=tiles, use_tma=use_tma, push_to=push_to)
    return None if push_to is not None else out


def down_dgrad_swiglu_partials(d_y_rows, w_down, gate_up, router_weights, schedule: Schedule,
                               swiglu_limit: float | None, tiles: TileConfig, use_tma: bool, *,
                               pull: in_gemm_pull.Pull | None = None):
    """Down dgrad + SwiGLU backward: d_y_rows [R, H], w_down [E, H, I], gate_up [num_packed, 2I] (packed),
    router_weights fp32 [N * k] (by source). Returns d_gate_up [R, 2I], h_weighted = rw * h [R, I] and the
    router-weight gradient's row partials fp32 [R, ceil(I / 16)] (`sum_partials` reduces them). With
    `pull`, d_y_rows is the contiguous buffer the GEMM's communication programs fill (as gate_up_swiglu's)."""
    _check(d_y_rows, w_down, gate_up)
    hidden, inter = w_down.shape[1:]
    num_rows = schedule.capacity
    check_d_rw_chunks("tiles", tiles.block_n, tiles.epi_split)
    d_gate_up = common.empty((num_rows, 2 * inter), gate_up.dtype, gate_up.device)
    h_weighted = common.empty((num_rows, inter), gate_up.dtype, gate_up.device)
    d_rw_partial = new_d_rw_partial(num_rows, inter, gate_up.device)
    _launch(a=d_y_rows.contiguous(), weights=(w_down,), out=d_gate_up, h=h_weighted,
            schedule=schedule, n_out=inter, k=hidden, w_nk=False, k_split=False, epilogue="swiglu_bwd",
            tiles=tiles, use_tma=use_tma, swiglu_limit=swiglu_limit, packed=packed_index(schedule),
            gate_up=gate_up.contiguous(), router_weights=router_weights, d_rw_partial=d_rw_partial, pull=pull)
    return d_gate_up, h_weighted, d_rw_partial


def check_d_rw_chunks(name: str, block_n: int, epi_split: int) -> None:
    """ValueError unless a down dgrad's epilogue chunks (block_n // epi_split columns) are whole groups of the
    router-weight gradient's 16-column partials (`swiglu.D_RW_COLUMNS`)."""
    if block_n % epi_split or (block_n // epi_split) % swiglu.D_RW_COLUMNS:
        raise ValueError(f"{name}: the down dgrad's epilogue chunks (block_n {block_n} // epi_split {epi_split}) must "
                         f"be a multiple of {swiglu.D_RW_COLUMNS} columns (the router-weight gradient's partials)")


def new_d_rw_partial(num_rows: int, inter: int, device) -> torch.Tensor:
    """The router-weight gradient's partials fp32 [R, ceil(I / 16)], one per row and group of 16 columns, written
    by every down dgrad engine in the order `swiglu.d_rw_group_sums` fixes (`sum_partials` adds them)."""
    return common.empty((num_rows, common.cdiv(inter, swiglu.D_RW_COLUMNS)), torch.float32, device)


def sum_partials(d_rw_partial, schedule: Schedule):
    """d_rw_rows fp32 [R]: each row's partials [R, n] (`new_d_rw_partial`) added in ascending column order."""
    num_rows, num_groups = d_rw_partial.shape
    d_rw_rows = common.empty((num_rows,), torch.float32, d_rw_partial.device)
    block_r = 128
    _sum_partials_kernel[(common.cdiv(num_rows, block_r),)](
        d_rw_partial, d_rw_rows, schedule.expert_offsets, schedule.num_experts, num_rows, num_groups,
        BLOCK_R=block_r)
    return d_rw_rows


def gate_up_dgrad(d_gate_up, w_gate, w_up, schedule: Schedule, tiles: TileConfig, use_tma: bool, *,
                  push_to: PeerSlots | None = None):
    """Gate/up dgrad: d_gate_up [R, 2I], w_gate, w_up [E, I, H] -> d_x_rows [R, H] = d_gate @ w_gate[e] +
    d_up @ w_up[e], one accumulation over K = 2I; with push_to, pushed into the owners' slots (as down)."""
    _check(d_gate_up, w_gate, w_up)
    inter, hidden = w_gate.shape[1:]
    out = _output(schedule, hidden, d_gate_up, push_to)
    _launch(a=d_gate_up.contiguous(), weights=(w_gate, w_up), out=out, h=None,
            schedule=schedule, n_out=hidden, k=inter, w_nk=False, k_split=True, epilogue="store", tiles=tiles,
            use_tma=use_tma, push_to=push_to)
    return None if push_to is not None else out
