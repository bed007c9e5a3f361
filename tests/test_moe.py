"""serval.moe against the reference: values, gradients, determinism, edge cases, bad input, compile, graphs."""

import pytest
import torch

import serval
from conftest import (CUDA, check_sync_free_and_graph_replay, cuda_layer_step, make_layer, make_routing, rel_err,
                      requires_cuda)
from serval import reference

# (name, N, H, I, E, k, routing kind, shared intermediate, swiglu_limit); sizes are not multiples of any tile
CASES = [
    ("random", 37, 24, 20, 6, 2, "random", 0, None),
    ("shared+limit", 29, 24, 12, 5, 3, "random", 10, 0.6),
    ("skewed", 40, 16, 12, 4, 2, "skewed", 0, None),
    ("empty-experts", 21, 16, 8, 8, 2, "empty", 6, None),
    ("k1-one-expert", 33, 16, 12, 3, 1, "one", 0, 1.5),
    ("one-token", 1, 16, 8, 4, 2, "random", 4, None),
    ("single-expert", 11, 8, 4, 1, 1, "random", 0, None),
    ("aligned", 45, 64, 48, 6, 2, "random", 32, 3.0),  # what the GPU kernels take: H, I, Is multiples of 8
    ("rows-8-mod-16", 45, 136, 40, 6, 2, "random", 24, None),  # 16-byte rows, not 32: no divisibility by 16
]
ALIGNED = CASES[-2]


def backends(device, case):
    """Backends that take this case here: the torch stages everywhere; the Triton kernels under
    Triton's interpreter on the CPU, and on CUDA when H, I, Is are multiples of 8."""
    from serval import kernels

    if device == "cuda":
        _, _, hidden, inter, _, _, _, shared_inter, _ = case
        ok = kernels.supports((hidden, inter, shared_inter))
    else:
        ok = kernels.INTERPRET
    return ["torch", "triton"] if ok else ["torch"]


def run_layer(case, *, device="cpu", dtype=torch.float32, config=None, seed=0, fn=serval.moe, rounded_to=None):
    """(y, grads of x, router_weights, weights, shared weights) for one case.

    rounded_to: draw the layer in this dtype, then convert to `dtype` (the reference of a bf16 run sees
    exactly the bf16 inputs).
    """
    _, N, H, I, E, k, kind, shared_inter, limit = case
    x, weights, shared = make_layer(N, H, I, E, shared_inter=shared_inter, device=device,
                                    dtype=rounded_to or dtype, seed=seed)
    x, weights = x.to(dtype), [w.to(dtype) for w in weights]
    shared = None if shared is None else tuple(w.to(dtype) for w in shared)
    rw_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    rw, ids = make_routing(N, E, k, kind=kind, device=device, dtype=rw_dtype, seed=seed)
    inputs = [x, rw, *weights, *(shared or ())]
    for t in inputs:
        t.requires_grad_()
    kwargs = dict(swiglu_limit=limit)
    if config is not None:
        kwargs["config"] = config
    y = fn(x, rw, ids, *weights, shared, **kwargs)
    d_y = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed + 1))
    d_y = d_y.to(device=device, dtype=rounded_to or dtype).to(dtype)
    grads = torch.autograd.grad(y, inputs, d_y)
    return y.detach(), grads


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_fp32_matches_reference(case):
    for backend in backends("cpu", case):
        config = serval.Config(block_m=16, backend=backend)
        y, grads = run_layer(case, config=config)
        y_ref, grads_ref = run_layer(case, dtype=torch.float64, fn=reference.moe)
        assert rel_err(y, y_ref) < 1e-5, backend
        for g, g_ref in zip(grads, grads_ref):
            assert torch.isfinite(g).all(), backend
            assert rel_err(g, g_ref) < 1e-5, backend


