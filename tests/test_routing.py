"""serval.routing against the code it follows, on random inputs (CPU, fp32).

- `route` against the routers of transformers' Qwen3-MoE, Mixtral (renormalised softmax), OLMoE and Qwen2-MoE (raw
  softmax) and DeepSeek-V3 (sigmoid, correction bias, group-limited top-k, renormalisation, scaling factor).
- `load_balancing_loss` against transformers' `load_balancing_loss_func` (Qwen3-MoE's and Mixtral's), value and
  gradient, with and without an attention mask.
- `update_correction_bias` against torchtitan's own optimizer pre-step hook (`register_moe_load_balancing_hook`),
  bit for bit, on one process and with the counts all-reduced over two gloo ranks.
- argument errors name the argument; on CUDA nothing syncs the host.
"""

import datetime
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import serval
from conftest import requires_cuda
from serval import routing

H, N = 32, 40


def transformers_module(family):
    return pytest.importorskip(f"transformers.models.{family}.modeling_{family}")


def randomized(router, seed=0, bias_std=0.0):
    """A transformers router with a random weight (so that the routing is far from uniform) and, where it has one,
    a random correction bias."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
        if bias_std:
            router.e_score_correction_bias.copy_(torch.randn(router.num_experts, generator=gen) * bias_std)
    return router


def hidden_states(seed=1):
    return torch.randn(N, H, generator=torch.Generator().manual_seed(seed))


def by_expert(ids, weights):
    """Each token's (ids, weights) ordered by expert id: a top-k compared as a set."""
    order = ids.argsort(dim=-1)
    return ids.gather(1, order), weights.gather(1, order)


def softmax_router(family):
    """(transformers' router for `family`, the route() options that reproduce it)."""
    module = transformers_module(family)
    import transformers

    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(hidden_size=H, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True)
        return module.Qwen3MoeTopKRouter(config), {}
    if family == "mixtral":
        config = transformers.MixtralConfig(hidden_size=H, num_local_experts=8, num_experts_per_tok=2)
        return module.MixtralTopKRouter(config), {}
    if family == "olmoe":
        config = transformers.OlmoeConfig(hidden_size=H, num_experts=16, num_experts_per_tok=4)
        assert not config.norm_topk_prob  # OLMoE's default: the raw top-k probabilities
        return module.OlmoeTopKRouter(config), dict(renormalize=False)
    config = transformers.Qwen2MoeConfig(hidden_size=H, num_experts=16, num_experts_per_tok=4, norm_topk_prob=False)
    return module.Qwen2MoeTopKRouter(config), dict(renormalize=False)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe"])
def test_softmax_routing_matches_transformers(family):
    router, options = softmax_router(family)
    randomized(router)
    logits, weights, ids = router(hidden_states())
    out = routing.route(logits, router.top_k, **options)
    assert torch.equal(out.logits, logits)
    assert torch.equal(out.ids, ids)  # the same scores and torch.topk: the same ids in the same order
    torch.testing.assert_close(out.weights, weights, rtol=1e-6, atol=0)
    assert out.weights.dtype == torch.float32 and out.ids.dtype == torch.int64
    assert torch.equal(out.tokens_per_expert, torch.bincount(ids.flatten(), minlength=router.num_experts))
    if options.get("renormalize", True):
        torch.testing.assert_close(out.weights.sum(-1), torch.ones(N))
    else:
        assert (out.weights.sum(-1) < 1).all()


