"""Hardware counters for every kernel of one forward + backward step (Nsight Compute), per implementation.

    python tools/ncu_layer.py --shapes qwen3-30b-a3b,kimi-k2 --impls serval
    source benchmarks/install_sonicmoe.sh && python tools/ncu_layer.py --impls serval,sonicmoe
    python tools/ncu_layer.py --shapes kimi-k2 --impls serval --precision fp8_blockwise   # where an FP8 step goes

For each (shape, implementation) this script runs itself under `ncu` (on PATH or in /usr/local/cuda/bin):
the child process runs warm-up steps (compiles, autotunes), then one forward + backward between
cudaProfilerStart / Stop, and ncu collects METRICS for every kernel of that step. Per kernel (summed over its
calls) it prints the time, the SM clock, how busy the tensor pipe was (% of its peak over the active
cycles: the MMA rate a GEMM reached), DRAM bytes read / written, DRAM and L2 throughput (% of peak) and the
L2 hit rate, and appends the records to --out.

ncu leaves the clocks alone here (--clock-control none, as the device notes ask) and replays each kernel
once per metric pass on an otherwise idle GPU: kernels run near the idle boost clock, not at the 700 W cap
that bench_layer's timings include, so the times are not the layer's; the percentages and bytes are what
carry over. Needs a GPU whose runtime lets ncu read the counters (the nvidia-h200 kind does); elsewhere it
says so and exits with status 2.
"""

import argparse
import csv
import datetime
import io
import json
import os
import shutil
import subprocess
import sys

import torch

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCHMARKS)
from bench_layer import SHAPES, TINY_SHAPES, load_impl, make_inputs, make_params, pass_fn, serval_impl  # noqa: E402

# (column, ncu metric, how a kernel's calls combine: "sum" or "time" = time-weighted mean)
METRICS = [
    ("ms", "gpu__time_duration.sum", "sum"),
    ("sm_ghz", "sm__cycles_elapsed.avg.per_second", "time"),
    ("tensor_pct", "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active", "time"),
    ("dram_read_gb", "dram__bytes_read.sum", "sum"),
    ("dram_write_gb", "dram__bytes_write.sum", "sum"),
    ("dram_pct", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", "time"),
    ("l2_pct", "lts__throughput.avg.pct_of_peak_sustained_elapsed", "time"),
    ("l2_hit_pct", "lts__t_sector_hit_rate.pct", "time"),
]
# ncu's units for the metrics above, to ms, GHz, GB and %
_SCALE = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0,
          "hz": 1e-9, "cycle/second": 1e-9, "khz": 1e-6, "mhz": 1e-3, "ghz": 1.0, "cycle/nsecond": 1.0,
          "byte": 1e-9, "kbyte": 1e-6, "mbyte": 1e-3, "gbyte": 1.0, "%": 1.0, "": 1.0}


def find_ncu():
    default = "/usr/local/cuda/bin/ncu"
    return shutil.which("ncu") or (default if os.path.exists(default) else None)


def child(shape_name, impl_name, scope, sonic_configs, precision):
    """Warm up, then one profiled forward + backward (what ncu collects); serval's routed experts in
    `precision`."""
    device = torch.device("cuda")
    if impl_name == "serval" and precision != "bf16":
        loaded = serval_impl((("precision", precision),)), None
    else:
        loaded = load_impl(impl_name, device, argparse.Namespace(sonic_configs=sonic_configs))
    if loaded is None:
        sys.exit(3)
    impl, prepare = loaded
    inp = make_inputs({**SHAPES, **TINY_SHAPES}[shape_name], device)
    params = make_params(inp, scope)
    params = prepare(params) if prepare else params
    step = pass_fn(impl, params, inp["topk_ids"], inp["dy"], "fwdbwd")
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def parse(text, per_launch=False):
    """ncu --csv --metrics output -> {kernel: {column: value, "calls": n}}, calls combined as METRICS says
    (per_launch: one entry per launch, "<launch id> <kernel>", in launch order)."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    by_column = {metric: (column, how) for column, metric, how in METRICS}
    launches = {}
    for row in csv.DictReader(io.StringIO("\n".join(lines))):
        if row["Metric Name"] not in by_column:
            continue
        value = row["Metric Value"].replace(",", "")
        try:
            value = float(value) * _SCALE[row["Metric Unit"].lower()]
        except (ValueError, KeyError):
            continue
        launches.setdefault(row["ID"], {"kernel": row["Kernel Name"]})[by_column[row["Metric Name"]][0]] = value
    kernels = {}
    for ident, launch in sorted(launches.items(), key=lambda kv: int(kv[0])):
        name = f"{int(ident):3d} {short_name(launch['kernel'])}" if per_launch else launch["kernel"]
        k = kernels.setdefault(name, {"calls": 0, "_weighted": {}})
        k["calls"] += 1
        ms = launch.get("ms", 0.0)
        for column, _, how in METRICS:
            if column not in launch:
                continue
            if how == "sum":
                k[column] = k.get(column, 0.0) + launch[column]
            else:
                total, weight = k["_weighted"].get(column, (0.0, 0.0))
                k["_weighted"][column] = (total + launch[column] * ms, weight + ms)
    for k in kernels.values():
        for column, (total, weight) in k.pop("_weighted").items():
            k[column] = total / weight if weight else float("nan")
    return kernels


def profile(ncu, shape_name, impl_name, scope, sonic_configs, timeout, per_launch=False, precision="bf16"):
    """The child once without ncu (compiles and autotuning land in the disk caches: Triton's, quack's .o
    files, quack's autotuning results with QUACK_CACHE_AUTOTUNING=1; under ncu they would take many
    minutes), then under ncu."""
    child_cmd = [sys.executable, os.path.abspath(__file__), "--child", shape_name, impl_name, scope,
                 str(sonic_configs), precision]
    env = {**os.environ, "QUACK_CACHE_AUTOTUNING": "1"}
    metrics = ",".join(metric for _, metric, _ in METRICS)
    for cmd in (child_cmd, [ncu, "--clock-control", "none", "--profile-from-start", "off", "--print-kernel-base",
                            "function", "--print-units", "base", "--metrics", metrics, "--csv", *child_cmd]):
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            print(f"{shape_name} {impl_name}: {os.path.basename(cmd[0])} took over {timeout} s; not run")
            return None
        if run.returncode:
            print(f"{shape_name} {impl_name}: {os.path.basename(cmd[0])} exited {run.returncode}\n"
                  f"{run.stderr[-2000:]}{run.stdout[-2000:]}")
            return None
    return parse(run.stdout, per_launch)


def short_name(kernel):
    """CUTLASS DSL kernels carry their whole type in the name: keep the op and the MMA atom's shape."""
    if "quackgemm_" in kernel:
        op = kernel.split("quackgemm_")[1].split("Sm90")[0]
        atom = kernel.split("ShapeMNK")[1].split("_")[0] if "ShapeMNK" in kernel else "?"
        if atom.startswith("64") and atom.endswith("16"):  # wgmma m64 nN k16, written without separators
            atom = f"64x{atom[2:-2]}x16"
        warpgroups = kernel.split("ThrLayoutVMNK128")[1][0] if "ThrLayoutVMNK128" in kernel else "?"
        return f"quack {op} atom {atom} x{warpgroups}wg"
    return kernel


