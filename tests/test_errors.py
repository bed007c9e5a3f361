"""Bad input: a clear Python error naming the argument the caller passed and what was expected, with
nothing lost (inputs unchanged, the process and the device usable). Expert ids out of range on the
no-sync path: NaN that step, a ValueError in a later call."""

import pytest
import torch

import serval
from conftest import make_layer, make_routing, requires_cuda
from serval import api, functional

N, H, I, E, K, IS = 8, 16, 8, 4, 2, 4


def layer_inputs(dtype=torch.float32, device="cpu"):
    x, (wg, wu, wd), shared = make_layer(N, H, I, E, shared_inter=IS, dtype=dtype, device=device)
    rw, ids = make_routing(N, E, K, device=device, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    return dict(x=x, router_weights=rw, topk_ids=ids, w_gate=wg, w_up=wu, w_down=wd, shared=shared)


def call(inputs, **kwargs):
    args = dict(inputs)
    return serval.moe(*args.values(), **kwargs)


def bad_cases(inputs):
    x, rw, ids = inputs["x"], inputs["router_weights"], inputs["topk_ids"]
    wg, wu, wd, shared = inputs["w_gate"], inputs["w_up"], inputs["w_down"], inputs["shared"]
    return [
        # (override, error type, the message must match)
        (dict(x="x"), TypeError, r"^x must be a torch.Tensor"),
        (dict(x=x[None]), ValueError, r"^x must be 2-D \[N, H\]"),
        (dict(x=x.half()), TypeError, r"^x must have dtype"),
        (dict(x=x[:0]), ValueError, r"^x must hold at least one token"),
        (dict(x=x[:, :0]), ValueError, r"^x must have a hidden size H >= 1"),
        (dict(x=x[:, :15].contiguous()), ValueError,
         r"^x must have the experts' hidden size H = 16 \(w_gate.shape\[2\]\)"),
        (dict(router_weights=rw.double()), TypeError, r"^router_weights must have dtype float32"),
        (dict(router_weights=rw[:5]), ValueError, r"^router_weights must have one row per token of x"),
        (dict(router_weights=torch.cat([rw, rw[:, :1]], 1)), ValueError,
         r"^router_weights and topk_ids must have the same shape \[N, k\], got router_weights \(8, 3\) and "
         r"topk_ids \(8, 2\)"),
        (dict(topk_ids=ids.float()), TypeError, r"^topk_ids must have dtype int32 or int64"),
        (dict(topk_ids=ids[:7]), ValueError, r"^topk_ids must have one row per token of x"),
        (dict(topk_ids=ids[:, :1].contiguous()), ValueError, r"^router_weights and topk_ids must have the same shape"),
        (dict(topk_ids=ids + E), ValueError, r"topk_ids must hold expert ids in \[0, 4\)"),
        (dict(topk_ids=ids - 1 - ids), ValueError, r"topk_ids must hold expert ids in \[0, 4\)"),
        (dict(w_gate=wg[:0], w_up=wu[:0], w_down=wd[:0]), ValueError, r"^w_gate must hold at least one expert"),
        (dict(w_gate=wg[:, :0], w_up=wu[:, :0], w_down=wd[:, :, :0]), ValueError,
         r"^w_gate must have an intermediate size I >= 1"),
        (dict(w_gate=wg.double()), TypeError, r"^w_gate must have dtype float32 \(the dtype of x\)"),
        (dict(w_up=wu.double()), TypeError, r"^w_up must have dtype float32 \(the dtype of x\)"),
        (dict(w_up=wu[:, :7].contiguous()), ValueError, r"^w_up must have shape \(4, 8, 16\) \(the shape of w_gate"),
        (dict(w_down=wd.transpose(1, 2).contiguous()), ValueError, r"^w_down must have shape \(4, 16, 8\)"),
        (dict(w_gate=wg[:1], w_up=wu[:1], w_down=wd[:1]), ValueError,
         r"^top-k \(topk_ids.shape\[1\] = 2\) must be in \[1, E = 1\]"),
        (dict(shared=shared[:2]), TypeError, r"^shared must be None or a tuple of 3 tensors"),
        (dict(shared=(shared[0][:, :15].contiguous(), shared[1], shared[2])), ValueError,
         r"^shared\[0\] \(ws_gate\) must have shape \(4, 16\)"),
        (dict(shared=(shared[0], shared[1][:3], shared[2])), ValueError, r"^shared\[1\] \(ws_up\) must have shape"),
        (dict(shared=(shared[0], shared[1], shared[2].t().contiguous())), ValueError,
         r"^shared\[2\] \(ws_down\) must have shape \(16, 4\)"),
        (dict(shared=(shared[0][:0], shared[1][:0], shared[2][:, :0])), ValueError,
         r"^shared\[0\] \(ws_gate\) must have an intermediate size Is >= 1"),
        (dict(shared=(shared[0].double(), shared[1], shared[2])), TypeError,
         r"^shared\[0\] \(ws_gate\) must have dtype"),
    ]


def test_every_bad_argument_is_named():
    inputs = layer_inputs()
    before = {k: (v.clone() if isinstance(v, torch.Tensor) else tuple(t.clone() for t in v)) for k, v in inputs.items()}
    for override, error, pattern in bad_cases(inputs):
        with pytest.raises(error, match=pattern):
            call({**inputs, **override}, config=serval.Config(block_m=16))
    for k, v in inputs.items():  # nothing was changed
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, before[k]), k
        else:
            assert all(torch.equal(a, b) for a, b in zip(v, before[k])), k
    call(inputs)  # and the layer still runs


