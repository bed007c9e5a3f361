"""serval as torchtitan's routed experts against torchtitan's own, on CPU, with the real torchtitan (0.3).

The MoE blocks are torchtitan's, built from its config helpers (and one from the deepseek_v3 debugmodel's own layer
config) with random weights. torchtitan's GroupedExperts computes in bf16 whatever the parameters' dtype, and so does
serval in its place: results agree to bf16 rounding, not fp32, and the routed stage is checked against a float64
oracle of the same function, where serval must be as close as torchtitan is. Covered: the stage alone, whole MoE
blocks (router variants, shared expert, expert bias) with every parameter's gradient, torch.compile, training steps (and
their determinism), zero copy of bf16 weights, the override line in a real Trainer.Config, the refusals, and expert
parallelism under torchtitan's parallelize step on two gloo processes (both SPMD backends that run on gloo).
"""

import copy
import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytest.importorskip("torchtitan")

import spmd_types as spmd  # noqa: E402

from torchtitan.config.override import OverrideConfig, apply_overrides  # noqa: E402
from torchtitan.distributed.parallel_dims import ParallelDims  # noqa: E402
from torchtitan.models.common.config_utils import (  # noqa: E402
    make_ffn_config,
    make_moe_config,
    make_routed_experts_config,
    make_router_config,
)
from torchtitan.models.common.moe import GroupedExperts, RoutedExperts  # noqa: E402
from torchtitan.models.common.moe_sharding import set_moe_sharding_config  # noqa: E402

import serval  # noqa: E402
from serval.integrations import torchtitan as serval_torchtitan  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:In CPU autocast")

OVERRIDE = "serval.integrations.torchtitan.serval_routed_experts"
DIM, HIDDEN, EXPERTS, TOP_K = 32, 24, 8, 2
BF16_ROUNDING = 2e-2  # relative norm error of two bf16 computations of the same function


def _normal(p):
    torch.nn.init.normal_(p, std=0.2)


def block_config(*, score_func="softmax", top_k=TOP_K, shared=True, load_balance_coeff=1e-3, **router):
    """A torchtitan MoE.Config from its own helpers: EXPERTS SwiGLU experts [HIDDEN x DIM], standard comm backend."""
    return make_moe_config(
        num_experts=EXPERTS, load_balance_coeff=load_balance_coeff,
        router=make_router_config(dim=DIM, num_experts=EXPERTS, gate_param_init={"weight": _normal}, top_k=top_k,
                                  score_func=score_func, **router),
        routed_experts=make_routed_experts_config(
            dim=DIM, hidden_dim=HIDDEN, num_experts=EXPERTS, top_k=top_k, comm_backend="standard",
            param_init={name: _normal for name in ("w1_EFD", "w2_EDF", "w3_EFD")}),
        shared_experts=make_ffn_config(dim=DIM, hidden_dim=16, w1_param_init={"weight": _normal},
                                       w2w3_param_init={"weight": _normal}) if shared else None)


def debugmodel_moe_config():
    """The MoE layer config of torchtitan's deepseek_v3 "debugmodel" (softmax top-3 of 8, two shared experts)."""
    from torchtitan.models.deepseek_v3 import model_registry
    return model_registry("debugmodel").model.layers[1].moe


def build(config, dtype=torch.float32, seed=0):
    """The block with torchtitan's initialisation, then every parameter and the expert bias random (std 0.2)."""
    torch.manual_seed(seed)
    block = config.build()
    block.init_states()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2)
        if block.expert_bias_E is not None:
            block.expert_bias_E.normal_(0, 0.1)
    return block.to(dtype)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def output_and_grads(module, inputs, d_out):
    """(output, the gradients of each differentiable input then of every parameter)."""
    inputs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = module(*inputs)
    leaves = [t for t in inputs if t.requires_grad] + list(module.parameters())
    return out.detach(), torch.autograd.grad(out, leaves, d_out)


