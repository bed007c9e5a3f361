"""
The forward's two expert GEMMs staged (two Triton launches) against fused (one persistent launch), one GPU, EP=1.

For each shape of benchmarks/shapes.py (bench_layer.make_inputs: bf16, balanced routing, seeded; block_m 128):

  staged          serval.kernels.triton_gemm.gate_up_swiglu, then triton_gemm.down (the Triton engine, the plan's
                  gate_up_tiles and down_tiles)
  fused MB        serval.kernels.fused_forward.fused_forward with the same tiles, minibatch MB rows: "mok" (None:
                  MoK's rule, serval.plan.minibatch_rows on all SMs), a number of rows, or "all" (one
                  minibatch: every gate/up tile before any down tile)

The plan is serval.plan.choose_plan's for the shape (its Triton tiles and use_tma; the Gluon engines the layer may
pick instead are not timed here). swiglu_limit None (the layer's default). The gather of x's rows is EXCLUDED from
every timing: both paths start from the same gathered rows [R, H] (serval.kernels.rows.gather, run once). Each fused
minibatch is first checked bit for bit against the staged (gate_up, h, o); a mismatch is recorded and not timed.

Timing: bench_layer.time_ms (--warmup calls, --soak seconds of back-to-back calls, then the median of --iters calls
timed with CUDA events). TFLOP/s as bench_layer counts the routed forward: 6 * N*k * H * I / time (padding rows
not counted). Few iterations by default, so that all five shapes take a few minutes (kernel compiles included:
one per minibatch size and shape).

  python benchmarks/bench_fused_forward.py                             # all shapes, results/h200_fused_forward.json
  python benchmarks/bench_fused_forward.py --shapes kimi-k2 --minibatches mok,512,2048
  python benchmarks/bench_fused_forward.py --tiny                      # CPU smoke test (Triton's interpreter)

Each record appended to --out: {shape, impl ("staged" / "fused"), minibatch (as given), minibatch_rows (resolved),
ms, tflops, bitwise_equal, gather ("excluded"), error, date, gpu, torch, triton}.
"""

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_layer  # noqa: E402  (puts this checkout's serval first on the path; without a GPU, TRITON_INTERPRET=1)
from shapes import SHAPES, TINY_SHAPES  # noqa: E402

from serval.kernels import common, fused_launch, rows, task_order, triton_gemm  # noqa: E402
from serval.plan import TileConfig, choose_plan  # noqa: E402
from serval.schedule import build_schedule  # noqa: E402
from serval.values import new_sync  # noqa: E402

SWIGLU_LIMIT = None


def bits(t):
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def bitwise_equal(got, want, schedule):
    """(gate_up, h, o) bit for bit over what the kernels write: every packed row, the used rows of h and o (rows
    past the used M-tiles are never written: uninitialised memory)."""
    used = int(schedule.expert_offsets[-1])
    return all(torch.equal(bits(x[:n]), bits(y[:n])) for x, y, n in zip(got, want, (got[0].shape[0], used, used)))


def parse_minibatch(text):
    """'mok' -> None (MoK's rule), 'all' -> a row count past any capacity (one minibatch), else rows."""
    if text == "mok":
        return None
    return 1 << 40 if text == "all" else int(text)


