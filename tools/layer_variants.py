"""serval against variants of itself: the whole layer, forward + backward, interleaved under sustained load.

    python benchmarks/layer_variants.py --shapes qwen3-30b-a3b,kimi-k2 \
        --variant "triton dgrad: grouped_gemm.WARP_SPECIALIZED=False" \
        --variant "gate/up 4 stages: grouped_gemm.CONFIGS.hopper.gate_up_swiglu.num_stages=4"
    python benchmarks/layer_variants.py --tiny --variant "x: grouped_gemm.FUSED_GATHER=True"   # CPU smoke test

A variant is "name: setting; setting; ...", a setting `module.path=value`: module is a submodule of
serval.kernels, path walks module attributes, dict keys and dataclass fields (a frozen dataclass, such as
a TileConfig, is replaced by a copy), value is a Python literal. Settings must be ones the kernels read at
call time (module flags, the CONFIGS table): the layer calls the stage functions through serval.kernels'
own references, so replacing a function in grouped_gemm would change nothing. Each setting is undone after
its variant ran.

Protocol: the default ("serval") and every variant are compiled once, then timed in --rounds rounds of
A B C ... (each: --soak seconds of calls, then the median of --iters calls, CUDA events; bench_layer.time_ms),
so slow drifts of the GPU's clock at its power cap hit every variant alike. The table (mean ms of the rounds,
TFLOP/s as SPEC.md counts them, median SM clock of each round) comes last; --out appends the records as JSON.
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import importlib
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_layer  # noqa: E402  (puts this checkout's serval on the path)


def parse_variant(text):
    """'name: a.b=1; c.d=x' -> (name, [("a.b", 1), ("c.d", "x")])."""
    name, _, settings = text.partition(":")
    if not settings.strip():
        raise ValueError(f"variant {text!r}: expected 'name: module.path=value; ...'")
    parsed = []
    for setting in settings.split(";"):
        path, eq, value = setting.partition("=")
        if not eq:
            raise ValueError(f"variant {name!r}: setting {setting.strip()!r} has no '='")
        try:
            value = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            value = value.strip()
        parsed.append((path.strip(), value))
    return name.strip(), parsed


def _child(obj, key):
    return obj[key] if isinstance(obj, dict) else getattr(obj, key)


def _with(obj, key, value):
    """obj with key set to value: in place for modules and dicts, a copy for (frozen) dataclasses."""
    if isinstance(obj, dict):
        obj[key] = value
        return obj
    if dataclasses.is_dataclass(obj):
        return dataclasses.replace(obj, **{key: value})
    setattr(obj, key, value)
    return obj


def apply(settings):
    """Apply the settings; returns how to undo them (the touched module attributes' original values)."""
    undo = []
    for path, value in settings:
        module_name, *keys = path.split(".")
        module = importlib.import_module(f"serval.kernels.{module_name}")
        if not keys or not hasattr(module, keys[0]):
            raise ValueError(f"setting {path!r}: serval.kernels.{module_name} has no {keys[:1]}")
        undo.append((module, keys[0], copy.deepcopy(getattr(module, keys[0]))))
        chain = [module]
        for key in keys[:-1]:
            chain.append(_child(chain[-1], key))
        for obj, key in zip(reversed(chain), reversed(keys)):  # rebuild upward (dataclasses are copies)
            value = _with(obj, key, value)
    return undo


def undo(saved):
    for module, name, value in reversed(saved):
        setattr(module, name, value)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=None, help="comma-separated SPEC shapes (default: all)")
    parser.add_argument("--variant", action="append", default=[], help="'name: module.path=value; ...'")
    parser.add_argument("--scope", default="routed", choices=bench_layer.SCOPES)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--soak", type=float, default=2.0)
    parser.add_argument("--out", default=None, help="JSON list to append the records to")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (torch stages), seconds")
    args = parser.parse_args()
    variants = [("serval", [])] + [parse_variant(v) for v in args.variant]
    table = bench_layer.TINY_SHAPES if args.tiny else bench_layer.SHAPES
    shape_names = args.shapes.split(",") if args.shapes else list(table)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    info = bench_layer.env_info(device)
    print(f"{info['gpu']}, torch {info['torch']}, triton {info['triton']}")
    monitor = bench_layer.GpuMonitor(device)
    records = []
    for shape_name in shape_names:
        shape = table[shape_name]
        inp = bench_layer.make_inputs(shape, device)
        params = bench_layer.make_params(inp, args.scope)
        step = bench_layer.pass_fn(bench_layer.serval_moe, params, inp["topk_ids"], inp["dy"], "fwdbwd")
        for _, settings in variants:  # compile every variant before any timing
            saved = apply(settings)
            step()
            undo(saved)
        rounds = {name: [] for name, _ in variants}
        for _ in range(args.rounds):
            for name, settings in variants:
                saved = apply(settings)
                ms = bench_layer.time_ms(step, 3, args.iters, device, args.soak)
                clock, _ = monitor.window(ms * args.iters / 1e3)
                undo(saved)
                rounds[name].append((ms, clock))
                print(f"{shape_name:16s} {name:24s} {ms:9.3f} ms  {clock} MHz", flush=True)
        for name, settings in variants:
            ms = statistics.mean(r[0] for r in rounds[name])
            records.append(dict(shape=shape_name, variant=name, settings=[f"{p}={v!r}" for p, v in settings],
                                scope=args.scope, ms=ms, ms_rounds=[r[0] for r in rounds[name]],
                                tflops=bench_layer.flops(shape, args.scope, "fwdbwd") / ms / 1e9,
                                sm_clock_mhz=[r[1] for r in rounds[name]], soak_s=args.soak, **info))
        del inp, params, step
    monitor.close()
    if args.out:
        old = json.load(open(args.out)) if os.path.exists(args.out) else []
        with open(args.out, "w") as f:
            json.dump(old + records, f, indent=1)
    print(f"\n{args.scope} fwd+bwd: mean of {args.rounds} rounds")
    print(f"{'shape':16s} {'variant':24s} {'ms':>9s} {'TFLOP/s':>8s}  SM MHz per round")
    for r in records:
        print(f"{r['shape']:16s} {r['variant']:24s} {r['ms']:9.3f} {r['tflops']:8.1f}  {r['sm_clock_mhz']}")


if __name__ == "__main__":
    main()
