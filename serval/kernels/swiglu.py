"""The SwiGLU math of the GEMM epilogues, written once for every kernel that runs it.

The gate/up GEMM's epilogue (forward) stores h = silu(gate) * up; the down dgrad's epilogues (the Triton
GEMM's and the ping-pong engine's) recompute that h and take the SwiGLU backward. All of them call these
@triton.jit functions (Gluon kernels can call Triton functions), so they run the same operations: the
backward sees bit for bit the h that the forward stored and fed to the down GEMM, and the two dgrad
engines agree bit for bit.

sigmoid(x) = 1 / (1 + 2^(-x log2 e)) runs on the GPU as two special-function ops with subnormals flushed
(`ex2.approx.ftz.f32`, `rcp.approx.ftz.f32`: ~2 ulp each), not as tl.sigmoid's exp and full-range division,
which made the ping-pong dgrad's epilogue outlast its K loop. Its h is as close to torch's as tl.sigmoid's.
The interpreter has no inline PTX and uses tl.sigmoid (the CPU tests compare against the fp64 reference).

The router-weight gradient d_rw[r] = <d_h_raw[r], h[r]> is a sum over I columns that every engine splits
differently (tile widths, epilogue chunks, register layouts). So that its bits do not depend on the engine or
its tiles, every engine sums it in one order, written here with explicit element-wise adds (reshape / split),
which fix the order whatever the layout, on products the compiler cannot fuse into FMAs (`_product`): per
group of D_RW_COLUMNS = 16 consecutive columns a fixed tree (`d_rw_group_sums`), stored as a partial per group;
`triton_gemm.sum_partials` then adds a row's groups in ascending order.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import INTERPRET, to_dtype

_INTERPRET: tl.constexpr = tl.constexpr(INTERPRET)
D_RW_COLUMNS = 16  # columns per router-weight-gradient partial (an epilogue chunk is a whole number of them)


@triton.jit
def sigmoid(x):
    """fp32 sigmoid: ex2 and rcp special-function ops on the GPU (x = -inf .. inf gives 0 .. 1, NaN stays
    NaN), tl.sigmoid in the interpreter."""
    if _INTERPRET:
        return tl.sigmoid(x)
    else:
        exp_neg = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x * -1.4426950408889634],
                                            dtype=tl.float32, is_pure=True, pack=1)
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [1 + exp_neg],
                                         dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def clamp_gate(gate, limit):
    """gate.clamp(max=limit); NaN stays NaN, as in torch (PTX min/max would drop it)."""
    return tl.minimum(gate, limit, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def clamp_up(up, limit):
    """up.clamp(-limit, limit); NaN stays NaN."""
    return tl.minimum(tl.maximum(up, -limit, propagate_nan=tl.PropagateNan.ALL), limit,
                      propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def forward(gate, up, swiglu_limit, HAS_LIMIT: tl.constexpr):
    """h = silu(gate) * up in fp32 from the stored (bf16-rounded) pre-activations, as stages.swiglu."""
    gate = gate.to(tl.float32)
    up = up.to(tl.float32)
    if HAS_LIMIT:
        gate = clamp_gate(gate, swiglu_limit)
        up = clamp_up(up, swiglu_limit)
    return gate * sigmoid(gate) * up


@triton.jit
def backward(d_h_raw, pre_gate, pre_up, rw, swiglu_limit, HAS_LIMIT: tl.constexpr):
    """SwiGLU backward of a [rows, cols] chunk of the down dgrad, as stages.down_dgrad_swiglu.

    d_h_raw: fp32 d_y_rows @ w_down[e] (before the router weight); pre_gate, pre_up: the stored bf16
    pre-activations (zeros on padding rows); rw: the rows' router weights. d_h = rw * d_h_raw,
    d_gate = d_h * up * silu'(gate), d_up = d_h * silu(gate), no gradient through an active clamp.
    Returns (d_gate, d_up, h_weighted) in bf16 (pre_gate's dtype) and the d_rw terms d_h_raw * h (fp32, the
    chunk's shape; `d_rw_group_sums` sums them), with h recomputed exactly as `forward` stored it.
    """
    dtype = pre_gate.dtype
    pre_gate = pre_gate.to(tl.float32)
    pre_up = pre_up.to(tl.float32)
    if HAS_LIMIT:
        gate = clamp_gate(pre_gate, swiglu_limit)
        up = clamp_up(pre_up, swiglu_limit)
    else:
        gate = pre_gate
        up = pre_up
    sig = sigmoid(gate)
    silu = gate * sig
    d_silu = sig * (1 + gate * (1 - sig))
    if HAS_LIMIT:
        d_silu = d_silu * (pre_gate <= swiglu_limit).to(tl.float32)
    h = to_dtype(silu * up, dtype).to(tl.float32)  # the h `forward` stored: (gate * sig) * up, rounded once
    d_rw_terms = _product(d_h_raw, h)
    d_h = d_h_raw * rw[:, None]
    d_up = d_h * silu
    if HAS_LIMIT:
        d_up = d_up * ((pre_up >= -swiglu_limit) & (pre_up <= swiglu_limit)).to(tl.float32)
    return to_dtype(d_h * up * d_silu, dtype), to_dtype(d_up, dtype), to_dtype(h * rw[:, None], dtype), d_rw_terms


@triton.jit
def _product(a, b):
    """a * b in fp32, rounded once: on the GPU `mul.rn`, which ptxas never contracts with a later add into an FMA
    (where it would, the bits of `d_rw_group_sums` would depend on the code the compiler generates)."""
    if _INTERPRET:
        return a * b
    else:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)


@triton.jit
def _pair_sums(x, ROWS: tl.constexpr, GROUPS: tl.constexpr, WIDTH: tl.constexpr):
    """[ROWS, GROUPS, WIDTH] -> [ROWS, GROUPS, WIDTH // 2]: x[..., 2i] + x[..., 2i + 1]."""
    a, b = tl.split(tl.reshape(x, (ROWS, GROUPS, WIDTH // 2, 2)))
    return a + b


@triton.jit
def _half_sums(x, ROWS: tl.constexpr, GROUPS: tl.constexpr, WIDTH: tl.constexpr):
    """[ROWS, GROUPS, WIDTH] -> [ROWS, GROUPS, WIDTH // 2]: x[..., i] + x[..., i + WIDTH // 2]."""
    a, b = tl.split(tl.permute(tl.reshape(x, (ROWS, GROUPS, 2, WIDTH // 2)), (0, 1, 3, 2)))
    return a + b


@triton.jit
def d_rw_group_quads(terms):
    """The first two levels of `d_rw_group_sums`: [rows, C] -> [rows, C // 16, 4] (C a multiple of 16), per group
    q[i] = (t[2i] + t[2i + 1]) + (t[2i + 8] + t[2i + 9]), i < 4. On a wgmma accumulator's layout these adds stay
    within a thread (lane l of a quad holds columns 2l, 2l + 1, 2l + 8, 2l + 9 of each 16); the last two levels
    (`d_rw_finish_quads`) are across the quad's lanes."""
    ROWS: tl.constexpr = terms.shape[0]
    GROUPS: tl.constexpr = terms.shape[1] // 16
    pairs = _pair_sums(tl.reshape(terms, (ROWS, GROUPS, 16)), ROWS, GROUPS, 16)
    return _half_sums(pairs, ROWS, GROUPS, 8)


@triton.jit
def d_rw_finish_quads(quads):
    """The last two levels of `d_rw_group_sums`: [rows, G, 4] -> [rows, G], (q[0] + q[2]) + (q[1] + q[3]). (The
    ping-pong engine, whose q[l] sit in lane l of a quad, takes them as a warp sum: its butterfly, xor 2 then
    xor 1, is this tree, as fp32 addition commutes.)"""
    ROWS: tl.constexpr = quads.shape[0]
    GROUPS: tl.constexpr = quads.shape[1]
    halves = _half_sums(quads, ROWS, GROUPS, 4)
    return tl.reshape(_half_sums(halves, ROWS, GROUPS, 2), (ROWS, GROUPS))


@triton.jit
def d_rw_group_sums(terms):
    """[rows, C] d_rw terms -> [rows, C // 16]: each group of 16 columns summed in one fixed tree. On the GPU its
    last two levels are a warp sum over the quad's lanes (a wgmma accumulator's chunk puts q0..q3 in lanes 0..3 of
    a quad; the butterfly, xor 2 then xor 1, is `d_rw_finish_quads`' tree), which needs no shared memory; the
    interpreter, whose sum adds in order, takes the explicit tree. GPU tests check the bits against the
    ping-pong engine's (five tile widths and splits); the sm_90a layouts of eight tiles were read (reports)."""
    quads = d_rw_group_quads(terms)
    if _INTERPRET:
        return d_rw_finish_quads(quads)
    else:
        return tl.sum(quads, axis=2)
