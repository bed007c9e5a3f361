"""serval.kernels.cooperative (Gluon cooperative 128 x 256 tiles: gate/up + SwiGLU with x's rows gathered by its
loader, and the plain-store GEMMs down and gate/up dgrad) against serval.kernels.grouped_gemm's Triton kernel, on
the H200: outputs bit for bit over the rows that hold a (token, slot), run to run (outputs NaN-poisoned, conftest),
and the layer routed to it.

Gluon has no CPU interpreter: these tests skip wherever the kernel is not available (no sm_90 GPU, another
Triton release). The Triton kernel they compare with is itself checked against the torch stages and the fp64
reference (test_kernels_gemm.py), on CPU and GPU.
"""
import pytest
import torch
from conftest import GLUON_CASES, cuda_topk

from serval.kernels import cooperative, grouped_gemm, warp_specialized
from serval.kernels.rows import gather
from serval.schedule import build_schedule

pytestmark = pytest.mark.skipif(not warp_specialized.available(),
                                reason="needs an sm_90 GPU and a Triton release the Gluon kernel was written for")


def case(num_tokens, top_k, num_experts, hidden, inter, skew=False, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    topk = cuda_topk(num_tokens, top_k, num_experts, skew, g)
    randn = lambda *s, scale=1.0: (torch.randn(*s, generator=g, device="cuda") * scale).to(torch.bfloat16)
    return (randn(num_tokens, hidden), randn(num_experts, inter, hidden, scale=hidden**-0.5),
            randn(num_experts, inter, hidden, scale=hidden**-0.5), build_schedule(topk, num_experts, 128))


@pytest.mark.parametrize("gather_in_loader", [True, False])
@pytest.mark.parametrize("limit", [None, 0.75])
@pytest.mark.parametrize("name", GLUON_CASES)
def test_gate_up_swiglu_bitwise(name, limit, gather_in_loader):
    x, w_gate, w_up, schedule = case(**GLUON_CASES[name])
    used = schedule.row_source >= 0
    x_rows = gather(x, schedule)
    a = x if gather_in_loader else x_rows
    got = cooperative.gate_up_swiglu(a, w_gate, w_up, schedule, limit, gather=gather_in_loader)
    again = cooperative.gate_up_swiglu(a, w_gate, w_up, schedule, limit, gather=gather_in_loader)
    ref = grouped_gemm.gate_up_swiglu(x, w_gate, w_up, schedule, limit, a_rows=x_rows)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[0], again[0])  # gate_up: packed, every row used
    assert torch.equal(got[1][used], ref[1][used]) and torch.equal(got[1][used], again[1][used])


def test_gate_up_swiglu_routes_by_hidden(monkeypatch):
    """grouped_gemm.gate_up_swiglu takes the cooperative kernel when it gathers x itself and H is at most
    COOPERATIVE_GATHER_MAX_HIDDEN; with rows given, or above it, the Triton kernel."""
    x, w_gate, w_up, schedule = case(**GLUON_CASES["several tiles"])
    calls = []
    kernel = cooperative.gate_up_swiglu
    monkeypatch.setattr(cooperative, "gate_up_swiglu", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    grouped_gemm.gate_up_swiglu(x, w_gate, w_up, schedule, None)
    assert calls == [1]
    grouped_gemm.gate_up_swiglu(x, w_gate, w_up, schedule, None, a_rows=gather(x, schedule))
    monkeypatch.setattr(grouped_gemm, "COOPERATIVE_GATHER_MAX_HIDDEN", x.shape[1] - 1)
    grouped_gemm.gate_up_swiglu(x, w_gate, w_up, schedule, None)
    assert calls == [1]


@pytest.mark.parametrize("stage", ["down", "gate_up_dgrad"])
@pytest.mark.parametrize("name", GLUON_CASES)
def test_store_gemms_bitwise(name, stage):
    """down (weights [E, N, K]) and the gate/up dgrad (weights [E, K, N], K over both): the Triton kernel's
    output bit for bit; where K is not a whole number of K-tiles in the [E, K, N] layout, `takes` refuses and
    grouped_gemm runs the Triton kernel."""
    x, w_gate, w_up, schedule = case(**GLUON_CASES[name])
    inter, hidden = w_gate.shape[1:]
    used = schedule.row_source >= 0
    g = torch.Generator(device="cuda").manual_seed(1)
    if stage == "down":
        args = (torch.randn(schedule.capacity, inter, generator=g, device="cuda").to(torch.bfloat16),
                w_gate.transpose(1, 2).contiguous())
        taken = cooperative.takes(schedule, *args)
    else:
        args = (torch.randn(schedule.capacity, 2 * inter, generator=g, device="cuda").to(torch.bfloat16), w_gate, w_up)
        taken = cooperative.takes(schedule, *args, k=inter)
    assert taken == (stage == "down" or inter % 64 == 0)
    ref = getattr(grouped_gemm, stage)(*args, schedule, config=grouped_gemm.default_config(stage))
    routed = getattr(grouped_gemm, stage)(*args, schedule)
    assert torch.equal(routed[used], ref[used])
    if taken:
        got = getattr(cooperative, stage)(*args, schedule)
        again = getattr(cooperative, stage)(*args, schedule)
        assert torch.equal(got[used], ref[used]) and torch.equal(got[used], again[used])


def test_layer_routes_to_it(monkeypatch):
    """serval.moe runs its forward gate/up, down and gate/up dgrad on this kernel where grouped_gemm's switches
    say so: y and every gradient as with the Triton kernel alone, bit for bit; no host sync; a CUDA-graph replay
    equal to the eager step."""
    from conftest import check_sync_free_and_graph_replay, cuda_layer_step

    step = cuda_layer_step()
    monkeypatch.setattr(grouped_gemm, "COOPERATIVE_GATHER_MAX_HIDDEN", 0)
    monkeypatch.setattr(grouped_gemm, "COOPERATIVE_STORE", dict.fromkeys(grouped_gemm.COOPERATIVE_STORE, False))
    triton_only = step()
    monkeypatch.setattr(grouped_gemm, "COOPERATIVE_GATHER_MAX_HIDDEN", 1 << 20)
    monkeypatch.setattr(grouped_gemm, "COOPERATIVE_STORE", dict.fromkeys(grouped_gemm.COOPERATIVE_STORE, True))
    calls = []
    for stage in ("gate_up_swiglu", "down", "gate_up_dgrad"):
        kernel = getattr(cooperative, stage)
        monkeypatch.setattr(cooperative, stage,
                            lambda *a, _stage=stage, _kernel=kernel, **kw: calls.append(_stage) or _kernel(*a, **kw))
    eager = step()
    assert sorted(set(calls)) == ["down", "gate_up_dgrad", "gate_up_swiglu"], calls
    for i, (a, b) in enumerate(zip(eager, triton_only)):
        assert torch.equal(a, b), i
    check_sync_free_and_graph_replay(step, eager)
