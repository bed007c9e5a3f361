"""How the H200's 700 W power cap moves the SM clock under sustained GEMM load (why bench_layer soaks).

    python benchmarks/power_cap.py [--shape kimi-k2] [--seconds 8]

Runs a dense bf16 matmul (8192^3), then serval's forward + backward on one SPEC shape, each for
--seconds back to back after an idle pause, and prints each one's first calls against its settled
state (the median of the second half): time, TFLOP/s, and the settled SM clock and board power sampled
by nvidia-smi (idle, the clock sits at its 1980 MHz maximum).
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_layer import SHAPES, GpuMonitor, make_inputs, make_params, pass_fn, serval_moe  # noqa: E402


def sustained(fn, seconds, flop, monitor, label, calls_per_sample=5):
    """Run fn back to back for `seconds`; print the first sample and the settled (second-half) median."""
    fn()  # library set-up (cuBLAS handles, autotuning) out of the first sample
    torch.cuda.synchronize()
    time.sleep(3)  # idle first, as between two benchmark entries
    samples = []
    t_end = time.time() + seconds
    while time.time() < t_end:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls_per_sample):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / calls_per_sample)
    settled = sorted(samples[len(samples) // 2:])[len(samples[len(samples) // 2:]) // 2]
    clock, power = monitor.window(seconds / 2)
    print(f"{label:28s} first   {samples[0]:8.3f} ms {flop / samples[0] / 1e9:6.0f} TFLOP/s (from idle)")
    print(f"{label:28s} settled {settled:8.3f} ms {flop / settled / 1e9:6.0f} TFLOP/s"
          + (f"  {clock:5.0f} MHz {power:4.0f} W" if clock else ""), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="kimi-k2", choices=list(SHAPES))
    parser.add_argument("--seconds", type=float, default=8.0)
    args = parser.parse_args()
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    monitor = GpuMonitor(device)
    n = 8192
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    sustained(lambda: a @ b, args.seconds, 2 * n**3, monitor, f"torch.matmul {n}^3")
    inp = make_inputs(SHAPES[args.shape], device)
    H, I, E, k, N, _ = inp["shape"]
    step = pass_fn(serval_moe, make_params(inp, "routed"), inp["topk_ids"], inp["dy"], "fwdbwd")
    sustained(step, args.seconds, 18 * N * k * H * I, monitor, f"serval {args.shape} fwd+bwd")
    monitor.close()


if __name__ == "__main__":
    main()