@pytest.mark.parametrize("n_group, topk_group, norm_topk_prob", [(4, 2, True), (4, 2, False), (1, 1, True)])
def test_deepseek_v3_routing_matches_transformers(n_group, topk_group, norm_topk_prob):
    import transformers

    module = transformers_module("deepseek_v3")
    config = transformers.DeepseekV3Config(hidden_size=H, n_routed_experts=16, num_experts_per_tok=4, n_group=n_group,
                                           topk_group=topk_group, norm_topk_prob=norm_topk_prob,
                                           routed_scaling_factor=2.5)
    router = randomized(module.DeepseekV3TopkRouter(config), bias_std=0.3)
    logits, weights, ids = router(hidden_states())
    groups = dict(num_groups=n_group, topk_groups=topk_group) if n_group > 1 else {}  # one group limits nothing
    options = dict(scoring="sigmoid", renormalize=norm_topk_prob, routed_scaling_factor=2.5, **groups)
    out = routing.route(logits, 4, correction_bias=router.e_score_correction_bias, **options)
    serval_ids, serval_weights = by_expert(out.ids, out.weights)
    reference_ids, reference_weights = by_expert(ids, weights)
    assert torch.equal(serval_ids, reference_ids)
    torch.testing.assert_close(serval_weights, reference_weights, rtol=1e-6, atol=0)
    # the inputs exercise what is tested: the bias moves the choice (not the weights), and so do the groups
    unbiased = routing.route(logits, 4, **options)
    assert (by_expert(unbiased.ids, unbiased.weights)[0] != serval_ids).any(dim=-1).sum() >= N // 4
    if n_group > 1:
        ungrouped = routing.route(logits, 4, correction_bias=router.e_score_correction_bias,
                                  **dict(options, num_groups=None, topk_groups=None))
        assert (by_expert(ungrouped.ids, ungrouped.weights)[0] != serval_ids).any(dim=-1).sum() >= N // 4
        kept_groups = torch.zeros(N, n_group, dtype=torch.int64).scatter_add_(
            1, out.ids // (16 // n_group), torch.ones_like(out.ids)).count_nonzero(dim=-1)
        assert (kept_groups <= topk_group).all()


def layer_logits(num_layers=3, batch=2, seq=7, num_experts=8, seed=2):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch * seq, num_experts, generator=gen) * 2).requires_grad_() for _ in range(num_layers)]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("masked", [False, True])
def test_load_balancing_loss_matches_transformers(family, masked):
    reference = transformers_module(family).load_balancing_loss_func
    logits = layer_logits()
    mask = None
    if masked:  # [batch, seq], padding at the end of the second sequence
        mask = torch.ones(2, 7, dtype=torch.int64)
        mask[1, 4:] = 0
    loss = routing.load_balancing_loss(logits, 2, attention_mask=mask)
    expected = reference(tuple(logits), num_experts=8, top_k=2, attention_mask=mask)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    grads = torch.autograd.grad(loss, logits)
    for grad, expected_grad in zip(grads, torch.autograd.grad(expected, logits)):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-9)
    one_layer = routing.load_balancing_loss(logits[0], 2, attention_mask=mask)
    torch.testing.assert_close(one_layer, reference((logits[0],), 8, 2, mask), rtol=1e-6, atol=0)


def torchtitan_update(biases, counts, coeff, loss_group=None):
    """Run torchtitan's own MoE bias update (the optimizer pre-step hook `register_moe_load_balancing_hook`
    registers) on stand-in MoE layers that hold these biases and counts (fp32, as torchtitan keeps them); with
    loss_group, torchtitan all-reduces the counts over it. Returns the updated biases."""
    optimizer = pytest.importorskip("torchtitan.components.optimizer.optimizer")
    layers = nn.ModuleDict()
    for i, (bias, count) in enumerate(zip(biases, counts)):
        block = nn.Module()
        block.moe_enabled = True
        block.moe = types.SimpleNamespace(load_balance_coeff=coeff, expert_bias_E=bias.clone(),
                                          tokens_per_expert_E=count.float())
        layers[str(i)] = block
    model = nn.Module()
    model.layers = layers
    loss_mesh = None if loss_group is None else types.SimpleNamespace(get_group=lambda: loss_group)
    parallel_dims = types.SimpleNamespace(get_optional_mesh=lambda name: loss_mesh if name == "loss" else None,
                                          ep_enabled=False, tp=1)
    hooks = []
    optimizer.register_moe_load_balancing_hook(types.SimpleNamespace(register_step_pre_hook=hooks.append), [model],
                                               parallel_dims)
    (hook,) = hooks
    hook()
    return [block.moe.expert_bias_E for block in layers.values()]


def bias_problem(seed, num_layers=3, num_experts=8):
    """Random biases and integer counts per layer, one layer's counts with some equal to their mean (sign 0)."""
    gen = torch.Generator().manual_seed(seed)
    biases = [torch.randn(num_experts, generator=gen) * 0.01 for _ in range(num_layers)]
    counts = [torch.randint(0, 50, (num_experts,), generator=gen) for _ in range(num_layers)]
    counts[0] = torch.tensor([3, 5, 5, 7, 5, 1, 9, 5])[:num_experts]  # mean 5
    return biases, counts


