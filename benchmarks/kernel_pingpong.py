"""Check and time the warp-specialised ping-pong grouped GEMM (serval.kernels.warp_specialized: the down dgrad
fused with the SwiGLU backward) against serval's one-role Triton kernel (serval.kernels.grouped_gemm), on the H200.

    python benchmarks/kernel_pingpong.py [--soak 1] [--shapes qwen3-30b-a3b kimi-k2]   # sm_90, Triton 3.6
    python benchmarks/kernel_pingpong.py --compile-only   # any machine with Triton 3.6: smem, registers, spills

Checks first, on small cases that put several tiles on each program and consumer (three experts, a ring
shorter than the K loop, a tile of padding rows) and then on each SPEC shape: the dgrad's d_gate_up /
h_weighted must equal the Triton kernel's bit for bit (same fp32 accumulation order, same epilogue
operations); the router-weight gradient within float rounding (its row sums run in another register
layout). Then times both kernels (bench_layer's sustained-load protocol with --soak). Prints
"not run" where the ping-pong kernel is not available (no sm_90 GPU, another Triton release).
"""
import argparse
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from serval.kernels import grouped_gemm as gg  # noqa: E402
from serval.kernels import warp_specialized as ws  # noqa: E402


def dgrad_inputs(schedule, hidden, inter, num_tokens, top_k, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    randn = lambda *s, scale=1.0: (torch.randn(*s, generator=g, device="cuda") * scale).to(torch.bfloat16)
    return (randn(schedule.capacity, hidden), randn(schedule.num_experts, hidden, inter, scale=inter**-0.5),
            randn(schedule.num_packed, 2 * inter), torch.rand(num_tokens * top_k, generator=g, device="cuda"),
            schedule)


def compare_dgrad(args, limit, **ring):
    """(bitwise d_gate_up and h_weighted, d_rw relative error) over the used rows; ring: the ping-pong kernel's
    stages."""
    schedule = args[-1]
    used = schedule.row_source >= 0
    if ring:
        d_gate_up, h_weighted, partials = ws.down_dgrad_swiglu_partials(*args[:4], schedule, limit, **ring)
        got = d_gate_up, h_weighted, gg._sum_partials(partials, schedule)
    else:
        got = gg.down_dgrad_swiglu(*args, limit, warp_specialized=True)
    ref = gg.down_dgrad_swiglu(*args, limit, warp_specialized=False)
    same = all(torch.equal(a[used], b[used]) for a, b in zip(got[:2], ref[:2]))
    d_rw_err = ((got[2][used] - ref[2][used]).norm() / ref[2][used].norm()).item()
    return same, d_rw_err


def check_small():
    from serval.schedule import build_schedule

    torch.manual_seed(0)
    E, H, I, N, k = 3, 256, 384, 200, 2
    topk = torch.stack([torch.arange(N, device="cuda") % E, (torch.arange(N, device="cuda") + 1) % E], 1)
    schedule = build_schedule(topk, E, 128)
    args = dgrad_inputs(schedule, H, I, N, k)
    ok = True
    for ring in (dict(stages=2), dict(stages=3), {}):
        for limit in (None, 0.5):
            same, err = compare_dgrad(args, limit, **ring)
            print(f"small dgrad {ring} swiglu_limit={limit}: d_gate_up, h_weighted "
                  f"{'bitwise equal' if same else 'MISMATCH'}, d_rw rel err {err:.1e}")
            ok &= same and err < 1e-5
    return ok


def compile_only():
    """Compile the kernel for sm_90a without a GPU (Triton 3.6 installed) and print shared memory,
    registers and spill bytes (ptxas -v): a Gluon change can be checked before it takes device time."""
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from serval.schedule import build_schedule

    E, H, I, N, k = 4, 512, 256, 256, 2  # small CPU tensors: only their dtypes, alignments and boxes matter
    topk = torch.stack([torch.arange(N) % E, (torch.arange(N) + 1) % E], 1)
    schedule = build_schedule(topk, E, 128)
    rows = lambda cols: torch.zeros(schedule.capacity, cols, dtype=torch.bfloat16)
    w = torch.zeros(E, H, I, dtype=torch.bfloat16)
    launches = []  # (args, kwargs) of each launch, recorded instead of run
    kernel, ws._pingpong_kernel = ws._pingpong_kernel, type("Recorder", (), {
        "__getitem__": lambda self, grid: lambda *args, **kwargs: launches.append((args, kwargs))})()
    try:
        ws.down_dgrad_swiglu_partials(rows(H), w, torch.zeros(schedule.num_packed, 2 * I, dtype=torch.bfloat16),
                                      torch.zeros(N * k), schedule, None)
    finally:
        ws._pingpong_kernel = kernel
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    print(f"triton {triton.__version__}, sm_90a: shared memory (of 232448 B), registers, spill bytes")
    for args, kwargs in launches:
        kwargs = dict(kwargs)
        options = dict(num_warps=kwargs.pop("num_warps"), maxnreg=kwargs.pop("maxnreg"))
        signature = {name: mangle_type(arg) for name, arg in zip(kernel.arg_names, args)}
        signature.update({name: "constexpr" for name in kwargs})
        constexprs = {(kernel.arg_names.index(name),): value for name, value in kwargs.items()}
        compiled = triton.compile(GluonASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                                  options=options)
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
            ptx.write(compiled.asm["ptx"])
            ptx.flush()
            report = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx.name, "-o", os.devnull], capture_output=True,
                                    text=True).stderr
        regs = re.findall(r"Used (\d+) registers", report)
        spills = re.findall(r"(\d+) bytes spill stores", report)
        print(f"  dgrad + SwiGLU backward STAGES {kwargs['STAGES']} GROUP_M {kwargs['GROUP_M']}: smem "
              f"{compiled.metadata.shared:7d}  registers {regs[0] if regs else '?':>4s} (per thread before setmaxnreg)"
              f"  spills {spills[0] if spills else '?':>5s}", flush=True)
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="*", default=["qwen3-30b-a3b", "kimi-k2"])
    parser.add_argument("--soak", type=float, default=1.0)
    parser.add_argument("--compile-only", action="store_true",
                        help="compile for sm_90a and show shared memory, registers, spills (no GPU needed)")
    args = parser.parse_args()
    if args.compile_only:
        gluon_release = ".".join(triton.__version__.split(".")[:2]) in ws.GLUON_VERSIONS
        if not gluon_release or os.environ.get("TRITON_INTERPRET") == "1":
            print(f"kernel_pingpong --compile-only: needs Triton {'/'.join(ws.GLUON_VERSIONS)} and TRITON_INTERPRET "
                  "unset; not run")
            return 0
        return compile_only()
    if not ws.available():
        print(f"kernel_pingpong: needs an sm_90 GPU and Triton {'/'.join(ws.GLUON_VERSIONS)}; not run")
        return 0
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from kernel_stages import SHAPES, make_inputs, timer

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    ok = check_small()
    run_timed = timer(False, args.soak)
    table = []
    for name in args.shapes:
        shape = SHAPES[name]
        data = make_inputs(shape, torch.device("cuda"), 128)
        schedule = data["schedule"]
        flops = 2 * shape["tokens"] * shape["top_k"] * shape["hidden"] * shape["inter"]
        dgrad_args = dgrad_inputs(schedule, shape["hidden"], shape["inter"], shape["tokens"], shape["top_k"])
        same, err = compare_dgrad(dgrad_args, None)
        print(f"{name} dgrad: d_gate_up, h_weighted {'bitwise equal' if same else 'MISMATCH'}, d_rw rel err {err:.1e}")
        ok &= same and err < 1e-5
        variants = {
            ("dgrad+swiglu", "triton"): lambda: gg.down_dgrad_swiglu(*dgrad_args, None, warp_specialized=False),
            ("dgrad+swiglu", "ping-pong"): lambda: gg.down_dgrad_swiglu(*dgrad_args, None, warp_specialized=True),
        }
        for (stage, label), fn in variants.items():
            ms = run_timed(fn)
            table.append(f"{name:14s} {stage:13s} {label:10s} {ms:7.3f} ms {flops / ms / 1e9:6.1f} TFLOP/s")
            print(table[-1], flush=True)
    print("\n".join(["", "shape          stage         kernel          ms    TFLOP/s"] + table))
    print("all checks passed" if ok else "CHECK FAILED: MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
