"""`python -m serval demo`: train a small MoE block twice and show the two runs are bitwise identical.

The task is distillation: a frozen random "teacher" MoE block maps random tokens
to targets, and a student serval.MoE (router, routed experts, shared expert)
learns to imitate it with AdamW. Runs on the default device: CUDA (bf16, the
Triton kernels) where present, else CPU (fp32, the torch-op path; bf16 with an FP8 --precision).

Exit codes: 0 the two runs are bitwise identical (and an FP8 run's loss is within its band of the bf16 run's);
1 they differ (or the FP8 loss is outside the band); 2 a bad option, or more memory than the device has;
3 the two runs are bitwise identical but training diverged (a loss that is not finite: try a smaller --lr).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

import serval
from serval import precision
from serval.schedule import capacity_rows


def train(args, device, dtype, precision="bf16") -> tuple[list[float], dict[str, torch.Tensor]]:
    def block(seed, precision="bf16"):
        torch.manual_seed(seed)
        return serval.MoE(args.hidden, args.inter, args.experts, args.top_k, shared_intermediate_size=args.inter,
                          config=serval.Config(precision=precision), device=device, dtype=dtype)

    teacher, student = block(1234).requires_grad_(False), block(args.seed, precision)
    shared = tuple(student.shared[name].weight for name in ("gate", "up", "down"))
    x = torch.empty(args.tokens, args.hidden, device=device, dtype=dtype)
    print("  " + str(serval.functional.plan_pass(student.config, x, student.w_gate, shared)).replace("\n", "\n  "))
    with torch.no_grad():
        teacher.router.weight.mul_(50)  # a decisive teacher router: routing is part of what must be learned
    optimizer = torch.optim.AdamW(student.parameters(), lr=args.lr)
    data = torch.Generator(device=device).manual_seed(args.seed)
    losses, start = [], time.perf_counter()
    for step in range(1, args.steps + 1):
        x = torch.randn(args.tokens, args.hidden, generator=data, device=device).to(dtype)
        loss = torch.nn.functional.mse_loss(student(x).float(), teacher(x).float())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())  # the demo prints it; a training loop would not sync every step
        if step == 1 or step % args.log_every == 0 or step == args.steps:
            rate = step * args.tokens / (time.perf_counter() - start)
            print(f"  step {step:4d}  loss {losses[-1]:.6f}  ({rate:,.0f} tokens/s)", flush=True)
    return losses, {k: v.detach().clone() for k, v in student.state_dict().items()}


# an FP8 run's loss may differ from the BF16 run's by this fraction of the BF16 loss at every step, a band
# that the small block keeps with room to spare (docs/reports/2026-12-01-fp8.md)
LOSS_BAND = 0.10


SHORT_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}
EXIT_DIFFERENT, EXIT_RESOURCES, EXIT_DIVERGED = 1, 2, 3


def demo_dtype(args) -> torch.dtype:
    """The dtype of the demo's weights and activations: bf16 on CUDA, and on the CPU with an FP8 precision (the FP8
    precisions quantize bf16 activations); else fp32."""
    return torch.bfloat16 if args.device.startswith("cuda") or args.precision != "bf16" else torch.float32


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a and b hold the same bits (NaNs included, which == and torch.equal call different)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8))


def same_loss_bits(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and same_bits(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64))


def demo(args) -> int:
    device = args.device
    low_precision = args.precision != "bf16"
    dtype = demo_dtype(args)
    # the routed experts run in the precision's FP8 GEMMs, or else in the block's dtype
    experts = args.precision if low_precision else SHORT_NAMES[dtype]
    print(f"serval {serval.__version__} demo on {device} ({SHORT_NAMES[dtype]} weights and activations, routed "
          f"experts in {experts}): distil a "
          f"random teacher MoE into a student (H={args.hidden}, I={args.inter}, E={args.experts}, top-{args.top_k}, "
          f"shared expert, {args.tokens} tokens/step, {args.steps} steps), twice"
          + (", and once in bf16 to compare" if low_precision else ""))
    runs = []
    threads = torch.get_num_threads()
    if device == "cpu":
        # one thread: MKL may run a GEMM on fewer threads when the machine is busy (its dynamic threading), and
        # splits the sums of a long K by the threads it runs, so two CPU runs could round differently (the small
        # block runs as fast on one)
        torch.set_num_threads(1)
    try:
        for run in (1, 2):
            print(f"run {run}:")
            runs.append(train(args, device, dtype, args.precision))
    finally:
        torch.set_num_threads(threads)
    (losses_a, weights_a), (losses_b, weights_b) = runs
    same_losses = same_loss_bits(losses_a, losses_b)
    same_weights = weights_a.keys() == weights_b.keys() and all(same_bits(weights_a[k], weights_b[k])
                                                                 for k in weights_a)
    print(f"loss: {losses_a[0]:.6f} -> {losses_a[-1]:.6f}")
    print(f"bitwise identical across the two runs: losses {'yes' if same_losses else 'NO'}, "
          f"trained weights {'yes' if same_weights else 'NO'}")
    diverged = [step for step, losses in enumerate(zip(losses_a, losses_b), 1)
                if not all(math.isfinite(loss) for loss in losses)]
    if diverged:
        print(f"training diverged: the loss is not finite from step {diverged[0]} (--lr {args.lr:g} is too large for "
              f"this block: try a smaller one)" + ("; no comparison with bf16" if low_precision else ""))
        return EXIT_DIFFERENT if not (same_losses and same_weights) else EXIT_DIVERGED
    in_band = True
    if low_precision:
        print("bf16 run:")
        losses_bf16, _ = train(args, device, dtype)
        gap = max(abs(a - b) / b for a, b in zip(losses_a, losses_bf16))
        in_band = gap <= LOSS_BAND
        print(f"loss {args.precision} vs bf16: {losses_a[-1]:.6f} vs {losses_bf16[-1]:.6f} at the last step; "
              f"largest gap {gap:.1%} of the bf16 loss over all steps, band {LOSS_BAND:.0%}: "
              f"{'within' if in_band else 'OUTSIDE'}")
    return 0 if same_losses and same_weights and in_band else EXIT_DIFFERENT


GIB = 2 ** 30


def demo_memory_bytes(args) -> int:
    """A conservative upper estimate of the memory the demo allocates, from its sizes: every tensor of the
    weights (teacher and student), the student's gradients, AdamW's two states, the two runs' kept copies and
    room for temporaries of the weights' size; and the activations of a step's forward and backward through both
    blocks (the routed rows padded to whole block_m segments), in fp32, with room for their temporaries."""
    element = demo_dtype(args).itemsize
    hidden, inter, experts = args.hidden, args.inter, args.experts
    params = experts * 3 * inter * hidden + experts * hidden + 3 * inter * hidden  # experts, router, shared
    # teacher, student, grads, 2 AdamW states, 2 kept copies; 6 fp32 temporaries (casts, FP8 quantization)
    weights = params * (7 * element + 6 * 4)
    rows = capacity_rows(args.tokens * args.top_k, experts, serval.Config().block_m)
    per_block = 2 * args.tokens * hidden + rows * (2 * hidden + 3 * inter) + 3 * args.tokens * inter
    activations = 4 * 2 * 4 * per_block  # fp32, two blocks, forward + backward and temporaries
    return weights + activations + experts * rows  # + the schedule's [E, R] row masks


def _cgroup_available() -> int | None:
    """Bytes this process's cgroup (v2) still allows, where it sets a limit: the limit less what the cgroup
    uses, its inactive page cache (which the kernel reclaims) not counted."""
    try:
        with open("/sys/fs/cgroup/memory.max") as limit_file:
            limit = limit_file.read().strip()
        if limit == "max":
            return None
        with open("/sys/fs/cgroup/memory.current") as current_file:
            used = int(current_file.read())
        with open("/sys/fs/cgroup/memory.stat") as stat_file:
            stats = dict(line.split() for line in stat_file if line.count(" ") == 1)
        return int(limit) - used + int(stats.get("inactive_file", 0))
    except (OSError, ValueError):
        return None


def available_memory_bytes(device: str) -> int | None:
    """Memory the device can still give: CUDA's free memory; on the CPU, MemAvailable (/proc/meminfo, else the
    free physical pages), capped by the cgroup's limit. None where it cannot be read."""
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[0]
    available = None
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, AttributeError):
            pass
    cgroup = _cgroup_available()
    if cgroup is not None:
        available = cgroup if available is None else min(available, cgroup)
    return available