def test_strided_inputs_and_narrow_ids_are_taken():
    """Views with any strides (transposes, slices of a joined weight, an expanded router weight) give the bits of
    their contiguous copies, gradients included, and so do expert ids in int8 / uint8 / int16."""
    inputs = layer_inputs()
    leaves = {k: v.detach().clone().requires_grad_() for k, v in inputs.items()
              if k in ("x", "router_weights", "w_gate", "w_down")}
    joined = torch.cat([inputs["w_gate"], inputs["w_up"]], 1).detach().requires_grad_()  # [E, 2I, H]
    x_t = leaves["x"].detach().t().clone().requires_grad_()  # [H, N]: x is its transpose
    w_down_t = leaves["w_down"].detach().transpose(1, 2).clone().requires_grad_()  # [E, I, H]
    strided = dict(inputs, x=x_t.t(), w_gate=joined[:, :I], w_up=joined[:, I:], w_down=w_down_t.transpose(1, 2),
                   router_weights=leaves["router_weights"].detach()[:1].expand(N, K),
                   topk_ids=inputs["topk_ids"].t().contiguous().t())
    dense = dict(inputs, x=leaves["x"], w_gate=leaves["w_gate"], w_down=leaves["w_down"],
                 router_weights=leaves["router_weights"].detach()[:1].expand(N, K).contiguous())
    config = serval.Config(block_m=16)
    y_strided, y_dense = call(strided, config=config), call(dense, config=config)
    assert torch.equal(y_strided, y_dense)
    d_y = torch.randn_like(y_dense)
    y_strided.backward(d_y)
    y_dense.backward(d_y)
    assert torch.equal(x_t.grad.t(), leaves["x"].grad)
    assert torch.equal(joined.grad[:, :I], leaves["w_gate"].grad)
    assert torch.equal(w_down_t.grad.transpose(1, 2), leaves["w_down"].grad)
    for dtype in (torch.int8, torch.uint8, torch.int16):
        assert torch.equal(call(dict(inputs, topk_ids=inputs["topk_ids"].to(dtype)), config=config),
                           call(inputs, config=config)), dtype


def test_triton_backend_names_an_unsupported_dtype():
    with pytest.raises(ValueError, match=r"Config\(backend='triton'\) runs bf16 or fp32 tensors, got float64"):
        call(layer_inputs(dtype=torch.float64), config=serval.Config(backend="triton", block_m=16))