@pytest.mark.parametrize("case", CASES[:3] + CASES[-2:], ids=[c[0] for c in CASES[:3] + CASES[-2:]])
def test_bf16_matches_reference(case):
    device = "cuda" if CUDA else "cpu"
    for backend in backends(device, case):
        config = serval.Config(block_m=16 if device == "cpu" else 128, backend=backend)
        y, grads = run_layer(case, device=device, dtype=torch.bfloat16, config=config)
        y_ref, grads_ref = run_layer(case, dtype=torch.float64, fn=reference.moe, rounded_to=torch.bfloat16)
        assert rel_err(y.cpu(), y_ref) < 2e-2, backend
        # Triton's CPU interpreter rounds fp32 to bf16 toward zero (the GPU: to nearest), which moves a
        # pre-activation of the small shared expert across the swiglu_limit clamp in this case
        interpreted_clamp = device == "cpu" and backend == "triton" and case[-1] is not None
        for g, g_ref in zip(grads, grads_ref):
            assert rel_err(g.cpu(), g_ref) < (6e-2 if interpreted_clamp else 3e-2), backend


def test_gradcheck():
    x, (wg, wu, wd), shared = make_layer(7, 6, 4, 3, shared_inter=3, dtype=torch.float64)
    rw, ids = make_routing(7, 3, 2, dtype=torch.float64)
    config = serval.Config(block_m=16, backend="torch")

    def f(x, rw, wg, wu, wd, *shared):
        return serval.moe(x, rw, ids, wg, wu, wd, shared, config=config, swiglu_limit=0.9)

    assert torch.autograd.gradcheck(f, [t.requires_grad_() for t in (x, rw, wg, wu, wd, *shared)])


@pytest.mark.parametrize("recompute", [False, True])
def test_bitwise_deterministic(recompute):
    device = "cuda" if CUDA else "cpu"
    dtype = torch.bfloat16 if CUDA else torch.float32
    block_m = 128 if CUDA else 16
    config = serval.Config(block_m=block_m, recompute=recompute)
    first = run_layer(ALIGNED, device=device, dtype=dtype, config=config)
    second = run_layer(ALIGNED, device=device, dtype=dtype, config=config)
    assert torch.equal(first[0], second[0])
    assert all(torch.equal(a, b) for a, b in zip(first[1], second[1]))
    if recompute:  # recomputing the pre-activations changes nothing
        kept = run_layer(ALIGNED, device=device, dtype=dtype, config=serval.Config(block_m=block_m))
        assert torch.equal(first[0], kept[0])
        assert all(torch.equal(a, b) for a, b in zip(first[1], kept[1]))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_swiglu_limit_applies_to_the_shared_expert(backend):
    """The limit clamps the shared expert's gate and up as well as the routed experts' (the contract: "in
    the routed experts and the shared expert alike"), forward and backward; checked against the formula
    written out, in fp64."""
    from serval import kernels

    device = "cpu"
    if backend == "triton" and not kernels.INTERPRET:
        if not CUDA:
            pytest.skip("the Triton kernels need CUDA or TRITON_INTERPRET=1")
        device = "cuda"
    num_tokens, hidden, inter, num_experts, top_k, shared_inter, limit = 13, 16, 8, 4, 2, 8, 0.3
    x, weights, shared = make_layer(num_tokens, hidden, inter, num_experts, shared_inter=shared_inter, scale=2.0)
    rw, ids = make_routing(num_tokens, num_experts, top_k)
    shared_gate, shared_up = x @ shared[0].T, x @ shared[1].T
    assert (shared_gate > limit).float().mean() > 0.2 and (shared_up.abs() > limit).float().mean() > 0.2

    def expected(x, rw, w_gate, w_up, w_down, ws_gate, ws_up, ws_down):
        routed = reference.moe(x, rw, ids, w_gate, w_up, w_down, None, swiglu_limit=limit)
        gate = (x @ ws_gate.T).clamp(max=limit)
        up = (x @ ws_up.T).clamp(min=-limit, max=limit)
        return routed + (torch.nn.functional.silu(gate) * up) @ ws_down.T

    inputs = [t.to(device).requires_grad_() for t in (x, rw, *weights, *shared)]
    y = serval.moe(inputs[0], inputs[1], ids.to(device), *inputs[2:5], tuple(inputs[5:]),
                   config=serval.Config(block_m=16, backend=backend), swiglu_limit=limit)
    d_y = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(device)
    grads = torch.autograd.grad(y, inputs, d_y)
    inputs_ref = [t.detach().double().cpu().requires_grad_() for t in inputs]
    y_ref = expected(*inputs_ref)
    grads_ref = torch.autograd.grad(y_ref, inputs_ref, d_y.double().cpu())
    assert rel_err(y.cpu(), y_ref) < 1e-5
    names = ["x", "router_weights", "w_gate", "w_up", "w_down", "ws_gate", "ws_up", "ws_down"]
    for name, g, g_ref in zip(names, grads, grads_ref):
        assert rel_err(g.cpu(), g_ref) < 1e-5, name


