"""Check and time the grouped weight-gradient kernel (serval.kernels.weight_grad) on the H200.

For each shape (balanced routing, block_m 128, bf16) and each config of serval.kernels.weight_grad.CONFIGS
("-nested": one pipelined K loop per tile; the others run all K steps of a program's tiles in one loop):
  gate_up  fused   d_w_gate, d_w_up = d_gate_up[seg].T @ x[token(row)]   (B rows gathered in the kernel)
  gate_up  mat     the same with x_rows materialised beforehand (gather not timed)
  down             d_w_down = d_y_rows[seg].T @ h_weighted[seg]
against torch._grouped_mm(a.t(), b, offs=expert_offsets[1:]) (x_rows given; "+gather" adds the
index gather, the whole torch stage). A skewed-routing line shows the LPT tile order's effect.
TFLOP/s = 2 * rows * P * Q over the real (unpadded) rows. Median of triton.testing.do_bench.

    python benchmarks/kernel_wgrad.py            # H200, < 3 minutes
    python benchmarks/kernel_wgrad.py --tiny     # CPU, Triton interpreter, tiny shapes (a smoke test)
    python benchmarks/kernel_wgrad.py --compile-only   # no GPU needed: compile every config for sm_90
"""

from __future__ import annotations

import argparse
import os
import sys
import time

TINY = "--tiny" in sys.argv
if TINY:  # must be set before triton / serval are imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from serval import stages  # noqa: E402
from serval.kernels import weight_grad as wg  # noqa: E402
from serval.schedule import build_schedule  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_layer  # noqa: E402

SHAPES = {name: spec[:5] for name, spec in bench_layer.SHAPES.items()}  # name: (H, I, E, k, N), the SPEC shapes
DEFAULT_SHAPES = "kimi-k2,qwen3-30b-a3b"
TINY_SHAPES = {"tiny-a": (64, 48, 6, 2, 40), "tiny-b": (48, 32, 16, 4, 24)}


def routing(kind: str, n: int, k: int, e: int) -> torch.Tensor:
    if kind == "balanced":  # token t -> experts 8t .. 8t+k-1 (mod E): k distinct experts, equal loads
        t = torch.arange(n)[:, None] * k + torch.arange(k)[None, :]
        return t % e
    gen = torch.Generator().manual_seed(0)  # skewed: expert j drawn with weight 1/(j+1), k distinct per token
    probs = (1.0 / torch.arange(1, e + 1, dtype=torch.float64)).expand(n, e)
    return torch.multinomial(probs, k, replacement=False, generator=gen)


def timer(fn) -> float:
    """Median milliseconds (do_bench on the GPU; one timed call in the interpreter)."""
    if torch.cuda.is_available() and not TINY:
        return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")
    fn()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30)).item()


def bench_shape(name, shape, configs, device, dtype, rows_out, kinds, failures):
    H, I, E, k, N = shape
    block_m = 16 if TINY else 128
    for kind in kinds:
        ids = routing(kind, N, k, E).to(device)
        sched = build_schedule(ids, E, block_m=block_m)
        R = sched.capacity
        real = (sched.row_source >= 0)[:, None]
        gen = torch.Generator(device=device).manual_seed(1)
        x = torch.randn(N, H, device=device, generator=gen).to(dtype)
        d_gate_up = (torch.randn(R, 2 * I, device=device, generator=gen) * real).to(dtype)
        d_y_rows = (torch.randn(R, H, device=device, generator=gen) * real).to(dtype)
        h_weighted = (torch.randn(R, I, device=device, generator=gen) * real).to(dtype)
        x_rows = stages.gather(x, sched)
        rows = N * k
        flops_gu = 2.0 * rows * 2 * I * H
        flops_dn = 2.0 * rows * H * I
        offs = sched.expert_offsets[1:]

        ref_gu = stages.weight_grad(d_gate_up, x_rows, sched)  # torch._grouped_mm on the GPU
        ref_dn = stages.down_weight_grad(d_y_rows, h_weighted, sched)

        def add(grad, variant, cfg, ms, flops, err):
            rows_out.append((f"{name}/{kind}", grad, variant, cfg, ms, flops / ms / 1e9, err))

        if device == "cuda":
            add("gate_up", "torch", "_grouped_mm", timer(lambda: torch._grouped_mm(d_gate_up.t(), x_rows, offs=offs)),
                flops_gu, 0.0)
            add("gate_up", "torch+gather", "_grouped_mm",
                timer(lambda: stages.gate_up_weight_grad(d_gate_up, x, sched)), flops_gu, 0.0)
            add("down", "torch", "_grouped_mm", timer(lambda: torch._grouped_mm(d_y_rows.t(), h_weighted, offs=offs)),
                flops_dn, 0.0)
        for cfg in configs if kind == "balanced" else configs[:1]:
            c = None if cfg == "auto" else cfg
            for lpt in (True,) if kind == "balanced" else (True, False):
                tag = "" if kind == "balanced" else (" lpt" if lpt else " plain")
                fused = lambda: wg.grouped_wgrad(d_gate_up, x, sched, num_outputs=2, gather=True, config=c, lpt=lpt)  # noqa: E731
                mat = lambda: wg.grouped_wgrad(d_gate_up, x_rows, sched, num_outputs=2, config=c, lpt=lpt)  # noqa: E731
                down = lambda: wg.grouped_wgrad(d_y_rows, h_weighted, sched, config=c, lpt=lpt)  # noqa: E731
                for grad, variant, fn, ref, flops in (("gate_up", "fused", fused, ref_gu, flops_gu),
                                                      ("gate_up", "mat", mat, ref_gu, flops_gu),
                                                      ("down", "serval", down, ref_dn, flops_dn)):
                    try:  # one failing config (compile error, wrong result) must not hide the others
                        out = fn()
                        err = rel_err(torch.cat(out, dim=1) if len(out) == 2 else out[0], ref)
                        again = fn()
                        if not all(torch.equal(u, v) for u, v in zip(out, again)):
                            raise AssertionError("run to run not bitwise equal")
                        del out, again
                        if not err < 1e-2:
                            raise AssertionError(f"relative error {err:.3e}")
                        add(grad, variant + tag, cfg, timer(fn), flops, err)
                    except Exception as exc:  # noqa: BLE001
                        failures.append(f"{name}/{kind} {grad} {variant}{tag} {cfg}: {type(exc).__name__}: {exc}")
                        print("  FAILED", failures[-1][:2000], flush=True)
        print(f"  {name}/{kind} done", flush=True)
        del ref_gu, ref_dn, x_rows


