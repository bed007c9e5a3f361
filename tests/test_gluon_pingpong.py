"""The ping-pong engine (serval.kernels.gluon_pingpong: the down dgrad + SwiGLU backward) against the Triton GEMM,
on the H200: bit for bit over the rows that hold a (token, slot), the router-weight gradient included (both
engines sum it in `swiglu.d_rw_group_sums`' order), and run to run (outputs NaN-poisoned, conftest).

Gluon has no CPU interpreter: these tests skip wherever the engine is not available (no sm_90 GPU, another
Triton release; tests/test_gluon_compile.py compiles it for sm_90 without a GPU). The Triton GEMM they compare
with is itself checked against the torch stages and the fp64 reference (test_kernels_gemm.py).
"""
import dataclasses

import pytest
import torch
from conftest import GLUON_CASES, cuda_topk

import serval
from serval.kernels import common, gemm_stages, gluon_common
from serval.plan import KernelPlan, choose_plan
from serval.schedule import build_schedule

pytestmark = pytest.mark.skipif(not gluon_common.available(),
                                reason="needs an sm_90 GPU and a Triton release the Gluon engines were written for")

TRITON = KernelPlan()
PINGPONG = dataclasses.replace(TRITON, down_dgrad_engine="pingpong")


def case(num_tokens, top_k, num_experts, hidden, inter, skew=False, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    topk = cuda_topk(num_tokens, top_k, num_experts, skew, g)
    schedule = build_schedule(topk, num_experts, 128)
    randn = lambda *s, scale=1.0: (torch.randn(*s, generator=g, device="cuda") * scale).to(torch.bfloat16)
    return dict(schedule=schedule, d_y_rows=randn(schedule.capacity, hidden),
                w_down=randn(num_experts, hidden, inter, scale=inter**-0.5),
                gate_up=randn(schedule.num_packed, 2 * inter),
                router_weights=torch.rand(num_tokens * top_k, generator=g, device="cuda"))


@pytest.mark.parametrize("limit", [None, 0.75])
@pytest.mark.parametrize("name", GLUON_CASES)
def test_down_dgrad_swiglu_bitwise(name, limit):
    c = case(**GLUON_CASES[name])
    used = c["schedule"].row_source >= 0
    args = (c["d_y_rows"], c["w_down"], c["gate_up"], c["router_weights"], c["schedule"], limit)
    got = gemm_stages.down_dgrad_swiglu(*args, plan=PINGPONG)
    ref = gemm_stages.down_dgrad_swiglu(*args, plan=TRITON)
    again = gemm_stages.down_dgrad_swiglu(*args, plan=PINGPONG)
    for i, (a, b, a2) in enumerate(zip(got, ref, again)):  # d_gate_up, h_weighted, d_rw: the same operations
        assert torch.equal(a[used], b[used]) and torch.equal(a[used], a2[used]), i


def test_layer_on_it():
    """serval.moe with the chosen plan runs its dgrad on this engine: gradients bit for bit those with the Triton
    GEMM, no host sync, and a CUDA-graph replay equal to the eager step."""
    from conftest import check_sync_free_and_graph_replay, cuda_layer_step

    step = cuda_layer_step()
    plan = choose_plan(256, torch.bfloat16, common.target())
    assert plan.down_dgrad_engine == "pingpong"
    triton_only = step(serval.Config(kernel_plan=dataclasses.replace(plan, down_dgrad_engine="triton")))
    eager = step()
    for i, (a, b) in enumerate(zip(eager, triton_only)):
        assert torch.equal(a, b), i
    check_sync_free_and_graph_replay(step, eager)
