"""The FP8 precisions of the layer (`serval.precision`) through serval.moe and serval.MoE.

Against `serval.reference.moe_fp8` (the same recipe emulated in float64: relative error at bf16 level),
against the BF16 layer (MoK's acceptance: max |diff| <= 1 and sum |diff| / sum |ref| <= 0.1), bitwise
repeatable, recompute giving the same bits, and the inputs a recipe cannot take as clear errors.
On CPU the torch stages run (and the kernels through Triton's interpreter); on a GPU the kernels.
"""

import os

import pytest
import torch

import serval
from conftest import (CUDA, check_sync_free_and_graph_replay, cuda_layer_step, make_layer, make_routing, rel_err,
                      requires_cuda)

PRECISIONS = ["mxfp8", "fp8_blockwise"]
DEVICE = "cuda" if CUDA else "cpu"
# (N, H, I, E, k, routing): routings with an empty expert, all rows on one expert, k = 1, one token
CASES = [
    ("random", 96, 256, 128, 4, 2, "random"),
    ("empty-experts", 64, 192, 128, 6, 2, "empty"),
    ("one-expert-k1", 40, 256, 128, 4, 1, "one"),
    ("one-token", 1, 128, 256, 4, 2, "random"),
]


def _inputs(num_tokens, hidden, inter, experts, top_k, kind, device=DEVICE, seed=0):
    x, weights, _ = make_layer(num_tokens, hidden, inter, experts, device=device, dtype=torch.bfloat16, seed=seed)
    rw, ids = make_routing(num_tokens, experts, top_k, kind=kind, device=device, seed=seed)
    d_y = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(seed + 1)).to(device, torch.bfloat16)
    return x, rw, ids, weights, d_y


def _layer(x, rw, ids, weights, d_y, config, swiglu_limit=None, expert_weights=None):
    leaves = [t.detach().clone().requires_grad_() for t in (x, rw, *weights)]
    y = serval.moe(leaves[0], leaves[1], ids, *leaves[2:], config=config, swiglu_limit=swiglu_limit,
                   expert_weights=expert_weights)
    return (y.detach(), *torch.autograd.grad(y, leaves, d_y))


NAMES = ("y", "d_x", "d_router_weights", "d_w_gate", "d_w_up", "d_w_down")


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_matches_the_emulated_recipe(precision, case):
    _, n, hidden, inter, experts, top_k, kind = case
    x, rw, ids, weights, d_y = _inputs(n, hidden, inter, experts, top_k, kind)
    limit = 1.5 if kind == "random" else None
    got = _layer(x, rw, ids, weights, d_y, serval.Config(precision=precision), swiglu_limit=limit)
    want = serval.reference.moe_fp8(x.cpu(), rw.cpu(), ids.cpu(), *(w.cpu() for w in weights), d_y.cpu(),
                                    precision=precision, swiglu_limit=limit)
    # the torch stages match the emulation to 1%. The kernels differ by a last bit in places (GEMM sums in
    # another order, the fast sigmoid) and, in mxfp8's backward, by one rounding: the BF16 down dgrad feeds its
    # fp32 sums straight into the SwiGLU backward in its epilogue, where the emulation and the torch stage round
    # d_h to bf16 first. The FP8 quantization downstream turns a last-bit difference into a whole E4M3 step for
    # the values it moves across a rounding boundary: up to ~3%, against ~7% between FP8 and BF16
    tol = 4e-2 if DEVICE == "cuda" else 1e-2
    for name, a, b in zip(NAMES, got, want):
        assert torch.isfinite(a.float()).all(), name
        assert rel_err(a.cpu(), b) < tol, (name, rel_err(a.cpu(), b))


@pytest.mark.parametrize("precision", PRECISIONS)
def test_close_to_bf16_by_moks_acceptance(precision):
    x, rw, ids, weights, d_y = _inputs(128, 256, 128, 4, 2, "random")
    fp8 = _layer(x, rw, ids, weights, d_y, serval.Config(precision=precision))
    bf16 = _layer(x, rw, ids, weights, d_y, serval.Config())
    for name, a, b in zip(NAMES, fp8, bf16):
        diff = (a.double() - b.double()).abs()
        assert diff.sum() / b.double().abs().sum() <= 0.1, name
        if name in ("y", "d_x"):  # O(1) values, where an absolute bound means something
            assert diff.max() <= 1.0, name


@pytest.mark.parametrize("precision", PRECISIONS)
def test_bitwise_repeatable_and_recompute_gives_the_same_bits(precision):
    x, rw, ids, weights, d_y = _inputs(96, 256, 128, 4, 2, "random")
    first = _layer(x, rw, ids, weights, d_y, serval.Config(precision=precision))
    again = _layer(x, rw, ids, weights, d_y, serval.Config(precision=precision))
    recomputed = _layer(x, rw, ids, weights, d_y, serval.Config(precision=precision, recompute=True))
    for name, a, b, c in zip(NAMES, first, again, recomputed):
        assert torch.equal(a, b), name
        assert torch.equal(a, c), name


