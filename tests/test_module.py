"""serval.MoE: routing, shapes, gradients through router and experts, and agreement with the reference."""

import pytest
import torch

import serval
from conftest import rel_err


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("shared", [0, 24])
def test_module_matches_reference(scoring, shared):
    torch.manual_seed(0)
    block = serval.MoE(32, 24, 6, 2, shared_intermediate_size=shared, scoring=scoring,
                       config=serval.Config(block_m=16))
    x = torch.randn(3, 7, 32, requires_grad=True)
    y = block(x)
    assert y.shape == x.shape
    rw, ids = block.route(x.reshape(-1, 32))
    if scoring == "sigmoid":  # renormalised by default
        torch.testing.assert_close(rw.sum(-1), torch.ones(21))
    shared_w = None
    if shared:
        shared_w = (block.shared["gate"].weight, block.shared["up"].weight, block.shared["down"].weight)
    y_ref = serval.reference.moe(x.reshape(-1, 32), rw, ids, block.w_gate, block.w_up, block.w_down, shared_w)
    assert rel_err(y.reshape(-1, 32), y_ref) < 1e-5
    params = [x, *block.parameters()]
    router = next(i for i, p in enumerate(params) if p is block.router.weight)
    grads = torch.autograd.grad(y.square().sum(), params)
    grads_ref = torch.autograd.grad(y_ref.square().sum(), params)
    for g, g_ref in zip(grads, grads_ref):
        assert rel_err(g, g_ref) < 1e-5
    assert grads[router].abs().sum() > 0, "the router must receive a gradient"


def test_module_arguments():
    with pytest.raises(ValueError, match="scoring"):
        serval.MoE(8, 8, 4, 2, scoring="relu")
    with pytest.raises(ValueError, match="top_k"):
        serval.MoE(8, 8, 4, 5)
    assert "num_experts=4" in repr(serval.MoE(8, 8, 4, 2))


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_module_under_autocast(scoring, param_dtype):
    """torch.autocast(bf16) with fp32 (or bf16) parameters: the experts run in bf16 on bf16 copies of the weights,
    the router in fp32 on x as given; gradients reach the parameters in their own dtype."""
    torch.manual_seed(0)
    block = serval.MoE(32, 24, 6, 2, shared_intermediate_size=8, scoring=scoring, dtype=param_dtype,
                       config=serval.Config(block_m=16))
    x = torch.randn(9, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = block(x)
    assert y.dtype == torch.bfloat16
    y.float().square().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == param_dtype for p in block.parameters())
    assert x.grad.dtype == torch.float32
    with torch.no_grad():  # the same as serval.moe on bf16 copies, routed from x in fp32
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = block(x)
        router_weights, topk_ids = block.route(x)
        bf16 = [w.bfloat16() for w in (block.w_gate, block.w_up, block.w_down)]
        shared = tuple(block.shared[n].weight.bfloat16() for n in ("gate", "up", "down"))
        assert torch.equal(y, serval.moe(x.bfloat16(), router_weights, topk_ids, *bf16, shared,
                                         config=block.config))


def test_module_empty_batch_and_fp16():
    block = serval.MoE(16, 8, 4, 2, shared_intermediate_size=6)
    x = torch.randn(0, 16, requires_grad=True)
    y = block(x)
    assert y.shape == (0, 16)
    y.sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in block.parameters())
    assert block(torch.randn(2, 0, 16)).shape == (2, 0, 16)
    block.half()
    with pytest.raises(TypeError, match="parameters are torch.float16"):
        block(torch.randn(3, 16).half())


def test_module_on_the_meta_device():
    """Shapes without data (a device with no autocast): y's shape and dtype."""
    block = serval.MoE(16, 8, 4, 2, shared_intermediate_size=6, device="meta")
    y = block(torch.randn(3, 5, 16, device="meta"))
    assert y.shape == (3, 5, 16) and y.device.type == "meta" and y.dtype == torch.float32


def test_demo_is_bitwise_repeatable(capsys):
    from serval.__main__ import main

    assert main(["demo", "--steps", "4", "--tokens", "32", "--log-every", "2"]) == 0
    assert "losses yes, trained weights yes" in capsys.readouterr().out
