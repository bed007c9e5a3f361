"""`python -m serval demo`: train a small MoE block twice and show the two runs are bitwise identical.

The task is distillation: a frozen random "teacher" MoE block maps random tokens
to targets, and a student serval.MoE (router, routed experts, shared expert)
learns to imitate it with AdamW. Runs on the default device: CUDA (bf16, the
Triton kernels) where present, else CPU (fp32, the torch-op path).
"""

from __future__ import annotations

import argparse
import time

import torch

import serval


def train(args, device, dtype) -> tuple[list[float], dict[str, torch.Tensor]]:
    def block(seed):
        torch.manual_seed(seed)
        return serval.MoE(args.hidden, args.inter, args.experts, args.top_k, shared_intermediate_size=args.inter,
                          device=device, dtype=dtype)

    teacher, student = block(1234).requires_grad_(False), block(args.seed)
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


def demo(args) -> int:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    print(f"serval {serval.__version__} demo on {device} ({dtype}): distil a random teacher MoE into a student "
          f"(H={args.hidden}, I={args.inter}, E={args.experts}, top-{args.top_k}, shared expert, "
          f"{args.tokens} tokens/step, {args.steps} steps), twice")
    runs = []
    for run in (1, 2):
        print(f"run {run}:")
        runs.append(train(args, device, dtype))
    (losses_a, weights_a), (losses_b, weights_b) = runs
    same_losses = losses_a == losses_b
    same_weights = all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    print(f"loss: {losses_a[0]:.6f} -> {losses_a[-1]:.6f}")
    print(f"bitwise identical across the two runs: losses {'yes' if same_losses else 'NO'}, "
          f"trained weights {'yes' if same_weights else 'NO'}")
    return 0 if same_losses and same_weights else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serval", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="train a small MoE block twice; check bitwise-identical runs")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--inter", type=int, default=128)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=20)
    args = parser.parse_args(argv)
    return demo(args)


if __name__ == "__main__":
    raise SystemExit(main())