@pytest.mark.parametrize("precision", PRECISIONS)
def test_module_and_shared_expert(precision):
    torch.manual_seed(0)
    layer = serval.MoE(256, 128, 4, 2, shared_intermediate_size=128, config=serval.Config(precision=precision),
                       device=DEVICE, dtype=torch.bfloat16)
    x = torch.randn(2, 48, 256, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    y.float().square().mean().backward()
    assert y.shape == x.shape and torch.isfinite(y.float()).all()
    assert all(torch.isfinite(p.grad.float()).all() for p in layer.parameters())


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the kernels on CPU tensors need the interpreter")
@pytest.mark.parametrize("precision", PRECISIONS)
def test_kernels_in_interpreter_match_the_torch_stages(precision):
    x, rw, ids, weights, d_y = _inputs(40, 128, 128, 3, 2, "random", device="cpu")
    kernels = _layer(x, rw, ids, weights, d_y, serval.Config(precision=precision, backend="triton"))
    torch_ops = _layer(x, rw, ids, weights, d_y, serval.Config(precision=precision, backend="torch"))
    # last-bit differences before a quantization move some values a whole E4M3 step (as on the GPU, above)
    for name, a, b in zip(NAMES, kernels, torch_ops):
        assert rel_err(a, b) < 5e-2, (name, rel_err(a, b))


def test_inputs_a_recipe_cannot_take_are_clear_errors():
    x, rw, ids, weights, _ = _inputs(16, 128, 96, 4, 2, "random", device="cpu")
    with pytest.raises(ValueError, match=r"I \(w_gate.shape\[1\]\) to be a multiple of 128"):
        serval.moe(x, rw, ids, *weights, config=serval.Config(precision="fp8_blockwise"))
    with pytest.raises(ValueError, match="block_m must be a multiple of 32"):
        serval.moe(x, rw, ids, *weights, config=serval.Config(precision="mxfp8", block_m=16))
    with pytest.raises(ValueError, match="bfloat16"):
        serval.moe(x.float(), rw, ids, *(w.float() for w in weights), config=serval.Config(precision="mxfp8"))


@pytest.mark.parametrize("precision", PRECISIONS)
def test_torch_compile_fullgraph(precision):
    x, rw, ids, weights, _ = _inputs(24, 128, 128, 4, 2, "random")
    config = serval.Config(precision=precision)

    def step(x, rw, wg, wu, wd):
        return serval.moe(x, rw, ids, wg, wu, wd, config=config).float().square().sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    inputs = [t.detach().clone().requires_grad_() for t in (x, rw, *weights)]
    eager = step(*inputs)
    eager_grads = torch.autograd.grad(eager, inputs)
    loss = compiled(*inputs)
    grads = torch.autograd.grad(loss, inputs)
    assert torch.equal(loss, eager)
    assert all(torch.equal(a, b) for a, b in zip(grads, eager_grads))


@pytest.mark.parametrize("precision", PRECISIONS)
def test_expert_weights_quantized_once_give_the_same_bits(precision):
    """serval.quantize_expert_weights once, then every call (and a recomputing one) with expert_weights: the same
    bits as quantizing in each call, gradients included (the kernels on a GPU; on CPU the torch stages, which
    take the weights through the same code as the kernels)."""
    x, rw, ids, weights, d_y = _inputs(24, 128, 128, 3, 2, "random")
    made = serval.quantize_expert_weights(*weights, precision)
    for recompute in (False, True):
        config = serval.Config(precision=precision, recompute=recompute)
        want = _layer(x, rw, ids, weights, d_y, config, swiglu_limit=1.5)
        got = _layer(x, rw, ids, weights, d_y, config, swiglu_limit=1.5, expert_weights=made)
        for name, a, b in zip(NAMES, got, want):
            assert torch.equal(a, b), (name, recompute)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_module_expert_weights(precision):
    """serval.MoE.quantize_expert_weights() once, then forward(x, expert_weights=...): the bits of forward(x)."""
    torch.manual_seed(0)
    layer = serval.MoE(128, 128, 4, 2, config=serval.Config(precision=precision), device=DEVICE,
                       dtype=torch.bfloat16)
    x = torch.randn(3, 8, 128, device=DEVICE, dtype=torch.bfloat16)
    made = layer.quantize_expert_weights()
    assert torch.equal(layer(x, expert_weights=made), layer(x))


def test_expert_weights_errors():
    x, rw, ids, weights, _ = _inputs(16, 128, 128, 4, 2, "random", device="cpu")
    made = serval.quantize_expert_weights(*weights, "fp8_blockwise")
    with pytest.raises(ValueError, match="expert_weights is for the FP8 precisions"):
        serval.moe(x, rw, ids, *weights, expert_weights=made)
    with pytest.raises(ValueError, match=r"expert_weights must be serval.quantize_expert_weights\(.*'mxfp8'"):
        serval.moe(x, rw, ids, *weights, config=serval.Config(precision="mxfp8"), expert_weights=made)
    fewer = [w[:2] for w in weights]
    with pytest.raises(ValueError, match="expert_weights must be"):
        serval.moe(x, rw, ids.clamp(max=1), *fewer, config=serval.Config(precision="fp8_blockwise"),
                   expert_weights=made)
    with pytest.raises(ValueError, match="precision must be one of"):
        serval.quantize_expert_weights(*weights, "bf16")
    with pytest.raises(ValueError, match="w_down must be a 3-D bfloat16 tensor"):
        serval.quantize_expert_weights(weights[0], weights[1], weights[2].float(), "mxfp8")
    strided = made._replace(down=made.down._replace(data=made.down.data.transpose(1, 2).contiguous().transpose(1, 2)))
    with pytest.raises(ValueError, match="expert_weights must be"):  # a view the GEMMs cannot read
        serval.moe(x, rw, ids, *weights, config=serval.Config(precision="fp8_blockwise"), expert_weights=strided)
    assert serval.quantize_expert_weights(*weights, precision="fp8_blockwise").down.data.equal(made.down.data)
    poisoned = weights[0].clone()
    poisoned[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="w_gate holds NaN or Inf"):
        serval.moe(x, rw, ids, poisoned, *weights[1:], config=serval.Config(precision="mxfp8", debug=True))


@pytest.mark.parametrize("precision", ["fp8_blockwise"])
def test_expert_weights_under_torch_compile(precision):
    """The pre-quantized weights ride the custom ops as a tensor list: fullgraph compile, the eager bits."""
    x, rw, ids, weights, _ = _inputs(24, 128, 128, 4, 2, "random")
    config = serval.Config(precision=precision)
    made = serval.quantize_expert_weights(*weights, precision)

    def step(x, rw, wg, wu, wd):
        return serval.moe(x, rw, ids, wg, wu, wd, config=config, expert_weights=made).float().square().sum()

    inputs = [t.detach().clone().requires_grad_() for t in (x, rw, *weights)]
    eager = step(*inputs)
    eager_grads = torch.autograd.grad(eager, inputs)
    loss = torch.compile(step, fullgraph=True, backend="aot_eager")(*inputs)
    assert torch.equal(loss, eager)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(loss, inputs), eager_grads))


