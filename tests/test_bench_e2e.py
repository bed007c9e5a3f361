"""benchmarks/bench_e2e.py in its --smoke mode on the CPU (tiny models, fp32, the same code path as on the GPU):
its records, serval's losses against grouped_mm's, the merge into an existing file, the determinism check.

The script's main() runs in this process (its imports, torch and transformers, take most of the time: once)."""

import json
import os
import sys

import pytest
import torch

from serval.integrations import TRANSFORMERS_MIN

pytest.importorskip("transformers", minversion=TRANSFORMERS_MIN)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_e2e  # noqa: E402


def run_script(monkeypatch, capsys, *args):
    """bench_e2e.py --smoke --device cpu --models qwen3-30b-a3b ARGS (on the CPU where there is a GPU too: fp32,
    the checks below are fp32's); its stdout. Deterministic mode (--determinism) is switched off again after it."""
    monkeypatch.setattr(sys, "argv", ["bench_e2e.py", "--smoke", "--device", "cpu", "--models", "qwen3-30b-a3b", *args])
    try:
        bench_e2e.main()
    finally:
        torch.use_deterministic_algorithms(False)
    return capsys.readouterr().out


def earlier_record(model, impl, tokens_per_s):
    return dict(kind="throughput", model=model, impl=impl, precision="bf16", tokens_per_s=tokens_per_s,
                step_ms=1.0, peak_mem_gib=None, moe_share=None, error=None)


def test_smoke_records_match_and_merge(tmp_path, monkeypatch, capsys):
    """grouped_mm and serval (bf16) train the same tiny Qwen3-MoE: every record field, serval's losses within
    fp32 rounding of grouped_mm's at every step; a record of another model in the file stays, the stale one of the
    same (model, impl, precision) is replaced."""
    out = tmp_path / "e2e.json"
    other = earlier_record("olmoe-1b-7b", "grouped_mm", 123.0)
    out.write_text(json.dumps([other, earlier_record("qwen3-30b-a3b", "serval", -1.0)]))
    stdout = run_script(monkeypatch, capsys, "--impls", "grouped_mm,serval", "--precisions", "bf16", "--out", str(out))
    records = json.loads(out.read_text())
    assert records[0] == other and len(records) == 3
    by_impl = {r["impl"]: r for r in records[1:]}
    assert set(by_impl) == {"grouped_mm", "serval"}
    for r in by_impl.values():
        assert r["error"] is None, r["error"]
        assert r["kind"] == "throughput" and r["model"] == "qwen3-30b-a3b" and r["precision"] == "bf16"
        assert r["tokens_per_s"] > 0 and r["step_ms"] > 0 and len(r["step_ms_all"]) == r["steps"] == 2
        assert r["tokens"] == 16 and r["layers"] == 2 and r["config"]["hidden"] == 64
        assert r["config"]["experts"] == 4 and r["dtype"] == "float32"
        assert len(r["losses"]) == r["warmup"] + r["steps"] + 2  # warm-up, timed, the two measuring steps
        assert 0 < len(r["kernels"]) <= 12 and all(k["ms"] >= 0 for k in r["kernels"])
        for field in ("date", "gpu", "torch", "triton", "transformers", "serval_commit", "mem_estimate_gib"):
            assert field in r
        assert r["moe_share"] is None and r["peak_mem_gib"] is None  # CUDA only
    ref, got = by_impl["grouped_mm"]["losses"], by_impl["serval"]["losses"]
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got, ref)), (got, ref)
    assert "x grouped_mm" in stdout and "olmoe-1b-7b" in stdout  # the table of the whole file


def test_smoke_determinism(tmp_path, monkeypatch, capsys):
    """--determinism: two runs per implementation, the losses compared bitwise, recorded beside the throughput."""
    out = tmp_path / "e2e.json"
    run_script(monkeypatch, capsys, "--determinism", "--impls", "grouped_mm,serval", "--steps", "3", "--out", str(out))
    records = json.loads(out.read_text())
    assert {(r["kind"], r["impl"], r["precision"]) for r in records} == {
        ("determinism", "grouped_mm", "bf16"), ("determinism", "serval", "bf16")}
    for r in records:
        assert r["error"] is None, r["error"]
        assert r["identical"] is True and r["max_abs_diff"] == 0.0 and len(r["losses"]) == 3
        assert r["losses"] == r["losses_run2"]
