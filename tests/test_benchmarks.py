"""The benchmark scripts (benchmarks/) and the investigation tools (tools/) run, and count what the contract says.

Smoke tests run the --tiny modes, each in seconds: on the GPU where there is one, else on the CPU (serval's
kernels, where a variant asks for them, in Triton's interpreter: TRITON_INTERPRET=1, which conftest.py and the
scripts set without a GPU). The GPU-only tools are skipped without a GPU (and ncu).
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import CUDA

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "benchmarks")
TOOLS = os.path.join(ROOT, "tools")
sys.path.insert(0, BENCHMARKS)
sys.path.insert(0, TOOLS)

import bench_layer  # noqa: E402
import shapes  # noqa: E402

TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")
# a variant that runs serval's kernels (in the interpreter on the CPU) with a Config field and plan fields changed
KERNELS = "kernels: backend='triton'; block_m=16; down_tiles.num_stages=2"


def run_script(path, *args, launcher=(), env=None):
    result = subprocess.run([sys.executable, *launcher, path, *args], capture_output=True, text=True, timeout=600,
                            env={**os.environ, **env} if env else None)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


# ---------------------------------------------------------------- the shapes, FLOPs and variants


def test_shapes_are_the_contracts():
    """benchmarks/shapes.py holds docs/CONTRACT.md's benchmark shapes: the EP=1 table, and the multi-GPU shapes
    (the first four with their real expert counts, 4096 tokens per GPU)."""
    text = open(os.path.join(ROOT, "docs", "CONTRACT.md")).read()
    section = text[text.index("## Benchmark shapes"):]
    table = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 7 and cells[1].isdigit():
            table[cells[0].split(" (")[0]] = (*map(int, cells[1:6]), "no shared" not in cells[0])
    assert table == {name: tuple(shape) for name, shape in shapes.SHAPES.items()}
    multi_gpu = section[section.index("Multi-GPU"):]
    experts = dict(re.findall(r"([\w.-]+) (\d+)", re.search(r"expert counts \(([^)]*)\)", multi_gpu).group(1)))
    assert int(re.search(r"(\d+)\s+tokens\s+per\s+GPU", multi_gpu).group(1)) == shapes.TOKENS_PER_GPU
    assert {name: (s.experts, s.tokens) for name, s in shapes.EP_SHAPES.items()} == \
        {name: (int(e), shapes.TOKENS_PER_GPU) for name, e in experts.items()}
    for name, s in shapes.EP_SHAPES.items():
        assert s._replace(experts=0, tokens=0) == shapes.SHAPES[name]._replace(experts=0, tokens=0)


def test_flops_count_the_contract():
    """bench_layer.flops: forward 6 * (N + N*k) * H * I with the shared expert (6 * N*k * H * I routed only),
    backward 2 x forward."""
    H, I, E, k, N, _ = shape = shapes.SHAPES["kimi-k2"]
    assert bench_layer.flops(shape, "layer", "fwd") == 6 * (N + N * k) * H * I
    assert bench_layer.flops(shape, "routed", "fwd") == 6 * N * k * H * I
    for scope in ("routed", "layer"):
        assert bench_layer.flops(shape, scope, "fwdbwd") == 3 * bench_layer.flops(shape, scope, "fwd")


def test_variant_is_a_config_value():
    """A variant string becomes a serval.Config: KernelPlan fields (nested ones into a TileConfig) set in the plan
    serval picks for x, Config fields in the Config; no settings give Config(); bad settings are errors."""
    from serval import Config, kernels

    name, settings = bench_layer.parse_variant(
        "v: down_engine=triton; gate_up_tiles.num_stages=4; pull_programs=16; block_m=64; recompute=True;")
    assert name == "v" and settings == [("down_engine", "triton"), ("gate_up_tiles.num_stages", 4),
                                        ("pull_programs", 16), ("block_m", 64), ("recompute", True)]
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    config = bench_layer.variant_config(settings, x)
    chosen = kernels.plan_for(x)
    assert config.block_m == 64 and config.recompute is True
    assert config.kernel_plan.gate_up_tiles.num_stages == 4 and config.kernel_plan.pull_programs == 16
    assert config.kernel_plan.down_tiles == chosen.down_tiles  # fields not named keep the chosen plan's
    assert bench_layer.variant_config([], x) == Config()
    assert bench_layer.variant_config([("block_m", 32)], x).kernel_plan is None
    for bad, match in [("v: block_m", "FIELD=VALUE"), ("no colon", "expected"), ("v: ", "expected")]:
        with pytest.raises(ValueError, match=match):
            bench_layer.parse_variant(bad)
    for bad, match in [([("colour", 1)], "not a field"), ([("gate_up_tiles.colour", 1)], "no field 'colour'"),
                       ([("down_engine", "pingpong")], "down_engine"), ([("block_m", 48)], "block_m"),
                       ([("use_tma.x", 1)], "not a dataclass")]:
        with pytest.raises(ValueError, match=match):
            bench_layer.variant_config(bad, x)


# ---------------------------------------------------------------- benchmarks/


def test_bench_layer_tiny(tmp_path):
    """bench_layer.py --tiny on the CPU: every implementation checked against torch_grouped_mm and timed, for
    both shapes, scopes and passes; records as the docstring lists them."""
    out = tmp_path / "records.json"
    run_script(os.path.join(BENCHMARKS, "bench_layer.py"), "--tiny", "--impls", "serval,torch_grouped_mm,hf_loop",
               "--iters", "2", "--warmup", "1", "--soak", "0.1", "--out", str(out))
    records = [r for r in json.load(open(out)) if r["scope"] != "dense"]  # dense: the GPU's matmul ceiling
    assert {(r["shape"], r["scope"], r["pass"]) for r in records} == {
        (s, scope, ps) for s in ("tiny-a", "tiny-b") for scope in ("routed", "layer") for ps in ("fwd", "fwdbwd")
        if scope == "routed" or shapes.TINY_SHAPES[s].shared}
    assert {r["impl"] for r in records} == {"serval", "torch_grouped_mm", "hf_loop"}
    for r in records:
        assert r["error"] is None and r["ms"] > 0 and r["tflops"] > 0, r
        assert r["rel_err"] < 3e-2 and r["soak_s"] == 0.1 and r["settings"] is None
        assert r["host_ms"] > 0 if CUDA else r["host_ms"] is None, r  # the host's pace: CUDA only


def test_bench_layer_fp8_weights_once_per_step(tmp_path):
    """--fp8-weights both: each FP8 precision also as impl "serval (weights once per step)" (the expert weights
    quantized once and passed in), checked and timed like the per-call one. --tol 0.15: mxfp8's errors against
    bf16 are ~0.075 on every shape, but on tiny-a's 96 routing weights they scatter (up to 0.0995 over 40 CPU
    seeds; one draw on the H200 went past the default 0.1)."""
    out = tmp_path / "records.json"
    run_script(os.path.join(BENCHMARKS, "bench_layer.py"), "--tiny", "--shapes", "tiny-a", "--scopes", "routed",
               "--passes", "fwdbwd", "--impls", "serval", "--precisions", "bf16,mxfp8", "--fp8-weights", "both",
               "--tol", "0.15", "--iters", "2", "--warmup", "1", "--soak", "0", "--out", str(out))
    records = [r for r in json.load(open(out)) if r["scope"] != "dense"]
    assert sorted((r["impl"], r["precision"]) for r in records) == [
        ("serval", "bf16"), ("serval", "mxfp8"), ("serval (weights once per step)", "mxfp8")]
    for r in records:
        assert r["error"] is None and r["ms"] > 0 and r["tflops"] > 0, r


def test_bench_fused_forward_tiny(tmp_path):
    """bench_fused_forward.py --tiny: the staged and the fused forward GEMMs (the interpreter on the CPU), each fused
    minibatch bit for bit the staged, all timed and recorded."""
    out = tmp_path / "records.json"
    run_script(os.path.join(BENCHMARKS, "bench_fused_forward.py"), "--tiny", "--shapes", "tiny-b", "--minibatches",
               "mok,all", "--iters", "1", "--warmup", "0", "--soak", "0", "--out", str(out))
    records = json.load(open(out))
    assert [(r["impl"], r["minibatch"]) for r in records] == [("staged", None), ("fused", "mok"), ("fused", "all")]
    for r in records:
        assert r["error"] is None and r["bitwise_equal"] and r["ms"] > 0 and r["gather"] == "excluded", r


def test_bench_layer_tiny_variant(tmp_path):
    """bench_layer.py --variant: serval with the variant's Config (here its kernels, in the interpreter), recorded
    as "serval (NAME)" with its settings, checked and timed like the others."""
    out = tmp_path / "records.json"
    run_script(os.path.join(BENCHMARKS, "bench_layer.py"), "--tiny", "--impls", "serval,torch_grouped_mm",
               "--shapes", "tiny-a", "--scopes", "layer", "--passes", "fwd", "--warmup", "0", "--iters", "1",
               "--soak", "0", "--variant", KERNELS, "--out", str(out))
    records = {r["impl"]: r for r in json.load(open(out)) if r["scope"] != "dense"}
    assert list(records) == ["serval", "serval (kernels)", "torch_grouped_mm"]
    variant = records["serval (kernels)"]
    assert variant["settings"] == ["backend='triton'", "block_m=16", "down_tiles.num_stages=2"]
    assert variant["error"] is None and variant["ms"] > 0 and variant["rel_err"] < 3e-2, variant


def emulate_fp8_gemms(monkeypatch):
    """torch._scaled_grouped_mm (row-scaled) and F.scaled_mm (DeepSeek block-scaled) on the CPU: dequantize, fp32
    matmul, bf16; behind the operand and scale layouts torch's CUDA code checks (GroupedBlas.cpp, ScaledBlas.cpp),
    and rows a multiple of 4 for cuBLAS's 1x128 scales."""
    import torch.nn.functional as F

    def scaled_grouped_mm(a, b, scale_a, scale_b, offs, out_dtype):
        assert a.stride(1) == 1 and b.stride(1) == 1 and scale_a.shape == a.shape[:1] and scale_a.is_contiguous()
        assert scale_b.shape == (b.shape[0], b.shape[2]) and scale_b.stride(1) == 1 and out_dtype == torch.bfloat16
        a, b, ends = a.float() * scale_a[:, None], b.float() * scale_b[:, None], offs.tolist()
        return torch.cat([a[lo:hi] @ b[e] for e, (lo, hi) in enumerate(zip([0] + ends[:-1], ends))]).bfloat16()

    def scaled_mm(a, b, scale_a, recipe_a, scale_b, recipe_b):
        M, N, kb = a.shape[0], b.shape[1], -(-a.shape[1] // 128)
        assert a.stride(1) == 1 and b.stride(0) == 1 and M % 4 == 0 and recipe_a == F.ScalingType.BlockWise1x128
        assert scale_a.shape == (M, kb) and scale_a.stride(0) == 1 and (kb == 1 or scale_a.stride(1) == M)
        if recipe_b == F.ScalingType.BlockWise1x128:  # [N, K/128], strides (1, N)
            assert scale_b.shape == (N, kb) and scale_b.stride(0) == 1 and (kb == 1 or scale_b.stride(1) == N)
            scale_b = scale_b.t().repeat_interleave(128, 0)
        else:  # BlockWise128x128: [round_up(K/128, 4), N/128], strides (1, round_up(K/128, 4))
            kb4 = -(-kb // 4) * 4
            assert scale_b.shape == (kb4, N // 128) and scale_b.stride(0) == 1
            assert N == 128 or scale_b.stride(1) == kb4
            scale_b = scale_b[:kb].repeat_interleave(128, 0).repeat_interleave(128, 1)
        return ((a.float() * scale_a.repeat_interleave(128, 1)) @ (b.float() * scale_b)).bfloat16()

    monkeypatch.setattr(torch, "_scaled_grouped_mm", scaled_grouped_mm, raising=False)
    monkeypatch.setattr(F, "scaled_mm", scaled_mm, raising=False)


def test_bench_layer_fp8_baselines_emulated(monkeypatch):
    """torch_fp8_rowwise and cublas_blockwise on the CPU, their FP8 GEMMs emulated (above): each GEMM right where every
    scaling group has a power-of-two magnitude of its own (a scale on the wrong rows or blocks is off by up to 2^10);
    each layer checked and timed by bench_impl as serval's FP8 precisions are (within FP8_TOL, not --tol) and recorded
    with its precision."""
    emulate_fp8_gemms(monkeypatch)
    g = torch.Generator().manual_seed(0)

    def rand(*shape, group):  # a magnitude 2^-5 .. 2^5 per group (rows, cols) of the last two dims
        f = 2.0 ** torch.randint(-5, 6, (*shape[:-2], shape[-2] // group[0], shape[-1] // group[1]), generator=g)
        return torch.randn(*shape, generator=g) * f.repeat_interleave(group[0], -2).repeat_interleave(group[1], -1)

    def close(got, want):  # FP8's error is a few %
        assert (got.float() - want).norm() / want.norm() < 0.1

    counts, K, N = [130, 0, 3, 256, 61], 384, 256  # an expert without rows, row counts not multiples of 4
    R, E = sum(counts), len(counts)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    rows = [slice(end - m, end) for m, end in zip(counts, offs.tolist())]
    per_expert = lambda f: torch.cat([f(e, r) for e, r in enumerate(rows)])  # noqa: E731
    a, d_y, w = rand(R, K, group=(1, K)), rand(R, N, group=(1, N)), rand(E, N, K, group=(1, K))
    close(bench_layer.rowwise_mm(a.bfloat16(), w.bfloat16(), offs, None), per_expert(lambda e, r: a[r] @ w[e].T))
    w = rand(E, N, K, group=(N, 1))  # the dgrad quantizes w's columns
    close(bench_layer.rowwise_mm(d_y.bfloat16(), w.bfloat16().transpose(-2, -1), offs, None),
          per_expert(lambda e, r: d_y[r] @ w[e]))
    a, d_y, w = rand(R, K, group=(1, 128)), rand(R, N, group=(1, 128)), rand(E, N, K, group=(128, 128))
    close(bench_layer.blockwise_mm(a.bfloat16(), w.bfloat16(), offs, counts), per_expert(lambda e, r: a[r] @ w[e].T))
    close(bench_layer.blockwise_mm(d_y.bfloat16(), w.bfloat16().transpose(-2, -1), offs, counts),
          per_expert(lambda e, r: d_y[r] @ w[e]))
    # weight gradients: 128x1 blocks of each expert's rows
    d_y, a = (torch.cat([rand(-(-m // 128) * 128, n, group=(128, 1))[:m] for m in counts]) for n in (N, K))
    for wgrad in (bench_layer.grouped_wgrad_bf16, bench_layer.blockwise_wgrad):
        close(wgrad(d_y.bfloat16(), a.bfloat16(), offs, counts), torch.stack([d_y[r].T @ a[r] for r in rows]))

    inp = bench_layer.make_inputs(shapes.Shape(256, 128, 4, 2, 70, True), torch.device("cpu"))
    ref = bench_layer.reference(bench_layer.torch_grouped_mm, inp, "layer", ["fwd", "fwdbwd"])
    args = argparse.Namespace(tol=3e-2, warmup=0, iters=1, soak=0)
    monitor = bench_layer.GpuMonitor(torch.device("cpu"))
    for name, precision in bench_layer.FP8_BASELINES.items():
        for r in bench_layer.bench_impl(name, getattr(bench_layer, name), None, None, precision, inp, ref, "fp8",
                                        "layer", ["fwd", "fwdbwd"], args, torch.device("cpu"), {}, monitor):
            assert r["impl"] == bench_layer.impl_label(r) == name and r["precision"] == precision
            assert r["error"] is None and 3e-2 < r["rel_err"] < bench_layer.FP8_TOL and r["ms"] > 0, r


def test_bench_ep_tiny(tmp_path):
    """bench_ep.py --tiny: two gloo processes on the CPU (torchrun), serval's EP layer and a Config variant of it
    against NCCL-style all_to_all + grouped_mm; serval's forward split into its stages, which compute serval's y."""
    out = tmp_path / "records.json"
    run_script(os.path.join(BENCHMARKS, "bench_ep.py"), "--tiny", "--out", str(out), "--variant", "bm64: block_m=64",
               launcher=TORCHRUN)
    records = json.load(open(out))
    assert {r["impl"] for r in records} == {"serval", "serval (bm64)", "nccl_a2a"}
    assert all(r["error"] is None and r["ms"] > 0 and r["ep"] == 2 for r in records)
    staged = [r for r in records if r["impl"].startswith("serval") and r["pass"] == "fwd"]
    assert staged and all(r["rel_errs"]["y_staged"] == 0.0 and r["stage_ms"]["total"] > 0 for r in staged)
    assert {r["shape"] for r in records} == set(shapes.EP_TINY_SHAPES)


@pytest.mark.skipif(CUDA, reason="--tiny runs EP on the CPU (gloo), where serval's kernels need Triton's interpreter: "
                    "off where there is a GPU (and the GPU machines' Triton 3.6 interpreter does not run them)")
def test_bench_ep_tiny_kernels(tmp_path):
    """bench_ep.py with variants on serval's kernels (the interpreter): the GEMMs push their rows into the peers'
    slots from the epilogue, with pull_programs the gate/up GEMM pulls its own rows, and either way the
    stage-by-stage forward gives serval.moe's y bit for bit."""
    out = tmp_path / "records.json"
    run_script(os.path.join(BENCHMARKS, "bench_ep.py"), "--tiny", "--shapes", "tiny-b", "--scopes", "routed",
               "--passes", "fwd", "--warmup", "0", "--iters", "1", "--variant", KERNELS, "--variant",
               "pull: backend='triton'; block_m=16; pull_programs=2", "--out", str(out), launcher=TORCHRUN)
    records = {r["impl"]: r for r in json.load(open(out))}
    for impl, stages in [("serval (kernels)", {"dispatch", "gate_up"}), ("serval (pull)", {"dispatch+gate_up"})]:
        variant = records[impl]
        assert variant["error"] is None and variant["rel_err"] < 3e-2 and variant["rel_errs"]["y_staged"] == 0.0
        assert set(variant["stage_ms"]) == {"schedule", "down_combine", "total"} | stages, variant


def test_shell_scripts_parse():
    """run_ep.sh and install_sonicmoe.sh are valid bash (they run only on the GPU machines)."""
    for script in ("run_ep.sh", "install_sonicmoe.sh"):
        result = subprocess.run(["bash", "-n", os.path.join(BENCHMARKS, script)], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr


# ---------------------------------------------------------------- tools/


def test_layer_variants_tiny(tmp_path):
    """tools/layer_variants.py --tiny: the default and two variants (the kernels in the interpreter; a Config
    field) timed in rounds, each compared with the default's outputs."""
    out = tmp_path / "records.json"
    run_script(os.path.join(TOOLS, "layer_variants.py"), "--tiny", "--shapes", "tiny-b", "--rounds", "1",
               "--warmup", "0", "--iters", "1", "--soak", "0", "--variant", KERNELS, "--variant", "bm32: block_m=32",
               "--out", str(out))
    records = json.load(open(out))
    assert [r["variant"] for r in records] == ["serval", "kernels", "bm32"]
    assert all(r["ms"] > 0 and r["rel_err"] < 3e-2 for r in records), records
    assert records[0]["rel_err"] == 0.0 and records[2]["settings"] == ["block_m=32"]


@pytest.mark.parametrize("mode", [(), ("--ep",)], ids=["layer", "ep"])
def test_fuzz_layer_tiny(mode):
    """tools/fuzz_layer.py: a few seconds of random small problems (and at EP, gloo processes on the CPU), every
    case checked, none failing."""
    out = run_script(os.path.join(TOOLS, "fuzz_layer.py"), "--tiny", "--seconds", "3", "--seed", "0", *mode)
    count, failed = re.search(r"(\d+) cases in .* (\d+) failed", out).groups()
    assert int(count) >= 1 and failed == "0", out[-3000:]


def test_kernel_stages_tiny():
    """tools/kernel_stages.py --tiny: every stage (GEMMs per plan, weight gradients, row kernels) in the
    interpreter, within tolerance of its torch stage; a --variant plan is a column of its own."""
    out = run_script(os.path.join(TOOLS, "kernel_stages.py"), "--tiny", "--variant",
                     "small tiles: gate_up_tiles.block_n=16; down_dgrad_tiles.num_stages=2")
    assert "all within rel err" in out
    for stage in ("gate_up_swiglu", "down", "down_dgrad_swiglu", "gate_up_dgrad"):
        assert re.search(rf"{stage} +small tiles ", out), stage
    for stage in ("gate_up_weight_grad", "down_weight_grad", "gather", "combine", "sum_slots"):
        assert stage in out


def test_ncu_layer_parse():
    """ncu's --csv rows (one per launch and metric) -> one row per kernel: sums, time-weighted means."""
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


def test_kernel_split_names_every_kernel():
    """tools/kernel_split.py gives every kernel serval launches (each `*_kernel` function of serval/kernels) a kind
    of its own, and names no kernel that is gone."""
    import kernel_split

    names = set()
    for name in os.listdir(os.path.join(ROOT, "serval", "kernels")):
        if name.endswith(".py"):
            source = open(os.path.join(ROOT, "serval", "kernels", name)).read()
            names |= set(re.findall(r"^ *def (\w+_kernel)\(", source, re.M))
    assert names == set(kernel_split.KINDS), sorted(names ^ set(kernel_split.KINDS))
    assert kernel_split.kind("void at::native::vectorized_elementwise_kernel<4>") == "torch ops"


@pytest.mark.skipif(not CUDA, reason="kernel_split.py splits GPU kernel time: needs a CUDA GPU")
def test_kernel_split_tiny(tmp_path):
    """tools/kernel_split.py --tiny: a record per precision whose kinds add up to its GPU time."""
    out = tmp_path / "split.jsonl"
    run_script(os.path.join(TOOLS, "kernel_split.py"), "--tiny", "--shapes", "tiny-a", "--precisions", "bf16,mxfp8",
               "--out", str(out))
    records = [json.loads(line) for line in open(out)]
    assert [r["precision"] for r in records] == ["bf16", "mxfp8"]
    for r in records:
        assert r["gpu_ms"] > 0 and r["wall_ms"] > 0 and r["peak_gib"] >= 0  # a tiny step's peak rounds to 0 GiB
        assert sum(r["kinds"].values()) == pytest.approx(r["gpu_ms"], abs=1e-2)
    assert any("BF16 GEMMs" in r["kinds"] for r in records)


NCU = shutil.which("ncu") or (os.path.exists("/usr/local/cuda/bin/ncu") and "/usr/local/cuda/bin/ncu")


@pytest.mark.skipif(not (CUDA and NCU), reason="ncu_layer.py needs a CUDA GPU and Nsight Compute (ncu)")
def test_ncu_layer(tmp_path):
    """tools/ncu_layer.py profiles every kernel of the tiny shape's forward + backward under ncu."""
    out = run_script(os.path.join(TOOLS, "ncu_layer.py"), "--shapes", "tiny-a", "--impls", "serval", "--out",
                     str(tmp_path / "n.json"))
    records = json.load(open(tmp_path / "n.json"))
    assert records and all(r["ms"] > 0 for r in records), out


def test_peak_memory_names_what_is_alive():
    """tools/peak_memory.py on a tiny shape (the torch stages: no interpreter): per precision the peak above the
    inputs, at least the weight gradients the step returns, and the sites alive at it, each by a serval line."""
    hidden, inter, experts = 64, 32, 4
    out = run_script(os.path.join(TOOLS, "peak_memory.py"), "--shape", f"{hidden},{inter},{experts},2,48",
                     "--backend", "torch", "--precisions", "bf16,mxfp8", "--top", "3", "--device", "cpu")
    peaks = re.findall(r"(bf16|mxfp8): peak ([0-9.]+) MiB above the inputs", out)
    assert [p for p, _ in peaks] == ["bf16", "mxfp8"], out
    weight_grads = 3 * experts * inter * hidden * 2 / 2**20
    assert all(float(mib) >= weight_grads for _, mib in peaks), out
    sites = re.findall(r"MiB +\d+ x  (\S+)", out)
    assert len(sites) == 6 and all(re.match(r"[a-z_/]+\.py:\d+$", site) for site in sites), out


@pytest.mark.skipif(not CUDA, reason="symmetric memory needs a CUDA GPU")
def test_ep_ceilings_one_gpu(tmp_path, monkeypatch):
    """tools/ep_ceilings.py: two processes on one GPU, every transfer checked against the peers' data (the figures
    mean nothing there)."""
    monkeypatch.setenv("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")
    out = tmp_path / "records.json"
    run_script(os.path.join(TOOLS, "ep_ceilings.py"), "--one-gpu", "--rows", "300", "--hidden", "136", "--warmup", "1",
               "--iters", "2", "--comm-programs", "3", "--out", str(out), launcher=TORCHRUN)
    records = json.load(open(out))
    assert {r["impl"] for r in records} == {"pull", "push", "ce_read", "local", "comm3"}
    assert all(r["checked"] and r["ms"] > 0 for r in records)
