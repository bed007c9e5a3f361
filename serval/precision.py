"""The FP8 precisions of the routed experts (`Config.precision`): what is quantized, how, where, and what
is kept for backward. The shared expert, the combine, the router weights (fp32) and the weight gradients'
dtype stay as in BF16; every GEMM accumulates in fp32 and writes bf16.

Two recipes (`RECIPES`), the same data flow, quantized with `serval.ops.quantize`:

* "mxfp8" (MoK's recipe): E4M3 with one E8M0 (power-of-two) scale per 32 elements along the GEMM's K.
  Hopper has no block-scaled tensor cores, and an E4M3 value times 2^k is exact in bf16, so each operand is
  quantized and dequantized to bf16 in one pass that keeps no E4M3 copy (`ops.round_trip`) and the BF16 engines
  run the GEMMs: the products and the fp32 sums are those of an MXFP8 GEMM, up to accumulation order.
* "fp8_blockwise" (the DeepSeek-V3 recipe): E4M3 with fp32 scales, 1x128 blocks for activations and
  gradients, 128x128 for weights; the block-scaled FP8 GEMMs (`serval.kernels.fp8_gemm`) apply the scales
  once per 128-K step. Needs I % 128 == 0 (a 128x128 weight block must not straddle w_gate and w_up) and
  block_m % 128 == 0.

Per GEMM, operand blocks run along that GEMM's K:

    forward   gate/up   x rows (along H)            x  w_gate|w_up (along H)
              down      h rows (along I)            x  w_down (along I)
    backward  down dgrad d_y rows (along H)         x  w_down (along H)
              gate/up dgrad d_gate_up (along I)     x  w_gate|w_up (along I)
              w_down grad  (r * d_y) along tokens   x  h along tokens
              w_gate|w_up grad  d_gate_up along tokens  x  x along tokens

Along tokens means blocks of rows of the routed buffer: expert segments start at multiples of block_m, a
multiple of the block, so no block spans two experts; padding rows are zero. The down dgrad takes d_y
rows unscaled and applies the router weight r in its epilogue, as BF16 does, so that d_router_weights is
<d_y W_down, h> with no division by r; the w_down gradient takes r * d_y, as MoK's does.

The fp8_blockwise SwiGLU row passes (`ops.swiglu_fp8`, `ops.swiglu_backward_fp8`) write their outputs
quantized along the row too (h and the kept pre-activations forward, d_gate_up backward), so no quantization
pass reads them again; the along-tokens copies stay separate passes. A weight wanted in both layouts (the weight
cache, `serval.quantize_expert_weights`) is read once for both (`serval.ops.quantize_both_layouts`: a 128 x 128
block has one scale either way).

Kept for backward (`Kept`): the gate/up pre-activations quantized along 2I in packed rows, and h quantized
along tokens; x along tokens is rebuilt in backward from x (the same bits, H bytes per row not kept).
At EP the rows are pulled in bf16 and quantized after the pull, as MoK does; the quantized values are
then those of EP=1.

The fused passes (`KernelPlan.fused_forward` / `fused_backward`) run mxfp8 (`Recipe.fused_passes`; fp8_blockwise
runs staged): the quantization between a pass's two GEMMs (h along I, d_gate_up along 2I: blocks within a row)
happens in the first GEMM's epilogue, and at EP the launch's pull programs round-trip the x and d_y rows they pull;
the bits are those of the staged passes, and the rows moved are the same.

Accuracy against BF16: MoK's acceptance (sum|diff| / sum|ref| <= 0.1) holds on the gradients while a
swiglu_limit rarely binds; where it clamps many pre-activations (a limit of the order of their spread), the
clamp's derivative, 0 or 1, flips for the elements that the FP8 rounding moves across it, and the gradients
of x and of w_gate / w_up drift further from BF16 (0.13-0.29 in a CPU sweep with limits 1.5 and 0.3 on O(1)
pre-activations), while y stays close.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal, NamedTuple

import torch

from . import stages, weight_layout
from .ops import dequantize, quantize, quantize_both_layouts, round_trip
from .peers import push_keywords
from .schedule import Schedule
from .values import QuantizedTensor


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One FP8 precision: E4M3 elements, `block` elements per scale along an activation's K (and along
    tokens), `weight_block` (rows, cols) per weight scale, the scale format, and whether the GEMMs run in
    FP8 (`fp8_gemm`) or on the BF16 engines with exactly dequantized operands. `quantize_backend`: the
    quantizers' (`serval.ops.quantize`), "triton" where the pass runs on the kernels (the pass plan sets it, so
    that the CPU's interpreter runs the quantizer kernels the GPU runs), "auto" elsewhere (the same bits)."""

    name: str
    scale_format: Literal["e8m0", "fp32"]
    block: int
    weight_block: tuple[int, int] | None  # None: 1 x block along each GEMM's K
    fp8_gemm: bool
    quantize_backend: Literal["auto", "triton"] = "auto"

    def rows(self, t: torch.Tensor, *, keep: bool = False, **kwargs
             ) -> tuple[QuantizedTensor | None, torch.Tensor | None]:
        """t [R, C] quantized along C: (the quantized copy, None) where the GEMMs run in FP8 or the copy is kept for
        backward (`keep`), else (None, its exact dequantized values: `round_trip`, no quantized copy made)."""
        return self._quantized(t, (1, self.block), False, keep, **kwargs)

    def tokens(self, t: torch.Tensor, *, keep: bool = False, **kwargs
               ) -> tuple[QuantizedTensor | None, torch.Tensor | None]:
        """t [R, C] quantized along R (tokens), as `rows`; the quantized copy stored [C, R] (K-contiguous for an
        FP8 weight gradient) when the GEMMs run in FP8."""
        return self._quantized(t, (self.block, 1), self.fp8_gemm, keep, **kwargs)

    def _quantized(self, t, block, transpose: bool, keep: bool, **kwargs):
        if self.fp8_gemm or keep:
            return quantize(t, block=block, scale_format=self.scale_format, transpose=transpose,
                            backend=self.quantize_backend, **kwargs)[0], None
        return None, round_trip(t, block=block, scale_format=self.scale_format, backend=self.quantize_backend,
                                **kwargs)

    def weight(self, w: torch.Tensor, k_dim: int):
        """Expert weights [E, A, B] as BF16 GEMMs whose K is dim `k_dim` (1 or 2) read them: dequantized bf16 in
        w's layout, blocks along K (the FP8 GEMMs' 128 x 128 blocks: `gemm_weights`)."""
        block = (1, self.block) if k_dim == 2 else (self.block, 1)
        return round_trip(w, block=block, scale_format=self.scale_format, backend=self.quantize_backend)

    @property
    def fused_passes(self) -> bool:
        """Whether the fused passes (`KernelPlan.fused_forward` / `fused_backward`) run this recipe: its GEMMs
        run on the BF16 engines (dequantized operands), and its blocks along a GEMM's K are row-local, so the
        first GEMM's epilogue can quantize what the second reads (`fused_pass` quant_block). Not fp8_blockwise,
        whose FP8 GEMMs have no tile in the fused launch."""
        return not self.fp8_gemm