def _out_of_memory(error: BaseException) -> bool:
    """Whether error is an allocator's failure (torch's OutOfMemoryError, or the CPU allocator's RuntimeError)."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(s in text for s in (
        "can't allocate memory", "out of memory", "not enough memory", "Out of memory"))


def _int_at_least(minimum: int, expected: str):
    """An argparse type: an integer >= minimum (`expected` says so in the error)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text if value is not None else repr(text)}")
        return value
    return parse


_positive_int = _int_at_least(1, "a positive integer")
_non_negative_int = _int_at_least(0, "an integer >= 0")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text}")
    return value


def _device(text: str) -> str:
    """'cpu', 'cuda' or 'cuda:<index>', available on this machine."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:<index>, got {text!r}") from None
    if device.type == "cpu" and device.index is None:
        return "cpu"
    if device.type != "cuda":
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:<index>, got {text!r}")
    if not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: no CUDA device is available here (use --device cpu)")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return str(device)


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (what to change) and exit code 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m serval", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"serval {serval.__version__}",
                        help="print the version of serval and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", help="what to run")
    p = sub.add_parser("demo", help="train a small MoE block twice; check bitwise-identical runs",
                       description="Train a small MoE block twice (distilling a random teacher) and check that "
                                   "the two runs give bitwise-identical losses and weights. Exit code 0: "
                                   "identical; 1: they differ (or an FP8 loss is outside its band of the bf16 "
                                   "loss); 2: a bad option, or the demo needs more memory than the device has; "
                                   "3: identical, but training diverged (a loss that is not finite).",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", type=_device, default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where to train: cpu, cuda or cuda:<index> (bf16 on CUDA; fp32 on CPU, bf16 with an FP8 "
                        "--precision)")
    p.add_argument("--steps", type=_positive_int, default=120, help="optimizer steps per run")
    p.add_argument("--tokens", type=_positive_int, default=256, help="tokens per step")
    p.add_argument("--hidden", type=_positive_int, default=64, help="hidden size H")
    p.add_argument("--inter", type=_positive_int, default=128,
                   help="intermediate size I of each expert (and of the shared expert)")
    p.add_argument("--experts", type=_positive_int, default=8, help="number of routed experts E")
    p.add_argument("--top-k", type=_positive_int, default=2, help="experts per token k (at most --experts)")
    p.add_argument("--lr", type=_positive_float, default=1e-2, help="AdamW learning rate")
    p.add_argument("--seed", type=_non_negative_int, default=0, help="seed of the student's weights and the data")
    p.add_argument("--log-every", type=_positive_int, default=20, help="print the loss every this many steps")
    p.add_argument("--precision", choices=serval.config.PRECISIONS, default="bf16",
                   help="the routed experts' precision; an FP8 one also trains once in bf16 and compares the losses")
    p.set_defaults(subparser=p)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.top_k > args.experts:
        args.subparser.error(f"argument --top-k: must be at most --experts ({args.experts}), got {args.top_k}")
    recipe = precision.recipe_of(args.precision)
    if recipe is not None:
        try:
            precision.check_sizes(recipe, args.inter, serval.Config().block_m)
        except ValueError as error:
            args.subparser.error(f"argument --inter: {error}")
    needed, available = demo_memory_bytes(args), available_memory_bytes(args.device)
    if available is not None and needed > available:
        args.subparser.exit(EXIT_RESOURCES, f"{args.subparser.prog}: error: the demo needs up to "
                                            f"{needed / GIB:,.1f} GiB (weights, gradients, optimizer state, "
                                            f"activations) and {args.device} has {available / GIB:,.1f} GiB "
                                            "available: use smaller --hidden, --inter, --experts or --tokens\n")
    try:
        return demo(args)
    except (torch.OutOfMemoryError, RuntimeError) as error:
        if not _out_of_memory(error):
            raise
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        print(f"{args.subparser.prog}: error: out of memory on {args.device} ({first_line}): use smaller --hidden, "
              f"--inter, --experts or --tokens", file=sys.stderr)
        return EXIT_RESOURCES


if __name__ == "__main__":
    raise SystemExit(main())