def test_functional_api():
    from serval import functional

    x, (wg, wu, wd), shared = make_layer(19, 16, 8, 4, shared_inter=8)
    rw, ids = make_routing(19, 4, 2)
    ws = functional.get_workspace(19, 2, 16, 4, config=serval.Config(block_m=16))
    assert ws is functional.get_workspace(19, 2, 16, 4, config=serval.Config(block_m=16))
    ring = ws.ring("x", x)  # the macrobatch ring's buffer: made once, the same memory on every later call
    assert ring.shape == (ws.ring_rows, 16) and ring.dtype == x.dtype and ws.ring("x", x) is ring
    assert ws.ring("d_y", x) is not ring
    schedule = functional.build_schedule(ids, 4, block_m=16)
    assert schedule.capacity == ws.capacity_rows
    config = serval.Config(block_m=16, recompute=True)
    y, ctx = functional.forward(x, rw, schedule, wg, wu, wd, shared, config=config)
    assert ctx.gate_up is None
    ctx = functional.recompute_forward_context(ctx, x, wg, wu, shared, config=config)
    d_y = torch.randn_like(y)
    grads = functional.backward(d_y, ctx, x, rw, wg, wu, wd, shared, config=config)
    inputs = [t.requires_grad_() for t in (x, rw, wg, wu, wd, *shared)]
    expected = torch.autograd.grad(reference.moe(x, rw, ids, wg, wu, wd, shared), inputs, d_y)
    got = [grads.x, grads.router_weights, grads.w_gate, grads.w_up, grads.w_down, *grads.shared]
    for g, e in zip(got, expected):
        assert rel_err(g, e) < 1e-5


def test_bad_inputs_name_the_argument():
    x, (wg, wu, wd), shared = make_layer(8, 16, 8, 4, shared_inter=4)
    rw, ids = make_routing(8, 4, 2)

    def call(**override):
        args = dict(x=x, router_weights=rw, topk_ids=ids, w_gate=wg, w_up=wu, w_down=wd, shared=shared)
        kwargs = {k: override.pop(k) for k in ("config", "swiglu_limit") if k in override}
        args.update(override)
        return serval.moe(*args.values(), **kwargs)

    bad = [
        (dict(x=x[:, :15].contiguous()), "w_gate"),
        (dict(x=x.t()), "x"),
        (dict(x=x[None]), "x"),
        (dict(router_weights=rw.double()), "router_weights"),
        (dict(router_weights=rw[:5]), "router_weights"),
        (dict(topk_ids=ids.float()), "topk_ids"),
        (dict(topk_ids=ids[:, :1]), "topk_ids"),
        (dict(topk_ids=ids + 4), "topk_ids"),
        (dict(topk_ids=ids - 1 - ids), "topk_ids"),
        (dict(w_up=wu.double()), "w_up"),
        (dict(w_down=wd.transpose(1, 2).contiguous()), "w_down"),
        (dict(w_gate=wg[:1], w_up=wu[:1], w_down=wd[:1]), "top-k"),
        (dict(shared=shared[:2]), "shared"),
        (dict(shared=(shared[0], shared[1][:3], shared[2])), "ws_up"),
        (dict(swiglu_limit=-1.0), "swiglu_limit"),
        (dict(config="fast"), "config"),
    ]
    for override, name in bad:
        with pytest.raises((ValueError, TypeError), match=name):
            call(**override)
    with pytest.raises(ValueError, match="precision"):
        serval.Config(precision="fp4")
    with pytest.raises(ValueError, match="minibatch_size"):
        serval.Config(minibatch_size=100)
    with pytest.raises(ValueError, match="capacity_multiplier"):
        serval.Config(capacity_multiplier=0.5)
    for value in (-1, True, 2.0):  # the upper bound is the GPU's SM count, checked per call (test_pass_plan)
        for knob in ("comm_sms_forward", "comm_sms_backward"):
            with pytest.raises(ValueError, match=knob):
                serval.Config(**{knob: value})
    with pytest.raises(ValueError, match="bfloat16"):  # the FP8 precisions quantize bf16 inputs
        call(config=serval.Config(precision="mxfp8"))
    from serval.kernels import INTERPRET

    if not INTERPRET:  # the kernels take CPU tensors only under Triton's interpreter
        with pytest.raises(ValueError, match="backend='triton'"):
            call(config=serval.Config(backend="triton"))