RECIPES = {
    "mxfp8": Recipe("mxfp8", "e8m0", 32, None, fp8_gemm=False),
    "fp8_blockwise": Recipe("fp8_blockwise", "fp32", 128, (128, 128), fp8_gemm=True),
}


def recipe_of(precision: str) -> Recipe | None:
    """The recipe of a Config.precision, None for "bf16"."""
    return RECIPES.get(precision)


def check_inputs(recipe: Recipe, dtype: torch.dtype, inter: int, block_m: int) -> None:
    """ValueError unless the recipe can run on this input dtype and these sizes (see the module docstring)."""
    if dtype != torch.bfloat16:
        raise ValueError(f"precision={recipe.name!r} quantizes bf16 activations: x and the weights must be "
                         f"bfloat16, got {str(dtype).replace('torch.', '')}")
    check_sizes(recipe, inter, block_m)


def check_sizes(recipe: Recipe, inter: int, block_m: int) -> None:
    """ValueError unless the recipe can run with expert intermediate size `inter` and Config.block_m `block_m`."""
    if block_m % recipe.block:
        raise ValueError(f"Config.block_m must be a multiple of {recipe.block} for precision={recipe.name!r} "
                         f"(a {recipe.block}-row block along tokens must not span two experts), got {block_m}")
    if recipe.fp8_gemm and inter % recipe.weight_block[0]:
        raise ValueError(f"precision={recipe.name!r} needs the expert intermediate size I (w_gate.shape[1]) to be "
                         f"a multiple of {recipe.weight_block[0]} (a weight block must not straddle w_gate and "
                         f"w_up), got {inter}")


