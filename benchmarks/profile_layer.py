"""Where serval's layer time goes: every GPU kernel of one forward + backward, from torch.profiler.

    python benchmarks/profile_layer.py --shapes kimi-k2,qwen3-30b-a3b [--scope routed|layer] [--soak 2]
    source benchmarks/install_sonicmoe.sh && python benchmarks/profile_layer.py --impls serval,sonicmoe --soak 2

Same inputs as bench_layer.py. Runs a few warm-up steps (--soak S: S seconds of them, so that the profile is
taken at the power cap, as bench_layer times), then profiles `--iters` steps and prints, per shape and
implementation, each kernel's mean time per step, its share of the step, and the step's wall time (CUDA
events) next to the sum of kernel times: the gap is launch overhead and idle GPU.
"""

import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_layer import SHAPES, load_impl, make_inputs, make_params, pass_fn, time_ms  # noqa: E402


def profile_shape(name, impl_name, scope, iters, host, soak, sonic_configs):
    loaded = load_impl(impl_name, torch.device("cuda"), argparse.Namespace(sonic_configs=sonic_configs))
    if loaded is None:
        return
    impl, prepare = loaded
    inp = make_inputs(SHAPES[name], "cuda")
    params = make_params(inp, scope)
    params = prepare(params) if prepare else params
    step = pass_fn(impl, params, inp["topk_ids"], inp["dy"], "fwdbwd")
    wall_ms = time_ms(step, 3, 10, torch.device("cuda"), soak)
    step()  # queued before the profile starts: the profiled steps never wait on an empty queue's host
    step()
    activities = [torch.profiler.ProfilerActivity.CUDA] + ([torch.profiler.ProfilerActivity.CPU] if host else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    host_events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    kernels = {}
    for event in events:
        kernels.setdefault(event.name, [0.0, 0])
        kernels[event.name][0] += event.device_time / 1e3 / iters
        kernels[event.name][1] += 1
    total = sum(ms for ms, _ in kernels.values())
    print(f"\n{name} {impl_name} ({scope}, forward + backward): wall {wall_ms:.3f} ms per step, kernels {total:.3f} ms")
    for kernel, (ms, count) in sorted(kernels.items(), key=lambda kv: -kv[1][0]):
        print(f"  {ms:8.3f} ms {ms / wall_ms:6.1%}  x{count // iters:<3d} {kernel[:100]}")
    # idle GPU between consecutive kernels (the profiled steps run back to back, nothing synchronises)
    gaps = [(b.time_range.start - a.time_range.end, a.name, b.name, a.time_range.end, b.time_range.start)
            for a, b in zip(events, events[1:])]
    idle = sum(g[0] for g in gaps if g[0] > 0) / 1e3 / iters
    print(f"  idle between kernels: {idle:.3f} ms per step; largest gaps (us, before -> after):")
    for gap, before, after, start, end in sorted(gaps, reverse=True)[:8]:
        print(f"    {gap:8.1f}  {before[:45]} -> {after[:45]}")
        if host:  # what the host did while the GPU waited (the CPU profile slows the host down)
            during = collections.Counter(e.name for e in host_events if start <= e.time_range.start < end)
            print("              host: " + ", ".join(f"{n[:40]} x{c}" for n, c in during.most_common(8)))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="kimi-k2,qwen3-30b-a3b")
    parser.add_argument("--impls", default="serval", help="comma-separated: serval, sonicmoe, torch_grouped_mm")
    parser.add_argument("--scope", default="routed", choices=["routed", "layer"])
    parser.add_argument("--soak", type=float, default=0.0, help="seconds of steps before the timed and profiled ones")
    parser.add_argument("--sonic-configs", type=int, default=3, help="autotuning configs per SonicMoE GEMM")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--host", action="store_true", help="also profile the host: what it ran in the GPU's gaps")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name in args.shapes.split(","):
        for impl_name in args.impls.split(","):
            profile_shape(name, impl_name, args.scope, args.iters, args.host, args.soak, args.sonic_configs)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
