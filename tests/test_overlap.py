"""MoK's minibatch rule (serval.plan) and the EP cost model (serval.overlap), pure functions, and the tool that runs
the model on the measured results (tools/ep_cost_model.py)."""

import json
import os
import subprocess
import sys

import pytest

from serval import overlap, plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_minibatch_rule_gives_every_gemm_two_waves():
    # 112 compute SMs, two waves = 224 tiles: 16 tiles per M-tile need 14 M-tiles, 28 need 8: the larger wins
    assert plan.minibatch_rows([16, 28], compute_sms=112, block_m=128) == 14 * 128
    assert plan.minibatch_rows([1000], compute_sms=112, block_m=128) == 128  # one M-tile is already two waves
    assert plan.minibatch_rows([7], compute_sms=3, block_m=64, waves=3) == 2 * 64  # ceil(9 / 7) = 2
    for n_tiles, sms, block_m in [([16, 28], 112, 128), ([6, 8], 124, 64), ([3], 7, 16)]:
        rows = plan.minibatch_rows(n_tiles, sms, block_m)
        assert rows % block_m == 0
        assert all(rows // block_m * n >= 2 * sms for n in n_tiles)  # two waves for every GEMM
        assert any((rows // block_m - 1) * n < 2 * sms for n in n_tiles)  # and no fewer M-tiles would do
    with pytest.raises(ValueError, match="compute_sms"):
        plan.minibatch_rows([16], compute_sms=0, block_m=128)


def test_layer_minibatch_rows_on_the_contract_shapes():
    # gate/up writes 128 columns of h a tile, down 256 of o: kimi-k2 (I 2048, H 7168) on 124 compute SMs
    assert plan.layer_minibatch_rows(7168, 2048, 124) == 16 * 128  # 2 * 124 / 16 = 15.5 -> 16 M-tiles
    assert plan.layer_minibatch_rows(2048, 768, 124) == 42 * 128  # 6 tiles of h: ceil(248 / 6) = 42


def problem_and_rates(**rates):
    problem = overlap.Problem(tokens=4096, top_k=8, hidden=7168, inter=2048, experts=384, ep=8)
    base = dict(compute_tflops=(450.0, 500.0), staged_gbps=280.0, nccl_gbps=300.0, nccl_compute_tflops=(350.0, 380.0),
                comm_gbps={4: 145.0, 16: 324.0, 64: 331.0})
    base.update(rates)
    return problem, overlap.Rates(**base)


def test_cost_model_orders_and_limits():
    problem, rates = problem_and_rates()
    assert problem.rows == 32768 and problem.rows_per_expert == 32768 * 8 / 384
    assert problem.transfer_bytes() == 7 / 8 * 32768 * 7168 * 2
    for backward in (False, True):
        compute = problem.flops(backward) / (rates.compute_tflops[backward] * 1e9)
        staged = overlap.staged_ms(problem, rates, backward)
        fused = overlap.fused_ms(problem, rates, backward, comm_sms=16, minibatch=2048)
        assert compute < fused < staged  # overlap hides most, never all, and never costs more than staging here
        # no communication at all (EP=1): the fused kernel is the compute, slowed by the SMs it gives up
        alone = overlap.Problem(4096, 8, 7168, 2048, 384, 1)
        slowed = alone.flops(backward) / (rates.compute_tflops[backward] * 1e9) * 132 / 116
        assert overlap.fused_ms(alone, rates, backward, 16, 2048) == pytest.approx(slowed + (0 if backward else 0.27))
        # a fused kernel computing at 0.9 of the staged rate (its EP=1 measurement): that much slower alone
        _, slower = problem_and_rates(fused_compute_ratio=(0.9, 0.9))
        assert overlap.fused_ms(alone, slower, backward, 16, 2048) == pytest.approx(
            slowed / 0.9 + (0 if backward else 0.27))
    ms, comm_sms, minibatch = overlap.best_fused(problem, rates, backward=False)
    assert comm_sms in rates.comm_gbps and minibatch % 128 == 0
    assert ms == min(overlap.fused_ms(problem, rates, False, c, plan.layer_minibatch_rows(7168, 2048, 132 - c))
                     for c in rates.comm_gbps)


def test_the_cost_model_tool_runs_on_the_committed_results(tmp_path):
    out = tmp_path / "ep8.json"
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "ep_cost_model.py"), "--out", str(out)],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    records = json.load(open(out))
    assert {(r["shape"], r["ep"]) for r in records} == {(s, p) for s in ("kimi-k2", "glm-5", "qwen3.5-397b",
                                                                          "deepseek-v4-pro") for p in (2, 8)}
    for r in records:  # calibrated on EP=2: the model gives what was measured there
        if r["ep"] == 2:
            assert r["staged_ms"] == pytest.approx(r["measured_ep2"]["staged_ms"], rel=1e-6)
            assert r["nccl_ms"] == pytest.approx(r["measured_ep2"]["nccl_ms"], rel=1e-6)