def print_kernels(title, kernels):
    print(f"\n{title}")
    print(f"  {'kernel':48s} {'calls':>5s} {'ms':>7s} {'GHz':>5s} {'tensor%':>7s} {'DRAM rd/wr GB':>14s} "
          f"{'DRAM%':>6s} {'L2%':>5s} {'L2 hit%':>7s}")
    per_launch = all(name[:3].strip().isdigit() for name in kernels)  # launch order, else by time
    for name, k in sorted(kernels.items(), key=lambda kv: kv[0] if per_launch else -kv[1].get("ms", 0.0)):
        print(f"  {short_name(name)[:48]:48s} {k['calls']:5d} {k.get('ms', 0):7.3f} {k.get('sm_ghz', 0):5.2f} "
              f"{k.get('tensor_pct', 0):7.1f} {k.get('dram_read_gb', 0):6.2f}/{k.get('dram_write_gb', 0):<7.2f} "
              f"{k.get('dram_pct', 0):6.1f} {k.get('l2_pct', 0):5.1f} {k.get('l2_hit_pct', 0):7.1f}")
    total = sum(k.get("ms", 0.0) for k in kernels.values())
    print(f"  {'all kernels':48s} {sum(k['calls'] for k in kernels.values()):5d} {total:7.3f}")


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return child(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="qwen3-30b-a3b")
    parser.add_argument("--impls", default="serval")
    parser.add_argument("--scope", default="routed", choices=["routed", "layer"])
    parser.add_argument("--sonic-configs", type=int, default=3, help="autotuning configs per SonicMoE (quack) GEMM")
    parser.add_argument("--precision", default="bf16", choices=["bf16", "mxfp8", "fp8_blockwise"],
                        help="serval's routed experts in this precision (the other implementations are bf16)")
    parser.add_argument("--per-launch", action="store_true",
                        help="one row per kernel launch, in launch order (default: per kernel, summed over its calls)")
    parser.add_argument("--timeout", type=float, default=400, help="seconds per (shape, implementation)")
    parser.add_argument("--out", default=os.path.join(BENCHMARKS, "results", "h200_ncu.json"))
    args = parser.parse_args()
    ncu = find_ncu()
    if not torch.cuda.is_available() or ncu is None:
        print(f"ncu_layer: needs a CUDA GPU and Nsight Compute (ncu: {ncu or 'not found'}); not run", file=sys.stderr)
        return 2
    import triton

    info = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), gpu=torch.cuda.get_device_name(),
                torch=torch.__version__, triton=triton.__version__)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    for shape_name in args.shapes.split(","):
        for impl_name in args.impls.split(","):
            kernels = profile(ncu, shape_name, impl_name, args.scope, args.sonic_configs, args.timeout,
                              args.per_launch, args.precision if impl_name == "serval" else "bf16")
            if kernels is None:
                continue
            print_kernels(f"{shape_name} {impl_name} {args.precision if impl_name == 'serval' else 'bf16'} "
                          f"({args.scope}, one forward + backward under ncu)", kernels)
            records = json.load(open(args.out)) if os.path.exists(args.out) else []  # appended as it goes
            precision = args.precision if impl_name == "serval" else "bf16"
            records += [dict(shape=shape_name, impl=impl_name, precision=precision, scope=args.scope, kernel=name,
                             **k, **info)
                        for name, k in kernels.items()]
            with open(args.out, "w") as f:
                json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
