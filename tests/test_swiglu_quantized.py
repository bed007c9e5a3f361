"""The SwiGLU row passes of the fp8_blockwise path that quantize their own outputs (`serval.kernels.swiglu_rows`:
`swiglu_quantized`, `swiglu_backward_quantized`) bit for bit against the unfused composition they replace: the
bf16 row pass, then `serval.ops.quantize` (1 x 128 along the row, 128 x 1 along tokens stored transposed, fp32
scales) and the packed-row gather of the kept pre-activations. Data and scales are compared as integers.

Cases: routings with empty experts (zero padding rows, segments at multiples of 128), a row count that is not a
multiple of the 128-row tile, I of two and three 128-blocks, swiglu_limit on and off, values over many binades
with zero rows and zero blocks (NaN-free). Then the torch stages (`serval.stages`, same signatures) against
their composition, and the layer (serval.moe, fp8_blockwise on the kernels) with the fused passes against the
layer with the unfused composition in their place: the same outputs and gradients, bit for bit.
On the CPU the kernels run in Triton's interpreter; with CUDA on the GPU.
"""

from __future__ import annotations

import pytest
import torch

import serval
from conftest import CUDA, make_layer, make_routing
from serval import kernels, stages
from serval.kernels import swiglu_rows
from serval.ops import QuantizedTensor, quantize
from serval.schedule import build_schedule, packed_rows, slot_schedule

DEVICE = "cuda" if CUDA else "cpu"
# (schedule kind, N, E, k, I): a routing with empty experts; slot rows (every row used, R = N*k not a multiple of
# 128) with I of three blocks
CASES = {"empty-experts": ("routed", 40, 6, 2, 256), "ragged-rows": ("slots", 75, 1, 2, 384)}


def _schedule(kind, tokens, experts, top_k):
    if kind == "slots":
        return slot_schedule(tokens, top_k, DEVICE)
    _, ids = make_routing(tokens, experts, top_k, kind="empty", device=DEVICE)
    return build_schedule(ids, experts, 128)


