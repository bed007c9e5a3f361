"""serval.kernels.cooperative (cooperative 128 x 256 tiles) against grouped_gemm's Triton kernel, on the H200:
gate/up + SwiGLU (x's rows gathered by its loader, against gather pass + Triton kernel), down and the gate/up
dgrad (A by TMA, plain stores).

    python benchmarks/kernel_coop.py [--shapes qwen3-30b-a3b,qwen3.5-397b,kimi-k2] [--soak 1]
    python benchmarks/kernel_coop.py --compile-only    # any machine with Triton 3.6: smem, registers, spills

Checks first (small cases: three experts, a padding-only tile, partial N tiles, swiglu_limit; the layer with and
without the kernel; then each shape): every output (used rows) must equal the Triton kernel's bit for bit. Then
times each variant, two interleaved rounds under sustained load (bench_layer's protocol), and prints a table last.
The layer A/Bs that set grouped_gemm.COOPERATIVE_GATHER_MAX_HIDDEN and COOPERATIVE_STORE:

    python benchmarks/layer_variants.py --shapes qwen3-30b-a3b,qwen3.5-397b,kimi-k2 --rounds 3 \
        --variant "no coop: grouped_gemm.COOPERATIVE_GATHER_MAX_HIDDEN=0" \
        --variant "coop everywhere: grouped_gemm.COOPERATIVE_GATHER_MAX_HIDDEN=100000"
    python benchmarks/layer_variants.py --shapes qwen3-30b-a3b,kimi-k2 --rounds 3 \
        --variant "triton down: grouped_gemm.COOPERATIVE_STORE.down=False" \
        --variant "triton gate/up dgrad: grouped_gemm.COOPERATIVE_STORE.gate_up_dgrad=False"
"""
import argparse
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from serval.kernels import grouped_gemm as gg  # noqa: E402
from serval.kernels import warp_specialized as ws  # noqa: E402
from serval.kernels.rows import gather as gather_rows  # noqa: E402
from serval.schedule import build_schedule  # noqa: E402


def same_as_triton(x, w_gate, w_up, schedule, limit, **kw):
    from serval.kernels import cooperative

    used = schedule.row_source >= 0
    x_rows = gather_rows(x, schedule)
    got = cooperative.gate_up_swiglu(x if kw.get("gather") else x_rows, w_gate, w_up, schedule, limit, **kw)
    ref = gg.gate_up_swiglu(x, w_gate, w_up, schedule, limit, a_rows=x_rows)
    torch.cuda.synchronize()
    return torch.equal(got[0], ref[0]) and torch.equal(got[1][used], ref[1][used])


def store_same_as_triton(stage, *args):
    """cooperative's down or gate_up_dgrad against grouped_gemm's Triton kernel, used rows, twice."""
    from serval.kernels import cooperative

    schedule = args[-1]
    used = schedule.row_source >= 0
    ref = getattr(gg, stage)(*args, config=gg.default_config(stage))
    got = [getattr(cooperative, stage)(*args) for _ in range(2)]
    torch.cuda.synchronize()
    return all(torch.equal(g[used], ref[used]) for g in got)