@requires_cuda
@pytest.mark.parametrize("precision", PRECISIONS)
def test_no_host_sync_and_cuda_graph(precision):
    step = cuda_layer_step()  # fresh leaves every step (conftest: a reused leaf breaks the capture)
    config = serval.Config(precision=precision)
    eager = step(config)
    check_sync_free_and_graph_replay(lambda: step(config), eager)


def test_fp8_blockwise_on_a_hidden_size_its_kernels_do_not_take():
    """H % 16 != 0: the FP8 GEMMs cannot take it (16-byte E4M3 rows), so "auto" runs the torch stages and
    "triton" says why."""
    x, rw, ids, weights, d_y = _inputs(24, 200, 128, 4, 2, "random", device=DEVICE)
    got = _layer(x, rw, ids, weights, d_y, serval.Config(precision="fp8_blockwise"))
    want = serval.reference.moe_fp8(x, rw, ids, *weights, d_y, precision="fp8_blockwise")
    for name, a, b in zip(NAMES, got, want):
        assert rel_err(a, b) < 1e-2, name
    with pytest.raises(ValueError, match="multiples of 16"):
        serval.moe(x, rw, ids, *weights, config=serval.Config(precision="fp8_blockwise", backend="triton"))


@pytest.mark.parametrize("precision", PRECISIONS)
def test_nan_in_x_propagates_or_is_an_error_in_debug_mode(precision):
    x, rw, ids, weights, d_y = _inputs(24, 128, 128, 4, 2, "random", device="cpu")
    x[3, 5] = float("nan")
    y = serval.moe(x, rw, ids, *weights, config=serval.Config(precision=precision))
    assert torch.isnan(y[3]).all() and torch.isfinite(y[:3].float()).all()  # the token's blocks, not its neighbours
    with pytest.raises(ValueError, match="x holds NaN or Inf"):
        serval.moe(x, rw, ids, *weights, config=serval.Config(precision=precision, debug=True))