def test_lower_layer_checks_its_schedule():
    """serval.functional: build_schedule's arguments (ids out of range on CPU, bool ids, block_m), a schedule built
    for other inputs, and a shared expert passed to backward but not to forward (or the reverse)."""
    inputs = layer_inputs()
    x, rw, ids, wg, wu, wd, shared = inputs.values()
    for bad, error, pattern in ((ids - 1, ValueError, r"in \[0, 4\)"), (ids + E, ValueError, r"in \[0, 4\)"),
                                (ids > 0, TypeError, "integer expert ids"), (ids[0], ValueError, "2-D")):
        with pytest.raises(error, match=pattern):
            functional.build_schedule(bad, E, block_m=16)
    for block_m in (0, True, 2.0):
        with pytest.raises(ValueError, match="block_m must be a positive int"):
            functional.build_schedule(ids, E, block_m=block_m)
    config = serval.Config(block_m=16)
    for schedule, pattern in ((functional.build_schedule(ids[:, :1], E, 16), "top_k = 1"),
                              (functional.build_schedule(ids[:-1], E, 16), "num_tokens"),
                              (functional.build_schedule(ids, E + 1, 16), "num_experts")):
        with pytest.raises(ValueError, match=f"schedule was built for {pattern}"):
            functional.forward(x, rw, schedule, wg, wu, wd, shared, config=config)
    schedule = functional.build_schedule(ids, E, 16)
    y, ctx = functional.forward(x, rw, schedule, wg, wu, wd, shared, config=config)
    with pytest.raises(ValueError, match="shared: the forward had one"):
        functional.backward(torch.ones_like(y), ctx, x, rw, wg, wu, wd, None, config=config)
    y, ctx = functional.forward(x, rw, schedule, wg, wu, wd, None, config=config)
    with pytest.raises(ValueError, match="shared: the forward had none"):
        functional.backward(torch.ones_like(y), ctx, x, rw, wg, wu, wd, shared, config=config)


def test_double_backward_is_a_clear_error():
    inputs = layer_inputs()
    x = inputs["x"].detach().requires_grad_()
    y = call(dict(inputs, x=x))
    (d_x,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)  # first order with a graph: fine
    with pytest.raises(NotImplementedError, match="first derivatives only"):
        d_x.sum().backward()


@pytest.mark.parametrize("limit", [-1.0, 0, float("inf"), float("nan"), True, "1"])
def test_bad_swiglu_limit(limit):
    with pytest.raises(ValueError, match="^swiglu_limit must be None or a positive finite float"):
        call(layer_inputs(), swiglu_limit=limit)


def test_bad_config():
    with pytest.raises(TypeError, match="^config must be a serval.Config"):
        call(layer_inputs(), config="fast")
    with pytest.raises(TypeError, match="Config.recompute must be a bool"):
        serval.Config(recompute="yes")
    with pytest.raises(ValueError, match="Config.capacity_multiplier must be a finite number >= 1.0"):
        serval.Config(capacity_multiplier=float("inf"))
    with pytest.raises(ValueError, match="Config.block_m"):
        serval.Config(block_m=True)
    for timeout in (0, -1.0, float("inf"), float("nan"), True, "5"):
        with pytest.raises(ValueError, match="Config.peer_timeout_s must be a finite number of seconds"):
            serval.Config(peer_timeout_s=timeout)


@pytest.mark.parametrize("precision", ["mxfp8", "fp8_blockwise"])
def test_fp8_precision_errors_name_what_to_change(precision):
    """A block_m the recipe cannot take, at every entry point (the Config itself; a schedule of that block_m in
    the lower layer); sizes the recipe cannot take, at serval.MoE's construction; a forward context of another
    precision."""
    message = "Config.block_m must be a multiple of"
    with pytest.raises(ValueError, match=message):
        serval.Config(precision=precision, block_m=16)
    inputs = layer_inputs(dtype=torch.bfloat16)
    x, rw, ids, wg, wu, wd, shared = inputs.values()
    schedule = functional.build_schedule(ids, E, block_m=16)
    with pytest.raises(ValueError, match=message):
        functional.forward(x, rw, schedule, wg, wu, wd, shared, config=serval.Config(precision=precision))
    if precision == "fp8_blockwise":
        with pytest.raises(ValueError, match="multiple of 128"):
            serval.MoE(H, 96, E, K, config=serval.Config(precision=precision))
    y, ctx = functional.forward(x, rw, schedule, wg, wu, wd, shared, config=serval.Config(block_m=16))
    with pytest.raises(ValueError, match=f"forward context was made in bf16, not {precision}"):
        functional.backward(torch.ones_like(y), ctx, x, rw, wg, wu, wd, shared,
                            config=serval.Config(precision=precision, block_m=128))


