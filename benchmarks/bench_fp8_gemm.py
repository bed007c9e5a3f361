"""
The expert GEMMs of the MoE layer in FP8 against the GEMMs a user could call instead, one GPU, side by side.

For each shape of benchmarks/shapes.py (balanced routing, EP=1) and each of the layer's six expert GEMMs:

  gate_up      rows x [R, H]          x  w_gate|w_up [E, 2I, H]      (forward)
  down         rows h [R, I]          x  w_down [E, H, I]            (forward)
  down_dgrad   rows d_y [R, H]        x  w_down^T [E, I, H]          (backward)
  gate_up_dgrad rows d_gate_up [R, 2I] x (w_gate|w_up)^T [E, H, 2I]   (backward)
  down_wgrad   d_y^T [H, R]           x  h^T [I, R]    -> [E, H, I]  (backward, K = each expert's rows)
  gate_up_wgrad d_gate_up^T [2I, R]   x  x^T [H, R]    -> [E, 2I, H] (backward)

implementations (the operands quantized once, outside the timed calls):
  bf16_grouped_mm      torch._grouped_mm in bf16 (the BF16 baseline)
  serval_fp8           serval.kernels.fp8_gemm, block-scaled (1x128 activations, 128x128 weights), engine "auto"
                       (Gluon on sm_90 with Triton 3.6, else the Triton kernel)
  serval_fp8_triton    the same, Triton engine
  scaled_grouped_mm    torch._scaled_grouped_mm, row-scaled fp8 (row-grouped GEMMs only)
  cublas_blockwise     torch.nn.functional.scaled_mm per expert, cuBLAS block-scaled (1x128 x 128x128), the
                       expert sizes read on the host once before timing (a Python loop of E calls)

TFLOP/s = 2 * (N*k real rows) * N_out * K / time (padding rows not counted). Timing: warmup, then the median
of --iters calls timed with CUDA events, after --soak seconds of back-to-back calls (the H200 runs at its power
cap under sustained load). Ceilings in the same run: dense 8192^3 bf16 matmul, fp8 row-scaled _scaled_mm and
block-scaled F.scaled_mm.

  python benchmarks/bench_fp8_gemm.py                      # all shapes, results/h200_fp8_gemm.json
  python benchmarks/bench_fp8_gemm.py --shapes kimi-k2 --gemms gate_up,down
"""

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's serval
from shapes import SHAPES  # noqa: E402

GEMMS = ["gate_up", "down", "down_dgrad", "gate_up_dgrad", "down_wgrad", "gate_up_wgrad"]
IMPLS = ["bf16_grouped_mm", "serval_fp8", "serval_fp8_triton", "scaled_grouped_mm", "cublas_blockwise"]


def balanced_ids(num_tokens, num_experts, top_k, device):
    """Every token k distinct experts, every expert N*k/E rows +-1."""
    return (torch.arange(num_tokens * top_k, device=device) % num_experts).view(num_tokens, top_k)


def operands(shape, gemm, schedule, gen_device):
    """(a [R, K] or [M, R] bf16, b [E, N, K] or [N, R] bf16, real rows, n_out, k, grouped over rows?)."""
    hidden, inter = shape.hidden, shape.inter
    rows = schedule.capacity
    dims = {"gate_up": (hidden, 2 * inter), "down": (inter, hidden), "down_dgrad": (hidden, inter),
            "gate_up_dgrad": (2 * inter, hidden), "down_wgrad": (hidden, inter), "gate_up_wgrad": (2 * inter, hidden)}
    first, second = dims[gemm]
    used = (schedule.row_source >= 0)[:, None]
    rand = lambda *s: torch.randn(*s, device=gen_device, dtype=torch.bfloat16)  # noqa: E731
    if gemm.endswith("wgrad"):  # a: first x R, b: second x R, zero on padding rows
        a = torch.where(used, rand(rows, first), 0).t().contiguous()
        b = torch.where(used, rand(rows, second), 0).t().contiguous()
        return a, b, first, second, False
    a = torch.where(used, rand(rows, first), 0)
    b = rand(shape.experts, second, first) / first ** 0.5
    return a, b, second, first, True


def quantized(t, block, transpose=False):
    from serval.ops import quantize

    return quantize(t, block=block, scale_format="fp32", transpose=transpose)[0]


