"""serval against variants of itself: the whole layer, forward + backward, interleaved under sustained load.

    python tools/layer_variants.py --shapes qwen3-30b-a3b,kimi-k2 \
        --variant "triton dgrad: down_dgrad_engine=triton" \
        --variant "gate/up 4 stages: gate_up_tiles.num_stages=4"
    python tools/layer_variants.py --tiny --variant "kernels: backend=triton; block_m=16"   # smoke test, any machine

A variant is "NAME: FIELD=VALUE; ...", as benchmarks/bench_layer.py takes it: fields of serval.plan.KernelPlan,
set in the plan that serval.plan.choose_plan picks for the shape (FIELD.SUB: into a TileConfig / GluonConfig),
or of serval.Config; the default ("serval") is serval.Config().

Protocol: the default and every variant run once first (compiling), their y and gradients compared with the
default's (rel_err: the largest relative error; a plan changes no bits, a Config field such as block_m may round
differently); then they are timed in --rounds rounds of A B C ..., each: --warmup calls, --soak seconds of calls,
then the median of --iters calls (CUDA events; bench_layer.time_ms), so slow drifts of the GPU's clock at its power
cap hit every variant alike. The table (mean ms of the rounds, TFLOP/s as docs/CONTRACT.md counts them, median SM
clock of each round) comes last; --out appends the records as JSON.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bench_layer  # noqa: E402  (puts this checkout's serval on the path)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=None, help="comma-separated benchmark shapes (default: all)")
    parser.add_argument("--variant", action="append", default=[], help="'NAME: FIELD=VALUE; ...'")
    parser.add_argument("--scope", default="routed", choices=bench_layer.SCOPES)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3, help="calls before each round's soak")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--soak", type=float, default=2.0)
    parser.add_argument("--out", default=None, help="JSON list to append the records to")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes, seconds (on the CPU without a GPU)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    variants = [("serval", [])] + bench_layer.parse_variants(parser, args.variant, device)
    table = bench_layer.TINY_SHAPES if args.tiny else bench_layer.SHAPES
    shape_names = args.shapes.split(",") if args.shapes else list(table)
    if set(shape_names) - set(table):
        parser.error(f"unknown shapes {sorted(set(shape_names) - set(table))}; known: {', '.join(table)}")
    info = bench_layer.env_info(device)
    print(f"{info['gpu']}, torch {info['torch']}, triton {info['triton']}")
    monitor = bench_layer.GpuMonitor(device)
    records = []
    for shape_name in shape_names:
        shape = table[shape_name]
        inp = bench_layer.make_inputs(shape, device)
        params = bench_layer.make_params(inp, args.scope)
        steps, errs, default = {}, {}, None
        for name, settings in variants:  # compile every variant before any timing; compare with the default
            impl = bench_layer.serval_impl(settings)
            out = bench_layer.run_and_grads(impl, params, inp["topk_ids"], inp["dy"])
            default = out if default is None else default
            errs[name] = max(bench_layer.compare(out, default).values())
            steps[name] = bench_layer.pass_fn(impl, params, inp["topk_ids"], inp["dy"], "fwdbwd")
        del default, out
        rounds = {name: [] for name, _ in variants}
        for _ in range(args.rounds):
            for name, _ in variants:
                ms = bench_layer.time_ms(steps[name], args.warmup, args.iters, device, args.soak)
                clock, _ = monitor.window(ms * args.iters / 1e3)
                rounds[name].append((ms, clock))
                print(f"{shape_name:16s} {name:24s} {ms:9.3f} ms  {clock} MHz", flush=True)
        for name, settings in variants:
            ms = statistics.mean(r[0] for r in rounds[name])
            records.append(dict(shape=shape_name, variant=name, settings=[f"{p}={v!r}" for p, v in settings],
                                scope=args.scope, rel_err=errs[name], ms=ms, ms_rounds=[r[0] for r in rounds[name]],
                                tflops=bench_layer.flops(shape, args.scope, "fwdbwd") / ms / 1e9,
                                sm_clock_mhz=[r[1] for r in rounds[name]], soak_s=args.soak, **info))
        del inp, params, steps
    monitor.close()
    if args.out:
        bench_layer.save_records(records, args.out)
    print(f"\n{args.scope} fwd+bwd: mean of {args.rounds} rounds; rel_err against serval's default")
    print(f"{'shape':16s} {'variant':24s} {'ms':>9s} {'TFLOP/s':>8s} {'rel_err':>8s}  SM MHz per round")
    for r in records:
        print(f"{r['shape']:16s} {r['variant']:24s} {r['ms']:9.3f} {r['tflops']:8.1f} {r['rel_err']:8.1e}  "
              f"{r['sm_clock_mhz']}")


if __name__ == "__main__":
    main()
