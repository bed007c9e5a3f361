"""The benchmark scripts still run: their --tiny modes, in seconds (CPU, or the GPU where there is one)."""

import json
import os
import subprocess
import sys

import pytest

from conftest import CUDA

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def run_script(name, *args, launcher=(), env=None):
    result = subprocess.run([sys.executable, *launcher, os.path.join(BENCHMARKS, name), *args], capture_output=True,
                            text=True, timeout=600, env={**os.environ, **env} if env else None)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def test_bench_layer_tiny(tmp_path):
    out = tmp_path / "records.json"
    run_script("bench_layer.py", "--tiny", "--impls", "serval,torch_grouped_mm,hf_loop", "--iters", "2",
               "--warmup", "1", "--soak", "0.1", "--out", str(out))
    records = json.load(open(out))
    routed = [r for r in records if r["scope"] != "dense"]
    assert {r["impl"] for r in routed} == {"serval", "torch_grouped_mm", "hf_loop"}
    for r in routed:
        assert r["error"] is None and r["ms"] > 0 and r["tflops"] > 0, r
        assert r["rel_err"] < 3e-2 and r["soak_s"] == 0.1


@pytest.mark.skipif(CUDA, reason="--tiny runs the kernels in the CPU interpreter")
def test_kernel_stages_tiny():
    assert "all within rel err" in run_script("kernel_stages.py", "--tiny")


def test_bench_ep_tiny(tmp_path):
    """Two gloo processes on the CPU (torchrun), serval's EP layer against NCCL-style all_to_all + grouped_mm,
    and serval with a variant (a kernel flag and a Config field)."""
    out = tmp_path / "records.json"
    run_script("bench_ep.py", "--tiny", "--out", str(out), "--variant",
               "v: grouped_gemm.PUSH_FROM_EPILOGUE=False; config.block_m=64",
               launcher=("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"))
    records = json.load(open(out))
    assert {r["impl"] for r in records} == {"serval", "serval (v)", "nccl_a2a"}
    assert all(r["error"] is None and r["ms"] > 0 for r in records)


def test_layer_variants_tiny(tmp_path):
    out = tmp_path / "records.json"
    run_script("layer_variants.py", "--tiny", "--shapes", "tiny-a", "--rounds", "1", "--iters", "2", "--soak", "0",
               "--variant", "triton dgrad: grouped_gemm.WARP_SPECIALIZED=False", "--out", str(out))
    records = json.load(open(out))
    assert [r["variant"] for r in records] == ["serval", "triton dgrad"] and all(r["ms"] > 0 for r in records)


def test_layer_variants_settings_undone():
    """A setting reaches a frozen TileConfig inside CONFIGS, and undo restores every touched module attribute."""
    sys.path.insert(0, BENCHMARKS)
    import layer_variants
    from serval.kernels import grouped_gemm

    before = (grouped_gemm.WARP_SPECIALIZED, grouped_gemm.CONFIGS["hopper"]["down"])
    name, settings = layer_variants.parse_variant("v: grouped_gemm.CONFIGS.hopper.down.num_stages=5; "
                                                  "grouped_gemm.WARP_SPECIALIZED=False")
    saved = layer_variants.apply(settings)
    try:
        assert name == "v" and grouped_gemm.CONFIGS["hopper"]["down"].num_stages == 5
        assert grouped_gemm.WARP_SPECIALIZED is False
    finally:
        layer_variants.undo(saved)
    assert (grouped_gemm.WARP_SPECIALIZED, grouped_gemm.CONFIGS["hopper"]["down"]) == before
    with pytest.raises(ValueError, match="no '='"):
        layer_variants.parse_variant("v: grouped_gemm.WARP_SPECIALIZED")


def test_kernel_pingpong():
    """On the CPU it declines; on an H200 it checks the ping-pong kernel against serval's Triton kernel."""
    out = run_script("kernel_pingpong.py", "--shapes", "qwen3-30b-a3b", "--soak", "0.1")
    assert "not run" in out or "all checks passed" in out