def check_finite(name: str, t: torch.Tensor) -> None:
    """ValueError if t holds a NaN or Inf (a host sync: `Config(debug=True)` only). Without the check a NaN or
    Inf makes its quantization blocks NaN, and the NaN propagates to the outputs and gradients it reaches."""
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"serval.moe: {name} holds NaN or Inf (Config(debug=True) checks it before the FP8 "
                         "quantization, which would turn its blocks into NaN)")


class Kept(NamedTuple):
    """What a low-precision forward keeps for backward (see the module docstring)."""

    gate_up: QuantizedTensor  # [num_packed, 2I], blocks along 2I
    h_tokens: QuantizedTensor  # h [R, I] along tokens; stored [I, R] when the GEMMs run in FP8

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.gate_up.data, self.gate_up.scale, self.h_tokens.data, self.h_tokens.scale)

    @classmethod
    def from_tensors(cls, recipe: Recipe, gate_up, gate_up_scale, h_tokens, h_tokens_scale) -> "Kept":
        return cls(QuantizedTensor(gate_up, gate_up_scale, (1, recipe.block), False),
                   QuantizedTensor(h_tokens, h_tokens_scale, (recipe.block, 1), recipe.fp8_gemm))


def kept_like(recipe: Recipe, num_packed: int, capacity: int, inter: int, device) -> tuple[torch.Tensor, ...]:
    """Empty tensors shaped as `Kept.tensors()` (the custom op's fake implementation)."""
    scale_dtype = torch.uint8 if recipe.scale_format == "e8m0" else torch.float32
    fp8 = dict(dtype=torch.float8_e4m3fn, device=device)
    blocks_2i, blocks_r = math.ceil(2 * inter / recipe.block), math.ceil(capacity / recipe.block)
    h_shape, h_scale_shape = ((inter, capacity), (inter, blocks_r)) if recipe.fp8_gemm else \
        ((capacity, inter), (blocks_r, inter))
    return (torch.empty(num_packed, 2 * inter, **fp8), torch.empty(num_packed, blocks_2i, dtype=scale_dtype,
                                                                   device=device),
            torch.empty(h_shape, **fp8), torch.empty(h_scale_shape, dtype=scale_dtype, device=device))


def _fp8_layouts(recipe: Recipe, w, layouts: tuple[bool, ...], outs: dict | None = None) -> dict:
    """w [E, A, B] quantized in the recipe's 128 x 128 blocks, for each of `layouts` (transposed or not: stored
    [E, A, B] for a GEMM whose K is B, [E, B, A] for K = A): {transposed: QuantizedTensor}, written into
    outs[transposed] = (data, scale) where given. Both layouts from one read where both are wanted
    (`quantize_both_layouts`)."""
    if not layouts:
        return {}
    outs = outs or {}
    kwargs = dict(block=recipe.weight_block, scale_format=recipe.scale_format, backend=recipe.quantize_backend)
    if len(layouts) == 2:
        q, q_t = quantize_both_layouts(w, out=outs.get(False), out_t=outs.get(True), **kwargs)
        return {False: q, True: q_t}
    (transposed,) = layouts
    return {transposed: quantize(w, transpose=transposed, out=outs.get(transposed), **kwargs)[0]}


