"""serval.moe on random problems: shapes, routings, precisions and Config variants the tests do not name.

    python tools/fuzz_layer.py --seconds 240 --seed 7          # the default device (the H200: the kernels)
    python tools/fuzz_layer.py --ep --seconds 300 --seed 1     # expert parallelism: gloo processes on the CPU
    python tools/fuzz_layer.py --ep --device cuda --seconds 300   # P processes on one GPU (symmetric memory)
    TRITON_INTERPRET=1 python tools/fuzz_layer.py --backend triton --seconds 600   # the kernels, interpreted

Each case draws N, H, I, E, k, a routing (random, every token's first slot on one expert, empty experts, all
tokens on one expert with k = 1), a shared expert or none, a swiglu_limit or none, a precision and one Config
variant (the default, recompute, both fused passes (bf16 and mxfp8; fp8_blockwise runs staged), another block_m,
fp32 inputs, FP8 weights quantized once), then checks what every serval path promises:
- two runs give the same bits (y and every gradient);
- bf16 / fp32: y and the gradients within bf16 rounding of `serval.reference.moe` in float64 (3e-2 relative; 1e-1
  with a swiglu_limit, whose clamp's derivative flips for pre-activations that bf16 rounding moves across it);
- FP8 (no shared expert): every output finite and within FP8_TOLERANCE of `serval.reference.moe_fp8`, the
  recipe emulated in float64 (relative error);
- with --ep: P in {2, 3, 4} ranks on the CPU (gloo, the torch stages) bitwise equal to EP=1 on the whole batch,
  also with a macrobatch ring of a few tokens (streamed in windows on the kernels: --backend triton) and with both
  passes fused (`KernelPlan.fused_forward` / `fused_backward`, the kernels: --backend triton); with --device cuda
  the ranks share one GPU (symmetric memory over overlapping devices, the CUDA kernels, bf16), and draw
  Config.comm_sms_* too (the GEMMs pulling their own rows).
An exception is a failure too (a kernel that does not compile, an input check that refuses a valid problem). The
cases and failures are printed; the exit status is 1 if any case failed. A case is reproduced by its seed.
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import sys
import tempfile
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
import serval  # noqa: E402
from conftest import make_layer, make_routing, rel_err  # noqa: E402
from serval.plan import KernelPlan  # noqa: E402

OUTPUTS = ("y", "d_x", "d_router_weights", "d_w_gate", "d_w_up", "d_w_down", "d_shared")
# FP8 against the emulated recipe: a last-bit difference before a quantization (GEMM sums in another order, the
# fast sigmoid) moves a value a whole E4M3 step (tests/test_precision.py allows 4e-2 at its sizes); on a few values
# (one token) that weighs more
FP8_TOLERANCE = 1e-1


def draw_case(rng: random.Random, tiny: bool) -> dict:
    """One random problem and variant."""
    num_experts = rng.choice([1, 2, 5, 8, 16, 33, 64, 128] if not tiny else [1, 3, 6])
    top_k = rng.randint(1, min(num_experts, 8))
    routing = rng.choice(["random", "random", "skewed", "empty", "one"])
    if routing == "empty" and num_experts <= top_k + 1:
        routing = "random"
    if routing == "one":
        top_k = 1
    precision = rng.choice(["bf16", "bf16", "mxfp8", "fp8_blockwise"])
    hidden = rng.choice([16, 64, 136, 256, 520, 1024, 2048, 4096] if not tiny else [16, 24, 32])
    inter = rng.choice([8, 24, 128, 136, 256, 384, 768, 1024] if not tiny else [8, 24, 128])
    if precision == "fp8_blockwise" and (inter % 128 or hidden % 16):
        precision = "bf16"
    variant = rng.choice(["default", "default", "recompute", "fused", "block_m", "fp32", "weights_once"])
    # the FP8 emulation (serval.reference.moe_fp8) has no shared expert
    shared_inter = rng.choice([0, 0, inter, 64 if not tiny else 8]) if precision == "bf16" else 0
    if (precision != "bf16" and variant == "fp32") or (precision == "bf16" and variant == "weights_once"):
        variant = "default"
    return dict(num_tokens=rng.choice([1, 2, 5, 63, 129, 300, 1000, 2049, 3001] if not tiny else [1, 5, 17]),
                hidden=hidden, inter=inter, num_experts=num_experts, top_k=top_k, routing=routing,
                shared_inter=shared_inter, swiglu_limit=rng.choice([None, None, 2.0]),
                precision=precision, variant=variant, block_m=rng.choice([64, 256]) if variant == "block_m" else 128)


def config_of(case: dict, device: str, backend: str = "auto") -> serval.Config:
    block_m = case["block_m"]
    if case["precision"] != "bf16":
        block_m = max(block_m, 128)  # the FP8 recipes' 128-row blocks along tokens
    elif device == "cpu":
        block_m = min(block_m, 16 if case["variant"] != "block_m" else 32)  # the interpreter: small tiles
    kwargs = dict(precision=case["precision"], block_m=block_m, recompute=case["variant"] == "recompute",
                  backend=backend)
    if case["variant"] == "fused":
        kwargs["kernel_plan"] = KernelPlan(fused_forward=True, fused_backward=True)
    return serval.Config(**kwargs)


def layer(case: dict, device: str, dtype: torch.dtype, *, config=None, fn=serval.moe, rounded_to=None,
          expert_weights=False, tokens=None, experts=None, group=None):
    """y and the gradients of x, the router weights, the routed weights and the shared weights (joined), for the
    problem of `case` (the same draw whatever the dtype: rounded_to is the dtype it is drawn in); tokens /
    experts: a rank's slices at EP."""
    n, e = case["num_tokens"], case["num_experts"]
    x, weights, shared = make_layer(n, case["hidden"], case["inter"], e, shared_inter=case["shared_inter"],
                                    device=device, dtype=rounded_to or dtype, seed=3)
    x, weights = x.to(dtype), [w.to(dtype) for w in weights]
    shared = None if shared is None else [w.to(dtype) for w in shared]
    rw, ids = make_routing(n, e, case["top_k"], kind=case["routing"], device=device,
                           dtype=torch.float64 if dtype == torch.float64 else torch.float32, seed=3)
    d_y = torch.randn(n, case["hidden"], generator=torch.Generator().manual_seed(5)).to(device, dtype)
    if tokens is not None:
        x, rw, ids, d_y = x[tokens], rw[tokens], ids[tokens], d_y[tokens]
        weights = [w[experts] for w in weights]
    leaves = [t.detach().clone().requires_grad_() for t in (x, rw, *weights, *(shared or ()))]
    kwargs = dict(swiglu_limit=case["swiglu_limit"])
    if config is not None:
        kwargs["config"] = config
    if group is not None:
        kwargs["group"] = group
    if expert_weights:
        kwargs["expert_weights"] = serval.quantize_expert_weights(*weights, precision=config.precision)
    y = fn(leaves[0], leaves[1], ids, *leaves[2:5], None if shared is None else tuple(leaves[5:]), **kwargs)
    grads = torch.autograd.grad(y, leaves, d_y)
    shared_grads = torch.cat([g.flatten() for g in grads[5:]]) if shared is not None else torch.zeros(0)
    return [y.detach(), *grads[:5], shared_grads]