# ---------------------------------------------------------------- serval.MoE


def test_module_float64_runs():
    torch.manual_seed(0)
    block = serval.MoE(H, I, E, K, shared_intermediate_size=IS, dtype=torch.float64,
                       config=serval.Config(block_m=16))
    x = torch.randn(3, 5, H, dtype=torch.float64, requires_grad=True)
    y = block(x)
    assert y.dtype == torch.float64 and y.shape == x.shape
    rw, ids = block.route(x.reshape(-1, H))
    assert rw.dtype == torch.float64
    shared = (block.shared["gate"].weight, block.shared["up"].weight, block.shared["down"].weight)
    y_ref = serval.reference.moe(x.reshape(-1, H), rw, ids, block.w_gate, block.w_up, block.w_down, shared)
    torch.testing.assert_close(y.reshape(-1, H), y_ref, rtol=1e-12, atol=1e-12)
    y.sum().backward()
    assert torch.isfinite(x.grad).all()


def test_module_checks_x():
    block = serval.MoE(8, 8, 4, 2)
    with pytest.raises(ValueError, match=r"^x must have last dimension hidden_size = 8, got shape \(3, 16\)"):
        block(torch.randn(3, 16))  # would otherwise be read as 6 tokens
    with pytest.raises(TypeError, match=r"^x must have the dtype of the module's parameters \(torch.float32\)"):
        block(torch.randn(3, 8, dtype=torch.float64))
    with pytest.raises(TypeError, match="^x must be a torch.Tensor"):
        block([[0.0] * 8])
    with pytest.raises(ValueError, match="^x must have last dimension"):
        block(torch.tensor(1.0))
    assert block(torch.randn(2, 3, 8)).shape == (2, 3, 8)


@pytest.mark.parametrize("kwargs, name", [
    (dict(hidden_size=0), "hidden_size"), (dict(intermediate_size=-1), "intermediate_size"),
    (dict(num_experts=0), "num_experts"), (dict(top_k=0), "top_k"), (dict(top_k=5), "top_k"),
    (dict(shared_intermediate_size=-2), "shared_intermediate_size"), (dict(swiglu_limit=0.0), "swiglu_limit"),
    (dict(dtype=torch.float16), "dtype"), (dict(config="fast"), "config"), (dict(scoring="relu"), "scoring"),
])
def test_module_arguments_are_named(kwargs, name):
    args = dict(hidden_size=8, intermediate_size=8, num_experts=4, top_k=2) | kwargs
    with pytest.raises((TypeError, ValueError), match=f"^{name}"):
        serval.MoE(**args)


# ---------------------------------------------------------------- expert ids without a host sync


def test_error_flags_count_and_report_once():
    flags = functional.ErrorFlags("cpu")
    kind = functional.ErrorFlags.EXPERT_IDS
    assert not flags.pending(kind)
    flags.record(kind, torch.tensor(False))
    assert not flags.pending(kind)
    flags.record(kind, torch.tensor(True))
    flags.record(kind, torch.tensor(True))
    assert flags.pending(kind)  # two bad steps, reported once
    assert not flags.pending(kind)
    flags.record(kind, torch.tensor(True))
    assert flags.pending(kind)


