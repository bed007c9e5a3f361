"""serval.MoE: routing, shapes, gradients through router and experts, and agreement with the reference; whole blocks
against transformers' Qwen3-MoE and DeepSeek-V3 MoE blocks (output and every gradient, the aux loss included); the
router output a trainer needs; the correction bias; every option in the docstring and the repr; dtype advice that
works."""

import inspect

import pytest
import torch

import serval
from conftest import rel_err
from serval import routing


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
    torch.testing.assert_close(rw.sum(-1), torch.ones(21))  # renormalised by default, either scoring
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
    for kwargs, name in [(dict(renormalize=None), "renormalize"), (dict(correction_bias=1), "correction_bias"),
                         (dict(num_groups=2), "num_groups and topk_groups"),
                         (dict(num_groups=3, topk_groups=1), "num_groups"),
                         (dict(num_groups=2, topk_groups=3), "topk_groups"),
                         (dict(routed_scaling_factor=-1.0), "routed_scaling_factor")]:
        with pytest.raises(ValueError, match=f"^{name}"):
            serval.MoE(8, 8, 4, 2, **kwargs)


def test_module_documents_and_shows_every_option():
    """help(serval.MoE) names every constructor argument; the repr shows every option's value."""
    names = [n for n in inspect.signature(serval.MoE.__init__).parameters if n != "self"]
    doc = serval.MoE.__doc__
    assert all(name in doc for name in names), [name for name in names if name not in doc]
    block = serval.MoE(8, 8, 4, 2, shared_intermediate_size=6, scoring="sigmoid", renormalize=False,
                       correction_bias=True, num_groups=2, topk_groups=1, routed_scaling_factor=2.5,
                       swiglu_limit=7.0, config=serval.Config(precision="mxfp8"))
    text = repr(block)
    for shown in ["hidden_size=8", "intermediate_size=8", "num_experts=4", "top_k=2", "shared_intermediate_size=6",
                  "scoring=sigmoid", "renormalize=False", "correction_bias=True", "num_groups=2", "topk_groups=1",
                  "routed_scaling_factor=2.5", "swiglu_limit=7.0", "precision=mxfp8", "ep_size=1"]:
        assert shown in text, (shown, text)


def test_softmax_renormalises_unless_told_not_to():
    """The default renormalises the top-k (Mixtral, Qwen3-MoE); renormalize=False keeps the raw top-k
    probabilities (Qwen2-MoE, OLMoE)."""
    torch.manual_seed(0)
    block = serval.MoE(16, 8, 6, 2)
    x = torch.randn(9, 16)
    probabilities = (x @ block.router.weight.T).softmax(-1)
    weights, ids = block.route(x)
    torch.testing.assert_close(weights, probabilities.topk(2).values / probabilities.topk(2).values.sum(-1, True))
    block.renormalize = False
    raw, raw_ids = block.route(x)
    assert torch.equal(raw_ids, ids)
    torch.testing.assert_close(raw, probabilities.topk(2).values)


def test_router_output():
    """forward(x, return_router_output=True): y as forward(x) gives it, and the routing of x's tokens: logits
    [N, E] fp32, the weights and ids serval.moe was given, the tokens per expert; an empty batch gives empty
    logits and zero counts."""
    torch.manual_seed(0)
    block = serval.MoE(16, 8, 6, 2, shared_intermediate_size=4, config=serval.Config(block_m=16))
    x = torch.randn(3, 5, 16)
    y, out = block(x, return_router_output=True)
    assert isinstance(out, routing.RouterOutput) and torch.equal(y, block(x))
    assert out.logits.shape == (15, 6) and out.logits.dtype == torch.float32
    weights, ids = block.route(x.reshape(-1, 16))
    assert torch.equal(out.weights, weights) and torch.equal(out.ids, ids)
    assert torch.equal(out.tokens_per_expert, torch.bincount(ids.flatten(), minlength=6))
    assert out.logits.requires_grad and out.weights.requires_grad
    y, out = block(torch.randn(0, 16), return_router_output=True)
    assert y.shape == (0, 16) and out.logits.shape == (0, 6) and out.ids.shape == (0, 2)
    assert out.tokens_per_expert.shape == (6,) and not out.tokens_per_expert.any()


