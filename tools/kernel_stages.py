"""Each stage of the layer alone, per kernel plan: checked against its torch stage (serval.stages), then timed.

    python tools/kernel_stages.py                 # H200: kimi-k2 and qwen3-30b-a3b, balanced routing (minutes)
    python tools/kernel_stages.py --soak 1        # H200: each timing after 1 s of load, at the power cap
    python tools/kernel_stages.py --variant "gate/up 4 stages: gate_up_tiles.num_stages=4"
    python tools/kernel_stages.py --tiny          # any machine: a tiny shape (without a GPU in Triton's interpreter)

Plans (serval.plan.KernelPlan), each a column of the table: "plan", the one serval.plan.choose_plan picks for the
shape here (on an H200 with Triton 3.6 the Gluon engines run most stages); "triton", the same with every stage on
the Triton GEMM (where that differs); "pointer loads" (GPU), the Triton GEMM without TMA; and each --variant
"NAME: FIELD=VALUE; ...": KernelPlan fields set in the chosen plan (FIELD.SUB into a TileConfig / GluonConfig),
as benchmarks/bench_layer.py takes them.

Stages: the four GEMM stages through serval.kernels.gemm_stages with each plan (gate/up + SwiGLU also over rows
gathered beforehand: "rows given", the GEMM alone), the weight gradients (serval.kernels.weight_grad: "table", the
config its table picks, and on the GPU each named config of WGRAD_CONFIGS), the row kernels (gather,
combine, sum_slots), and on the GPU the torch stages themselves ("torch").

Inputs: bench_layer.make_inputs (bf16, balanced routing), block_m 128 (16 on the CPU), swiglu_limit 7.
Check: relative error ||a - b|| / ||b|| against the torch stage, over the rows that hold a (token, slot).
Time: triton.testing.do_bench (median, L2 flushed between runs); with --soak, bench_layer.time_ms after that many
seconds of calls (the GPU at its power cap, as training runs it); in the interpreter one call, only to exercise
the code. GEMM rates count 2 * M * N * K over the real routed rows M = N * k (padding rows are overhead); row
kernels count bytes read + written. Ceilings (this H200, bursts): 793 TFLOP/s dense bf16, 4.2 TB/s device copy.
The table comes last.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_layer  # noqa: E402  (puts this checkout's serval on the path; without a GPU, TRITON_INTERPRET=1)

from serval import stages  # noqa: E402
from serval.kernels import common, gemm_stages, rows, weight_grad  # noqa: E402
from serval.plan import WGRAD_CONFIGS, KernelPlan, choose_plan  # noqa: E402
from serval.schedule import build_schedule  # noqa: E402

PEAK_TFLOPS = 793.0
PEAK_TBPS = 4.2
DEFAULT_SHAPES = ("kimi-k2", "qwen3-30b-a3b")  # the largest and the smallest expert
TINY_SHAPE = "tiny-a"
LIMIT = 7.0  # swiglu_limit: the clamps on
ENGINES = ("gate_up_engine", "down_engine", "down_dgrad_engine", "gate_up_dgrad_engine")


def plans(hidden, variants, gpu):
    """{column: KernelPlan} for a shape of hidden size `hidden` (see the module docstring)."""
    chosen = choose_plan(hidden, torch.bfloat16, common.target())
    triton = dataclasses.replace(chosen, **{engine: "triton" for engine in ENGINES})
    columns = {"plan": chosen}
    if triton != chosen:
        columns["triton"] = triton
    if gpu:
        columns["pointer loads"] = dataclasses.replace(triton, use_tma=False)
    for name, settings in variants:
        columns[name] = bench_layer.variant_plan(settings, chosen)
    return columns


def timer(gpu, soak):
    if not gpu:  # the interpreter: one run, only to exercise the code
        def run(fn):
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        return run
    if soak > 0:  # the GPU at its power cap, as in training; no L2 flush
        return lambda fn: bench_layer.time_ms(fn, 3, 20, torch.device("cuda"), soak)
    import triton.testing

    return lambda fn: triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def rel_err(got, ref, mask):
    """The largest relative error over the outputs; outputs with one row per schedule row only over `mask`."""
    got = got if isinstance(got, tuple) else (got,)
    ref = ref if isinstance(ref, tuple) else (ref,)
    worst = 0.0
    for a, b in zip(got, ref):
        if mask is not None and a.shape[0] == mask.shape[0]:  # packed gate_up and weights: whole
            a, b = a[mask], b[mask]
        a, b = a.float(), b.float()
        if torch.isnan(a).any():
            return float("nan")
        worst = max(worst, ((a - b).norm() / b.norm().clamp(min=1e-12)).item())
    return worst


def bench_shape(name, shape, columns, gpu, results, selected, soak):
    device = torch.device("cuda" if gpu else "cpu")
    inp = bench_layer.make_inputs(shape, device)
    hidden, inter, experts, top_k, tokens, _ = shape
    sched = build_schedule(inp["topk_ids"], experts, 128 if gpu else 16)
    x, w_gate, w_up, w_down, rw = (inp[n] for n in ("x", "w_gate", "w_up", "w_down", "router_weights"))
    m = tokens * top_k  # real routed rows
    valid = sched.row_source >= 0
    token_mask = torch.ones(tokens, dtype=torch.bool, device=device)
    run_timed = timer(gpu, soak)

    def measure(stage, variant, fn, ref, mask=valid, flops=None, nbytes=None):
        if selected and stage not in selected:
            return
        out = fn()  # compiles, and is the output checked
        err = rel_err(out, ref, mask)
        del out
        ms = run_timed(fn)
        results.append(dict(shape=name, stage=stage, variant=variant, ms=ms, err=err,
                            tflops=flops / ms / 1e9 if flops else None, tbps=nbytes / ms / 1e9 if nbytes else None))
        rate = f"{results[-1]['tflops']:7.1f} TFLOP/s" if flops else f"{results[-1]['tbps']:7.3f} TB/s"
        print(f"  {name:14s} {stage:20s} {variant:24s} {ms:9.3f} ms {rate}  rel err {err:.2e}", flush=True)

    def each(stage, kernel, options, torch_stage, flops, mask=valid):
        """kernel(option) for each of {label: option}, and on the GPU the torch stage, which is the reference;
        returns the reference's output."""
        ref = torch_stage()
        for label, option in options.items():
            measure(stage, label, lambda option=option: kernel(option), ref, mask, flops=flops)
        if gpu:
            measure(stage, "torch", torch_stage, ref, mask, flops=flops)
        return ref

    # ---------------------------------------------------------------- row kernels
    elem = x.element_size()
    x_rows = stages.gather(x, sched)
    measure("gather", "triton", lambda: rows.gather(x, sched), x_rows, nbytes=(m + sched.capacity) * hidden * elem)
    expert_out = stages.gather(inp["dy"], sched)  # any [R, H] rows
    combine_bytes = (m + tokens) * hidden * elem
    measure("combine", "triton", lambda: rows.combine(expert_out, rw, sched),
            stages.combine(expert_out, rw, sched), token_mask, nbytes=combine_bytes)
    measure("combine", "triton +shared", lambda: rows.combine(expert_out, rw, sched, x),
            stages.combine(expert_out, rw, sched, x), token_mask, nbytes=combine_bytes + tokens * hidden * elem)
    measure("sum_slots", "triton", lambda: rows.sum_slots(expert_out, sched),
            stages.sum_slots(expert_out, sched), token_mask, nbytes=combine_bytes)
    if gpu:
        measure("combine", "torch", lambda: stages.combine(expert_out, rw, sched),
                stages.combine(expert_out, rw, sched), token_mask, nbytes=combine_bytes)

    # ---------------------------------------------------------------- the GEMM stages, per plan
    flops = 2 * m * 2 * inter * hidden
    gate_up, h = each("gate_up_swiglu",
                      lambda plan: gemm_stages.gate_up_swiglu(x, w_gate, w_up, sched, LIMIT, plan=plan), columns,
                      lambda: stages.gate_up_swiglu(x, w_gate, w_up, sched, LIMIT), flops)
    measure("gate_up_swiglu", "plan, rows given", lambda: gemm_stages.gate_up_swiglu(
        x, w_gate, w_up, sched, LIMIT, plan=columns["plan"], a_rows=x_rows), (gate_up, h), flops=flops)
    each("down", lambda plan: gemm_stages.down(h, w_down, sched, plan=plan), columns,
         lambda: stages.down(h, w_down, sched), 2 * m * hidden * inter)
    d_y_rows = stages.gather(inp["dy"], sched)
    args = (d_y_rows, w_down, gate_up, rw, sched, LIMIT)
    d_gate_up, h_weighted, _ = each("down_dgrad_swiglu", lambda plan: gemm_stages.down_dgrad_swiglu(*args, plan=plan),
                                    columns, lambda: stages.down_dgrad_swiglu(*args), 2 * m * inter * hidden)
    each("gate_up_dgrad", lambda plan: gemm_stages.gate_up_dgrad(d_gate_up, w_gate, w_up, sched, plan=plan), columns,
         lambda: stages.gate_up_dgrad(d_gate_up, w_gate, w_up, sched), 2 * m * hidden * 2 * inter)

    # ---------------------------------------------------------------- weight gradients, per config (whole outputs)
    configs = {"table": None, **({name: name for name in WGRAD_CONFIGS} if gpu else {})}
    each("gate_up_weight_grad", lambda c: weight_grad.gate_up_weight_grad(d_gate_up, x, sched, x_rows=x_rows, config=c),
         configs, lambda: stages.gate_up_weight_grad(d_gate_up, x, sched, x_rows=x_rows), 2 * m * 2 * inter * hidden,
         mask=None)
    each("down_weight_grad", lambda c: weight_grad.down_weight_grad(d_y_rows, h_weighted, sched, config=c), configs,
         lambda: stages.down_weight_grad(d_y_rows, h_weighted, sched), 2 * m * hidden * inter, mask=None)