def _rows(schedule, cols, seed):
    """bf16 [R, cols]: normal values times 2^k per (row, 128-block), k in [-12, 4]; a zero row and a zero block;
    zeros on padding rows."""
    gen = torch.Generator().manual_seed(seed)
    rows = schedule.capacity
    v = torch.randn(rows, cols, generator=gen)
    v = v * torch.exp2(torch.randint(-12, 5, (rows, -(-cols // 128)), generator=gen).float()).repeat_interleave(
        128, dim=1)[:, :cols]
    v[1] = 0
    v[2, 128:256] = 0
    v[schedule.row_source.cpu() < 0] = 0
    return v.to(DEVICE, torch.bfloat16)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def assert_same(got: QuantizedTensor, want: QuantizedTensor, what: str) -> None:
    assert got.block == want.block and got.transposed == want.transposed, what
    assert got.data.dtype == want.data.dtype and got.scale.dtype == want.scale.dtype, what
    assert torch.equal(_bits(got.data), _bits(want.data)), f"{what}: data"
    assert torch.equal(got.scale, want.scale), f"{what}: scale"


def blockwise(t: torch.Tensor, along_tokens: bool) -> QuantizedTensor:
    block = (128, 1) if along_tokens else (1, 128)
    return quantize(t, block=block, scale_format="fp32", transpose=along_tokens)[0]


def unfused_forward(gate_up_rows, schedule, swiglu_limit, *, h_rows=True):
    """What the fp8_blockwise forward did before the fusion: the bf16 SwiGLU pass, three quantize passes and
    the packed-row gather."""
    h = swiglu_rows.swiglu(gate_up_rows, swiglu_limit)
    kept = blockwise(gate_up_rows, False)
    index = packed_rows(schedule)
    kept = kept._replace(data=kept.data.view(torch.uint8)[index].view(kept.data.dtype), scale=kept.scale[index])
    return blockwise(h, False) if h_rows else None, blockwise(h, True), kept


def unfused_backward(d_h_raw, gate_up, schedule, row_router_weights, swiglu_limit):
    """The bf16 SwiGLU backward pass, then two quantize passes over d_gate_up."""
    d_gate_up, d_rw_rows = swiglu_rows.swiglu_backward_fp8(d_h_raw, gate_up, schedule, row_router_weights,
                                                           swiglu_limit)
    return blockwise(d_gate_up, False), blockwise(d_gate_up, True), d_rw_rows


@pytest.mark.parametrize("limit", [None, 1.5], ids=["no-limit", "limit"])
@pytest.mark.parametrize("case", CASES)
def test_forward_matches_the_unfused_passes(case, limit):
    kind, tokens, experts, top_k, inter = CASES[case]
    schedule = _schedule(kind, tokens, experts, top_k)
    gate_up_rows = _rows(schedule, 2 * inter, seed=0)
    got = swiglu_rows.swiglu_quantized(gate_up_rows, schedule, limit)
    want = unfused_forward(gate_up_rows, schedule, limit)
    for name, a, b in zip(("h rows", "h tokens", "kept gate/up"), got, want):
        assert_same(a, b, name)
    assert got[0].data.shape == (schedule.capacity, inter) and got[1].data.shape == (inter, schedule.capacity)
    assert got[2].data.shape == (schedule.num_packed, 2 * inter)
    # without h's rows (what a recomputing backward asks for): the same other outputs
    no_rows = swiglu_rows.swiglu_quantized(gate_up_rows, schedule, limit, h_rows=False)
    assert no_rows[0] is None
    assert_same(no_rows[1], want[1], "h tokens (h_rows=False)")
    assert_same(no_rows[2], want[2], "kept gate/up (h_rows=False)")


@pytest.mark.parametrize("limit", [None, 1.5], ids=["no-limit", "limit"])
@pytest.mark.parametrize("case", CASES)
def test_backward_matches_the_unfused_passes(case, limit):
    kind, tokens, experts, top_k, inter = CASES[case]
    schedule = _schedule(kind, tokens, experts, top_k)
    gate_up = swiglu_rows.swiglu_quantized(_rows(schedule, 2 * inter, seed=0), schedule, limit)[2]
    d_h_raw = _rows(schedule, inter, seed=1)
    d_h_raw[3, :128] = 0
    row_router_weights = torch.rand(schedule.capacity, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    got = swiglu_rows.swiglu_backward_quantized(d_h_raw, gate_up, schedule, row_router_weights, limit)
    want = unfused_backward(d_h_raw, gate_up, schedule, row_router_weights, limit)
    assert_same(got[0], want[0], "d_gate_up rows")
    assert_same(got[1], want[1], "d_gate_up tokens")
    assert torch.equal(got[2], want[2]), "d_rw_rows"
    assert got[0].data.shape == (schedule.capacity, 2 * inter) and got[1].data.shape == (2 * inter, schedule.capacity)


def test_torch_stages_are_the_composition_with_the_kernels_signature():
    """`serval.stages` composes its reference functions; its outputs have the kernels' layout (ops are
    interchangeable) and values one E4M3 step apart at most (the kernels' h / d_gate_up differ from torch's
    in last bits, which can move a value across a rounding boundary)."""
    kind, tokens, experts, top_k, inter = CASES["empty-experts"]
    schedule = _schedule(kind, tokens, experts, top_k)
    gate_up_rows = _rows(schedule, 2 * inter, seed=0)
    got = stages.swiglu_quantized(gate_up_rows, schedule, 1.5)
    h = stages.swiglu(gate_up_rows, 1.5)
    index = packed_rows(schedule)
    kept = blockwise(gate_up_rows, False)
    want = (blockwise(h, False), blockwise(h, True),
            kept._replace(data=kept.data.view(torch.uint8)[index].view(kept.data.dtype), scale=kept.scale[index]))
    for name, a, b in zip(("h rows", "h tokens", "kept gate/up"), got, want):
        assert_same(a, b, name)
    assert stages.swiglu_quantized(gate_up_rows, schedule, 1.5, h_rows=False)[0] is None
    d_h_raw = _rows(schedule, inter, seed=1)
    rw = torch.rand(schedule.capacity, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    back = stages.swiglu_backward_quantized(d_h_raw, got[2], schedule, rw, 1.5)
    d_gate_up, d_rw = stages.swiglu_backward_fp8(d_h_raw, got[2], schedule, rw, 1.5)
    assert_same(back[0], blockwise(d_gate_up, False), "d_gate_up rows")
    assert_same(back[1], blockwise(d_gate_up, True), "d_gate_up tokens")
    assert torch.equal(back[2], d_rw)
    for a, b in zip((*got, *back[:2]), (*swiglu_rows.swiglu_quantized(gate_up_rows, schedule, 1.5),
                                        *swiglu_rows.swiglu_backward_quantized(d_h_raw, got[2], schedule, rw, 1.5)[:2])):
        assert (a.block, a.transposed, a.data.shape, a.scale.shape, a.data.dtype, a.scale.dtype) == \
            (b.block, b.transposed, b.data.shape, b.scale.shape, b.data.dtype, b.scale.dtype)
        step = (a.data.float() - b.data.float()).abs() <= a.data.float().abs().clamp_min(1) / 8
        assert step.float().mean() > 0.99


def test_layer_matches_the_unfused_passes(monkeypatch):
    """serval.moe in fp8_blockwise on the kernels: the same output and gradients, bit for bit, with the fused
    passes as with the unfused composition in their place."""
    x, weights, _ = make_layer(40, 128, 256, 3, device=DEVICE, dtype=torch.bfloat16)
    rw, ids = make_routing(40, 3, 2, device=DEVICE)
    d_y = torch.randn(40, 128, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.bfloat16)
    config = serval.Config(precision="fp8_blockwise", backend="triton")

    def step():
        leaves = [t.detach().clone().requires_grad_() for t in (x, rw, *weights)]
        y = serval.moe(leaves[0], leaves[1], ids, *leaves[2:], config=config, swiglu_limit=1.5)
        return (y.detach(), *torch.autograd.grad(y, leaves, d_y))

    fused = step()
    monkeypatch.setattr(kernels.KernelStages, "swiglu_quantized", staticmethod(unfused_forward))
    monkeypatch.setattr(kernels.KernelStages, "swiglu_backward_quantized", staticmethod(unfused_backward))
    unfused = step()
    for name, a, b in zip(("y", "d_x", "d_router_weights", "d_w_gate", "d_w_up", "d_w_down"), fused, unfused):
        assert torch.isfinite(a.float()).all(), name
        assert torch.equal(a, b), name