def _gate_up_weights(recipe: Recipe, w_gate, w_up, layouts: tuple[bool, ...]) -> dict:
    """w_gate and w_up as one FP8 GEMM operand, for each of `layouts` (`_fp8_layouts`): [E, 2I, H] (not
    transposed: K = H, forward) and [E, H, 2I] (transposed: K = I, dgrad), gate first. Each is quantized straight
    into its half of the joined buffers (I % 128 == 0: the blocks are those of the joined weight), so joining
    them costs no pass."""
    num_experts, inter, hidden = w_gate.shape
    n_inter, n_hidden = (math.ceil(n / recipe.weight_block[0]) for n in (inter, hidden))
    joined = {}
    for transposed in layouts:
        data_shape = (num_experts, hidden, 2 * inter) if transposed else (num_experts, 2 * inter, hidden)
        scale_shape = (num_experts, n_hidden, 2 * n_inter) if transposed else (num_experts, 2 * n_inter, n_hidden)
        joined[transposed] = (torch.empty(data_shape, dtype=torch.float8_e4m3fn, device=w_gate.device),
                              torch.empty(scale_shape, dtype=torch.float32, device=w_gate.device))
    for half, w in enumerate((w_gate, w_up)):
        _fp8_layouts(recipe, w, layouts, {
            transposed: (data.narrow(2 if transposed else 1, half * inter, inter),
                         scale.narrow(2 if transposed else 1, half * n_inter, n_inter))
            for transposed, (data, scale) in joined.items()})
    return {transposed: QuantizedTensor(data, scale, recipe.weight_block, transposed)
            for transposed, (data, scale) in joined.items()}


class ExpertWeights(NamedTuple):
    """The routed experts' weights as the four GEMMs of a precision read them, made by `expert_weights`:
    per call, or once per optimizer step by the user (`serval.quantize_expert_weights`) and passed to every
    micro-batch's `serval.moe`, so that gradient accumulation quantizes them once.

    fp8_blockwise: QuantizedTensors, 128 x 128 blocks: gate_up [E, 2I, H] (K = H, forward), down [E, H, I]
    (K = I, forward), down_t [E, I, H] (K = H, down dgrad), gate_up_t [E, H, 2I] (K = I, gate/up dgrad).
    mxfp8: the exactly dequantized bf16 weights the BF16 GEMMs read, blocks of 32 along each GEMM's K:
    gate_up and gate_up_t are (w_gate, w_up) pairs in the bf16 layout, down and down_t w_down's."""

    gate_up: object
    down: object
    down_t: object
    gate_up_t: object

    def tensors(self) -> list[torch.Tensor]:
        """Flat, in field order (the custom ops carry them as a tensor list)."""
        flat = []
        for field in self:
            flat += [field.data, field.scale] if isinstance(field, QuantizedTensor) else list(
                field if isinstance(field, tuple) else (field,))
        return flat

    @classmethod
    def from_tensors(cls, recipe: Recipe, tensors) -> "ExpertWeights":
        t = list(tensors)
        if recipe.fp8_gemm:
            block = recipe.weight_block
            return cls(*(QuantizedTensor(t[2 * i], t[2 * i + 1], block, transposed)
                         for i, transposed in enumerate((False, False, True, True))))
        return cls((t[0], t[1]), t[2], t[3], (t[4], t[5]))


def expert_weights(recipe: Recipe, w_gate, w_up, w_down) -> ExpertWeights:
    """w_gate, w_up [E, I, H] and w_down [E, H, I] bf16, in the form each GEMM of the recipe reads."""
    return gemm_weights(recipe, w_gate, w_up, w_down, None, ExpertWeights._fields)


def gemm_weights(recipe: Recipe, w_gate, w_up, w_down, made: ExpertWeights | None, fields) -> ExpertWeights:
    """`made` (the user's `expert_weights`), else `expert_weights` with only `fields` (ExpertWeights field names: the
    GEMMs a pass runs) quantized, the others None."""
    if made is not None:
        return made
    if recipe.fp8_gemm:  # each weight read once for the layouts wanted of it (transposed: the dgrads')
        gate_up = _gate_up_weights(recipe, w_gate, w_up, _layouts(fields, "gate_up"))
        down = _fp8_layouts(recipe, w_down, _layouts(fields, "down"))
        return ExpertWeights(gate_up.get(False), down.get(False), down.get(True), gate_up.get(True))
    make = dict(gate_up=lambda: (recipe.weight(w_gate, 2), recipe.weight(w_up, 2)),
                down=lambda: recipe.weight(w_down, 2), down_t=lambda: recipe.weight(w_down, 1),
                gate_up_t=lambda: (recipe.weight(w_gate, 1), recipe.weight(w_up, 1)))
    return ExpertWeights(*(make[field]() if field in fields else None for field in ExpertWeights._fields))


