"""The joined gate/up weight ([E, 2I, H], `w_up=None`), the FP8 weight cache, router weights in bf16.

A joined weight gives the bits of the two separate weights it holds, on every path (torch stages, the Triton kernels
in the interpreter or on the GPU, the Gluon engines there, the fused passes, every precision), and its gradient is
one contiguous [E, 2I, H] tensor. The FP8 expert weights are quantized once per version of the weights and again
after an in-place update.
"""

import dataclasses

import pytest
import torch

import serval
from conftest import CUDA, make_layer, make_routing, requires_cuda, requires_interpreter
from serval import weight_cache, weight_layout
from serval.plan import choose_plan

FUSED = dict(fused_forward=True, fused_backward=True)


def _config(backend, precision, device, fused=False):
    block_m = 128 if precision != "bf16" or device == "cuda" else 16
    plan = None
    if fused:
        from serval.kernels import common

        plan = dataclasses.replace(choose_plan(64, torch.bfloat16, common.target()), **FUSED)
    return serval.Config(backend=backend, precision=precision, block_m=block_m, kernel_plan=plan)


def joined_and_separate(config, *, num_tokens=40, hidden=64, inter=128, experts=4, top_k=2, device="cpu",
                        dtype=torch.float32, shared_inter=16, limit=0.8):
    """(y, grads) of the layer with the gate and up weights joined, and with them separate (same values)."""
    x, (wg, wu, wd), shared = make_layer(num_tokens, hidden, inter, experts, shared_inter=shared_inter, device=device,
                                         dtype=dtype)
    rw, ids = make_routing(num_tokens, experts, top_k, device=device)
    d_y = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(2)).to(device, dtype)

    def run(joined):
        routed = [torch.cat([wg, wu], dim=1), wd] if joined else [wg, wu, wd]
        leaves = [t.detach().clone().requires_grad_() for t in (x, rw, *routed, *shared)]
        weights = (leaves[2], None, leaves[3]) if joined else tuple(leaves[2:5])
        y = serval.moe(leaves[0], leaves[1], ids, *weights, tuple(leaves[-3:]), config=config, swiglu_limit=limit)
        return y, torch.autograd.grad(y, leaves, d_y)

    return run(True), run(False)


def check_same_bits(joined, separate):
    (y, grads), (y_sep, grads_sep) = joined, separate
    assert torch.equal(y, y_sep)
    d_gate_up = grads[2]
    assert d_gate_up.is_contiguous() and d_gate_up.shape[1] == 2 * grads_sep[2].shape[1]
    assert torch.equal(d_gate_up, torch.cat(grads_sep[2:4], dim=1))
    assert all(torch.equal(a, b) for a, b in zip(grads[:2] + grads[3:], grads_sep[:2] + grads_sep[4:]))


def interpreted(*case):
    return pytest.param("triton", *case, marks=requires_interpreter)


@pytest.mark.parametrize("backend,precision,fused", [
    ("torch", "bf16", False), interpreted("bf16", False), interpreted("bf16", True),
    ("torch", "mxfp8", False), interpreted("mxfp8", False), ("torch", "fp8_blockwise", False),
    interpreted("fp8_blockwise", False)])
def test_joined_weight_gives_the_bits_of_separate_weights(backend, precision, fused):
    dtype = torch.float32 if precision == "bf16" else torch.bfloat16
    config = _config(backend, precision, "cpu", fused)
    interpreted = backend == "triton"  # the smallest sizes each path takes: the interpreter runs ops one by one
    sizes = dict(num_tokens=12 if interpreted else 40, hidden=32, inter=128 if precision == "fp8_blockwise" else 32,
                 shared_inter=16)
    check_same_bits(*joined_and_separate(config, dtype=dtype, **sizes))


@requires_interpreter
def test_halves_of_one_tensor_are_read_in_place():
    """w_gate and w_up passed as the two halves of one tensor (views with dense rows): the kernels read them in
    place (the expert stride), and the gradients reach the tensor they view."""
    x, (wg, wu, wd), _ = make_layer(20, 32, 24, 4)
    rw, ids = make_routing(20, 4, 2)
    base = torch.cat([wg, wu], dim=1).requires_grad_()
    gate, up = weight_layout.split(base)
    assert weight_layout.dense_rows(gate) and weight_layout.is_joined(gate, up)
    config = serval.Config(backend="triton", block_m=16)
    y = serval.moe(x, rw, ids, gate, up, wd, config=config)
    y_ref = serval.moe(x, rw, ids, wg, wu, wd, config=config)
    assert torch.equal(y, y_ref)
    (d_base,) = torch.autograd.grad(y.square().sum(), [base])
    wg_leaf, wu_leaf = wg.clone().requires_grad_(), wu.clone().requires_grad_()
    d_gate, d_up = torch.autograd.grad(serval.moe(x, rw, ids, wg_leaf, wu_leaf, wd, config=config).square().sum(),
                                       [wg_leaf, wu_leaf])
    assert torch.equal(d_base, torch.cat([d_gate, d_up], dim=1))


