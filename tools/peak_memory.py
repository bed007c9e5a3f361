"""What is alive when a layer's forward + backward peaks: one step of serval.moe on bench_layer's inputs, every
allocation and free recorded (torch.profiler, profile_memory), the peak above the inputs and the tensors alive at
it, each named by the innermost serval line whose torch op made it (a TorchDispatchMode notes the line of every
op's outputs).

    TRITON_INTERPRET=1 python tools/peak_memory.py --shape 512,256,12,8,512 --backend triton
    python tools/peak_memory.py --shapes kimi-k2,qwen3-30b-a3b                     # on a GPU

The host code is the same on the CPU (the kernels in Triton's interpreter, which allocates no torch memory) and on
a GPU, so the CPU's account of a small shape is the GPU's, scaled (the GPU's caching allocator also rounds each
block up, which this account does not). Per precision (--precisions; FP8 per call, the weight cache emptied
before the step, and --weights-once: the FP8 weights made beforehand, as once per optimizer step): the peak above
the inputs (MiB) and, at the peak, the live allocations by function, largest first. The step's outputs (y and the
gradients) count: they are alive at the end as in training.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench_layer  # noqa: E402  (puts this checkout's serval first on the path)
import shapes  # noqa: E402

import serval  # noqa: E402
import serval.weight_cache  # noqa: E402

MIB = 2**20


def step(config, p, topk_ids, dy, expert_weights):
    y = serval.moe(p["x"], p["router_weights"], topk_ids, p["w_gate"], p["w_up"], p["w_down"], config=config,
                   expert_weights=expert_weights)
    return y, torch.autograd.grad(y, list(p.values()), dy)


class Makers(TorchDispatchMode):
    """Notes, for every torch op's output storage, the innermost serval line (file:line function) that ran the op."""

    def __init__(self):
        super().__init__()
        self.line_of = {}  # storage address -> line

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        frame = sys._getframe(1)
        while frame is not None and not _serval_file(frame.f_code.co_filename):
            frame = frame.f_back
        if frame is not None:
            line = f"{frame.f_code.co_filename.split('serval/', 1)[-1]}:{frame.f_lineno} {frame.f_code.co_name}"
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                    self.line_of.setdefault(t.untyped_storage().data_ptr(), line)
        return out


def _serval_file(path: str) -> bool:
    return f"{os.sep}serval{os.sep}" in path and f"{os.sep}tools{os.sep}" not in path


def account(trace: dict, device_type: int, line_of: dict):
    """(peak bytes above the start, {line: [count, bytes]} alive at the peak) from the trace's memory events on one
    device type (0 CPU, 1 CUDA). An address is named by the last line that made a storage there."""
    memory = sorted((e["ts"], e["args"]["Addr"], e["args"]["Bytes"]) for e in trace["traceEvents"]
                    if e.get("name") == "[memory]" and e["args"].get("Device Type") == device_type)
    total, peak, peak_at = 0, 0, -1
    for i, (_, _, nbytes) in enumerate(memory):
        total += nbytes
        if total > peak:
            peak, peak_at = total, i
    live = {}
    for _, addr, nbytes in memory[:peak_at + 1]:
        if nbytes > 0:
            live[addr] = nbytes
        else:
            live.pop(addr, None)
    by_line = collections.defaultdict(lambda: [0, 0])
    for addr, nbytes in live.items():
        entry = by_line[line_of.get(addr, "(not a serval op)")]
        entry[0] += 1
        entry[1] += nbytes
    return peak, dict(by_line)


def measure(shape, precision, weights_once, backend, device, top):
    inp = bench_layer.make_inputs(shape, device)
    config = serval.Config(precision=precision, backend=backend)
    expert_weights = None
    if weights_once and precision != "bf16":
        expert_weights = serval.quantize_expert_weights(inp["w_gate"], inp["w_up"], inp["w_down"], precision)
    p = bench_layer.make_params(inp, "routed")
    step(config, p, inp["topk_ids"], inp["dy"], expert_weights)  # compiles; fills the weight cache
    serval.weight_cache.clear()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    makers = Makers()
    with profile(activities=activities, profile_memory=True) as prof, makers:
        out = step(config, p, inp["topk_ids"], inp["dy"], expert_weights)
        if device == "cuda":
            torch.cuda.synchronize()
    del out
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    peak, by_line = account(trace, 1 if device == "cuda" else 0, makers.line_of)
    largest = sorted(by_line.items(), key=lambda item: -item[1][1])[:top]
    return peak, largest


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="", help=f"benchmark shapes ({', '.join(shapes.SHAPES)})")
    parser.add_argument("--shape", action="append", default=[], metavar="H,I,E,K,N",
                        help="a shape of your own (no shared expert); repeatable")
    parser.add_argument("--precisions", default="bf16,fp8_blockwise,mxfp8")
    parser.add_argument("--weights-once", action="store_true", help="FP8: the weights made before the step")
    parser.add_argument("--backend", default="auto", choices=["auto", "triton", "torch"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--top", type=int, default=10, help="lines listed at each peak")
    args = parser.parse_args()
    chosen = {name: shapes.SHAPES[name] for name in filter(None, args.shapes.split(","))}
    for text in args.shape:
        h, i, e, k, n = (int(v) for v in text.split(","))
        chosen[text] = shapes.Shape(h, i, e, k, n, False)
    if not chosen:
        parser.error("name --shapes or --shape")
    for name, shape in chosen.items():
        rows = shape.tokens * shape.top_k
        print(f"{name}: R = {rows} routed rows; R x H x 2 B = {rows * shape.hidden * 2 / MIB:.1f} MiB, "
              f"R x I x 2 B = {rows * shape.inter * 2 / MIB:.1f} MiB, "
              f"E x I x H x 2 B = {shape.experts * shape.inter * shape.hidden * 2 / MIB:.1f} MiB")
        for precision in args.precisions.split(","):
            peak, largest = measure(shape, precision, args.weights_once, args.backend, args.device, args.top)
            mode = " (weights once)" if args.weights_once and precision != "bf16" else ""
            print(f"  {precision}{mode}: peak {peak / MIB:.1f} MiB above the inputs; alive at it:")
            for line, (count, nbytes) in largest:
                print(f"    {nbytes / MIB:8.1f} MiB  {count:3d} x  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
