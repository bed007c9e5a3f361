"""What is alive when a layer's forward + backward peaks: one step of serval.moe on bench_layer's inputs, every
allocation and free recorded (torch.profiler, profile_memory), the peak above the inputs and the allocations alive
at it, each named by the serval lines on the stack of the torch op that made it (a TorchDispatchMode notes them;
serval's custom ops run their Python bodies under it so that it sees inside).

    python tools/peak_memory.py --shapes kimi-k2,qwen3-30b-a3b --weights-once           # on a GPU
    TRITON_INTERPRET=1 python tools/peak_memory.py --shape 512,256,12,8,256 --backend triton

Per precision (--precisions; FP8 per call: the weight cache emptied before the step; --weights-once: the FP8
weights made beforehand, as once per optimizer step): the peak above the inputs (MiB) and the allocation sites
alive at it, largest first. The step's outputs (y and the gradients) count, as in training. On the CPU, with
--backend triton, the same host code runs (the kernels and the FP8 quantizers in Triton's interpreter, which
allocates no torch memory), except mxfp8's dequantizations, which run as torch ops there with temporaries the
GPU's kernel does not make; the GPU's caching allocator rounds blocks up, which this account does not.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile

import torch
from torch._library import custom_ops
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
    """Notes, for every torch op's output storage, the innermost `depth` serval lines (file:line function) on the
    stack of the op, innermost first."""

    def __init__(self, depth: int):
        super().__init__()
        self.depth = depth
        self.line_of = {}  # storage address -> lines

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "serval":  # serval's custom ops: their Python bodies with this mode on, to see inside
            with self:
                return custom_ops.OPDEFS[func._name]._init_fn(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        lines, frame = [], sys._getframe(1)
        while frame is not None and len(lines) < self.depth:
            if _serval_file(frame.f_code.co_filename):
                path = frame.f_code.co_filename.split(f"serval{os.sep}", 1)[-1]
                lines.append(f"{path}:{frame.f_lineno} {frame.f_code.co_name}")
            frame = frame.f_back
        if lines:
            line = " < ".join(lines)
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                    self.line_of.setdefault(t.untyped_storage().data_ptr(), line)
        return out


def _serval_file(path: str) -> bool:
    return f"{os.sep}serval{os.sep}" in path and f"{os.sep}tools{os.sep}" not in path


def account(trace: dict, device_type: int, line_of: dict):
    """(peak bytes above the start, {name: [count, bytes]} alive at the peak) from the trace's memory events on one
    device type (0 CPU, 1 CUDA). An allocation is named by the serval line whose op made a storage at its address,
    else (made inside a custom op, where the dispatch mode does not look) by the ops around it in the trace,
    outermost serval op first."""
    events = trace["traceEvents"]
    memory = sorted((e["ts"], e["args"]["Addr"], e["args"]["Bytes"]) for e in events
                    if e.get("name") == "[memory]" and e["args"].get("Device Type") == device_type)
    ops = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in events if e.get("cat") == "cpu_op")
    total, peak, peak_at = 0, 0, -1
    for i, (_, _, nbytes) in enumerate(memory):
        total += nbytes
        if total > peak:
            peak, peak_at = total, i
    live = {}
    for ts, addr, nbytes in memory[:peak_at + 1]:
        if nbytes > 0:
            live[addr] = (ts, nbytes)
        else:
            live.pop(addr, None)
    by_name = collections.defaultdict(lambda: [0, 0])
    for addr, (ts, nbytes) in live.items():
        name = line_of.get(addr)
        if name is None:
            around = [op for start, end, op in ops if start <= ts <= end]
            ours = [op for op in around if op.startswith("serval::")]
            name = " > ".join((ours[:1] or around[:1]) + around[-1:]) or "(outside any op)"
        entry = by_name[name]
        entry[0] += 1
        entry[1] += nbytes
    return peak, dict(by_name)


def measure(shape, precision, weights_once, backend, device, top, depth):
    inp = bench_layer.make_inputs(shape, device)
    config = serval.Config(precision=precision, backend=backend)
    expert_weights = None
    if weights_once and precision != "bf16":
        expert_weights = serval.quantize_expert_weights(inp["w_gate"], inp["w_up"], inp["w_down"], precision)
    p = bench_layer.make_params(inp, "routed")
    step(config, p, inp["topk_ids"], inp["dy"], expert_weights)  # compiles; fills the weight cache
    serval.weight_cache.clear()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    makers = Makers(depth)
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
    peak, by_name = account(trace, 1 if device == "cuda" else 0, makers.line_of)
    largest = sorted(by_name.items(), key=lambda item: -item[1][1])[:top]
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
    parser.add_argument("--top", type=int, default=10, help="allocation sites listed at each peak")
    parser.add_argument("--depth", type=int, default=3, help="serval lines that name an allocation site")
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
            peak, largest = measure(shape, precision, args.weights_once, args.backend, args.device, args.top,
                                    args.depth)
            mode = " (weights once)" if args.weights_once and precision != "bf16" else ""
            print(f"  {precision}{mode}: peak {peak / MIB:.2f} MiB above the inputs; alive at it:")
            for name, (count, nbytes) in largest:
                print(f"    {nbytes / MIB:9.2f} MiB  {count:3d} x  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