def test_routed_stage_is_torchtitans_function():
    """RoutedExperts and its serval replacement on the same router output: both within bf16 rounding of a float64
    oracle of y = sum_k score_k * w2 @ (silu(w1 @ x) * (w3 @ x)), serval no further than torchtitan, in y and the
    gradients of x, the scores and the three expert weights; fp32 and bf16 parameters."""
    for dtype in (torch.float32, torch.bfloat16):
        block = build(block_config(), dtype)
        x = torch.randn(3, 9, DIM, generator=torch.Generator().manual_seed(1)).to(dtype)
        with torch.no_grad():
            scores, ids, _ = block.router(x, block.expert_bias_E)
        counts = torch.bincount(ids.flatten(), minlength=EXPERTS)
        d_y = torch.randn(3, 9, DIM, generator=torch.Generator().manual_seed(2)).to(dtype)
        stage = block.routed_experts
        serval_stage = serval_torchtitan.apply(copy.deepcopy(stage))
        assert type(stage) is RoutedExperts and type(serval_stage) is serval_torchtitan.ServalRoutedExperts
        inputs = (x, scores, ids, counts)
        y_tt, grads_tt = output_and_grads(stage, inputs, d_y)
        y_sv, grads_sv = output_and_grads(serval_stage, inputs, d_y)

        experts = stage.inner_experts
        oracle_inputs = [t.detach().double().requires_grad_() for t in (x.reshape(-1, DIM), scores.reshape(-1, TOP_K),
                         experts.w1_EFD, experts.w3_EFD, experts.w2_EDF)]
        y_64 = serval.reference.moe(oracle_inputs[0], oracle_inputs[1], ids.reshape(-1, TOP_K), *oracle_inputs[2:])
        grads_64 = torch.autograd.grad(y_64, oracle_inputs, d_y.reshape(-1, DIM).double())
        # the parameters' order is w1_EFD, w2_EDF, w3_EFD; the oracle's w_gate, w_up, w_down
        pairs = [("y", y_sv, y_tt, y_64.view(y_tt.shape)), ("d_x", grads_sv[0], grads_tt[0], grads_64[0].view(x.shape)),
                 ("d_scores", grads_sv[1], grads_tt[1], grads_64[1].view(scores.shape)),
                 ("d_w1_EFD", grads_sv[2], grads_tt[2], grads_64[2]),
                 ("d_w2_EDF", grads_sv[3], grads_tt[3], grads_64[4]),
                 ("d_w3_EFD", grads_sv[4], grads_tt[4], grads_64[3])]
        for name, got, torchtitan_result, oracle in pairs:
            assert got.dtype == torchtitan_result.dtype, name
            assert rel(torchtitan_result, oracle) < BF16_ROUNDING, (dtype, name)
            assert rel(got, oracle) <= 2 * rel(torchtitan_result, oracle), (dtype, name)
            assert rel(got, torchtitan_result) < BF16_ROUNDING, (dtype, name)


ROUTINGS = {
    "deepseek_v3_debugmodel": debugmodel_moe_config,
    "sigmoid_grouped_norm_scale_bias": lambda: block_config(score_func="sigmoid", num_expert_groups=4,
                                                            num_limited_groups=2, route_norm=True, route_scale=2.5),
    "softmax_top1_no_shared_no_bias": lambda: block_config(top_k=1, shared=False, load_balance_coeff=None),
}


@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_moe_block_matches_torchtitan(routing):
    """A whole torchtitan MoE block (its router, its shared expert) with serval's routed experts: the output and the
    gradient of x and of every parameter, the router's included, within bf16 rounding of torchtitan's; the same
    state-dict keys and parameter objects (apply swaps the module's class in place)."""
    block = build(ROUTINGS[routing]())
    dim = block.router.gate.weight.shape[1]
    x = torch.randn(2, 12, dim, generator=torch.Generator().manual_seed(1))
    d_y = torch.randn(2, 12, dim, generator=torch.Generator().manual_seed(2))
    y_tt, grads_tt = output_and_grads(block, [x], d_y)
    keys, params = list(block.state_dict()), list(block.parameters())
    assert serval_torchtitan.apply(block) is block
    assert list(block.state_dict()) == keys and all(a is b for a, b in zip(block.parameters(), params))
    assert type(block.routed_experts.inner_experts) is GroupedExperts
    y_sv, grads_sv = output_and_grads(block, [x], d_y)
    assert rel(y_sv, y_tt) < BF16_ROUNDING
    names = ["x"] + [name for name, _ in block.named_parameters()]
    for name, got, want in zip(names, grads_sv, grads_tt):
        assert rel(got, want) < BF16_ROUNDING, name