def _layouts(fields, name: str) -> tuple[bool, ...]:
    """The layouts of weight `name` ("gate_up" or "down") among ExpertWeights `fields`: False for the forward's
    (`name`), True for the dgrad's (`name`_t)."""
    return tuple(transposed for field, transposed in ((name, False), (name + "_t", True)) if field in fields)


def check_expert_weights(recipe: Recipe, made: ExpertWeights, w_gate, w_down) -> None:
    """ValueError unless `made` is what `expert_weights(recipe, w_gate, w_up, w_down)` returns for weights of
    these shapes (the values are the caller's to keep current: quantize again after each optimizer step)."""
    want = expert_weights_like(recipe, w_gate.shape, w_down.shape, "meta")  # shapes and dtypes, no memory
    got = made.tensors() if isinstance(made, ExpertWeights) else None
    if got is None or len(got) != len(want) or any(
            g.shape != w.shape or g.dtype != w.dtype or g.device != w_gate.device or not g.is_contiguous()
            for g, w in zip(got, want)):
        raise ValueError(f"expert_weights must be serval.quantize_expert_weights(w_gate, w_up, w_down, "
                         f"precision={recipe.name!r}) of this layer's weights (w_gate {tuple(w_gate.shape)}, "
                         f"w_down {tuple(w_down.shape)}, {w_gate.device})")


def expert_weights_like(recipe: Recipe, gate_shape, down_shape, device) -> list[torch.Tensor]:
    """Empty tensors shaped as `expert_weights(...).tensors()`."""
    num_experts, inter, hidden = gate_shape
    if not recipe.fp8_gemm:
        bf16 = dict(dtype=torch.bfloat16, device=device)
        return [torch.empty(gate_shape, **bf16)] * 2 + [torch.empty(down_shape, **bf16)] * 2 + \
            [torch.empty(gate_shape, **bf16)] * 2
    fp8, f32 = dict(dtype=torch.float8_e4m3fn, device=device), dict(dtype=torch.float32, device=device)
    nb = recipe.weight_block[0]
    n_i, n_h = math.ceil(inter / nb), math.ceil(hidden / nb)
    shapes = [((num_experts, 2 * inter, hidden), (num_experts, 2 * n_i, n_h)),
              ((num_experts, hidden, inter), (num_experts, n_h, n_i)),
              ((num_experts, inter, hidden), (num_experts, n_i, n_h)),
              ((num_experts, hidden, 2 * inter), (num_experts, n_h, 2 * n_i))]
    return [t for data, scale in shapes for t in (torch.empty(data, **fp8), torch.empty(scale, **f32))]


def _gathered(ops, q: QuantizedTensor, schedule: Schedule) -> QuantizedTensor:
    """The schedule's rows of a row-quantized token tensor (padding rows: zero data and scale)."""
    return q._replace(data=ops.gather(q.data.view(torch.uint8), schedule).view(q.data.dtype),
                      scale=ops.gather(q.scale, schedule))


def _row_slice(q: QuantizedTensor, start: int, length: int) -> QuantizedTensor:
    """Rows [start, start + length) of a tensor stored along tokens ([C, R], one scale row per data row)."""
    return q._replace(data=q.data.narrow(0, start, length), scale=q.scale.narrow(0, start, length))


def dequantized_weights(recipe: Recipe, w_gate, w_up, w_down, made: ExpertWeights | None, backward: bool):
    """The weights as a recipe whose GEMMs run in BF16 (mxfp8) reads them, made or quantized here: forward
    (w_gate, w_up, w_down), backward (w_down, w_gate, w_up), each quantized along its GEMM's K."""
    if backward:
        made = gemm_weights(recipe, w_gate, w_up, w_down, made, ("down_t", "gate_up_t"))
        return made.down_t, *made.gate_up_t
    made = gemm_weights(recipe, w_gate, w_up, w_down, made, ("gate_up", "down"))
    return *made.gate_up, made.down