def test_joined_weight_under_torch_compile():
    x, (wg, wu, wd), _ = make_layer(13, 16, 8, 4)
    rw, ids = make_routing(13, 4, 2)
    gate_up = torch.cat([wg, wu], dim=1).requires_grad_()
    config = serval.Config(block_m=16)

    def step(x, gate_up):
        return serval.moe(x, rw, ids, gate_up, None, wd, config=config).square().sum()

    eager = torch.autograd.grad(step(x, gate_up), [gate_up])[0]
    compiled = torch.autograd.grad(torch.compile(step, fullgraph=True, backend="aot_eager")(x, gate_up), [gate_up])[0]
    assert torch.equal(eager, compiled) and compiled.shape == gate_up.shape


def test_bad_joined_weight_and_group_are_named():
    x, (wg, wu, wd), _ = make_layer(6, 16, 8, 2)
    rw, ids = make_routing(6, 2, 1)
    with pytest.raises(ValueError, match=r"w_gate with w_up=None must be the joined gate/up weight"):
        serval.moe(x, rw, ids, wg[:, :7], None, wd)
    with pytest.raises(ValueError, match=r"w_down must have shape"):
        serval.moe(x, rw, ids, torch.cat([wg, wg], 1), None, wd[:, :, :4])
    with pytest.raises(TypeError, match=r"group must be None or a torch.distributed.ProcessGroup"):
        serval.moe(x, rw, ids, wg, wu, wd, group=1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_router_weights_in_half_precision_are_taken_as_float32(dtype):
    """A router that returns bf16 / fp16 weights (transformers does, in the model's dtype): the layer computes with
    them as fp32, and their gradient comes back in their dtype."""
    x, (wg, wu, wd), _ = make_layer(10, 16, 8, 3)
    rw, ids = make_routing(10, 3, 2)
    rw_half = rw.to(dtype).requires_grad_()
    y = serval.moe(x, rw_half, ids, wg, wu, wd)
    assert torch.equal(y, serval.moe(x, rw_half.detach().float(), ids, wg, wu, wd))
    (d_rw,) = torch.autograd.grad(y.sum(), [rw_half])
    assert d_rw.dtype == dtype


def test_fp8_weights_made_once_per_version(monkeypatch):
    """The FP8 expert weights are quantized in the first call, reused while the weights are unchanged (forward and
    backward, several micro-batches), quantized again after an in-place update, and dropped with the weights."""
    weight_cache.clear()
    calls = []
    real = serval.precision.expert_weights
    monkeypatch.setattr(serval.precision, "expert_weights", lambda *a: calls.append(1) or real(*a))
    x, (wg, wu, wd), _ = make_layer(16, 32, 128, 2, dtype=torch.bfloat16)
    rw, ids = make_routing(16, 2, 1)
    gate_up = torch.cat([wg, wu], dim=1).requires_grad_()
    config = serval.Config(precision="fp8_blockwise", block_m=128)

    def step():
        return serval.moe(x, rw, ids, gate_up, None, wd, config=config).float().square().sum()

    first = step()
    first.backward()
    step().backward()
    assert len(calls) == 1
    with torch.no_grad():
        gate_up.mul_(0.5)  # what an optimizer step does: an in-place update bumps the version
    changed = step()
    assert len(calls) == 2 and not torch.equal(changed, first)
    monkeypatch.setattr(weight_cache, "usable", lambda: False)  # quantized in the call: the same bits
    assert torch.equal(step(), changed)
    del gate_up, step, changed, first  # the weight and everything that holds it (the closure, the graphs)
    import gc

    gc.collect()
    weight_cache._drop_freed()
    assert not weight_cache._ENTRIES


@requires_cuda
@pytest.mark.parametrize("precision,fused,hidden", [("bf16", False, 512), ("bf16", False, 6144), ("bf16", True, 512),
                                                    ("mxfp8", False, 512), ("mxfp8", True, 512),
                                                    ("fp8_blockwise", False, 512)])
def test_joined_weight_on_the_gpu(precision, fused, hidden):
    """On the H200's engines (the cooperative gate/up gathering x at H <= 4096 and the Triton GEMM above it, the
    cooperative and ping-pong dgrads, the fused passes, the FP8 GEMMs): the joined weight read in place gives the
    separate weights' bits, and its gradient is one tensor."""
    assert CUDA
    config = _config("auto", precision, "cuda", fused)
    check_same_bits(*joined_and_separate(config, num_tokens=1000, hidden=hidden, inter=256, experts=8, top_k=4,
                                         device="cuda", dtype=torch.bfloat16, shared_inter=128))