def test_bf16_weights_reach_serval_as_they_are():
    """bf16 parameters are passed to serval.moe themselves (no cast, no copy); the Config given to apply reaches
    every call."""
    block = build(block_config(), torch.bfloat16)
    chosen = serval.Config(block_m=32, backend="torch")
    serval_torchtitan.apply(block, chosen)
    experts = block.routed_experts.inner_experts
    seen = []
    real_moe = serval_torchtitan.moe

    def spy(*args, **kwargs):
        seen.append((args[3:6], kwargs["config"], kwargs["group"]))
        return real_moe(*args, **kwargs)

    serval_torchtitan.moe = spy
    try:
        block(torch.randn(1, 5, DIM, dtype=torch.bfloat16)).sum().backward()
    finally:
        serval_torchtitan.moe = real_moe
    (weights, config, group), = seen
    assert all(w is p for w, p in zip(weights, (experts.w1_EFD, experts.w3_EFD, experts.w2_EDF)))
    assert config is chosen and group is None
    assert experts.w1_EFD.grad.dtype == torch.bfloat16


def test_block_compiles_fullgraph():
    """torch.compile(fullgraph=True) traces a block with serval's routed experts in one graph (serval's ops have fake
    implementations; the adapter reads only metadata) and gives the eager bits, forward and backward."""
    block = serval_torchtitan.apply(build(block_config()))
    x = torch.randn(2, 7, DIM, generator=torch.Generator().manual_seed(1))
    y_eager, grads_eager = output_and_grads(block, [x], torch.ones(2, 7, DIM))
    y_compiled, grads_compiled = output_and_grads(torch.compile(block, fullgraph=True, backend="aot_eager"), [x],
                                                  torch.ones(2, 7, DIM))
    assert torch.equal(y_compiled, y_eager) and all(torch.equal(a, b) for a, b in zip(grads_compiled, grads_eager))


