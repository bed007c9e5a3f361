"""One output tile of a grouped GEMM over the schedule's M-tiles: its K loop and its epilogue (`gemm_tile`), the
tensor descriptors it goes through (`descriptors`), and the argument bundles both take, built on the host here.

Every expert GEMM of the layer has the same shape: rows of an operand A, grouped by expert into M-tiles (see
`serval.schedule`), times the weight of the tile's expert,

    C[r, n] = sum_k A[r, k] * B_e[k, n],   e = tile_expert[r // block_m]

and differs only in how B_e is stored and what happens to the fp32 accumulator before it is stored. The
persistent grouped GEMM (`triton_gemm`) and the fused pass (`fused_pass`) both run every tile through
`gemm_tile`, so both compute every element with the same code: their results agree bit for bit.

What a tile computes is one constexpr value, `Variant`:

* W_NK: the weight is stored [E, Nout, K] (nn.Linear layout, C = A @ W[e].T: the forward GEMMs); otherwise
  [E, K, Nout] (C = A @ W[e]: the data gradients, which read the forward weights transposed). Both in place.
* K_SPLIT: K runs over two weights, A's first K columns against w0 and the next K against w1, into one
  accumulator (the gate/up dgrad: d_gate @ w_gate + d_up @ w_up).
* EPILOGUE: "store" (a plain store, or each row pushed into its owner's slot where `push` is given),
  "swiglu_fwd" (two accumulators, gate from w0 and up from w1; stores gate_up and h = silu(gate) * up),
  "swiglu_bwd" (the down dgrad fused with the SwiGLU backward and the router-weight gradient's row partials).
  gate_up, kept for backward, is stored in packed rows (no padding rows; `serval.schedule.packed_index`) and
  read back from them: row-scattered, so always through pointers.
* HAS_LIMIT: SwiGLU's clamp. PUSH_ALIGNED: pushed rows go as 16-byte vectors (host-checked).
* QUANT_BLOCK (mxfp8, the fused pass): where `Outputs.deq` is given, the SwiGLU epilogues also store the E8M0
  round trip of what the pass's next GEMM reads (`quantize.e8m0_round_trip`).

How it is cut and moved is another, `Tile`: BLOCK_M x BLOCK_N x BLOCK_K; EPI_SPLIT column chunks in the epilogue
(fewer live registers, smaller store staging); USE_TMA, tensor descriptors (Hopper TMA) for the weights, A and the
row-aligned outputs, else masked pointer loads and stores (operands TMA cannot address); TMA_STORES, the
row-aligned stores through TMA (a TMA store waits for the one before it to leave the staging buffer, and the
kernels are not warp-specialised, so nothing else runs meanwhile; pointer stores are fire-and-forget); UPCAST,
fp64 dot products (the interpreter, whose bf16 dot is wrong).

The runtime arguments are bundles (NamedTuples: Triton passes them as tuples of their fields, and a field that
is None is a compile-time None, so a variant carries nothing it does not read): `Operands` (`Rows` A,
`Weights`, `Outputs`, the sizes), `ScheduleTables`, `SwigluBackwardInputs`, `PushTo`. PUSH: row r is written to
slot `row_source[r]` of its owner's slot buffer, found in a table of every rank's buffer address
(`serval.peers`), instead of to c[r]: the combine's push fused into the GEMM that makes the rows. Padding rows
write nothing.

Determinism: the K loop runs in one fixed order, no atomics; the router-weight gradient's partials (one per 16
columns, each summed in the fixed tree of `swiglu.d_rw_group_sums`) are added in column order by a second kernel
(`triton_gemm.sum_partials`), so their bits depend neither on the tiles nor on the engine.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import peers
from ..peers import PeerSlots
from ..plan import TileConfig
from ..schedule import Schedule, packed_index
from ..weight_layout import dense_rows
from . import common, quantize, swiglu


# ---------------------------------------------------------------- the bundles


class Variant(NamedTuple):
    """What a tile computes (constexpr; see the module docstring)."""

    W_NK: bool
    K_SPLIT: bool
    EPILOGUE: str
    HAS_LIMIT: bool
    PUSH_ALIGNED: bool = False
    QUANT_BLOCK: int = 0


class Tile(NamedTuple):
    """How a tile is cut and moved (constexpr; see the module docstring)."""

    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    EPI_SPLIT: int
    USE_TMA: bool
    TMA_STORES: bool
    UPCAST: bool


class Rows(NamedTuple):
    """A, row-major: rows [num_rows, K] (two K halves side by side with Variant.K_SPLIT), `stride` apart."""

    ptr: torch.Tensor
    stride: int
    num_rows: int


class Weights(NamedTuple):
    """The expert weights, rows dense, expert e at e * stride_expert elements: w0, and w1 (gate/up's up, the
    K_SPLIT's second half; w0 again where a variant reads one)."""

    w0: torch.Tensor
    w1: torch.Tensor
    stride_expert: int


class Outputs(NamedTuple):
    """c [R, Nout] ("store"), the packed gate_up [num_packed, 2 Nout] ("swiglu_fwd") or d_gate_up [R, 2 Nout]
    ("swiglu_bwd"), `stride_c` apart; h [R, Nout] (the SwiGLU epilogues); deq (QUANT_BLOCK), the SwiGLU
    epilogue's output the next GEMM reads, round-tripped, laid out as h (forward) or c (backward)."""

    c: torch.Tensor
    stride_c: int
    h: torch.Tensor | None = None
    deq: torch.Tensor | None = None


class Operands(NamedTuple):
    """One GEMM's operands and sizes: A, the weights, the outputs, n_out = Nout and k = K (per half)."""

    a: Rows
    w: Weights
    out: Outputs
    n_out: int
    k: int


class ScheduleTables(NamedTuple):
    """The schedule's device tables a GEMM reads: row_source [R], tile_expert [R // block_m], expert_offsets
    [E + 1] (the used M-tiles: expert_offsets[E] // BLOCK_M), E, the schedule's block_m, and each row's packed index
    [R] (the SwiGLU epilogues; None elsewhere)."""

    row_source: torch.Tensor
    tile_expert: torch.Tensor
    expert_offsets: torch.Tensor
    num_experts: int
    block_m: int
    packed: torch.Tensor | None = None


class SwigluBackwardInputs(NamedTuple):
    """What the "swiglu_bwd" epilogue reads beyond the accumulator and writes beside it: the forward's packed
    gate_up [num_packed, 2 Nout], the router weights fp32 [N * k] by source, the router-weight gradient's row
    partials fp32 [R, ceil(Nout / 16)]."""

    gate_up: torch.Tensor
    router_weights: torch.Tensor
    d_rw_partial: torch.Tensor


class PushTo(NamedTuple):
    """The owners' slot buffers [slots_per_rank, Nout], an int64 address per rank (`serval.peers.PeerSlots`)."""

    table: torch.Tensor
    slots_per_rank: int


def operand_rows(a: torch.Tensor) -> Rows:
    """A GEMM's A rows as the kernels read them: row-major (a contiguous copy where a is not)."""
    a = a.contiguous()
    return Rows(a, a.stride(0), a.shape[0])


def schedule_tables(schedule: Schedule, packed: bool) -> ScheduleTables:
    """The schedule's tables for a GEMM; packed: with each row's packed index (the SwiGLU epilogues)."""
    return ScheduleTables(schedule.row_source, schedule.tile_expert, schedule.expert_offsets, schedule.num_experts,
                          schedule.block_m, packed_index(schedule) if packed else None)


def push_to(target: PeerSlots | None) -> PushTo | None:
    return None if target is None else PushTo(target.table, target.num_slots)


def tile(config: TileConfig, block_m: int, use_tma: bool, tma_stores: bool) -> Tile:
    """The constexpr Tile of a TileConfig with the launch's BLOCK_M; tma_stores: whether the row-aligned stores may
    go through TMA (with use_tma and the config's epi_tma_stores)."""
    return Tile(block_m, config.block_n, config.block_k, config.epi_split, use_tma,
                use_tma and tma_stores and config.epi_tma_stores, common.INTERPRET)


# ---------------------------------------------------------------- host checks shared by the launches


def check_operands(a: torch.Tensor, *weights: torch.Tensor) -> None:
    """bf16 (the fast path), fp16, or fp32 (exact fp32 dot products: slow on the GPU, for checks), all one dtype."""
    for t in (a, *weights):
        if t.dtype not in (torch.bfloat16, torch.float16, torch.float32) or t.dtype != a.dtype:
            raise TypeError(f"the Triton grouped GEMM takes bf16, fp16 or fp32 operands of one dtype, "
                            f"got {[t.dtype for t in (a, *weights)]}")


def tma_compatible(*tensors_and_offsets) -> bool:
    """TMA needs 16-byte aligned bases (each half of a split tensor too) and row strides."""
    for t, col_offset in tensors_and_offsets:
        if t.stride(-1) != 1:
            return False
        if any((s * t.element_size()) % 16 for s in t.stride()[:-1]):
            return False
        if (t.data_ptr() + col_offset * t.element_size()) % 16:
            return False
    return True


def weights_in_place(*weights: torch.Tensor) -> Weights:
    """The weights as the kernels read them: in place where their rows are dense and they share one layout
    (`serval.weight_layout.dense_rows`: a contiguous weight, or the halves of a joined gate/up weight), else
    contiguous copies; w1 is w0 for one weight."""
    if not (all(dense_rows(w) for w in weights) and len({w.stride() for w in weights}) == 1):
        weights = tuple(w.contiguous() for w in weights)
    w = weights[0]
    return Weights(w, weights[-1], w.stride(0) if w.shape[0] > 1 else w.shape[1] * w.shape[2])


def check_d_rw_chunks(name: str, block_n: int, epi_split: int) -> None:
    """ValueError unless a down dgrad's epilogue chunks (block_n // epi_split columns) are whole groups of the
    router-weight gradient's 16-column partials (`swiglu.D_RW_COLUMNS`)."""
    if block_n % epi_split or (block_n // epi_split) % swiglu.D_RW_COLUMNS:
        raise ValueError(f"{name}: the down dgrad's epilogue chunks (block_n {block_n} // epi_split {epi_split}) must "
                         f"be a multiple of {swiglu.D_RW_COLUMNS} columns (the router-weight gradient's partials)")


def new_d_rw_partial(num_rows: int, inter: int, device) -> torch.Tensor:
    """The router-weight gradient's partials fp32 [R, ceil(I / 16)], one per row and group of 16 columns, written
    by every down dgrad engine in the order `swiglu.d_rw_group_sums` fixes (`triton_gemm.sum_partials` adds them)."""
    return common.empty((num_rows, common.cdiv(inter, swiglu.D_RW_COLUMNS)), torch.float32, device)


# ---------------------------------------------------------------- the tile's pieces


@triton.jit
def _load_a(a_desc, a_row_ptrs, a_row_valid, m0, k, col0, K, BLOCK_K: tl.constexpr, USE_TMA: tl.constexpr):
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
    e * stride_we elements into w."""
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
def _swiglu_bwd_chunk(d_h_raw, pre_gate, pre_up, rw, m0, n0, out, c0_desc, c1_desc, h_desc, d_rw_partial_ptr,
                      n_limit, swiglu_limit, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LIMIT: tl.constexpr,
                      USE_TMA: tl.constexpr, QUANT_BLOCK: tl.constexpr):
    """swiglu.backward of one [BLOCK_M, BLOCK_N] chunk of the down dgrad, stored (d_gate, d_up into
    d_gate_up's halves, h_weighted, and the router-weight gradient's partials, one per 16 columns, into
    d_rw_partial [R, ceil(n_limit / 16)]; with out.deq, d_gate and d_up also E8M0-quantized and dequantized
    into deq's halves)."""
    d_gate, d_up, h_weighted, d_rw_terms = swiglu.backward(d_h_raw, pre_gate, pre_up, rw, swiglu_limit, HAS_LIMIT)
    _store_tile(c1_desc, out.c + n_limit, out.stride_c, d_up, m0, n0, n_limit, BLOCK_M, BLOCK_N, USE_TMA)
    _store_tile(c0_desc, out.c, out.stride_c, d_gate, m0, n0, n_limit, BLOCK_M, BLOCK_N, USE_TMA)
    if out.deq is not None:
        _store_tile(out.deq, out.deq + n_limit, out.stride_c, quantize.e8m0_round_trip(d_up, QUANT_BLOCK), m0, n0,
                    n_limit, BLOCK_M, BLOCK_N, False)
        _store_tile(out.deq, out.deq, out.stride_c, quantize.e8m0_round_trip(d_gate, QUANT_BLOCK), m0, n0, n_limit,
                    BLOCK_M, BLOCK_N, False)
    _store_tile(h_desc, out.h, n_limit, h_weighted, m0, n0, n_limit, BLOCK_M, BLOCK_N, USE_TMA)
    num_groups = tl.cdiv(n_limit, 16)
    groups = n0 // 16 + tl.arange(0, BLOCK_N // 16)
    rows = m0 + tl.arange(0, BLOCK_M)
    tl.store(d_rw_partial_ptr + rows.to(tl.int64)[:, None] * num_groups + groups[None, :],
             swiglu.d_rw_group_sums(d_rw_terms), mask=(groups < num_groups)[None, :])


# ---------------------------------------------------------------- descriptors and the tile


@triton.jit
def descriptors(ops, sched, push, V: tl.constexpr, T: tl.constexpr):
    """((a0, a1), (w0, w1), outputs): the tensor descriptors `gemm_tile` reads and writes through with T.USE_TMA: A's
    two K halves (a1 is a0 without K_SPLIT), the two weights, and the outputs the epilogue stores by TMA ("store":
    (c,), none when pushing; "swiglu_fwd": (h,), its packed gate_up goes through pointers; "swiglu_bwd": (c's
    two halves, h)). On the pointer path the tensors stand in for them, unread."""
    a, w, out = ops.a, ops.w, ops.out
    N_OUT = ops.n_out
    K = ops.k
    BLOCK_M: tl.constexpr = T.BLOCK_M
    BLOCK_N: tl.constexpr = T.BLOCK_N
    BLOCK_K: tl.constexpr = T.BLOCK_K
    EPI_N: tl.constexpr = T.BLOCK_N // T.EPI_SPLIT
    EPILOGUE: tl.constexpr = V.EPILOGUE
    USE_TMA: tl.constexpr = T.USE_TMA
    W_NK: tl.constexpr = V.W_NK
    K_SPLIT: tl.constexpr = V.K_SPLIT
    if USE_TMA:
        if W_NK:
            w0_desc = tl.make_tensor_descriptor(w.w0, shape=[sched.num_experts, N_OUT, K],
                                                strides=[w.stride_expert, K, 1], block_shape=[1, BLOCK_N, BLOCK_K])
            w1_desc = tl.make_tensor_descriptor(w.w1, shape=[sched.num_experts, N_OUT, K],
                                                strides=[w.stride_expert, K, 1], block_shape=[1, BLOCK_N, BLOCK_K])
        else:
            w0_desc = tl.make_tensor_descriptor(w.w0, shape=[sched.num_experts, K, N_OUT],
                                                strides=[w.stride_expert, N_OUT, 1],
                                                block_shape=[1, BLOCK_K, BLOCK_N])
            w1_desc = tl.make_tensor_descriptor(w.w1, shape=[sched.num_experts, K, N_OUT],
                                                strides=[w.stride_expert, N_OUT, 1],
                                                block_shape=[1, BLOCK_K, BLOCK_N])
        # the second half of a split-K A (and of every [R, 2 N_OUT] tensor) is its own descriptor, so that
        # TMA bounds each half at its own last column (the host checks the halves are 16-byte aligned)
        a0_desc = tl.make_tensor_descriptor(a.ptr, shape=[a.num_rows, K], strides=[a.stride, 1],
                                            block_shape=[BLOCK_M, BLOCK_K])
        if K_SPLIT:
            a1_desc = tl.make_tensor_descriptor(a.ptr + K, shape=[a.num_rows, K], strides=[a.stride, 1],
                                                block_shape=[BLOCK_M, BLOCK_K])
        else:
            a1_desc = a0_desc
        if EPILOGUE == "store" and push is None:
            outs = (tl.make_tensor_descriptor(out.c, shape=[a.num_rows, N_OUT], strides=[out.stride_c, 1],
                                              block_shape=[BLOCK_M, EPI_N]),)
        elif EPILOGUE == "store":  # pushed into the peers' slots: pointer stores
            outs = ()
        elif EPILOGUE == "swiglu_fwd":  # the packed gate_up: pointer stores
            outs = (tl.make_tensor_descriptor(out.h, shape=[a.num_rows, N_OUT], strides=[N_OUT, 1],
                                              block_shape=[BLOCK_M, EPI_N]),)
        else:
            outs = (tl.make_tensor_descriptor(out.c, shape=[a.num_rows, N_OUT], strides=[out.stride_c, 1],
                                              block_shape=[BLOCK_M, EPI_N]),
                    tl.make_tensor_descriptor(out.c + N_OUT, shape=[a.num_rows, N_OUT], strides=[out.stride_c, 1],
                                              block_shape=[BLOCK_M, EPI_N]),
                    tl.make_tensor_descriptor(out.h, shape=[a.num_rows, N_OUT], strides=[N_OUT, 1],
                                              block_shape=[BLOCK_M, EPI_N]))
    else:  # pointer path: gemm_tile reads no descriptor, these stand in for them
        w0_desc = w.w0
        w1_desc = w.w1
        a0_desc = a.ptr
        a1_desc = a.ptr
        if EPILOGUE == "store" and push is None:
            outs = (out.c,)
        elif EPILOGUE == "store":
            outs = ()
        elif EPILOGUE == "swiglu_fwd":
            outs = (out.h,)
        else:
            outs = (out.c, out.c, out.h)
    return (a0_desc, a1_desc), (w0_desc, w1_desc), outs


@triton.jit
def gemm_tile(descs, m_tile, n_tile, ops, sched, swiglu_bwd, push, swiglu_limit, V: tl.constexpr, T: tl.constexpr):
    """One output tile (m_tile, n_tile) of the GEMM `ops` (`Operands`) in variant V on tile T: its K loop and its
    epilogue. descs: `descriptors` of the same GEMM; sched: `ScheduleTables`; swiglu_bwd: `SwigluBackwardInputs`
    ("swiglu_bwd" only); push: `PushTo` or None. Inlined by the compiler into every kernel that calls it."""
    a_descs, w_descs, out_descs = descs
    a0_desc, a1_desc = a_descs
    w0_desc, w1_desc = w_descs
    a, w, out = ops.a, ops.w, ops.out
    N_OUT = ops.n_out
    K = ops.k
    BLOCK_M: tl.constexpr = T.BLOCK_M
    BLOCK_N: tl.constexpr = T.BLOCK_N
    BLOCK_K: tl.constexpr = T.BLOCK_K
    EPI_SPLIT: tl.constexpr = T.EPI_SPLIT
    USE_TMA: tl.constexpr = T.USE_TMA
    TMA_STORES: tl.constexpr = T.TMA_STORES
    UPCAST: tl.constexpr = T.UPCAST
    W_NK: tl.constexpr = V.W_NK
    K_SPLIT: tl.constexpr = V.K_SPLIT
    EPILOGUE: tl.constexpr = V.EPILOGUE
    HAS_LIMIT: tl.constexpr = V.HAS_LIMIT
    PUSH_ALIGNED: tl.constexpr = V.PUSH_ALIGNED
    QUANT_BLOCK: tl.constexpr = V.QUANT_BLOCK
    DUAL: tl.constexpr = EPILOGUE == "swiglu_fwd"  # two accumulators: gate (w0) and up (w1)
    EPI_N: tl.constexpr = BLOCK_N // EPI_SPLIT  # width of the epilogue's column chunks
    dtype = w.w0.dtype.element_ty
    m0 = m_tile * BLOCK_M
    n0 = n_tile * BLOCK_N
    expert = tl.load(sched.tile_expert + m0 // sched.block_m)
    rows = m0 + tl.arange(0, BLOCK_M)

    # per-row A addresses for the pointer path
    a_row_valid = rows < a.num_rows
    a_row_ptrs = a.ptr + rows.to(tl.int64) * a.stride

    acc0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a_tile = _load_a(a0_desc, a_row_ptrs, a_row_valid, m0, k, 0, K, BLOCK_K, USE_TMA)
        b = _load_w(w0_desc, w.w0, expert, n0, k, w.stride_expert, N_OUT, K, BLOCK_N, BLOCK_K, W_NK, USE_TMA)
        acc0 = _mma(a_tile, b, acc0, UPCAST)
        if DUAL:
            b1 = _load_w(w1_desc, w.w1, expert, n0, k, w.stride_expert, N_OUT, K, BLOCK_N, BLOCK_K, W_NK, USE_TMA)
            acc1 = _mma(a_tile, b1, acc1, UPCAST)
    if K_SPLIT:  # the same accumulator continues over A's second K columns against w1
        for k in range(0, K, BLOCK_K):
            a_tile = _load_a(a1_desc, a_row_ptrs, a_row_valid, m0, k, K, K, BLOCK_K, USE_TMA)
            b = _load_w(w1_desc, w.w1, expert, n0, k, w.stride_expert, N_OUT, K, BLOCK_N, BLOCK_K, W_NK, USE_TMA)
            acc0 = _mma(a_tile, b, acc0, UPCAST)

    # ------------------------------------------------ epilogues, EPI_SPLIT column chunks at a time
    # (smaller store staging in shared memory; for swiglu_bwd, fewer live fp32 temporaries: unsplit it spilled)
    chunks0 = _column_chunks(acc0, BLOCK_M, BLOCK_N, EPI_SPLIT)
    if EPILOGUE == "store" and push is not None:
        source = tl.load(sched.row_source + rows).to(tl.int64)
        valid = source >= 0
        slot_rows = peers.peer_rows(push.table, tl.where(valid, source, 0), valid, push.slots_per_rank, N_OUT,
                                     1, False, PUSH_ALIGNED, dtype)
        for c in tl.static_range(EPI_SPLIT):
            cols = n0 + c * EPI_N + tl.arange(0, EPI_N)
            tl.store(slot_rows[:, None] + cols[None, :], common.to_dtype(chunks0[c], dtype),
                     mask=valid[:, None] & (cols < N_OUT)[None, :])
    elif EPILOGUE == "store":
        c0_desc = out_descs[0]
        for c in tl.static_range(EPI_SPLIT):
            _store_tile(c0_desc, out.c, out.stride_c, common.to_dtype(chunks0[c], dtype), m0, n0 + c * EPI_N, N_OUT,
                        BLOCK_M, EPI_N, TMA_STORES)

    elif EPILOGUE == "swiglu_fwd":
        h_desc = out_descs[0]
        chunks1 = _column_chunks(acc1, BLOCK_M, BLOCK_N, EPI_SPLIT)
        packed = tl.load(sched.packed + rows)
        for c in tl.static_range(EPI_SPLIT):
            # gate_up is stored rounded (packed: kept for backward); h is computed from the rounded
            # values, as the torch stage does
            gate = common.to_dtype(chunks0[c], dtype)
            up = common.to_dtype(chunks1[c], dtype)
            ptrs, mask = _packed_tile_ptrs(out.c, packed, n0 + c * EPI_N, N_OUT, EPI_N)
            tl.store(ptrs, gate, mask=mask)
            tl.store(ptrs + N_OUT, up, mask=mask)
            h = common.to_dtype(swiglu.forward(gate, up, swiglu_limit, HAS_LIMIT), dtype)
            _store_tile(h_desc, out.h, N_OUT, h, m0, n0 + c * EPI_N, N_OUT, BLOCK_M, EPI_N, TMA_STORES)
            if out.deq is not None:  # the down GEMM's A in mxfp8 (h stays for the along-tokens copy kept for backward)
                _store_tile(out.deq, out.deq, N_OUT, quantize.e8m0_round_trip(h, QUANT_BLOCK), m0, n0 + c * EPI_N,
                            N_OUT, BLOCK_M, EPI_N, False)

    else:  # "swiglu_bwd": acc0 = d_y_rows @ w_down[e], the unscaled d_h
        c0_desc, c1_desc, h_desc = out_descs
        source = tl.load(sched.row_source + rows)
        rw = tl.load(swiglu_bwd.router_weights + source, mask=source >= 0, other=0.0)
        # the packed gate/up of chunk c + 1 is loaded before chunk c is computed: the loads stay in
        # flight meanwhile; padding rows read zeros
        packed = tl.load(sched.packed + rows)
        ptrs, mask = _packed_tile_ptrs(swiglu_bwd.gate_up, packed, n0, N_OUT, EPI_N)
        g_next = tl.load(ptrs, mask=mask, other=0.0)
        u_next = tl.load(ptrs + N_OUT, mask=mask, other=0.0)
        for c in tl.static_range(EPI_SPLIT):
            gate = g_next
            up = u_next
            if c + 1 < EPI_SPLIT:
                ptrs, mask = _packed_tile_ptrs(swiglu_bwd.gate_up, packed, n0 + (c + 1) * EPI_N, N_OUT, EPI_N)
                g_next = tl.load(ptrs, mask=mask, other=0.0)
                u_next = tl.load(ptrs + N_OUT, mask=mask, other=0.0)
            _swiglu_bwd_chunk(chunks0[c], gate, up, rw, m0, n0 + c * EPI_N, out, c0_desc, c1_desc, h_desc,
                              swiglu_bwd.d_rw_partial, N_OUT, swiglu_limit, BLOCK_M, EPI_N, HAS_LIMIT, TMA_STORES,
                              QUANT_BLOCK)