def test_bias_update_matches_torchtitan():
    biases, counts = bias_problem(seed=3)
    expected = torchtitan_update(biases, counts, 1e-3)
    before = [c.clone() for c in counts]
    routing.update_correction_bias(biases, counts, 1e-3)
    assert all(torch.equal(b, e) for b, e in zip(biases, expected))
    assert all(torch.equal(c, b) for c, b in zip(counts, before))  # the caller's counts are not changed
    one, one_count = bias_problem(seed=4, num_layers=1)
    expected = torchtitan_update(one, one_count, 0.5)
    routing.update_correction_bias(one[0], one_count[0], 0.5)  # one layer: tensors, not sequences
    assert torch.equal(one[0], expected[0])


def bias_update_worker(rank, world_size, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(minutes=2))
    try:
        biases, _ = bias_problem(seed=5)
        _, counts = bias_problem(seed=6 + rank)  # each rank saw its own tokens
        expected = torchtitan_update(biases, counts, 1e-3, loss_group=dist.group.WORLD)
        routing.update_correction_bias(biases, counts, 1e-3, group=dist.group.WORLD)
        assert all(torch.equal(b, e) for b, e in zip(biases, expected)), rank
        summed = [sum(bias_problem(seed=6 + r)[1][i] for r in range(world_size)) for i in range(len(counts))]
        alone, _ = bias_problem(seed=5)
        routing.update_correction_bias(alone, summed, 1e-3)  # the same as one process with every rank's counts
        assert all(torch.equal(b, a) for b, a in zip(biases, alone)), rank
    finally:
        dist.destroy_process_group()


def test_bias_update_all_reduces_the_counts_over_a_group(tmp_path):
    pytest.importorskip("torchtitan.components.optimizer.optimizer")
    mp.spawn(bias_update_worker, args=(2, str(tmp_path / "init")), nprocs=2, join=True)


def test_routing_arguments_are_named():
    logits = torch.randn(5, 8)
    for kwargs, name in [
        (dict(top_k=9), "top_k"), (dict(scoring="relu"), "scoring"), (dict(renormalize=None), "renormalize"),
        (dict(num_groups=4), "num_groups and topk_groups"), (dict(num_groups=3, topk_groups=1), "num_groups"),
        (dict(num_groups=8, topk_groups=4), "num_groups"), (dict(num_groups=4, topk_groups=1, top_k=3), "topk_groups"),
        (dict(num_groups=4, topk_groups=5), "topk_groups"), (dict(routed_scaling_factor=0.0), "routed_scaling_factor"),
        (dict(correction_bias=torch.zeros(7)), "correction_bias"),
        (dict(correction_bias=torch.zeros(8, dtype=torch.int64)), "correction_bias"),
    ]:
        with pytest.raises(ValueError, match=f"^{name}"):
            routing.route(logits, **(dict(top_k=2) | kwargs))
    with pytest.raises(ValueError, match="^logits must be a floating-point tensor"):
        routing.route(logits[None], 2)
    with pytest.raises(ValueError, match=r"^router_logits\[1\] must have the shape"):
        routing.load_balancing_loss([logits, logits[:4]], 2)
    with pytest.raises(ValueError, match="^attention_mask must be None or a tensor of N = 5"):
        routing.load_balancing_loss(logits, 2, attention_mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match="^top_k"):
        routing.load_balancing_loss(logits, 0)
    bias = torch.zeros(8)
    with pytest.raises(ValueError, match="^update_rate"):
        routing.update_correction_bias(bias, torch.zeros(8), -1.0)
    with pytest.raises(ValueError, match=r"^tokens_per_expert\[0\] must be a real tensor"):
        routing.update_correction_bias(bias, torch.zeros(4), 1e-3)
    with pytest.raises(ValueError, match="^correction_bias and tokens_per_expert"):
        routing.update_correction_bias([bias], [torch.zeros(8)] * 2, 1e-3)
    assert not bias.any()  # a refused update changes nothing


@requires_cuda
def test_routing_and_balancing_do_not_sync_the_host():
    """route (group-limited, biased), the loss and the bias update, and a serval.MoE step with its router output,
    under torch's sync debug mode (which raises on a host sync)."""
    block = serval.MoE(128, 128, 16, 4, shared_intermediate_size=128, scoring="sigmoid", correction_bias=True,
                       num_groups=4, topk_groups=2, routed_scaling_factor=2.5, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    block(x)  # the first call compiles and checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y, out = block(x, return_router_output=True)
        loss = y.float().square().mean() + 1e-2 * routing.load_balancing_loss(out.logits, 4)
        loss.backward()
        routing.update_correction_bias(block.correction_bias, out.tokens_per_expert, 1e-3)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(out.tokens_per_expert.cpu(), torch.bincount(out.ids.flatten().cpu(), minlength=16))
    assert block.correction_bias.abs().sum() > 0