def fused_forward_operands(recipe: Recipe, x, w_gate, w_up, w_down, made: ExpertWeights | None, at_ep: bool):
    """A fused forward's operands (a fused pass): the tokens the launch reads, and w_gate, w_up, w_down as the forward
    GEMMs read them (`dequantized_weights`). At EP=1 the tokens x [N, H] quantized along H and dequantized, whose
    gathered rows are, bit for bit, the staged path's (row blocks); at EP x itself: the launch's pull programs
    round-trip each row they pull (`fused_pass` quant_block)."""
    return (x if at_ep else recipe.rows(x)[1],
            *dequantized_weights(recipe, w_gate, w_up, w_down, made, backward=False))


def keep(recipe: Recipe, gate_up, h) -> Kept:
    """What a forward whose GEMMs ran in BF16 (mxfp8) keeps from its gate_up [num_packed, 2I] and h [R, I]."""
    return Kept(recipe.rows(gate_up, keep=True)[0], recipe.tokens(h, keep=True)[0])


def fused_backward_operands(recipe: Recipe, d_y, kept: Kept, w_gate, w_up, w_down, made: ExpertWeights | None,
                            at_ep: bool):
    """A fused backward's operands (a fused pass): the tokens the launch reads (d_y [N, H] as `fused_forward_operands`
    takes x), w_down, w_gate, w_up as the dgrads read them, and the kept pre-activations dequantized."""
    return (d_y if at_ep else recipe.rows(d_y)[1],
            *dequantized_weights(recipe, w_gate, w_up, w_down, made, backward=True),
            dequantize(kept.gate_up, d_y.dtype))


def forward(ops, recipe: Recipe, x, x_rows, w_gate, w_up, w_down, schedule: Schedule, swiglu_limit,
            made: ExpertWeights | None = None, push_to=None, keeps: bool = True, pull: dict | None = None):
    """The routed experts: (o [R, H] bf16, Kept). x [N, H] bf16: the tokens; x_rows [R, H]: their rows pulled
    at EP (quantized after the pull), None at EP=1, where the tokens are quantized once and their rows
    gathered in E4M3 (row blocks do not depend on the row order: the same bits, a k-th of the work).
    w_down None: what backward keeps only (recomputation), (None, Kept). made: the weights already in the
    GEMMs' form (`expert_weights` or `gemm_weights`), else they are quantized here. push_to: the owners' slots
    (`serval.peers.PeerSlots`), where a down GEMM that can (on BF16 engines: mxfp8) writes o's rows from its
    epilogue, returning None for o; an FP8 GEMM returns them for the caller to push. keeps False: Kept is None
    and not made (a later window of the macrobatch ring, whose backward recomputes it). pull (the GEMM pulls):
    the gate/up stage's pull_from and pull_flags: at EP its GEMM pulls x's rows itself (x_rows None), round-trips
    them and computes on them as they arrive."""
    made = gemm_weights(recipe, w_gate, w_up, w_down, made, ("gate_up",) if w_down is None else ("gate_up", "down"))
    if recipe.fp8_gemm:
        x_q = recipe.rows(x_rows)[0] if x_rows is not None else _gathered(ops, recipe.rows(x)[0], schedule)
        gate_up_rows = ops.fp8_grouped_gemm(x_q, made.gate_up, schedule)
        # one row pass: h, h quantized along I, and the pre-activations kept in packed rows, as BF16 keeps them
        h, h_q, gate_up = ops.swiglu_fp8(gate_up_rows, schedule, swiglu_limit, recipe.block, recipe.scale_format)
        del gate_up_rows
    elif pull is not None:
        gate_up, h = ops.gate_up_swiglu(x, *made.gate_up, schedule, swiglu_limit, quant_block=recipe.block, **pull)
    else:  # at EP=1 the gate/up stage gathers the dequantized tokens' rows itself
        x_deq = recipe.rows(x if x_rows is None else x_rows)[1]
        gate_up, h = ops.gate_up_swiglu(x_deq, *made.gate_up, schedule, swiglu_limit,
                                        a_rows=None if x_rows is None else x_deq)
    kept = None
    if keeps:
        kept = Kept(gate_up, recipe.tokens(h, keep=True)[0]) if recipe.fp8_gemm else keep(recipe, gate_up, h)
    if w_down is None:
        return None, kept
    if recipe.fp8_gemm:
        return ops.fp8_grouped_gemm(h_q, made.down, schedule), kept
    return ops.down(recipe.rows(h)[1], made.down, schedule, **push_keywords(push_to)), kept