def test_comm_sms_knobs_set_the_gemms_pull_programs():
    """Config.comm_sms_forward / comm_sms_backward / minibatch_size are the kernel plan's pull_programs /
    dgrad_pull_programs / minibatch_rows (None: the plan's own); the EP tests run them (tests/test_ep.py,
    bitwise equal to EP=1)."""
    from serval import functional, kernels

    if not (kernels.INTERPRET or torch.cuda.is_available()):
        pytest.skip("the kernels need a GPU or Triton's interpreter")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, (wg, _, _), _ = make_layer(13, 16, 8, 4, device=device, dtype=torch.bfloat16)
    for value, want in ((None, 0), (0, 0), (6, 6)):
        ops = functional.select_backend(serval.Config(backend="triton", comm_sms_forward=value), x, wg)
        assert ops.plan.pull_programs == want and ops.pulls_in_gemm == (want > 0) and not ops.pulls_in_dgrad
        ops = functional.select_backend(serval.Config(backend="triton", comm_sms_backward=value), x, wg)
        assert ops.plan.dgrad_pull_programs == want and ops.pulls_in_dgrad == (want > 0) and not ops.pulls_in_gemm
    for value in (None, 256):
        ops = functional.select_backend(serval.Config(backend="triton", minibatch_size=value), x, wg)
        assert ops.plan.minibatch_rows == value


def test_torch_compile_fullgraph():
    x, (wg, wu, wd), shared = make_layer(13, 16, 8, 4, shared_inter=8)
    rw, ids = make_routing(13, 4, 2)
    config = serval.Config(block_m=16)

    def step(x, rw, wg, wu, wd):
        return serval.moe(x, rw, ids, wg, wu, wd, shared, config=config).square().sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    inputs = [t.requires_grad_() for t in (x, rw, wg, wu, wd)]
    eager_loss = step(*inputs)
    eager_grads = torch.autograd.grad(eager_loss, inputs)
    loss = compiled(*inputs)
    grads = torch.autograd.grad(loss, inputs)
    assert torch.equal(loss, eager_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, eager_grads))


@pytest.mark.parametrize("what", ["function", "module"])
def test_torch_compile_before_any_eager_call(what):
    """A Config the process has not run yet, first used inside the compiled call: the ops' fake implementations
    read the Config table while the graph is traced, so a Config must be in it from its construction."""
    from serval import config as config_module

    torch.manual_seed(0)
    x, (wg, wu, wd), _ = make_layer(11, 16, 8, 4)
    rw, ids = make_routing(11, 4, 2)
    fields = dict(block_m=16, capacity_multiplier=3.0 + (what == "module") / 8)  # fresh in this process
    before = len(config_module._CONFIGS)
    config = serval.Config(**fields)
    assert config_module._CONFIGS[before:] == [config]  # registered when made
    if what == "function":
        def step(x):
            return serval.moe(x, rw, ids, wg, wu, wd, config=config)
    else:
        step = serval.MoE(16, 8, 4, 2, config=config)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(x)
    assert torch.equal(compiled, step(x))