def deferred_step(inputs, bad_ids):
    leaves = {k: v.detach().clone().requires_grad_() for k, v in inputs.items() if k not in ("topk_ids", "shared")}
    shared = tuple(w.detach().clone().requires_grad_() for w in inputs["shared"])
    y = serval.moe(leaves["x"], leaves["router_weights"], bad_ids, leaves["w_gate"], leaves["w_up"],
                   leaves["w_down"], shared, config=serval.Config(block_m=16))
    grads = torch.autograd.grad(y, [*leaves.values(), *shared], torch.ones_like(y))
    return y, dict(zip([*leaves, "ws_gate", "ws_up", "ws_down"], grads))


@pytest.mark.parametrize("bad", [E, -1])
def test_expert_ids_out_of_range_without_host_check(monkeypatch, bad):
    """The CUDA path's logic, run on the CPU: ids clamped (nothing out of bounds), y and the gradients
    through the routed experts NaN, the next call raises, the one after runs normally."""
    monkeypatch.setattr(api, "_checks_on_host", lambda device, debug: debug)
    monkeypatch.setattr(api, "_ERROR_FLAGS", {})
    inputs = layer_inputs()
    good_ids = inputs["topk_ids"]
    bad_ids = good_ids.clone()
    bad_ids[5, 1] = bad
    before = bad_ids.clone()
    y, grads = deferred_step(inputs, bad_ids)
    assert torch.equal(bad_ids, before)  # the caller's ids are not changed
    assert torch.isnan(y).all()
    for name in ("x", "w_gate", "w_up", "w_down"):
        assert torch.isnan(grads[name]).any(), name
    with pytest.raises(ValueError, match=r"topk_ids must hold expert ids in \[0, E\) .* in an earlier step"):
        call(inputs)
    y_good, _ = deferred_step(inputs, good_ids)
    torch.testing.assert_close(y_good, call(inputs, config=serval.Config(block_m=16)))


def test_expert_ids_debug_raises_at_once(monkeypatch):
    monkeypatch.setattr(api, "_checks_on_host", lambda device, debug: debug)
    inputs = layer_inputs()
    with pytest.raises(ValueError, match=r"^serval.moe: topk_ids must hold expert ids in \[0, 4\), got 16 id\(s\) "
                                         r"outside it: 4, 5, 6, 7$"):
        call({**inputs, "topk_ids": inputs["topk_ids"] + E}, config=serval.Config(debug=True))


def test_expert_ids_error_names_the_bad_values():
    """The CPU check names the ids outside [0, E): the first few, then the range."""
    inputs = layer_inputs()
    ids = 100 + torch.arange(inputs["topk_ids"].numel()).view_as(inputs["topk_ids"])
    assert ids.numel() > 8
    with pytest.raises(ValueError, match=rf"got {ids.numel()} id\(s\) outside it: 100, 101, 102, 103, 104, 105, 106, "
                                         rf"107, \.\.\. \(from 100 to {99 + ids.numel()}\)$"):
        call({**inputs, "topk_ids": ids})


@requires_cuda
def test_expert_ids_out_of_range_on_cuda():
    """No device-side assert: that step is NaN, the next call raises, the CUDA context stays usable; with
    Config(debug=True) the call itself raises."""
    inputs = layer_inputs(torch.bfloat16, "cuda")
    bad_ids = inputs["topk_ids"].clone()
    bad_ids[5, 1] = E + 3
    y, grads = deferred_step(inputs, bad_ids)
    torch.cuda.synchronize()
    assert torch.isnan(y.float()).all()
    assert torch.isnan(grads["x"].float()).all() and torch.isnan(grads["w_down"].float()).all()
    with pytest.raises(ValueError, match="in an earlier step"):
        call(inputs)
    y_good, _ = deferred_step(inputs, inputs["topk_ids"])
    torch.cuda.synchronize()
    assert torch.isfinite(y_good.float()).all()
    with pytest.raises(ValueError, match=r"topk_ids must hold expert ids in \[0, 4\)"):
        call({**inputs, "topk_ids": bad_ids}, config=serval.Config(debug=True))
    torch.cuda.synchronize()  # the context is still good