def _train(block, steps=3):
    optimizer = torch.optim.AdamW(block.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        x = torch.randn(2, 10, DIM, generator=torch.Generator().manual_seed(10 + step))
        loss = block(x).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return torch.stack(losses), [p.detach().clone() for p in block.parameters()]


def test_training_steps_track_torchtitan_and_repeat_bitwise():
    """AdamW steps on a block: serval's losses and weights follow torchtitan's to bf16 rounding, and two serval runs
    give bitwise-identical losses and weights."""
    losses_tt, weights_tt = _train(build(block_config()))
    runs = [_train(serval_torchtitan.apply(build(block_config()))) for _ in range(2)]
    assert torch.equal(runs[0][0], runs[1][0]) and all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
    assert rel(runs[0][0], losses_tt) < BF16_ROUNDING
    assert all(rel(a, b) < BF16_ROUNDING for a, b in zip(runs[0][1], weights_tt))


def test_override_line_in_a_trainer_config():
    """The one line in torchtitan's own deepseek_v3 debugmodel Trainer.Config (EP = 2), applied as the trainer does
    (after update_from_config): every MoE layer's routed experts become serval's with the given Config fields, the
    sharding config and state-dict keys stay torchtitan's (built on the meta device), the config still serializes,
    and the trainer's CUDA-graph check at EP, which refuses the standard all-to-all dispatcher (a host sync), finds
    no dispatcher to refuse."""
    from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel

    def trainer_config(imports):
        config = deepseek_v3_debugmodel()
        config.parallelism.expert_parallel_degree = 2
        config.override.imports.extend(imports)
        config.model_spec.model.update_from_config(config=config)
        apply_overrides(config.override, config)
        return config

    plain = trainer_config([])
    switched = trainer_config([(OVERRIDE, {"block_m": 64, "precision": "bf16"})])
    with pytest.raises(ValueError, match="CUDA graphs support only expert parallel token dispatcher"):
        plain._validate_cuda_graphs()
    switched._validate_cuda_graphs()
    assert switched.to_dict()["model_spec"]["model"]["layers"][1]["moe"]["routed_experts"]["serval_config"][
        "block_m"] == 64
    with torch.device("meta"):
        plain_model, model = plain.model_spec.model.build(), switched.model_spec.model.build()
    layers, plain_layers = ([m for name, m in built.named_modules() if name.endswith("moe.routed_experts")]
                            for built in (model, plain_model))
    assert len(layers) == len(plain_layers) == 5  # the debugmodel's layers 1-5
    for layer, plain_layer in zip(layers, plain_layers):
        assert type(layer) is serval_torchtitan.ServalRoutedExperts
        assert layer.serval_config == serval.Config(block_m=64)
        assert layer._sharding_config == plain_layer._sharding_config is not None
        assert not hasattr(layer, "token_dispatcher")
    assert list(model.state_dict()) == list(plain_model.state_dict())


def test_refusals():
    """What serval does not compute is refused by name, before anything changes."""
    from torchtitan.overrides import fused_swiglu  # registers torchtitan's fused gate/up experts override

    fused = block_config()
    apply_overrides(OverrideConfig(imports=["torchtitan.overrides.fused_swiglu.fused_grouped_experts"]), fused)
    assert type(fused.routed_experts.inner_experts) is fused_swiglu.FusedGroupedExperts.Config
    with pytest.raises(ValueError, match="FusedGroupedExperts"):
        apply_overrides(OverrideConfig(imports=[OVERRIDE]), fused)
    block = build(fused)
    with pytest.raises(ValueError, match="routed_experts: serval computes torchtitan's GroupedExperts"):
        serval_torchtitan.apply(block)
    assert type(block.routed_experts) is RoutedExperts

    with pytest.raises(TypeError, match="config must be None or a serval.Config"):
        serval_torchtitan.apply(build(block_config()), {"block_m": 64})
    with pytest.raises(ValueError, match="no torchtitan RoutedExperts"):
        serval_torchtitan.apply(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="unexpected keyword argument 'block'"):
        apply_overrides(OverrideConfig(imports=[(OVERRIDE, {"block": 64})]), block_config())

    tensor_parallel = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=2, pp=1, ep=1, world_size=2)
    with pytest.raises(ValueError, match="tensor parallelism inside the routed experts"):
        serval_torchtitan.apply(build(block_config())).routed_experts.parallelize(tensor_parallel)


# ---------------------------------------------------------------- expert parallelism on gloo

EP = 2
# the layout torchtitan's models give their GroupedExperts (its TP placements; with EP every weight is Shard(0))
EXPERT_PARAM_LAYOUT = {"w1_EFD": spmd.S(1), "w2_EDF": spmd.S(2), "w3_EFD": spmd.S(1)}


