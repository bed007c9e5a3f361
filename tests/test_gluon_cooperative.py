"""The cooperative engine (serval.kernels.gluon_cooperative: gate/up + SwiGLU with x's rows gathered by its loader,
and the plain-store GEMMs down and gate/up dgrad) against the Triton GEMM, on the H200: outputs bit for bit over
the rows that hold a (token, slot), run to run (outputs NaN-poisoned, conftest), and the layer on it.

Gluon has no CPU interpreter: these tests skip wherever the engine is not available (no sm_90 GPU, another
Triton release; tests/test_gluon_compile.py compiles it for sm_90 without a GPU). The Triton GEMM they compare
with is itself checked against the torch stages and the fp64 reference (test_kernels_gemm.py).
"""
import dataclasses

import pytest
import torch
from conftest import GLUON_CASES, cuda_topk

import serval
from serval.kernels import common, gemm_stages, gluon_common, gluon_cooperative, triton_gemm
from serval.kernels.rows import gather
from serval.plan import KernelPlan, choose_plan
from serval.schedule import build_schedule

pytestmark = pytest.mark.skipif(not gluon_common.available(),
                                reason="needs an sm_90 GPU and a Triton release the Gluon engines were written for")

TRITON = KernelPlan()  # every stage on the Triton GEMM, Hopper tiles


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
    config = TRITON.cooperative_gather if gather_in_loader else TRITON.cooperative_store
    got = gluon_cooperative.gate_up_swiglu(a, w_gate, w_up, schedule, limit, config, gather=gather_in_loader)
    again = gluon_cooperative.gate_up_swiglu(a, w_gate, w_up, schedule, limit, config, gather=gather_in_loader)
    ref = triton_gemm.gate_up_swiglu(x_rows, w_gate, w_up, schedule, limit, TRITON.gate_up_tiles, True)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[0], again[0])  # gate_up: packed, every row used
    assert torch.equal(got[1][used], ref[1][used]) and torch.equal(got[1][used], again[1][used])


def test_gate_up_swiglu_follows_the_plan():
    """gemm_stages.gate_up_swiglu runs the cooperative engine when the plan names it and the stage gathers x
    itself; with rows given (EP), the Triton GEMM; every way the same bits."""
    x, w_gate, w_up, schedule = case(**GLUON_CASES["several tiles"])
    used = schedule.row_source >= 0
    plan = choose_plan(x.shape[1], x.dtype, common.target())
    assert plan.gate_up_engine == "cooperative"  # H <= 4096
    results = [gemm_stages.gate_up_swiglu(x, w_gate, w_up, schedule, None, plan=plan),
               gemm_stages.gate_up_swiglu(x, w_gate, w_up, schedule, None, plan=plan, a_rows=gather(x, schedule)),
               gemm_stages.gate_up_swiglu(x, w_gate, w_up, schedule, None, plan=TRITON)]
    for gate_up, h in results[1:]:
        assert torch.equal(gate_up, results[0][0]) and torch.equal(h[used], results[0][1][used])
    assert choose_plan(8192, x.dtype, common.target()).gate_up_engine == "triton"


@pytest.mark.parametrize("stage", ["down", "gate_up_dgrad"])
@pytest.mark.parametrize("name", GLUON_CASES)
def test_store_gemms_bitwise(name, stage):
    """down (weights [E, N, K]) and the gate/up dgrad (weights [E, K, N], K over both): the Triton GEMM's
    output bit for bit; where K is not a whole number of K-tiles in the [E, K, N] layout, `takes` refuses and
    the stage runs the Triton GEMM."""
    x, w_gate, w_up, schedule = case(**GLUON_CASES[name])
    inter, hidden = w_gate.shape[1:]
    used = schedule.row_source >= 0
    g = torch.Generator(device="cuda").manual_seed(1)
    if stage == "down":
        args = (torch.randn(schedule.capacity, inter, generator=g, device="cuda").to(torch.bfloat16),
                w_gate.transpose(1, 2).contiguous())
        taken = gluon_common.takes(schedule, *args)
    else:
        args = (torch.randn(schedule.capacity, 2 * inter, generator=g, device="cuda").to(torch.bfloat16), w_gate, w_up)
        taken = gluon_common.takes(schedule, *args, k=inter)
    assert taken == (stage == "down" or inter % 64 == 0)
    stage_fn = getattr(gemm_stages, stage)
    ref = stage_fn(*args, schedule, plan=TRITON)
    routed = stage_fn(*args, schedule, plan=dataclasses.replace(TRITON, **{f"{stage}_engine": "cooperative"}))
    assert torch.equal(routed[used], ref[used])
    if taken:
        got = getattr(gluon_cooperative, stage)(*args, schedule, TRITON.cooperative_store)
        again = getattr(gluon_cooperative, stage)(*args, schedule, TRITON.cooperative_store)
        assert torch.equal(got[used], ref[used]) and torch.equal(got[used], again[used])


def test_layer_on_it():
    """serval.moe with the chosen plan (gate/up, down and gate/up dgrad on this engine) gives y and every
    gradient of the Triton-only plan bit for bit; no host sync; a CUDA-graph replay equal to the eager step."""
    from conftest import check_sync_free_and_graph_replay, cuda_layer_step

    step = cuda_layer_step()
    plan = choose_plan(256, torch.bfloat16, common.target())
    assert (plan.gate_up_engine, plan.down_engine, plan.gate_up_dgrad_engine) == ("cooperative",) * 3
    pingpong_off = dataclasses.replace(plan, down_dgrad_engine="triton")
    triton_only = step(serval.Config(kernel_plan=TRITON))
    eager = step(serval.Config(kernel_plan=pingpong_off))
    for i, (a, b) in enumerate(zip(eager, triton_only)):
        assert torch.equal(a, b), i
    check_sync_free_and_graph_replay(step, step())