def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny shape (runs without a GPU, in the interpreter)")
    parser.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help="comma-separated benchmark shapes")
    parser.add_argument("--stages", default=None, help="comma-separated: only these stages (default: all)")
    parser.add_argument("--variant", action="append", default=[], help="'NAME: FIELD=VALUE; ...' (KernelPlan fields)")
    parser.add_argument("--soak", type=float, default=0.0,
                        help="seconds of sustained load before each timing, at the power cap (default: "
                             "do_bench bursts with the L2 flushed)")
    args = parser.parse_args()
    variants = []
    for text in args.variant:
        try:
            name, settings = bench_layer.parse_variant(text)
            bench_layer.variant_plan(settings, KernelPlan())
        except (ValueError, TypeError) as e:
            parser.error(f"--variant {text!r}: {e}")
        variants.append((name, settings))
    gpu = torch.cuda.is_available()
    if not gpu and not args.tiny:
        parser.error("the benchmark shapes need a GPU; --tiny runs a tiny shape in Triton's CPU interpreter")
    names = [TINY_SHAPE] if args.tiny else args.shapes.split(",")
    if set(names) - set(bench_layer.SHAPES) - {TINY_SHAPE}:
        parser.error(f"unknown shapes {sorted(set(names) - set(bench_layer.SHAPES))}; "
                     f"known: {', '.join(bench_layer.SHAPES)}")
    info = bench_layer.env_info(torch.device("cuda" if gpu else "cpu"))
    print(f"{info['gpu']}, torch {info['torch']}, triton {info['triton']}{', interpreter' if common.INTERPRET else ''}")
    start = time.time()
    results = []
    for name in names:
        shape = bench_layer.TINY_SHAPES[name] if args.tiny else bench_layer.SHAPES[name]
        columns = plans(shape.hidden, variants, gpu)
        print(f"{name}: {shape}")
        for label, plan in columns.items():
            print(f"  {label}: " + ", ".join(f"{e.removesuffix('_engine')} {getattr(plan, e)}" for e in ENGINES)
                  + f", use_tma {plan.use_tma}")
        bench_shape(name, shape, columns, gpu, results, args.stages.split(",") if args.stages else None, args.soak)
        if gpu:
            torch.cuda.empty_cache()

    print(f"\n{'shape':14s} {'stage':20s} {'variant':24s} {'ms':>9s} {'rate':>16s} {'of peak':>8s} {'rel err':>9s}")
    for r in results:
        if r["tflops"] is not None:
            rate, peak = f"{r['tflops']:9.1f} TFLOP/s", r["tflops"] / PEAK_TFLOPS
        else:
            rate, peak = f"{r['tbps'] * 1e3:10.0f} GB/s", r["tbps"] / PEAK_TBPS
        print(f"{r['shape']:14s} {r['stage']:20s} {r['variant']:24s} {r['ms']:9.3f} {rate:>16s} {peak:8.1%} "
              f"{r['err']:9.2e}")
    # the interpreter truncates to bf16 instead of rounding: h (rounded twice) lands near 1e-2 there
    tolerance = 3e-2 if common.INTERPRET else 1e-2
    bad = [r for r in results if not r["err"] < tolerance]
    print(f"\n{len(results)} measurements in {time.time() - start:.0f} s; "
          f"{f'all within rel err {tolerance:g}' if not bad else f'{len(bad)} OVER rel err {tolerance:g}'} "
          f"(ceilings: {PEAK_TFLOPS:.0f} TFLOP/s bf16, {PEAK_TBPS} TB/s copy)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