def compile_only(configs) -> None:
    """Compile every config x variant for sm_90 (no GPU needed) and show what Triton made of it."""
    import re

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = wg._wgrad_kernel
    ints = ["R", "P", "Q", "P_OUT", "E", "top_k", "B_ROWS", "stride_a", "stride_b", "stride_oe", "stride_op"]
    ptrs = ["a_ptr", "b_ptr", "row_source_ptr", "offsets_ptr", "order_ptr", "out0_ptr", "out1_ptr"]
    print(f"triton {triton.__version__}, sm_90: shared memory (of 232448 B), pipelined loads, wgmma waits")
    for name in configs:
        cfg = wg.CONFIGS[name]
        for gather, num_out, tma in ((False, 1, True), (True, 2, True), (True, 2, False)):
            sig = {n: "constexpr" for n in fn.arg_names}
            sig.update({n: "*i32" if n in ("row_source_ptr", "offsets_ptr", "order_ptr") else "*bf16" for n in ptrs})
            sig.update({n: "i32" for n in ints})
            const = dict(BP=cfg.block_p, BQ=cfg.block_q, BK=cfg.block_k, GROUP_P=cfg.group_p, NUM_OUT=num_out,
                         B_GATHER=gather, USE_TMA=tma, SUBTILE=cfg.epilogue_subtile and tma, LPT=True,
                         FLATTEN=cfg.flatten, E_PAD=128, NUM_STAGES=cfg.num_stages, UPCAST=False, PRECISION="tf32")
            aligned = ptrs + [n for n in ints if n not in ("R", "E", "top_k", "B_ROWS")]
            attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
            kernel = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                                    options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
            ttgir = kernel.asm["ttgir"]
            waits = re.findall(r"pendings = (\d+)", ttgir)  # a 1 means the wgmma overlaps the next step's loads
            print(f"{name:15s} gather={gather:d} outputs={num_out} tma={tma:d}: smem {kernel.metadata.shared:6d} B, "
                  f"{ttgir.count('async_tma_copy_global_to_local')} TMA / "
                  f"{ttgir.count('async_copy_global_to_local')} cp.async loads, "
                  f"wgmma waits {waits}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU interpreter smoke test on tiny shapes")
    parser.add_argument("--shapes", default=None,
                        help=f"comma list (default {DEFAULT_SHAPES}) of " + ", ".join(SHAPES))
    parser.add_argument("--configs", default="128x256,128x256-nested,128x256s,256x128",
                        help="comma list of " + ", ".join(wg.CONFIGS) + " (or 'all')")
    parser.add_argument("--no-skew", action="store_true", help="skip the skewed-routing lines")
    parser.add_argument("--compile-only", action="store_true", help="compile every config for sm_90 (no GPU needed)")
    args = parser.parse_args()
    if args.compile_only:
        compile_only(list(wg.CONFIGS) if args.configs == "all" else args.configs.split(","))
        return

    shapes = TINY_SHAPES if TINY else SHAPES
    if args.shapes or not TINY:
        shapes = {s: shapes[s] for s in (args.shapes or DEFAULT_SHAPES).split(",")}
    configs = list(wg.CONFIGS) if args.configs == "all" else args.configs.split(",")
    if TINY:  # the interpreter uses the table's small tiles whatever the name
        configs = ["auto"]
    device = "cpu" if TINY else "cuda"
    dtype = torch.float32 if TINY else torch.bfloat16
    if not TINY:
        assert torch.cuda.is_available(), "needs a GPU (or --tiny)"
        print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    kinds = ("balanced",) if args.no_skew else ("balanced", "skewed")
    rows_out = []
    failures = []
    t0 = time.time()
    for name, shape in shapes.items():
        bench_shape(name, shape, configs, device, dtype, rows_out, kinds, failures)

    print(f"\nweight gradients, {dtype}, block_m {16 if TINY else 128}; TFLOP/s over real rows "
          f"(wall {time.time() - t0:.0f} s)")
    print(f"{'shape/routing':24s} {'grad':8s} {'variant':14s} {'config':14s} {'ms':>9s} {'TFLOP/s':>8s} {'rel err':>9s}")
    for shape, grad, variant, cfg, ms, tflops, err in rows_out:
        print(f"{shape:24s} {grad:8s} {variant:14s} {cfg:14s} {ms:9.3f} {tflops:8.1f} {err:9.2e}")
    for failure in failures:
        print("FAILED", failure[:300])
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