def _parallelized(block, spmd_backend):
    """`block` through torchtitan's parallelize step with EP = 2 (and FSDP's dp_shard = 2, which the EP axis takes)
    on the CPU, and the context torchtitan's trainer runs a step in."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.distributed.utils import get_spmd_context, set_spmd_backend

    set_spmd_backend(spmd_backend)
    parallel_dims = ParallelDims(dp_replicate=1, dp_shard=EP, cp=1, tp=1, pp=1, ep=EP, world_size=EP,
                                 spmd_backend=spmd_backend)
    parallel_dims_module.device_type = "cpu"  # torchtitan builds its meshes on "cuda" when no accelerator is found
    parallel_dims.build_mesh()
    step_context = get_spmd_context(parallel_dims=parallel_dims)
    with step_context():
        block.parallelize(parallel_dims)
    return block, step_context


def _local_grad(grad):
    return grad.to_local() if hasattr(grad, "to_local") else grad


def ep_worker(rank, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=EP,
                            timeout=datetime.timedelta(minutes=2))
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (the "fake" backend of torchtitan's 1-sized axes)

    try:
        config = block_config()
        set_moe_sharding_config(config, enable_ep=True, enable_sp=False, expert_param_layout=EXPERT_PARAM_LAYOUT)
        base = build(config)
        x = torch.randn(EP, 8, DIM, generator=torch.Generator().manual_seed(1))
        d_y = torch.randn(EP, 8, DIM, generator=torch.Generator().manual_seed(2))
        local = slice(rank, rank + 1)
        experts = slice(rank * EXPERTS // EP, (rank + 1) * EXPERTS // EP)

        # serval at EP=1 on the concatenated batch
        y_full, grads_full = output_and_grads(serval_torchtitan.apply(copy.deepcopy(base)), [x], d_y)
        full = dict(zip(["x"] + [n for n, _ in base.named_parameters()], grads_full))

        results = {}
        # partial_dtensor: torchtitan's own EP (all-to-all) runs on gloo, the reference; spmd_types (the default
        # backend; its all-to-all does not run on gloo): serval only
        for spmd_backend, on_serval in (("partial_dtensor", False), ("partial_dtensor", True), ("spmd_types", True)):
            block = copy.deepcopy(base)
            if on_serval:
                serval_torchtitan.apply(block)
            block, step_context = _parallelized(block, spmd_backend)
            with pytest.raises(ValueError, match="routed_experts: apply.model. must run before torchtitan's parallel"):
                serval_torchtitan.apply(block)
            assert type(block.routed_experts) is (serval_torchtitan.ServalRoutedExperts if on_serval else RoutedExperts)
            if on_serval:
                assert block.routed_experts.ep_group.size() == EP
            x_local = x[local].clone().requires_grad_()
            with step_context():
                y = block(x_local)
                y.backward(d_y[local])
            grads = {"x": x_local.grad} | {n: _local_grad(p.grad) for n, p in block.named_parameters()}
            results[spmd_backend, on_serval] = (y.detach(), grads)

        reference_y, reference_grads = results["partial_dtensor", False]
        for (spmd_backend, on_serval), (y, grads) in results.items():
            if not on_serval:
                continue
            assert rel(y, reference_y) < BF16_ROUNDING, spmd_backend
            for name, grad in grads.items():
                assert rel(grad, reference_grads[name]) < BF16_ROUNDING, (spmd_backend, name)
            # bitwise the EP=1 layer: y, d_x and the rank's experts' weight gradients
            assert torch.equal(y, y_full[local]), spmd_backend
            assert torch.equal(grads["x"], full["x"][local]), spmd_backend
            for name in ("w1_EFD", "w2_EDF", "w3_EFD"):
                key = f"routed_experts.inner_experts.{name}"
                assert torch.equal(grads[key], full[key][experts]), (spmd_backend, name)
            # the router's gradient is each rank's own tokens' part (FSDP would reduce it): the sum is EP=1's
            router_grad = grads["router.gate.weight"].clone()
            dist.all_reduce(router_grad)
            assert rel(router_grad, full["router.gate.weight"]) < 1e-5, spmd_backend
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_expert_parallel_under_torchtitans_parallelize(tmp_path):
    """EP = 2 on two gloo processes through torchtitan's own parallelize step: the experts' weights are Shard(0) on
    the EP mesh and serval gets their local shards and the EP group (torchtitan's all-to-all is not run); y and the
    gradients match torchtitan's EP within bf16 rounding and serval's EP=1 on the concatenated batch bitwise, under
    the partial_dtensor and spmd_types backends."""
    mp.spawn(ep_worker, args=(str(tmp_path / "init"),), nprocs=EP)