def make_impl(name, a, b, rows_grouped, schedule, offsets_host):
    """A zero-argument callable running one GEMM, or None where the implementation has no such GEMM."""
    from serval.kernels import fp8_gemm

    offs = schedule.expert_offsets[1:].to(torch.int32)
    if name == "bf16_grouped_mm":
        if rows_grouped:
            return lambda: torch._grouped_mm(a, b.transpose(-2, -1), offs=offs)
        return lambda: torch._grouped_mm(a, b.t(), offs=offs)
    if name.startswith("serval_fp8"):
        engine = "triton" if name.endswith("triton") else "auto"
        if rows_grouped:
            qa, qb = quantized(a, (1, 128)), quantized(b, (128, 128))
            return lambda: fp8_gemm.grouped_gemm(qa.data, qa.scale, qb.data, qb.scale, schedule, engine=engine)
        qa, qb = quantized(a, (1, 128)), quantized(b, (1, 128))
        return lambda: fp8_gemm.weight_grad(qa.data, qa.scale, qb.data, qb.scale, schedule, engine=engine)
    if name == "scaled_grouped_mm":
        if not rows_grouped:
            return None
        scale_a = a.float().abs().amax(1).clamp(min=1e-12) / 448
        scale_b = b.float().abs().amax(2).clamp(min=1e-12) / 448
        fa = (a.float() / scale_a[:, None]).to(torch.float8_e4m3fn)
        fb = (b.float() / scale_b[:, :, None]).to(torch.float8_e4m3fn)
        return lambda: torch._scaled_grouped_mm(fa, fb.transpose(-2, -1), scale_a, scale_b, offs=offs,
                                                out_dtype=torch.bfloat16)
    if name == "cublas_blockwise":
        blockwise = (F.ScalingType.BlockWise1x128, F.ScalingType.BlockWise128x128)
        if rows_grouped:
            qa, qb = quantized(a, (1, 128)), quantized(b, (128, 128))
            calls = []
            for e, (lo, hi) in enumerate(zip(offsets_host[:-1], offsets_host[1:])):
                if hi > lo:
                    scale_a = qa.scale[lo:hi].t().contiguous().t()  # column-major [M, K/128]
                    calls.append((qa.data[lo:hi], qb.data[e].t(), scale_a, qb.scale[e].t()))
            return lambda: [F.scaled_mm(x, w, sx, blockwise[0], sw, blockwise[1]) for x, w, sx, sw in calls]
        return None
    raise ValueError(name)


def time_ms(fn, warmup, iters, soak_s):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    end = time.perf_counter() + soak_s
    while time.perf_counter() < end:
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    stops = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, stop in zip(starts, stops):
        start.record()
        fn()
        stop.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, stops))


def ceilings(args):
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    fa, fb = a.to(torch.float8_e4m3fn), b.t().contiguous().to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    qa, qb = quantized(a, (1, 128)), quantized(b.t().contiguous(), (128, 128))
    runs = {"bf16 matmul": lambda: a @ b,
            "fp8 row-scaled _scaled_mm": lambda: torch._scaled_mm(fa, fb, one, one, out_dtype=torch.bfloat16),
            "fp8 block-scaled F.scaled_mm": lambda: F.scaled_mm(
                qa.data, qb.data.t(), qa.scale.t().contiguous().t(), F.ScalingType.BlockWise1x128, qb.scale.t(),
                F.ScalingType.BlockWise128x128)}
    out = []
    for name, fn in runs.items():
        ms = time_ms(fn, args.warmup, args.iters, args.soak)
        out.append(dict(shape="dense 8192^3", gemm="dense", impl=name, ms=ms, tflops=2 * n ** 3 / ms / 1e9))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--gemms", default=",".join(GEMMS))
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--soak", type=float, default=0.5, help="seconds of back-to-back calls before timing")
    parser.add_argument("--out", default="benchmarks/results/h200_fp8_gemm.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (sm_90 for the FP8 GEMMs)")
    from serval.schedule import build_schedule
    import triton

    info = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    records = [dict(r, **info) for r in ceilings(args)]
    for r in records:
        print(f"ceiling {r['impl']:<30} {r['tflops']:7.1f} TFLOP/s")
    for shape_name in args.shapes.split(","):
        shape = SHAPES[shape_name]
        ids = balanced_ids(shape.tokens, shape.experts, shape.top_k, "cuda")
        schedule = build_schedule(ids, shape.experts, 128)
        offsets_host = schedule.expert_offsets.tolist()  # outside any timed call
        real_rows = shape.tokens * shape.top_k
        for gemm in args.gemms.split(","):
            a, b, n_out, k, rows_grouped = operands(shape, gemm, schedule, "cuda")
            flops = 2 * real_rows * n_out * k
            line = f"{shape_name:<16} {gemm:<14}"
            for name in args.impls.split(","):
                rec = dict(shape=shape_name, gemm=gemm, impl=name, ms=None, tflops=None, error=None, **info)
                try:
                    fn = make_impl(name, a, b, rows_grouped, schedule, offsets_host)
                    if fn is None:
                        continue
                    rec["ms"] = time_ms(fn, args.warmup, args.iters, args.soak)
                    rec["tflops"] = flops / rec["ms"] / 1e9
                    line += f" {name} {rec['tflops']:6.0f}"
                except Exception as e:  # keep going: one failing implementation must not hide the others
                    rec["error"] = f"{type(e).__name__}: {e}"[:300]
                    line += f" {name} FAILED"
                records.append(rec)
            print(line, flush=True)
            del a, b
            torch.cuda.empty_cache()
    previous = json.load(open(args.out)) if os.path.exists(args.out) else []
    with open(args.out, "w") as f:
        json.dump(previous + records, f, indent=1)
    print(f"\n{args.out}: {len(records)} records added")
    table = {}
    for r in records:
        if r["gemm"] != "dense":
            table.setdefault((r["shape"], r["gemm"]), {})[r["impl"]] = r["tflops"]
    impls = args.impls.split(",")
    print(f"\nTFLOP/s ({info['gpu']}, {info['date']})\n{'shape':<16}{'gemm':<15}" + "".join(f"{i:>19}" for i in impls))
    for (shape_name, gemm), cells in table.items():
        print(f"{shape_name:<16}{gemm:<15}" + "".join(
            f"{cells[i]:>19.0f}" if cells.get(i) else f"{'-':>19}" for i in impls))


if __name__ == "__main__":
    main()