def compile_only():
    """Compile both loader variants for sm_90a without a GPU (Triton 3.6) and print smem / registers / spills."""
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from serval.kernels import cooperative as co

    E, H, I, N = 4, 512, 256, 256
    topk = torch.stack([torch.arange(N) % E, (torch.arange(N) + 1) % E], 1)
    schedule = build_schedule(topk, E, 128)
    w = torch.zeros(E, I, H, dtype=torch.bfloat16)
    launches = []
    kernel, co._cooperative_kernel = co._cooperative_kernel, type("Recorder", (), {
        "__getitem__": lambda self, grid: lambda *a, **kw: launches.append((a, kw))})()
    num_sms, co.common.num_sms = co.common.num_sms, lambda *a: 132
    try:
        co.gate_up_swiglu(torch.zeros(schedule.capacity, H, dtype=torch.bfloat16), w, w, schedule, None, gather=False)
        co.gate_up_swiglu(torch.zeros(N, H, dtype=torch.bfloat16), w, w, schedule, None, gather=True)
        co.down(torch.zeros(schedule.capacity, I, dtype=torch.bfloat16), w.transpose(1, 2).contiguous(), schedule)
        co.gate_up_dgrad(torch.zeros(schedule.capacity, 2 * I, dtype=torch.bfloat16), w, w, schedule)
    finally:
        co._cooperative_kernel, co.common.num_sms = kernel, num_sms
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    for args, kwargs in launches:
        kwargs = dict(kwargs)
        options = dict(num_warps=kwargs.pop("num_warps"), maxnreg=kwargs.pop("maxnreg"))
        signature = {name: mangle_type(arg) for name, arg in zip(kernel.arg_names, args)}
        signature.update({name: "constexpr" for name in kwargs})
        constexprs = {(kernel.arg_names.index(name),): value for name, value in kwargs.items()}
        # 16-byte alignment of pointers and of ints that are multiples of 16, as the launcher specialises
        attrs = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(args) if isinstance(arg, torch.Tensor)
                 or (isinstance(arg, int) and not isinstance(arg, bool) and arg % 16 == 0)}
        compiled = triton.compile(GluonASTSource(kernel, signature, constexprs, attrs),
                                  target=GPUTarget("cuda", 90, 32), options=options)
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
            ptx.write(compiled.asm["ptx"])
            ptx.flush()
            report = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx.name, "-o", os.devnull], capture_output=True,
                                    text=True).stderr
        found = re.findall(r"Used \d+ registers|\d+ bytes spill stores", report)
        print(f"{kwargs['EPILOGUE']:10s} W_NK {kwargs['W_NK']!s:5s} K_SPLIT {kwargs['K_SPLIT']!s:5s} A_GATHER "
              f"{kwargs['A_GATHER']!s:5s} STAGES {kwargs['STAGES']}: smem {compiled.metadata.shared}, {found}",
              flush=True)
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="qwen3-30b-a3b,qwen3.5-397b,kimi-k2")
    parser.add_argument("--soak", type=float, default=1.0)
    parser.add_argument("--compile-only", action="store_true")
    args = parser.parse_args()
    if args.compile_only:
        if ".".join(triton.__version__.split(".")[:2]) not in ws.GLUON_VERSIONS:
            print(f"kernel_coop --compile-only: needs Triton {'/'.join(ws.GLUON_VERSIONS)}; not run")
            return 0
        return compile_only()
    if not ws.available():
        print(f"kernel_coop: needs an sm_90 GPU and Triton {'/'.join(ws.GLUON_VERSIONS)}; not run")
        return 0
    from kernel_stages import SHAPES, make_inputs, timer
    from serval.kernels import cooperative

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    ok = True
    torch.manual_seed(0)
    E, H, I, N = 3, 256, 320, 200  # I = 320: a partial N tile
    topk = torch.stack([torch.arange(N, device="cuda") % E, (torch.arange(N, device="cuda") + 1) % E], 1)
    schedule = build_schedule(topk, E, 128)
    x = torch.randn(N, H, device="cuda").to(torch.bfloat16)
    w_gate, w_up = ((torch.randn(E, I, H, device="cuda") * H**-0.5).to(torch.bfloat16) for _ in range(2))
    for kw in (dict(gather=False), dict(gather=True), dict(gather=True, stages=3), dict(gather=False, stages=2)):
        for limit in (None, 0.5):
            same = all(same_as_triton(x, w_gate, w_up, schedule, limit, **kw) for _ in range(3))
            print(f"small {kw} swiglu_limit={limit}: {'bitwise equal' if same else 'MISMATCH'}", flush=True)
            ok &= same
    rows = lambda cols: torch.randn(schedule.capacity, cols, device="cuda").to(torch.bfloat16)  # noqa: E731
    for stage, stage_args in (("down", (rows(I), w_gate.transpose(1, 2).contiguous(), schedule)),
                              ("gate_up_dgrad", (rows(2 * I), w_gate, w_up, schedule))):
        same = store_same_as_triton(stage, *stage_args)
        print(f"small {stage}: {'bitwise equal' if same else 'MISMATCH'}", flush=True)
        ok &= same
    # the layer with the kernel and without (grouped_gemm.COOPERATIVE_*): y and gradients bitwise
    import serval

    xl = torch.randn(300, 512, device="cuda").to(torch.bfloat16).requires_grad_()
    rw = torch.rand(300, 4, device="cuda").requires_grad_()
    ids = torch.rand(300, 8, device="cuda").topk(4, dim=1).indices
    ws_ = [((torch.randn(8, 384, 512, device="cuda") * 0.05).to(torch.bfloat16)).requires_grad_() for _ in range(2)]
    wd = ((torch.randn(8, 512, 384, device="cuda") * 0.05).to(torch.bfloat16)).requires_grad_()
    dy = torch.randn(300, 512, device="cuda").to(torch.bfloat16)
    inputs = [xl, rw, *ws_, wd]

    def layer():
        y = serval.moe(xl, rw, ids, *ws_, wd)
        return [y] + list(torch.autograd.grad(y, inputs, dy))

    reference = layer()  # H = 512: gate/up, down and gate/up dgrad on the cooperative kernel
    defaults = gg.COOPERATIVE_GATHER_MAX_HIDDEN, gg.COOPERATIVE_STORE
    gg.COOPERATIVE_GATHER_MAX_HIDDEN, gg.COOPERATIVE_STORE = 0, dict.fromkeys(gg.COOPERATIVE_STORE, False)
    try:
        same = all(torch.equal(a, b) for a, b in zip(layer(), reference))
    finally:
        gg.COOPERATIVE_GATHER_MAX_HIDDEN, gg.COOPERATIVE_STORE = defaults
    print(f"layer with and without the kernel: y and gradients {'bitwise equal' if same else 'MISMATCH'}", flush=True)
    ok &= same
    run_timed = timer(False, args.soak)
    table = []
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        data = make_inputs(shape, torch.device("cuda"), 128)
        sch = data["schedule"]
        fwd = (data["x"], data["w_gate"], data["w_up"], sch, None)
        for gather in (False, True):
            same = same_as_triton(*fwd, gather=gather)
            print(f"{name} gather={gather}: {'bitwise equal' if same else 'MISMATCH'}", flush=True)
            ok &= same
        h = torch.randn(sch.capacity, shape["inter"], device="cuda").to(torch.bfloat16)
        d_gate_up = torch.randn(sch.capacity, 2 * shape["inter"], device="cuda").to(torch.bfloat16)
        store_args = {"down": (h, data["w_down"], sch), "gate_up_dgrad": (d_gate_up, data["w_gate"], data["w_up"], sch)}
        for stage, stage_args in store_args.items():
            same = store_same_as_triton(stage, *stage_args)
            print(f"{name} {stage}: {'bitwise equal' if same else 'MISMATCH'}", flush=True)
            ok &= same
        variants = {
            "down: triton": lambda: gg.down(*store_args["down"], config=gg.default_config("down")),
            "down: coop": lambda: cooperative.down(*store_args["down"]),
            "down: coop, 3 stages": lambda: cooperative.down(*store_args["down"], stages=3),
            "gate/up dgrad: triton": lambda: gg.gate_up_dgrad(*store_args["gate_up_dgrad"],
                                                              config=gg.default_config("gate_up_dgrad")),
            "gate/up dgrad: coop": lambda: cooperative.gate_up_dgrad(*store_args["gate_up_dgrad"]),
            "gate/up dgrad: coop, 3 stages": lambda: cooperative.gate_up_dgrad(*store_args["gate_up_dgrad"], stages=3),
            "gate/up: pass + triton": lambda: gg.gate_up_swiglu(*fwd, a_rows=gather_rows(data["x"], sch)),
            "gate/up: coop, loader gathers": lambda: cooperative.gate_up_swiglu(*fwd, gather=True),
        }
        times = {label: [] for label in variants}
        for _ in range(2):
            for label, fn in variants.items():
                times[label].append(run_timed(fn))
        flops = 2 * shape["tokens"] * shape["top_k"] * shape["hidden"] * shape["inter"]  # one [R, H] x [H, I]
        for label, t in times.items():
            gemm_flops = flops if label.startswith("down") else 2 * flops
            table.append(f"{name:14s} {label:32s} " + " ".join(f"{ms:7.3f}" for ms in t)
                         + f"  {gemm_flops / min(t) / 1e9:6.1f} TFLOP/s")
            print(table[-1], flush=True)
    print("\n".join(["", "shape          variant                          ms (2 rounds)   best"] + table))
    print("all checks passed" if ok else "CHECK FAILED: MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