def test_torch_compile_without_a_config_in_a_fresh_process():
    """serval.moe with no config, compiled as the process's first call of the layer (the default Config must be
    in the table before the trace: the fake implementations read it)."""
    import subprocess
    import sys

    script = """
import torch, serval
x = torch.randn(9, 16)
rw = torch.rand(9, 2)
ids = torch.rand(9, 4).argsort(1)[:, :2]
w = [torch.randn(4, 8, 16), torch.randn(4, 8, 16), torch.randn(4, 16, 8)]
step = lambda x: serval.moe(x, rw, ids, *w)
assert torch.equal(torch.compile(step, fullgraph=True, backend="aot_eager")(x), step(x))
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


def test_custom_ops_carry_the_whole_config(monkeypatch):
    """Every Config field reaches functional.forward/backward inside the custom ops, eager and compiled."""
    from serval import functional

    seen = []

    def spy(real):
        def wrapper(*args, config, **kwargs):
            seen.append((real.__name__, config))
            return real(*args, config=config, **kwargs)
        return wrapper

    monkeypatch.setattr(functional, "forward", spy(functional.forward))
    monkeypatch.setattr(functional, "backward", spy(functional.backward))
    x, (wg, wu, wd), shared = make_layer(13, 16, 8, 4, shared_inter=8)
    rw, ids = make_routing(13, 4, 2)
    config = serval.Config(block_m=16, backend="torch", comm_sms_forward=7, comm_sms_backward=9, minibatch_size=32,
                           macrobatch_size=5, capacity_multiplier=3.5)

    def step(x, rw):
        return serval.moe(x, rw, ids, wg, wu, wd, shared, config=config).sum()

    for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
        seen.clear()
        inputs = [t.detach().clone().requires_grad_() for t in (x, rw)]
        torch.autograd.grad(fn(*inputs), inputs)
        assert [name for name, _ in seen] == ["forward", "backward"]
        assert all(c == config for _, c in seen), seen


@requires_cuda
def test_no_host_sync_and_cuda_graph():
    step = cuda_layer_step()
    eager = step()  # warm-up: kernels compiled, allocator primed
    check_sync_free_and_graph_replay(step, eager)


@pytest.mark.parametrize("backend, precision", [("torch", "bf16"), ("triton", "bf16"), ("torch", "mxfp8"),
                                                ("torch", "fp8_blockwise")])
def test_frozen_weights_skip_their_gradients(backend, precision):
    """Weights that need no gradient (frozen experts, a frozen shared expert) get none, their weight-gradient
    GEMMs do not run, and every other gradient keeps its bits; also through torch.compile (the fake
    implementation's shapes)."""
    dtype = torch.float32 if precision == "bf16" and backend == "torch" else torch.bfloat16
    device = "cuda" if CUDA and backend == "triton" else "cpu"  # the kernels: on the GPU, else interpreted
    x, weights, shared = make_layer(24, 32, 128, 4, shared_inter=16, dtype=dtype, device=device)
    rw, ids = make_routing(24, 4, 2, device=device)
    block_m = 16 if precision == "bf16" and device == "cpu" else 128
    config = serval.Config(backend=backend, precision=precision, block_m=block_m)

    def grads(routed_frozen, shared_frozen, compiled=False):
        leaves = [t.detach().clone().requires_grad_() for t in (x, rw)]
        w = [t.detach().clone().requires_grad_(not routed_frozen) for t in weights]
        s = [t.detach().clone().requires_grad_(not shared_frozen) for t in shared]
        step = lambda x, rw: serval.moe(x, rw, ids, *w, tuple(s), config=config)  # noqa: E731
        if compiled:
            step = torch.compile(step, fullgraph=True, backend="aot_eager")
        step(*leaves).float().square().sum().backward()
        return [t.grad for t in (*leaves, *w, *s)]

    full = grads(False, False)
    for routed_frozen, shared_frozen in [(True, False), (False, True), (True, True)]:
        got = grads(routed_frozen, shared_frozen)
        for i, (g, f) in enumerate(zip(got, full)):
            frozen = (2 <= i < 5 and routed_frozen) or (i >= 5 and shared_frozen)
            assert (g is None) if frozen else torch.equal(g, f), (routed_frozen, shared_frozen, i)
    if backend == "torch" and precision == "bf16":
        got = grads(True, False, compiled=True)
        assert got[2:5] == [None] * 3 and torch.equal(got[0], full[0]) and torch.equal(got[5], full[5])