def check_case(case: dict, device: str, backend: str = "auto") -> str | None:
    """None if every promise holds, else what broke."""
    config = config_of(case, device, backend)
    dtype = torch.float32 if case["variant"] == "fp32" or (device == "cpu" and case["precision"] == "bf16") \
        else torch.bfloat16
    once = case["variant"] == "weights_once"
    first = layer(case, device, dtype, config=config, expert_weights=once)
    second = layer(case, device, dtype, config=config, expert_weights=once)
    for name, a, b in zip(OUTPUTS, first, second):
        if not torch.equal(a, b):
            return f"{name}: two runs differ"
    if case["precision"] == "bf16":
        want = layer(case, device, torch.float64, fn=serval.reference.moe, rounded_to=dtype)
        tolerance = 1e-1 if case["swiglu_limit"] is not None else 3e-2
        for name, a, b in zip(OUTPUTS, first, want):
            if not torch.isfinite(a.float()).all():
                return f"{name}: not finite"
            if a.numel() and rel_err(a, b) > tolerance:
                return f"{name}: relative error {rel_err(a, b):.3g} against the reference"
        return None
    want = fp8_emulation(case, device, config.block_m)
    for name, a, b in zip(OUTPUTS, first, want):
        if not torch.isfinite(a.float()).all():
            return f"{name}: not finite"
        if rel_err(a.cpu(), b) > FP8_TOLERANCE:
            return f"{name}: relative error {rel_err(a.cpu(), b):.3g} against the emulated recipe"
    return None


