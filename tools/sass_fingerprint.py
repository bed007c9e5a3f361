"""Does a change to the Triton kernels' code leave their machine code as it was? Every Triton launch a set of
kernel stages makes (the GEMM stages, the fused passes, their pulls and pushes, the row kernels around them) is
recorded on the CPU (the FP8 passes around the GEMMs too), compiled for sm_90a without a GPU, and its SASS reduced to a fingerprint: the instruction
sequence with the kernel-parameter offsets blanked (a reordered argument list moves them and nothing else), and
the registers, spills and shared memory. Two runs, before and after a change, compared with `--compare`: equal
fingerprints mean the same instructions, so the same bits and the same speed on the GPU.

    TRITON_INTERPRET=0 python tools/sass_fingerprint.py --out before.json        # on the tree before
    TRITON_INTERPRET=0 python tools/sass_fingerprint.py --out after.json         # on the tree after
    python tools/sass_fingerprint.py --compare before.json after.json

Drives `serval.kernels.KernelStages` (its stage signatures are the layer's contract) on the Hopper plan with every
GEMM on the Triton engine (the Gluon engines are `tests/test_gluon_compile.py`'s), 132 SMs. Needs a Triton with its
NVIDIA backend (ptxas, cuobjdump); the launches compile with the installed Triton (the H200 image's is 3.6).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "0")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

E, N, TOP_K, BLOCK_M = 4, 512, 2, 128
SHAPES = {"aligned": (512, 256), "ragged": (320, 200)}  # (H, I): the second has no 16-divisible sizes


def _record(launch) -> list:
    """[(JITFunction, args, kwargs)] of every Triton launch `launch()` makes (none runs)."""
    launches = []
    run = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs))

    JITFunction.run = record
    try:
        launch()
    finally:
        JITFunction.run = run
    return launches


def _variants(ops_for):
    """{name: launch()} over the stages' variants."""
    from serval.peers import PeerSlots, PeerTokens
    from serval.schedule import build_schedule, dense_schedule

    def inputs(hidden, inter, shared_inter=256):
        topk = torch.stack([torch.arange(N) % E, (torch.arange(N) + 1) % E], 1)
        schedule = build_schedule(topk, E, BLOCK_M)
        bf16 = dict(dtype=torch.bfloat16)
        table = torch.zeros(2, dtype=torch.int64)
        return dict(
            schedule=schedule, x=torch.zeros(N, hidden, **bf16),
            x_rows=torch.zeros(schedule.capacity, hidden, **bf16), h=torch.zeros(schedule.capacity, inter, **bf16),
            d_gate_up=torch.zeros(schedule.capacity, 2 * inter, **bf16),
            gate_up=torch.zeros(schedule.num_packed, 2 * inter, **bf16),
            w_gate=torch.zeros(E, inter, hidden, **bf16), w_up=torch.zeros(E, inter, hidden, **bf16),
            w_down=torch.zeros(E, hidden, inter, **bf16), rw=torch.zeros(N, TOP_K),
            tokens=PeerTokens(table, N, TOP_K, hidden, torch.bfloat16, True),
            slots=PeerSlots(table, N * TOP_K, hidden, torch.bfloat16, True),
            flags=(torch.zeros(schedule.capacity // BLOCK_M + 8, dtype=torch.int32),
                   torch.zeros(1, dtype=torch.int32)),
            shared_schedule=dense_schedule(N, BLOCK_M, "cpu"),
            ws=(torch.zeros(1, shared_inter, hidden, **bf16), torch.zeros(1, shared_inter, hidden, **bf16),
                torch.zeros(1, hidden, shared_inter, **bf16)),
            shared_gate_up=torch.zeros(N, 2 * shared_inter, **bf16))

    def shared(t, tokens, backward):
        return (tokens, *t["ws"], t["shared_schedule"]) + ((t["shared_gate_up"],) if backward else ())

    variants = {}
    for shape, (hidden, inter) in SHAPES.items():
        def add(name, fn, plan_fields=(), shape=shape, hidden=hidden, inter=inter):
            variants[f"{name}-{shape}"] = lambda: fn(ops_for(**dict(plan_fields)), inputs(hidden, inter))
        for limit in (None, 0.5):
            tag = "" if limit is None else "-limit"
            add(f"gate_up{tag}", lambda o, t, limit=limit: o.gate_up_swiglu(
                t["x"], t["w_gate"], t["w_up"], t["schedule"], limit, a_rows=t["x_rows"]))
            add(f"down_dgrad{tag}", lambda o, t, limit=limit: o.down_dgrad_swiglu(
                t["x_rows"], t["w_down"], t["gate_up"], t["rw"], t["schedule"], limit))
            add(f"fused_forward{tag}", lambda o, t, limit=limit: o.gate_up_down(
                t["x"], t["w_gate"], t["w_up"], t["w_down"], t["schedule"], limit))
            add(f"fused_backward{tag}", lambda o, t, limit=limit: o.down_dgrad_gate_up_dgrad(
                t["x_rows"], t["w_down"], t["w_gate"], t["w_up"], t["gate_up"], t["rw"], t["schedule"], limit))
        add("down", lambda o, t: o.down(t["h"], t["w_down"], t["schedule"]))
        add("down-push", lambda o, t: o.down(t["h"], t["w_down"], t["schedule"], push_to=t["slots"]))
        add("gate_up_dgrad", lambda o, t: o.gate_up_dgrad(t["d_gate_up"], t["w_gate"], t["w_up"], t["schedule"]))
        add("gate_up_dgrad-push", lambda o, t: o.gate_up_dgrad(t["d_gate_up"], t["w_gate"], t["w_up"],
                                                               t["schedule"], push_to=t["slots"]))
        if shape != "aligned":
            continue
        add("swiglu_fp8", lambda o, t: o.swiglu_fp8(t["d_gate_up"], t["schedule"], 0.5, 128, "fp32"))
        add("swiglu_backward_fp8", lambda o, t: o.swiglu_backward_fp8(t["h"], _fp8_rows(t["gate_up"]), t["schedule"],
                                                                      t["rw"].new_zeros(t["schedule"].capacity), 0.5))
        add("gate_up-pull", lambda o, t: o.gate_up_swiglu(
            t["x"], t["w_gate"], t["w_up"], t["schedule"], None, pull_from=t["tokens"], pull_flags=t["flags"]),
            {"pull_programs": 8})
        add("gate_up-pull-mxfp8", lambda o, t: o.gate_up_swiglu(
            t["x"], t["w_gate"], t["w_up"], t["schedule"], None, pull_from=t["tokens"], pull_flags=t["flags"],
            quant_block=32), {"pull_programs": 8})
        add("down_dgrad-pull", lambda o, t: o.down_dgrad_swiglu(
            t["x_rows"], t["w_down"], t["gate_up"], t["rw"], t["schedule"], None, pull_from=t["tokens"],
            pull_flags=t["flags"]), {"dgrad_pull_programs": 8})
        add("down_dgrad-pull-mxfp8", lambda o, t: o.down_dgrad_swiglu(
            t["x_rows"], t["w_down"], t["gate_up"], t["rw"], t["schedule"], None, pull_from=t["tokens"],
            pull_flags=t["flags"], quant_block=32), {"dgrad_pull_programs": 8})
        add("fused_forward-mxfp8", lambda o, t: o.gate_up_down(
            t["x"], t["w_gate"], t["w_up"], t["w_down"], t["schedule"], None, quant_block=32))
        add("fused_backward-mxfp8", lambda o, t: o.down_dgrad_gate_up_dgrad(
            t["x_rows"], t["w_down"], t["w_gate"], t["w_up"], t["gate_up"], t["rw"], t["schedule"], None,
            quant_block=32))
        add("fused_forward-shared", lambda o, t: o.gate_up_down(
            t["x"], t["w_gate"], t["w_up"], t["w_down"], t["schedule"], None, shared=shared(t, t["x"], False)))
        add("fused_backward-shared", lambda o, t: o.down_dgrad_gate_up_dgrad(
            t["x_rows"], t["w_down"], t["w_gate"], t["w_up"], t["gate_up"], t["rw"], t["schedule"], None,
            shared=shared(t, t["x"], True)))
        add("fused_forward-ep", lambda o, t: o.gate_up_down(
            t["x"], t["w_gate"], t["w_up"], t["w_down"], t["schedule"], None, pull_from=t["tokens"],
            pull_flags=t["flags"], push_to=t["slots"], shared=shared(t, t["x"], False)))
        add("fused_backward-ep", lambda o, t: o.down_dgrad_gate_up_dgrad(
            t["x_rows"], t["w_down"], t["w_gate"], t["w_up"], t["gate_up"], t["rw"], t["schedule"], None,
            pull_from=t["tokens"], pull_flags=t["flags"], push_to=t["slots"], shared=shared(t, t["x"], True)))
        add("fused_forward-ep-mxfp8", lambda o, t: o.gate_up_down(
            t["x"], t["w_gate"], t["w_up"], t["w_down"], t["schedule"], None, pull_from=t["tokens"],
            pull_flags=t["flags"], push_to=t["slots"], quant_block=32))
        add("fused_backward-ep-mxfp8", lambda o, t: o.down_dgrad_gate_up_dgrad(
            t["x_rows"], t["w_down"], t["w_gate"], t["w_up"], t["gate_up"], t["rw"], t["schedule"], None,
            pull_from=t["tokens"], pull_flags=t["flags"], push_to=t["slots"], quant_block=32))
    return variants


def _fp8_rows(t: torch.Tensor):
    """An empty fp8_blockwise row-quantized copy of t [R, C] (1 x 128 blocks, fp32 scales)."""
    from serval.values import QuantizedTensor
    return QuantizedTensor(torch.zeros(t.shape, dtype=torch.float8_e4m3fn),
                           torch.zeros(t.shape[0], t.shape[1] // 128), (1, 128), False)


_CONSTANT = re.compile(r"c\[0x0\]\[0x[0-9a-f]+\]")
_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")


def _fingerprint(compiled, cuobjdump: str, dump: str | None = None) -> dict:
    """The launch's SASS instructions (parameter offsets blanked) as a hash and a count, its resources; dump: a file
    to write the instructions to, one a line (to diff two runs)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        sass = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([cuobjdump, "-res-usage", path], capture_output=True, text=True, check=True).stdout
    instructions = [_CONSTANT.sub("c[0x0][param]", m.group(1)) for m in _INSTRUCTION.finditer(sass)]
    resources = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", usage))
    if dump is not None:
        with open(dump, "w") as f:
            f.write("\n".join(instructions) + "\n")
    return dict(sha=hashlib.sha256("\n".join(instructions).encode()).hexdigest()[:16],
                instructions=len(instructions), registers=int(resources["REG"]), stack=int(resources["STACK"]),
                local=int(resources["LOCAL"]), shared=compiled.metadata.shared)


def run(out: str, dump: str | None) -> None:
    from sm90 import compile_for_sm90
    from triton.backends.nvidia.compiler import get_ptxas

    import serval.kernels as kernels
    from serval.kernels import common
    from serval.plan import KernelPlan

    cuobjdump = os.path.join(os.path.dirname(get_ptxas(90).path), "cuobjdump")
    common.num_sms = lambda *a: 132
    common.install_tma_allocator = lambda: None
    ops_for = lambda **fields: kernels.KernelStages(dataclasses.replace(KernelPlan(), **fields))  # noqa: E731
    results = {}
    for name, launch in _variants(ops_for).items():
        for index, (kernel, args, kwargs) in enumerate(_record(launch)):
            key = f"{name}/{index}:{kernel.fn.__name__}"
            compiled = compile_for_sm90(kernel, args, kwargs, gluon=False)
            results[key] = _fingerprint(compiled, cuobjdump,
                                        None if dump is None else os.path.join(dump, f"{name}.{index}.sass"))
            print(key, results[key], flush=True)
    with open(out, "w") as f:
        json.dump(dict(triton=triton.__version__, launches=results), f, indent=1)


def compare(before: str, after: str) -> int:
    """Prints each launch whose fingerprint differs (kernel names aside); 1 if any does."""
    def load(path):
        with open(path) as f:
            data = json.load(f)
        return {key.split(":")[0]: value for key, value in data["launches"].items()}
    old, new = load(before), load(after)
    differ = 0
    for key in sorted(old.keys() | new.keys()):
        a, b = old.get(key), new.get(key)
        if a != b:
            differ += 1
            print(f"{key}: {a} -> {b}")
    print(f"{len(old)} launches before, {len(new)} after, {differ} differ")
    return 1 if differ else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="sass_fingerprint.json")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    parser.add_argument("--dump", metavar="DIR", help="also write each launch's instructions to DIR/<launch>.sass")
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare)
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
    run(args.out, args.dump)
    return 0


if __name__ == "__main__":
    sys.exit(main())