def _rows_quantized(tokens, rows, schedule: Schedule, quantize_along):
    """The schedule's rows of `tokens` [N, C], quantized by quantize_along: read through the schedule at EP=1
    (rows None), else the pulled rows [R, C]."""
    if rows is None:
        return quantize_along(tokens, rows_of=(schedule.row_source, schedule.top_k))
    return quantize_along(rows)


def backward(ops, recipe: Recipe, d_y, d_y_rows, x, x_rows, kept: Kept, router_weights, w_gate, w_up, w_down,
             schedule: Schedule, swiglu_limit, made: ExpertWeights | None = None, weight_grads: bool = True,
             push_to=None, d_y_pull: dict | None = None):
    """The routed experts' dgrads from d_y and x [N, H] (bf16), their rows [R, H] pulled at EP (None at EP=1: the
    quantization passes read the tokens' rows through the schedule, no bf16 rows are made) and the group's router
    weights [P*N, k]: (d_x_rows [R, H], d_router_weight_rows [R] fp32, the weight gradients still to run). The
    last is `expert_weight_grads` bound to its operands (call it for (d_w_gate, d_w_up, d_w_down), with the
    macrobatch ring's `windows` where there are): the caller sums and frees d_x's rows first, and the dgrad-layout
    weights are gone by then (peak memory). weight_grads False: None (none of their quantizations run). made: as
    in `forward`. push_to: as in `forward`, for d_x's rows. d_y_pull (the GEMM pulls): the down dgrad's pull_from
    and pull_flags: at EP it pulls d_y's rows itself, into d_y_rows (an empty [R, H] buffer: the rows as pulled,
    for the weight gradients) and round-tripped into the rows it reads."""
    dtype = x.dtype
    made = gemm_weights(recipe, w_gate, w_up, w_down, made, ("down_t", "gate_up_t"))
    at_ep1 = d_y_rows is None
    row_rw = stages.row_weights(router_weights, schedule).float()  # [R], 0 on padding rows
    if recipe.fp8_gemm:  # per token, then the E4M3 rows gathered, as the forward does with x
        d_y_q = _gathered(ops, recipe.rows(d_y)[0], schedule) if at_ep1 else recipe.rows(d_y_rows)[0]
        d_h_raw = ops.fp8_grouped_gemm(d_y_q, made.down_t, schedule)
        del d_y_q
        d_gate_up, d_gate_up_q, d_rw_rows = ops.swiglu_backward_fp8(d_h_raw, kept.gate_up, schedule, row_rw,
                                                                    swiglu_limit)
        del d_h_raw
    elif d_y_pull is not None:
        d_gate_up, _, d_rw_rows = ops.down_dgrad_swiglu(d_y_rows, made.down_t, dequantize(kept.gate_up, dtype),
                                                        router_weights, schedule, swiglu_limit,
                                                        quant_block=recipe.block, **d_y_pull)
    else:
        d_y_deq = _rows_quantized(d_y, d_y_rows, schedule, recipe.rows)[1]
        d_gate_up, _, d_rw_rows = ops.down_dgrad_swiglu(d_y_deq, made.down_t, dequantize(kept.gate_up, dtype),
                                                        router_weights, schedule, swiglu_limit)
        del d_y_deq
    if recipe.fp8_gemm:
        # d_gate_up along tokens (the weight gradients') now, so that the bf16 d_gate_up, which no FP8 GEMM reads,
        # goes before the gate/up dgrad makes d_x's rows (peak memory)
        d_gate_up_tokens = recipe.tokens(d_gate_up) if weight_grads else None
        del d_gate_up
        d_x_rows = ops.fp8_grouped_gemm(d_gate_up_q, made.gate_up_t, schedule)
        del d_gate_up_q
    else:
        d_gate_up_deq = recipe.rows(d_gate_up)[1]
        d_x_rows = ops.gate_up_dgrad(d_gate_up_deq, *made.gate_up_t, schedule, **push_keywords(push_to))
        del d_gate_up_deq
        # along tokens here (its dequantized copy is as large as d_gate_up): the weight gradients take it as made
        d_gate_up_tokens = recipe.tokens(d_gate_up) if weight_grads else None
        del d_gate_up
    if not weight_grads:
        return d_x_rows, d_rw_rows, None
    return d_x_rows, d_rw_rows, functools.partial(expert_weight_grads, ops, recipe, d_y, d_y_rows, x, x_rows,
                                                  d_gate_up_tokens, kept, row_rw, schedule, w_gate, w_up)


