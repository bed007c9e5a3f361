"""What is alive when a layer's forward + backward peaks: one step of serval.moe on bench_layer's inputs, every
storage the step's torch ops make followed until it is freed, the peak above the inputs and the storages alive at
it, each named by the serval lines on the stack of the op that made it.

    python tools/peak_memory.py --shapes kimi-k2,qwen3-30b-a3b --weights-once           # on a GPU
    TRITON_INTERPRET=1 python tools/peak_memory.py --shape 512,128,8,8,256 --backend triton

A TorchDispatchMode sees every op (serval's custom ops run their Python bodies under it, so that it sees inside
them): it notes each new output storage with a weak reference and the three innermost serval lines of the op, and
after each op sums the storages still alive; the peak is the largest sum (storages are made by ops, so the peak
falls after one). Per precision (--precisions; FP8 per call: the weight cache emptied before the step;
--weights-once: the FP8 weights made beforehand, as once per optimizer step): the peak above the inputs (MiB) and
the allocation sites alive at it, largest first. The step's outputs (y and the gradients) count, as in training.
The host code is the same on the CPU (with --backend triton: the kernels and the FP8 quantizers in Triton's
interpreter, whose copies of a launch's bf16 arguments are left out) and on a GPU, so a small shape's account on
the CPU is the GPU's, except mxfp8's dequantizations, which run as torch ops on the CPU with temporaries the
GPU's kernel does not make. Allocated bytes, as `torch.cuda.max_memory_allocated` counts them (not the caching
allocator's rounding).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch
from torch._library import custom_ops
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench_layer  # noqa: E402  (puts this checkout's serval first on the path)
import shapes  # noqa: E402

import serval  # noqa: E402
import serval.weight_cache  # noqa: E402

MIB = 2**20


class Storages(TorchDispatchMode):
    """Follows every storage the ops under it make: the live bytes after each op, their peak, and at the peak the
    live storages by site (the innermost `depth` serval lines, file:line function, innermost first)."""

    def __init__(self, depth: int):
        super().__init__()
        self.depth = depth
        self.live = {}  # weak reference key -> (StorageWeakRef, bytes, site)
        self.peak, self.at_peak = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "serval":  # serval's custom ops: their Python bodies with this mode on, to see inside
            with self:
                return custom_ops.OPDEFS[func._name]._init_fn(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        site = self._site()
        # an output on an input's storage (a view, an in-place op) is not new: it may be a storage from before
        inputs = {StorageWeakRef(t.untyped_storage()).cdata for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if site is not None and isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                ref = StorageWeakRef(t.untyped_storage())
                if ref.cdata not in self.live and ref.cdata not in inputs:
                    self.live[ref.cdata] = (ref, t.untyped_storage().nbytes(), site)
        self.live = {key: entry for key, entry in self.live.items() if not entry[0].expired()}
        total = sum(nbytes for _, nbytes, _ in self.live.values())
        if total > self.peak:
            self.peak, self.at_peak = total, [(nbytes, site) for _, nbytes, site in self.live.values()]
        return out

    def _site(self) -> str | None:
        """The op's serval lines; None for an op of Triton's interpreter (its copies of a launch's bf16 arguments,
        which the GPU does not make)."""
        lines, frame = [], sys._getframe(2)
        while frame is not None and len(lines) < self.depth:
            path = frame.f_code.co_filename
            if not lines and f"triton{os.sep}runtime{os.sep}interpreter" in path:
                return None
            if f"{os.sep}serval{os.sep}" in path:
                lines.append(f"{path.split(f'serval{os.sep}', 1)[-1]}:{frame.f_lineno} {frame.f_code.co_name}")
            frame = frame.f_back
        return " < ".join(lines) or "(outside serval)"


def step(config, p, topk_ids, dy, expert_weights):
    y = serval.moe(p["x"], p["router_weights"], topk_ids, p["w_gate"], p["w_up"], p["w_down"], config=config,
                   expert_weights=expert_weights)
    return y, torch.autograd.grad(y, list(p.values()), dy)


def measure(shape, precision, weights_once, backend, device, depth):
    """(peak bytes above the inputs, [(bytes, count, site)] alive at it, largest first) of one step."""
    inp = bench_layer.make_inputs(shape, device)
    config = serval.Config(precision=precision, backend=backend)
    expert_weights = None
    if weights_once and precision != "bf16":
        expert_weights = serval.quantize_expert_weights(inp["w_gate"], inp["w_up"], inp["w_down"], precision)
    p = bench_layer.make_params(inp, "routed")
    step(config, p, inp["topk_ids"], inp["dy"], expert_weights)  # compiles
    serval.weight_cache.clear()
    storages = Storages(depth)
    with storages:
        out = step(config, p, inp["topk_ids"], inp["dy"], expert_weights)
    del out
    by_site = collections.defaultdict(lambda: [0, 0])
    for nbytes, site in storages.at_peak:
        by_site[site][0] += nbytes
        by_site[site][1] += 1
    return storages.peak, sorted(((nbytes, count, site) for site, (nbytes, count) in by_site.items()), reverse=True)


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
            peak, sites = measure(shape, precision, args.weights_once, args.backend, args.device, args.depth)
            mode = " (weights once)" if args.weights_once and precision != "bf16" else ""
            print(f"  {precision}{mode}: peak {peak / MIB:.2f} MiB above the inputs; alive at it:")
            for nbytes, count, site in sites[:args.top]:
                print(f"    {nbytes / MIB:9.2f} MiB  {count:3d} x  {site}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
