"""Is this checkout slower than another one (the main it came from)? `benchmarks/bench_layer.py` of each checkout,
its own serval, run shape by shape in alternating order (A B for one shape, B A for the next, and the other way
round the next round), so that the GPU's clock drift at its power cap hits both alike; a table of the medians per
shape and pass, and the ratio.

    python tools/ab_checkouts.py --other ../old-main --shapes kimi-k2,qwen3-30b-a3b --out ab.json
    python tools/ab_checkouts.py --report ab.json

Each bench_layer run is a child process with its checkout's serval first on the path (bench_layer puts it there);
--bench-args pass through (default: serval alone, routed scope, fwd and fwd+bwd). The records are bench_layer's,
each with "checkout" ("this" or "other") and "round".
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = "kimi-k2,glm-5,qwen3.5-397b,deepseek-v4-pro,qwen3-30b-a3b"


def run(checkout: str, shape: str, bench_args: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "records.json")
        subprocess.run([sys.executable, os.path.join(checkout, "benchmarks", "bench_layer.py"), "--shapes", shape,
                        "--out", out, *bench_args], check=True)
        with open(out) as f:
            return json.load(f)


def report(records: list[dict]) -> None:
    """The table: per shape, pass and implementation (impl, precision, variant settings), each checkout's median ms
    and their ratio."""
    def key(r):
        settings = r.get("settings") and json.dumps(r["settings"])
        return r["shape"], r["pass"], f"{r['impl']} {r.get('precision') or 'bf16'}" + (f" {settings}" if settings else "")

    print(f"{'shape':<18}{'pass':<8}{'implementation':<44}{'this ms':>10}{'other ms':>10}{'this/other':>12}")
    for k in sorted({key(r) for r in records}, key=str):
        def median(which):
            ms = [r["ms"] for r in records if r["checkout"] == which and key(r) == k and r["ms"] is not None]
            return statistics.median(ms) if ms else None
        this, other = median("this"), median("other")
        ratio = f"{this / other:.3f}" if this and other else "-"
        print(f"{k[0]:<18}{k[1]:<8}{k[2][:42]:<44}{this or float('nan'):>10.3f}{other or float('nan'):>10.3f}"
              f"{ratio:>12}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--other", help="the other checkout's root")
    parser.add_argument("--shapes", default=SHAPES)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--bench-args", default="--impls serval --scopes routed --passes fwd,fwdbwd")
    parser.add_argument("--out", default="ab_checkouts.json")
    parser.add_argument("--report", metavar="JSON", help="only print the table of an earlier --out")
    args = parser.parse_args()
    if args.report:
        with open(args.report) as f:
            report(json.load(f))
        return 0
    checkouts = {"this": ROOT, "other": os.path.abspath(args.other)}
    records = []
    for round_index in range(args.rounds):
        for shape_index, shape in enumerate(args.shapes.split(",")):
            order = ("this", "other") if (round_index + shape_index) % 2 == 0 else ("other", "this")
            for which in order:
                for record in run(checkouts[which], shape, shlex.split(args.bench_args)):
                    records.append(dict(record, checkout=which, round=round_index))
                with open(args.out, "w") as f:
                    json.dump(records, f, indent=1)
    report(records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