def expert_weight_grads(ops, recipe: Recipe, d_y, d_y_rows, x, x_rows, d_gate_up_tokens, kept: Kept, row_rw,
                        schedule: Schedule, w_gate, w_up, windows=None):
    """(d_w_gate, d_w_up, d_w_down) from their operands quantized along tokens: d_y and x [N, H] (bf16) with their
    rows [R, H] pulled at EP (None at EP=1: the tokens' rows are read through the schedule), d_gate_up_tokens
    (`Recipe.tokens` of d_gate_up [R, 2I]: the copy and, where the GEMMs run in BF16, its dequantized values), the
    kept h, row_rw fp32 [R] (each row's router weight, 0 on padding rows); d_w_gate and d_w_up in the layout of the
    weights w_gate, w_up (`serval.weight_layout.grad_buffers`: halves of one tensor for a joined weight). windows:
    the macrobatch ring's (down, gate/up) `WgradWindow`s of these rows (`serval.kernels.weight_grad`; the gate/up
    one with outputs (d_w_gate, d_w_up) and carries [2I, H]), whose outputs they write; the along-tokens blocks lie
    whole in a window (its rows start on a block_m boundary, a multiple of the block)."""
    dtype = x.dtype
    down_window, gate_up_window = windows or (None, None)
    # each gradient's along-tokens operands are made just before its GEMM and freed after it (peak memory)
    d_y_tokens, d_y_tokens_deq = _rows_quantized(d_y, d_y_rows, schedule,
                                                 lambda t, **kw: recipe.tokens(t, row_scale=row_rw, **kw))
    if recipe.fp8_gemm:
        d_w_down = ops.fp8_weight_grad(d_y_tokens, kept.h_tokens, schedule, **_window(down_window))
    else:
        d_w_down = ops.down_weight_grad(d_y_tokens_deq, dequantize(kept.h_tokens, dtype), schedule,
                                        **_window(down_window))
    del d_y_tokens, d_y_tokens_deq
    d_gate_up_tokens, d_gate_up_tokens_deq = d_gate_up_tokens
    x_tokens, x_tokens_deq = _rows_quantized(x, x_rows, schedule, recipe.tokens)
    inter = w_gate.shape[1]
    out = weight_layout.grad_buffers(w_gate, w_up) if gate_up_window is None else (None, None)
    if recipe.fp8_gemm:
        # one GEMM per half of d_gate_up's rows: each writes its weight's gradient contiguous (no copy), each
        # window with its half of the carries
        d_w_gate, d_w_up = (ops.fp8_weight_grad(_row_slice(d_gate_up_tokens, half * inter, inter), x_tokens, schedule,
                                                **_window(_half(gate_up_window, half, inter)), **_out(out[half]))
                            for half in (0, 1))
    else:
        d_w_gate, d_w_up = ops.gate_up_weight_grad(d_gate_up_tokens_deq, x_tokens_deq, schedule,
                                                   x_rows=x_tokens_deq, **_window(gate_up_window),
                                                   **_out(None if gate_up_window else out))
    return d_w_gate, d_w_up, d_w_down


def _window(window) -> dict:
    """The window keyword of a weight-gradient stage, only where there is one (the torch stages take none)."""
    return {} if window is None else {"window": window}


def _out(out) -> dict:
    """The out keyword of a weight-gradient stage, only where there is one (a window holds its own outputs)."""
    return {} if out is None else {"out": out}


def _half(window, half: int, inter: int):
    """The gate (half 0) or up (half 1) part of a gate/up `WgradWindow` (carries [2I, H], outputs (gate, up)):
    rows [half * I, (half + 1) * I) of the carries and that output."""
    if window is None:
        return None
    rows = slice(half * inter, (half + 1) * inter)
    return dataclasses.replace(window, carry_in=window.carry_in[rows], carry_out=window.carry_out[rows],
                               outs=(window.outs[half],))