def setup(shape, device, tiny):
    """(a_rows, weights, schedule, gate_up_tiles, down_tiles, use_tma) of one shape; the gather runs here, once."""
    inp = bench_layer.make_inputs(shape, device)
    block_m = 16 if tiny else 128
    schedule = build_schedule(inp["topk_ids"], shape.experts, block_m)
    plan = choose_plan(shape.hidden, torch.bfloat16, common.target())
    gate_up_tiles, down_tiles = plan.gate_up_tiles, plan.down_tiles
    if tiny:  # the interpreter's tiles, on 16-row M-tiles
        gate_up_tiles = down_tiles = TileConfig(16, 32, 32, group_m=2)
    a_rows = rows.gather(inp["x"], schedule)
    return a_rows, (inp["w_gate"], inp["w_up"], inp["w_down"]), schedule, gate_up_tiles, down_tiles, plan.use_tma


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=None, help="comma-separated names (default: all)")
    parser.add_argument("--minibatches", default="mok,256,all",
                        help="comma-separated minibatch sizes of the fused kernel: mok, all, or rows")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--soak", type=float, default=0.5, help="seconds of back-to-back calls before timing (CUDA)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (on the CPU: Triton's interpreter, 1 call)")
    parser.add_argument("--out", default=None, help="JSON list to append to (default: benchmarks/results/"
                        "h200_fused_forward.json; with --tiny: bench_fused_forward_tiny.json in the temp folder)")
    args = parser.parse_args()
    if args.out is None:
        args.out = os.path.join(tempfile.gettempdir(), "bench_fused_forward_tiny.json") if args.tiny else \
            "benchmarks/results/h200_fused_forward.json"
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.tiny:
        parser.error("without a GPU only --tiny runs (in Triton's interpreter)")
    table = TINY_SHAPES if args.tiny else SHAPES
    shape_names = args.shapes.split(",") if args.shapes else list(table)
    if set(shape_names) - set(table):
        parser.error(f"unknown shapes {sorted(set(shape_names) - set(table))}; known: {', '.join(table)}")
    minibatches = args.minibatches.split(",")
    for text in minibatches:
        if text not in ("mok", "all") and not (text.isdigit() and int(text) > 0):
            parser.error(f"--minibatches: {text!r} is not mok, all or a positive row count")
    if device.type != "cuda":  # the interpreter: one call, only to exercise the code
        args.warmup, args.iters, args.soak = 0, 1, 0.0
    info = bench_layer.env_info(device)
    print(f"{info['gpu']}, torch {info['torch']}, triton {info['triton']}; gather excluded from the timings")

    rows_out = []
    for name in shape_names:
        shape = table[name]
        a_rows, (w_gate, w_up, w_down), schedule, gu_tiles, dn_tiles, use_tma = setup(shape, device, args.tiny)
        flops = bench_layer.flops(shape, "routed", "fwd")
        block_m = min(gu_tiles.block_m, schedule.block_m)
        sync = new_sync(schedule.capacity // block_m, device)

        def staged():
            gate_up, h = triton_gemm.gate_up_swiglu(a_rows, w_gate, w_up, schedule, SWIGLU_LIMIT, gu_tiles, use_tma)
            return gate_up, h, triton_gemm.down(h, w_down, schedule, dn_tiles, use_tma)

        def fused(minibatch_rows):
            return fused_launch.fused_forward(a_rows, w_gate, w_up, w_down, schedule, SWIGLU_LIMIT, gu_tiles, dn_tiles,
                                              use_tma, minibatch_rows, sync)[:3]

        want = staged()
        base = dict(shape=name, gather="excluded", error=None, **info)
        ms = bench_layer.time_ms(staged, args.warmup, args.iters, device, args.soak)
        records = [dict(base, impl="staged", minibatch=None, minibatch_rows=None, ms=ms, tflops=flops / ms / 1e9,
                        bitwise_equal=True)]
        for text in minibatches:
            minibatch_rows = parse_minibatch(text)
            resolved = block_m * task_order.minibatch_m_tiles(
                minibatch_rows, shape.hidden, shape.inter, block_m, schedule.capacity // block_m, gu_tiles.block_n,
                dn_tiles.block_n, gu_tiles.group_m, common.num_sms(device.index if device.type == "cuda" else None))[0]
            record = dict(base, impl="fused", minibatch=text, minibatch_rows=resolved, ms=None, tflops=None)
            record["bitwise_equal"] = equal = bitwise_equal(fused(minibatch_rows), want, schedule)
            if equal:
                record["ms"] = bench_layer.time_ms(lambda: fused(minibatch_rows), args.warmup, args.iters, device,
                                                   args.soak)
                record["tflops"] = flops / record["ms"] / 1e9
            else:
                record["error"] = "mismatch"
            records.append(record)
        for r in records:
            label = r["impl"] if r["impl"] == "staged" else f"fused {r['minibatch']} ({r['minibatch_rows']} rows)"
            timing = f"{r['ms']:9.3f} ms {r['tflops']:7.1f} TFLOP/s" if r["ms"] is not None else "MISMATCH: not timed"
            print(f"{name:<16} {label:<28} {timing}", flush=True)
        bench_layer.save_records(records, args.out)
        rows_out += records
        del a_rows, w_gate, w_up, w_down, want
        if device.type == "cuda":
            torch.cuda.empty_cache()

    print(f"\nforward, routed experts, gather excluded: ms (TFLOP/s); {args.out}")
    labels = ["staged"] + [f"fused {m}" for m in minibatches]
    print(f"{'shape':<16}" + "".join(f"{label:>22}" for label in labels))
    for name in shape_names:
        cells = []
        for label in labels:
            r = next(r for r in rows_out if r["shape"] == name and
                     (r["impl"] == "staged" if label == "staged" else f"fused {r['minibatch']}" == label))
            cells.append(f"{r['ms']:.3f} ({r['tflops']:.0f})" if r["ms"] is not None else "mismatch")
        print(f"{name:<16}" + "".join(f"{c:>22}" for c in cells))


if __name__ == "__main__":
    main()