def test_correction_bias_moves_the_choice_not_the_weights():
    block = serval.MoE(16, 8, 6, 2, scoring="sigmoid", correction_bias=True, dtype=torch.bfloat16)
    assert block.correction_bias.dtype == torch.float32 and not block.correction_bias.any()
    assert "correction_bias" in block.state_dict() and "correction_bias" not in dict(block.named_parameters())
    assert serval.MoE(16, 8, 6, 2, correction_bias=True, dtype=torch.float64).correction_bias.dtype == torch.float64
    x = torch.randn(7, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        block.correction_bias[4] = 2.0  # above any sigmoid gap: every token chooses expert 4
    weights, ids = block.route(x)
    scores = (x.float() @ block.router.weight.float().T).sigmoid()
    assert (ids == 4).any(-1).all()
    torch.testing.assert_close(weights, scores.gather(1, ids) / scores.gather(1, ids).sum(-1, True))
    routing.update_correction_bias(block.correction_bias, torch.bincount(ids.flatten(), minlength=6), 0.25)
    assert block.correction_bias[4] < 2.0 - 0.25 / 2  # the over-loaded expert's bias goes down
    torch.testing.assert_close(block.correction_bias.sum(), torch.tensor(2.0))  # centred: the mean stays


def test_dtype_errors_give_advice_that_works():
    """x of a dtype serval does not take (int64, fp16) is told to become the module's dtype or to use autocast,
    never to convert the module to it; x of another accepted dtype may also convert the module."""
    block = serval.MoE(16, 8, 4, 2)
    for dtype in (torch.int64, torch.float16):
        x = torch.ones(3, 16, dtype=dtype)
        with pytest.raises(TypeError, match=r"^x must have the dtype of the module's parameters") as error:
            block(x)
        message = str(error.value)
        assert f".to({dtype})" not in message and "x.to(torch.float32)" in message
        assert "bf16, fp32 or fp64" in message and "torch.autocast" in message
        assert block(x.to(torch.float32)).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert block(torch.ones(3, 16, dtype=torch.float16)).dtype == torch.bfloat16
    with pytest.raises(TypeError, match=r"or the module with \.to\(torch\.bfloat16\)"):
        block(torch.ones(3, 16, dtype=torch.bfloat16))
    assert block.bfloat16()(torch.ones(3, 16, dtype=torch.bfloat16)).dtype == torch.bfloat16


def _randomize(module, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return module


def _copy_experts(experts, block):
    """transformers' joined gate_up_proj [E, 2I, H] is serval's w_gate ([:, :I]) and w_up ([:, I:])."""
    inter = block.w_gate.shape[1]
    with torch.no_grad():
        block.w_gate.copy_(experts.gate_up_proj[:, :inter])
        block.w_up.copy_(experts.gate_up_proj[:, inter:])
        block.w_down.copy_(experts.down_proj)


def _serval_grads_as_transformers(block, grads):
    """serval's gradients, named as the transformers block's parameters are."""
    named = dict(zip([n for n, _ in block.named_parameters()], grads))
    out = {"experts.gate_up_proj": torch.cat([named["w_gate"], named["w_up"]], dim=1),
           "experts.down_proj": named["w_down"], "gate.weight": named["router.weight"]}
    for name in ("gate", "up", "down"):
        if f"shared.{name}.weight" in named:
            out[f"shared_experts.{name}_proj.weight"] = named[f"shared.{name}.weight"]
    return out


def _check_against_transformers(reference, block, top_k):
    x = torch.randn(2, 7, reference.gate.weight.shape[1], generator=torch.Generator().manual_seed(1))
    x_ref, x_serval = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref = reference(x_ref)
    logits_ref = reference.gate(x_ref)[0]  # what transformers records for the aux loss
    loss_ref = y_ref.square().mean() + 0.1 * pytest.importorskip(
        "transformers.models.qwen3_moe.modeling_qwen3_moe").load_balancing_loss_func((logits_ref,), logits_ref.shape[1],
                                                                                     top_k)
    y, out = block(x_serval, return_router_output=True)
    assert rel_err(y, y_ref) < 1e-6
    assert rel_err(out.logits, logits_ref) < 1e-6
    loss = y.square().mean() + 0.1 * routing.load_balancing_loss(out.logits, top_k)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-6, atol=0)
    ref_names = [n for n, _ in reference.named_parameters()]
    x_grad_ref, *grads_ref = torch.autograd.grad(loss_ref, [x_ref, *reference.parameters()])
    x_grad, *grads = torch.autograd.grad(loss, [x_serval, *block.parameters()])
    grads_ref, grads = dict(zip(ref_names, grads_ref)), _serval_grads_as_transformers(block, grads)
    assert grads.keys() == grads_ref.keys()
    for name, grad in grads.items():
        assert rel_err(grad, grads_ref[name]) < 1e-5, name
    assert rel_err(x_grad, x_grad_ref) < 1e-5
    return out


def test_module_matches_transformers_qwen3_moe_block():
    """serval.MoE with the defaults is Qwen3-MoE's sparse block (norm_topk_prob=True): the same y, router logits,
    aux loss and gradients (x, router, experts) in fp32."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = transformers.Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=24, num_experts=8,
                                         num_experts_per_tok=2, norm_topk_prob=True)
    config._experts_implementation = "eager"
    reference = _randomize(Qwen3MoeSparseMoeBlock(config), seed=0)
    block = serval.MoE(32, 24, 8, 2, config=serval.Config(block_m=16))
    _copy_experts(reference.experts, block)
    with torch.no_grad():
        block.router.weight.copy_(reference.gate.weight)
    _check_against_transformers(reference, block, top_k=2)


def test_module_matches_transformers_deepseek_v3_block():
    """serval.MoE with DeepSeek-V3's routing (sigmoid, correction bias for the choice, group-limited top-k,
    renormalised, scaled) and its shared expert (a plain SwiGLU MLP) is transformers' DeepseekV3MoE: the same y
    and gradients in fp32, with a random correction bias."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    config = transformers.DeepseekV3Config(hidden_size=32, moe_intermediate_size=24, n_routed_experts=16,
                                           n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
                                           routed_scaling_factor=2.5, norm_topk_prob=True)
    config._experts_implementation = "eager"
    reference = _randomize(DeepseekV3MoE(config), seed=0)
    with torch.no_grad():
        reference.gate.e_score_correction_bias.copy_(torch.randn(16, generator=torch.Generator().manual_seed(2)) / 4)
    block = serval.MoE(32, 24, 16, 4, shared_intermediate_size=24, scoring="sigmoid", correction_bias=True,
                       num_groups=4, topk_groups=2, routed_scaling_factor=2.5, config=serval.Config(block_m=16))
    _copy_experts(reference.experts, block)
    with torch.no_grad():
        block.router.weight.copy_(reference.gate.weight)
        block.correction_bias.copy_(reference.gate.e_score_correction_bias)
        for name in ("gate", "up", "down"):
            block.shared[name].weight.copy_(getattr(reference.shared_experts, f"{name}_proj").weight)
    out = _check_against_transformers(reference, block, top_k=4)
    _, _, ids_ref = reference.gate(torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(1)))
    assert torch.equal(out.tokens_per_expert, torch.bincount(ids_ref.flatten(), minlength=16))


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