def fp8_emulation(case: dict, device: str, block_m: int) -> list[torch.Tensor]:
    """`serval.reference.moe_fp8` (the recipe in float64) on the case's problem: y and the routed gradients."""
    n, e = case["num_tokens"], case["num_experts"]
    x, weights, _ = make_layer(n, case["hidden"], case["inter"], e, device=device, dtype=torch.bfloat16, seed=3)
    rw, ids = make_routing(n, e, case["top_k"], kind=case["routing"], device=device, seed=3)
    d_y = torch.randn(n, case["hidden"], generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    return list(serval.reference.moe_fp8(x.cpu(), rw.cpu(), ids.cpu(), *(w.cpu() for w in weights), d_y,
                                         precision=case["precision"], block_m=block_m,
                                         swiglu_limit=case["swiglu_limit"]))


def _ep_rank(rank: int, world_size: int, init_file: str, case: dict, out: str, backend: str, device: str) -> None:
    import torch.distributed as dist

    if device == "cuda":  # every rank on GPU 0: symmetric memory over overlapping devices, never multicast
        os.environ.update(TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES="1", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
        torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(minutes=3))
    outcome = "ok"
    try:
        dtype = torch.bfloat16 if device == "cuda" or case["precision"] != "bf16" else torch.float32
        block_m = case["block_m"]
        config = serval.Config(precision=case["precision"], block_m=block_m,
                               recompute=case["variant"] == "recompute", macrobatch_size=case.get("macrobatch_size"),
                               comm_sms_forward=case.get("comm_sms"), comm_sms_backward=case.get("comm_sms"),
                               backend=backend, kernel_plan=KernelPlan(fused_forward=True, fused_backward=True)
                               if case["variant"] == "fused" else None)
        per_rank, experts_per_rank = case["num_tokens"] // world_size, case["num_experts"] // world_size
        tokens = slice(rank * per_rank, (rank + 1) * per_rank)
        experts = slice(rank * experts_per_rank, (rank + 1) * experts_per_rank)
        ep = layer(case, device, dtype, config=config, tokens=tokens, experts=experts, group=dist.group.WORLD)
        whole = layer(case, device, dtype, config=config)
        want = [t[tokens] for t in whole[:3]] + [t[experts] for t in whole[3:6]]
        differ = [name for name, a, b in zip(OUTPUTS, ep, want) if not torch.equal(a, b)]
        if differ:
            outcome = f"differ from EP=1: {differ}"
        dist.barrier()
    except Exception as error:  # noqa: BLE001  (reported, not raised: the other ranks must finish too)
        outcome = f"{type(error).__name__}: {error}"[:300]
    finally:
        dist.destroy_process_group()
    with open(f"{out}.{rank}", "w") as f:
        f.write(outcome)


def check_ep_case(case: dict, world_size: int, backend: str, device: str) -> str | None:
    import torch.multiprocessing as mp

    folder = tempfile.mkdtemp()
    mp.spawn(_ep_rank, args=(world_size, f"{folder}/init", case, f"{folder}/out", backend, device),
             nprocs=world_size, join=True)
    outcomes = {open(f"{folder}/out.{rank}").read() for rank in range(world_size)}
    return None if outcomes == {"ok"} else "; ".join(sorted(outcomes - {"ok"}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=240.0, help="draw cases until this much time has passed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ep", action="store_true",
                        help="expert parallelism: P processes, on the CPU (gloo) or all on one GPU (--device cuda)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="auto: the GPU where there is one, except with --ep (the CPU)")
    parser.add_argument("--tiny", action="store_true", help="small shapes only (the CPU without --ep)")
    parser.add_argument("--backend", default="auto", choices=["auto", "triton", "torch"],
                        help="Config.backend ('triton' on the CPU: the kernels in the interpreter, TRITON_INTERPRET=1)")
    args = parser.parse_args()
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() and not args.ep else "cpu"
    tiny = args.tiny or device == "cpu"
    rng = random.Random(args.seed)
    start, failures, count = time.time(), [], 0
    while time.time() - start < args.seconds:
        case = draw_case(rng, tiny)
        world_size = None
        if args.ep:  # E and N divisible by P; the FP8 cases' 16-element rows
            world_size = rng.choice([2, 3, 4])
            case.update(num_experts=world_size * rng.choice([1, 2, 3]), num_tokens=world_size * case["num_tokens"],
                        variant=rng.choice(["default", "recompute", "macrobatch", "fused"]))
            # macrobatch: a ring of a few tokens, several windows on the kernels; fused: both passes fused (the
            # shared expert's tiles in their launches), with such a ring or the default one
            if case["variant"] == "macrobatch" or (case["variant"] == "fused" and rng.random() < 0.5):
                case["macrobatch_size"] = rng.randint(1, case["num_tokens"] // world_size)
            if device == "cuda":  # the GEMMs' pull programs (comm SMs), or the staged pull
                case["comm_sms"] = rng.choice([0, 0, 4, 16])
            # bf16 on the CPU: the interpreter's small tiles; FP8 and CUDA: 128 (the FP8 blocks along tokens)
            case["block_m"] = 16 if case["precision"] == "bf16" and device == "cpu" else 128
            case["top_k"] = min(case["top_k"], case["num_experts"])
            if case["routing"] == "empty" and case["num_experts"] <= case["top_k"] + 1:
                case["routing"] = "random"
        count += 1
        try:
            failure = (check_ep_case(case, world_size, args.backend, device) if args.ep
                       else check_case(case, device, args.backend))
        except Exception as error:  # noqa: BLE001  (a failure to report, with the case)
            traceback.print_exc()
            failure = f"{type(error).__name__}: {str(error)[:300]}"
        label = ", ".join(f"{key}={value}" for key, value in case.items()) + (f", P={world_size}" if args.ep else "")
        print(("FAIL " if failure else "ok   ") + label + (f": {failure}" if failure else ""), flush=True)
        if failure:
            failures.append(label)
    print(f"{count} cases in {time.time() - start:.0f} s on {device}{' (EP)' if args.ep else ''}, "
          f"{len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
