"""Where a layer step's GPU time goes, kernel kind by kernel kind: the per-kernel split issue 42 asks for, before
and after a change, on one machine.

    python tools/kernel_split.py                                      # the five shapes, bf16 / fp8_blockwise / mxfp8
    python tools/kernel_split.py --shapes kimi-k2 --precisions fp8_blockwise --per-call
    python tools/kernel_split.py --checkout ../before --precisions fp8_blockwise,mxfp8   # another checkout's serval
    python tools/kernel_split.py --tiny --precisions bf16,mxfp8       # seconds: the tiny shapes

One fwd+bwd of the routed experts on bench_layer's inputs (balanced routing, `serval.moe` with the default
Config), after 5 warm-up steps: the GPU time of every kernel torch.profiler sees over 5 steps, per step, summed by
kind (`KINDS`, by kernel name; torch's own small kernels are "torch ops"); the wall time per step of 10 steps back
to back; the peak memory of one step above its inputs. FP8 weights: quantized once beforehand, as once per
optimizer step (`serval.quantize_expert_weights`), or with --per-call in every step (the weight cache emptied
first). --checkout runs that checkout's `benchmarks/bench_layer.py` and serval (its inputs, its kernels), so two
mains compare on one GPU in two runs of this script. JSON lines (--out, appended), a table last. GPU only.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

import torch

# the kind of each kernel serval launches, by its function name (tests/test_benchmarks.py: every `*_kernel` of
# serval/kernels has one)
KINDS = {
    "_fp8_kernel": "FP8 GEMMs", "_fp8_gemm_kernel": "FP8 GEMMs",
    "_cooperative_kernel": "BF16 GEMMs", "_pingpong_kernel": "BF16 GEMMs", "_grouped_gemm_kernel": "BF16 GEMMs",
    "fused_pass_kernel": "BF16 GEMMs",
    "_wgrad_kernel": "BF16 weight gradients",
    "_quantize_kernel": "quantizers", "_dequantize_kernel": "quantizers",
    "_both_layouts_kernel": "weight quantizers",
    "_forward_kernel": "SwiGLU row passes", "_backward_kernel": "SwiGLU row passes",
    "_gather_kernel": "gathers",
    "_sum_slots_kernel": "sums", "_sum_partials_kernel": "sums",
}
STEPS, WARMUP, WALL_STEPS = 5, 5, 10


def kind(kernel_name: str) -> str:
    """The kind of a kernel from the name the profiler gives it (Triton names a kernel by its function)."""
    return KINDS.get(kernel_name, "torch ops")


def split(bench_layer, shape_name: str, shape, precision: str, per_call: bool) -> dict:
    """One record: the step's GPU ms by kind, its total, wall ms per step and peak GiB above the inputs."""
    import serval
    import serval.weight_cache

    inp = bench_layer.make_inputs(shape, "cuda")
    p = bench_layer.make_params(inp, "routed")
    config = serval.Config(precision=precision)
    weights = None
    if precision != "bf16" and not per_call:
        weights = serval.quantize_expert_weights(p["w_gate"].detach(), p["w_up"].detach(), p["w_down"].detach(),
                                                 precision)

    def step():
        for t in p.values():
            t.grad = None
        if per_call:
            serval.weight_cache.clear()
        y = serval.moe(p["x"], p["router_weights"], inp["topk_ids"], p["w_gate"], p["w_up"], p["w_down"],
                       config=config, expert_weights=weights)
        y.backward(inp["dy"])

    for _ in range(WARMUP):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    start = time.perf_counter()
    for _ in range(WALL_STEPS):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) * 1e3 / WALL_STEPS
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            step()
        torch.cuda.synchronize()
    by_kind = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            by_kind[kind(event.name)] += event.device_time / 1e3 / STEPS
    return dict(shape=shape_name, precision=precision, weights="per call" if per_call else "once",
                gpu_ms=round(sum(by_kind.values()), 3), wall_ms=round(wall, 3), peak_gib=round(peak, 3),
                kinds={k: round(v, 3) for k, v in by_kind.most_common()})


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=None, help="comma-separated names (default: all of the set)")
    parser.add_argument("--tiny", action="store_true", help="the tiny shapes (I = 16 or 32: no fp8_blockwise)")
    parser.add_argument("--precisions", default="bf16,fp8_blockwise,mxfp8")
    parser.add_argument("--per-call", action="store_true", help="FP8 weights quantized in every step")
    parser.add_argument("--checkout", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        help="the checkout whose serval and bench_layer run (default: this one)")
    parser.add_argument("--out", default=None, help="JSON lines to append to")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (the split is of GPU kernel time)")
    checkout = os.path.abspath(args.checkout)
    sys.path.insert(0, os.path.join(checkout, "benchmarks"))
    import bench_layer  # noqa: E402  (puts that checkout's serval first on the path)
    import shapes  # noqa: E402

    gpu = torch.cuda.get_device_name()
    shape_set = shapes.TINY_SHAPES if args.tiny else shapes.SHAPES
    records = []
    for shape_name in args.shapes.split(",") if args.shapes else shape_set:
        for precision in args.precisions.split(","):
            record = dict(split(bench_layer, shape_name, shape_set[shape_name], precision,
                                args.per_call and precision != "bf16"),
                          checkout=checkout, gpu=gpu, torch=torch.__version__, date=time.strftime("%Y-%m-%dT%H:%M:%S"))
            records.append(record)
            print(json.dumps(record), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(record) + "\n")
    kinds = sorted({k for r in records for k in r["kinds"]}, key=lambda k: -max(r["kinds"].get(k, 0) for r in records))
    print(f"\nGPU ms per fwd+bwd step by kernel kind ({gpu}, {checkout})")
    print(f"{'shape':16} {'precision':14} {'total':>7} {'wall':>7} {'peak':>6}  " + "  ".join(kinds))
    for r in records:
        print(f"{r['shape']:16} {r['precision']:14} {r['gpu_ms']:7.2f} {r['wall_ms']:7.2f} {r['peak_gib']:6.2f}  "
              + "  ".join(f"{r['kinds'].get(k, 0):{len(k)}.2f}" for k in kinds))


if __name__ == "__main__":
    main()