def test_kernel_pingpong_compile_only():
    """Without Triton 3.6 it declines; with it (any machine) it compiles the kernel for sm_90a, no spills."""
    out = run_script("kernel_pingpong.py", "--compile-only", env={"TRITON_INTERPRET": "0"})  # the real compiler
    assert "not run" in out or (out.count("spills     0") == 1 and "dgrad + SwiGLU backward" in out)


def test_kernel_coop():
    """On the CPU it declines; on an H200 it checks the cooperative kernel against serval's Triton kernel."""
    out = run_script("kernel_coop.py", "--shapes", "qwen3-30b-a3b", "--soak", "0.1")
    assert "not run" in out or "all checks passed" in out


def test_kernel_coop_compile_only():
    """Without Triton 3.6 it declines; with it (any machine) it compiles both gate/up loaders, down and the gate/up
    dgrad for sm_90a, no spills."""
    out = run_script("kernel_coop.py", "--compile-only", env={"TRITON_INTERPRET": "0"})  # the real compiler
    assert "not run" in out or out.count("'0 bytes spill stores'") == 4


def test_ncu_layer_parse():
    """ncu's --csv rows (one per launch and metric) -> one row per kernel: sums, time-weighted means."""
    sys.path.insert(0, BENCHMARKS)
    import ncu_layer

    header = '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"'
    rows = [(0, "gemm", "gpu__time_duration.sum", "nsecond", "1,000,000"),
            (0, "gemm", "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active", "%", "80"),
            (0, "gemm", "dram__bytes_read.sum", "byte", "2,000,000,000"),
            (1, "gemm", "gpu__time_duration.sum", "nsecond", "3,000,000"),
            (1, "gemm", "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active", "%", "40"),
            (1, "gemm", "dram__bytes_read.sum", "byte", "1,000,000,000"),
            (2, "gather", "gpu__time_duration.sum", "nsecond", "500,000")]
    text = "==PROF== noise\n" + "\n".join([header] + ['"%d","%s","%s","%s","%s"' % r for r in rows])
    kernels = ncu_layer.parse(text)
    assert kernels["gemm"]["calls"] == 2 and kernels["gemm"]["ms"] == pytest.approx(4.0)
    assert kernels["gemm"]["tensor_pct"] == pytest.approx(50.0)  # (80 * 1 + 40 * 3) / 4
    assert kernels["gemm"]["dram_read_gb"] == pytest.approx(3.0)
    assert kernels["gather"] == {"calls": 1, "ms": pytest.approx(0.5)}
    launches = ncu_layer.parse(text, per_launch=True)
    assert list(launches) == ["  0 gemm", "  1 gemm", "  2 gather"] and launches["  1 gemm"]["tensor_pct"] == 40.0


def test_ncu_layer(tmp_path):
    """Without a GPU or ncu it declines; with them it profiles the tiny shape's kernels."""
    out = run_script("ncu_layer.py", "--shapes", "tiny-a", "--impls", "serval", "--out", str(tmp_path / "n.json"))
    if "not run" in out:
        return
    assert os.path.exists(tmp_path / "n.json"), out
    records = json.load(open(tmp_path / "n.json"))
    assert records and all(r["ms"] > 0 for r in records), out


@pytest.mark.skipif(not CUDA, reason="symmetric memory needs a CUDA GPU")
def test_ep_ceilings_one_gpu(tmp_path, monkeypatch):
    """Two processes on one GPU (correctness of the transfers only; the figures mean nothing there)."""
    monkeypatch.setenv("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")
    out = tmp_path / "records.json"
    run_script("ep_ceilings.py", "--one-gpu", "--rows", "300", "--hidden", "136", "--warmup", "1", "--iters", "2",
               "--comm-programs", "3", "--out", str(out),
               launcher=("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"))
    records = json.load(open(out))
    assert {r["impl"] for r in records} == {"pull", "push", "ce_read", "local", "comm3"}
    assert all(r["checked"] and r["ms"] > 0 for r in records)
