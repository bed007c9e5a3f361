"""
Benchmark the MoE layer at expert parallelism, EP = P GPUs of one host (one process per GPU), side by side:

  serval    serval.moe(x, router_weights, topk_ids, w_gate_local, w_up_local, w_down_local, shared, group=pg):
            pull dispatch / push combine through the peers' buffers (serval.transport), schedule on the device
  nccl_a2a  the plain baseline: sort the rows by destination rank, all_to_all_single, torch._grouped_mm
            expert MLP on the received rows sorted by local expert, all_to_all_single back, weighted
            fixed-order combine; forward+backward by autograd (torch.distributed.nn.functional.all_to_all_single)

Run with torchrun (nccl; --tiny: tiny shapes on the CPU with gloo, seconds):
  nvidia-smi topo -m            # first: every GPU pair NV18 (NVLink), not PIX/PHB/SYS
  nvidia-smi nvlink -s          # per-link rates: 18 links x ~26.6 GB/s = the --link-gbps figure
  torchrun --nproc-per-node 8 benchmarks/bench_ep.py --tiny --device cuda   # smoke test on the GPUs, seconds
  torchrun --nproc-per-node 8 benchmarks/bench_ep.py --plot
  torchrun --nproc-per-node 2 benchmarks/bench_ep.py --tiny
  python benchmarks/bench_ep.py --report-only --out benchmarks/results/h200x2_ep.json

Inputs: docs/CONTRACT.md's multi-GPU shapes (benchmarks/shapes.py EP_SHAPES: real E, E_local = E/P on each
rank, N = 4096 tokens per GPU). Each rank makes its own tokens, router weights, d_y, experts and copy of the
shared expert (bench_layer.make_inputs on the rank's shape, seeded per rank) and takes its N rows of one balanced
routing of all P*N tokens (bench_layer.balanced_routing, same seed on every rank): every expert gets P*N*k/E
rows, every rank N*k.
Scopes: "routed" (experts only) and "layer" (+ the shared expert).

Correctness first: serval's y and gradients (d_x, d_rw, d_w_gate) against nccl_a2a's, relative errors
||a-b||/||b||, the largest over the ranks; an implementation past --tol is not timed.

serval's forward by stage (stage_ms of its fwd records), the steps of serval.functional.forward one at a time
through its public pieces (functional.build_ep_schedule, the pass plan's stages (serval.pass_plan), the workspace's
transport), CUDA events at the stage boundaries (perf_counter on the CPU), no autograd:
  schedule      functional.build_ep_schedule: all-gather of the routing, the group's schedule, this rank's slice
  dispatch      transport.pull(x, row_source): this rank's experts' rows read from their owners
  gate_up       gate_up_swiglu over those rows
  dispatch+gate_up  instead of those two where the plan has the gate/up GEMM pull its own rows (pull_programs > 0:
                transport.pull_into; no dispatch_gbps then)
  shared        the shared expert (scope "layer")
  down_combine  the down GEMM and its rows into the owners' slots (the kernels' GEMM epilogue writes them there,
                transport.push_from; the torch stages push them after it), the push's two barriers, then the
                combine over the slots
rel_errs["y_staged"] is this path against serval.moe's y (0.0: the stages are what serval.moe runs). Older
records split the last two stages as "experts" (gate/up + down) and "combine", with a combine_gbps.
dispatch_gbps: rank 0's rows moved across ranks (owner != rank 0) * H * 2 bytes over the dispatch stage's
time (the largest over the ranks), per GPU and direction: an effective rate, the stage also holds the copy
into the symmetric buffer and two barriers. --link-gbps (default 450, H200 NVLink per direction) is printed
beside.

--variant "NAME: FIELD=VALUE; ..." (as bench_layer.py takes it: fields of serval.plan.KernelPlan, set in the plan
serval picks for the shape, or of serval.Config) also runs serval with that Config, recorded as impl
"serval (NAME)" with its settings, right after serval's default; e.g. "pull 16: pull_programs=16",
"block_m 64: block_m=64". On the CPU (--tiny) serval runs its torch-op stages; a variant with backend=triton runs
its kernels in Triton's interpreter (TRITON_INTERPRET=1, which bench_layer sets where there is no GPU).

Records appended by rank 0 to --out (default benchmarks/results/h200x<P>_ep.json): {shape, impl, settings, scope,
pass, ep, ms, tflops, stage_ms, dispatch_gbps, link_gbps, rel_err, rel_errs, saved_mem_gib,
peak_mem_gib, error, soak_s, date, gpus, torch, triton}. ms: median over --iters calls after --warmup and
--soak seconds of sustained load (the GPUs at their power cap, as bench_layer.py times them), the largest
over the ranks; tflops: docs/CONTRACT.md's FLOPs per GPU (bench_layer.flops: forward 6*(N + N*k)*H*I for
layer, 6*N*k*H*I for routed, backward 2 x forward) over ms; memory: GiB on the GPU, largest over the ranks. A
rank that raises leaves its peers inside a collective, so an error ends the run (torchrun stops every rank);
records are saved after each implementation.
"""

import os

# NVLink multicast (NVLS) stays off (see /work/shared/ENVIRONMENT.md): before torch.distributed initialises
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import argparse
import functools
import statistics
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_autograd
import torch.nn.functional as F

import bench_layer  # also puts this checkout's serval first on the path (and, without a GPU, the interpreter on)
from bench_layer import (balanced_routing, env_info, flops, latest, load_records, make_inputs, make_params,
                         memory_gib, parse_variants, plot, print_table, rel_err, save_records, shared_mlp, shared_of,
                         time_ms, variant_config)
from shapes import EP_SHAPES, EP_TINY_SHAPES

import serval
from serval import functional, pass_plan
from serval.schedule import slot_schedule
from serval.transport import split_source

# the autograd all_to_all_single of the stable API; it warns that it is deprecated on every call
warnings.filterwarnings("ignore", message="torch.distributed.nn.functional.all_to_all_single is deprecated")

IMPLS = ["serval", "nccl_a2a"]
SCOPES = ["routed", "layer"]
PASSES = ["fwd", "fwdbwd"]
STAGES = ["schedule", "dispatch", "gate_up", "dispatch+gate_up", "shared", "down_combine"]


def log(*args):
    if dist.get_rank() == 0:
        print(*args, flush=True)


def group_max(values, device):
    """Elementwise max over the ranks of a list of floats."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


# -----------------------------------------------------------------------------
# inputs


def make_rank_inputs(shape, rank, world_size, device, seed):
    """This rank's part of the group's problem (see the module docstring)."""
    H, I, E, k, N, has_shared = shape
    inp = make_inputs((H, I, E // world_size, k, N, has_shared), device, seed + 1 + rank)
    gen = torch.Generator(device=device).manual_seed(seed)
    inp["topk_ids"] = balanced_routing(world_size * N, E, k, gen, device)[rank * N:(rank + 1) * N].contiguous()
    inp["shape"] = shape
    return inp


# -----------------------------------------------------------------------------
# implementations: impl(p, topk_ids, group) -> y [N, H], p from bench_layer.make_params (this rank's experts)


def serval_ep(p, topk_ids, group, config=None):
    return serval.moe(p["x"], p["router_weights"], topk_ids, p["w_gate"], p["w_up"], p["w_down"], shared_of(p),
                      group=group, config=config)


def inverse(perm):
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def expert_mlp(rows, p, offs):
    """SwiGLU MLP of each local expert over its segment of rows (offs: row end of each expert)."""
    gate = torch._grouped_mm(rows, p["w_gate"].transpose(-2, -1), offs=offs)
    up = torch._grouped_mm(rows, p["w_up"].transpose(-2, -1), offs=offs)
    return torch._grouped_mm(F.silu(gate) * up, p["w_down"].transpose(-2, -1), offs=offs)


def nccl_a2a(p, topk_ids, group):
    x, rw = p["x"], p["router_weights"]
    (N, k), (E_local, _, H) = topk_ids.shape, p["w_gate"].shape
    P = group.size()
    # send side: the N*k (token, slot) rows sorted by global expert, i.e. by destination rank, then expert
    sorted_ids, order = torch.sort(topk_ids.flatten(), stable=True)
    send_counts = torch.bincount(sorted_ids, minlength=P * E_local)  # [P * E_local] rows to each expert
    recv_counts = torch.empty_like(send_counts)  # [P * E_local]: rows from rank s for local expert e at s*E_local + e
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    # all_to_all_single takes its split sizes as host ints: this .tolist() syncs the host with the GPU on
    # every call (fine for the baseline; serval keeps every shape fixed and its schedule on the device)
    send_splits, recv_splits = torch.stack([send_counts.view(P, E_local).sum(1),
                                            recv_counts.view(P, E_local).sum(1)]).tolist()
    recv_x = dist_autograd.all_to_all_single(x.new_empty(sum(recv_splits), H), x[order // k],
                                             recv_splits, send_splits, group=group)
    # received: by source rank, by local expert inside; regroup by local expert (stable: source rank, then row)
    local_expert = torch.arange(E_local, device=x.device).repeat(P).repeat_interleave(
        recv_counts, output_size=recv_x.shape[0])
    by_expert = torch.sort(local_expert, stable=True).indices
    offs = torch.cumsum(recv_counts.view(P, E_local).sum(0), 0).to(torch.int32)
    out = expert_mlp(recv_x[by_expert], p, offs)[inverse(by_expert)]
    back = dist_autograd.all_to_all_single(out.new_empty(N * k, H), out, send_splits, recv_splits, group=group)
    # back[i] is row order[i]'s result: un-permute to [N, k, H], weight, sum over the k slots in fp32
    y = (back[inverse(order)].view(N, k, H).float() * rw.unsqueeze(-1)).sum(1)
    if shared_of(p):
        y = y + shared_mlp(x, shared_of(p)).float()
    return y.to(x.dtype)


IMPL_FNS = {"serval": serval_ep, "nccl_a2a": nccl_a2a}

# -----------------------------------------------------------------------------
# serval's forward by stage


def serval_workspace(p, topk_ids, group, config):
    """The workspace serval.moe uses for these inputs (the same cached one: same buffers)."""
    (N, k), x = topk_ids.shape, p["x"]
    return functional.get_workspace(N, k, x.shape[1], p["w_gate"].shape[0] * group.size(), device=x.device,
                                    config=config, group=group, dtype=x.dtype)


def serval_staged_forward(p, topk_ids, workspace, config, clock):
    """serval's EP forward, the steps of functional.forward one stage at a time, clock() called at each
    stage boundary. Returns (y, [(stage, clock value)] starting with ("start", ...))."""
    x, rw, shared = p["x"], p["router_weights"], shared_of(p)
    plan = pass_plan.plan_pass(config, x, p["w_gate"], shared, workspace)
    ops, transport = plan.ops, workspace.transport
    hidden, num_tokens = x.shape[1], x.shape[0]
    marks = [("start", clock())]
    schedule, _ = functional.build_ep_schedule(topk_ids, rw, workspace)
    marks.append(("schedule", clock()))
    if plan.forward.rows_in == pass_plan.PULLED_BY_GEMM:  # the GEMM's first programs pull its rows
        _, h = transport.pull_into(lambda source: ops.gate_up_swiglu(
            x, p["w_gate"], p["w_up"], schedule, None, pull_from=source, pull_flags=workspace.pull_flags), x)
        marks.append(("dispatch+gate_up", clock()))
    else:
        x_rows = transport.pull(x, schedule.row_source)
        marks.append(("dispatch", clock()))
        _, h = ops.gate_up_swiglu(x, p["w_gate"], p["w_up"], schedule, None, a_rows=x_rows)
        marks.append(("gate_up", clock()))
    shared_out = None
    if shared is not None:  # the shared expert as a one-expert group over the rank's own tokens
        ws_gate, ws_up, ws_down = (w.unsqueeze(0) for w in shared)
        shared_schedule = functional.dense_schedule(num_tokens, schedule.block_m, x.device)
        _, shared_h = ops.gate_up_swiglu(x, ws_gate, ws_up, shared_schedule, None)
        shared_out = ops.down(shared_h, ws_down, shared_schedule)[:num_tokens]
        marks.append(("shared", clock()))
    if plan.forward.rows_out == pass_plan.PUSHED_BY_GEMM:  # the down GEMM's epilogue stores into the owners' slots
        slots = transport.push_from(lambda target: ops.down(h, p["w_down"], schedule, push_to=target), hidden, x.dtype)
    else:
        slots = transport.push(ops.down(h, p["w_down"], schedule), schedule.row_source, complete=True, copy=False)
    y = ops.combine(slots, rw, slot_schedule(num_tokens, topk_ids.shape[1], x.device), shared_out)
    marks.append(("down_combine", clock()))
    return y, marks


def stage_clock(device):
    """(clock, elapsed ms between two clock values): CUDA events on the stream, no sync between stages;
    host time on the CPU."""
    if device.type != "cuda":
        return time.perf_counter, lambda a, b: (b - a) * 1e3

    def clock():
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    return clock, lambda a, b: a.elapsed_time(b)


def remote_rows(workspace, topk_ids, router_weights):
    """Rows of this rank's schedule whose token lives on another rank: what dispatch pulls across ranks
    and combine pushes across ranks."""
    schedule, _ = functional.build_ep_schedule(topk_ids, router_weights, workspace)
    owner = split_source(schedule.row_source, workspace.num_tokens, workspace.top_k)[0]
    return int(((owner >= 0) & (owner != workspace.rank)).sum())


def serval_stage_times(p, topk_ids, group, args, device, config):
    """{stage_ms, dispatch_gbps, link_gbps} of serval's forward: per-stage medians over
    --iters runs after --warmup, each the largest over the ranks."""
    workspace = serval_workspace(p, topk_ids, group, config)
    clock, elapsed = stage_clock(device)
    with torch.no_grad():
        runs = [serval_staged_forward(p, topk_ids, workspace, config, clock)[1]
                for _ in range(args.warmup + args.iters)][args.warmup:]
        moved = remote_rows(workspace, topk_ids, p["router_weights"])
    if device.type == "cuda":
        torch.cuda.synchronize()
    names = [name for name, _ in runs[0][1:]] + ["total"]
    medians = [statistics.median(elapsed(marks[i][1], marks[i + 1][1]) for marks in runs)
               for i in range(len(names) - 1)]
    medians.append(statistics.median(elapsed(marks[0][1], marks[-1][1]) for marks in runs))
    stage_ms = dict(zip(names, group_max(medians, device)))
    gbytes = moved * p["x"].shape[1] * p["x"].element_size() / 1e9
    dispatch_gbps = gbytes / (stage_ms["dispatch"] * 1e-3) if "dispatch" in stage_ms else None
    return dict(stage_ms=stage_ms, dispatch_gbps=dispatch_gbps, link_gbps=args.link_gbps)


def soak(fn, seconds, device):
    """Keep the GPUs busy with fn() for about `seconds` (bench_layer.time_ms's soak), with the same number of
    calls on every rank: fn holds collectives."""
    if seconds <= 0 or device.type != "cuda":
        return
    one_call_ms = group_max([time_ms(fn, 0, 1, device)], device)[0]
    for _ in range(int(seconds * 1e3 / max(one_call_ms, 1e-3))):
        fn()


# -----------------------------------------------------------------------------


def bench_impl(name, inp, ref, shape_name, scope, passes, group, args, device, info, label=None, settings=None):
    """Check one implementation against the reference (nccl_a2a), then time each pass. Returns its records
    (impl = label, default the name). settings: serval's variant (bench_layer.variant_config; None: Config())."""
    shape, topk_ids, dy = inp["shape"], inp["topk_ids"], inp["dy"]
    p = make_params(inp, scope)
    config = variant_config(settings or [], p["x"])
    impl = functools.partial(IMPL_FNS[name], group=group,  # bench_layer's impl(p, topk_ids)
                             **({"config": config} if name == "serval" else {}))
    label = label or name
    tag = f"{shape_name:<16} {scope:<6} {label:<9}"
    errs = bench_layer.check(impl, p, topk_ids, dy, ref)
    if name == "serval":  # the stage-by-stage path timed below must be what serval.moe computes
        with torch.no_grad():
            y_staged, _ = serval_staged_forward(p, topk_ids, serval_workspace(p, topk_ids, group, config), config,
                                                clock=lambda: None)
            errs["y_staged"] = rel_err(y_staged, impl(p, topk_ids))
    errs = dict(zip(errs, group_max(list(errs.values()), device)))
    err = max(errs.values())
    log(f"{tag} rel_err (max over ranks) " + " ".join(f"{k}={v:.2e}" for k, v in errs.items()))
    recorded = None if settings is None else [f"{path}={value!r}" for path, value in settings]
    records = []
    for ps in passes:
        rec = dict(shape=shape_name, impl=label, settings=recorded, scope=scope, **{"pass": ps}, ep=group.size(),
                   ms=None, tflops=None,
                   stage_ms=None, dispatch_gbps=None, link_gbps=None, rel_err=err, rel_errs=errs,
                   saved_mem_gib=None, peak_mem_gib=None, error=None, soak_s=args.soak, **info)
        records.append(rec)
        if not err <= args.tol:
            log(f"{tag} {ps:<6} MISMATCH (rel_err {err:.2e} > tol {args.tol}): not timed")
            rec["error"] = "mismatch"
            continue
        fn = bench_layer.pass_fn(impl, p, topk_ids, dy, ps)
        dist.barrier()
        soak(fn, args.soak, device)
        rec["ms"] = group_max([time_ms(fn, args.warmup, args.iters, device)], device)[0]
        rec["tflops"] = flops(shape, scope, ps) / (rec["ms"] * 1e-3) / 1e12
        mem = ""
        if device.type == "cuda":
            rec["saved_mem_gib"], rec["peak_mem_gib"] = group_max(list(memory_gib(impl, p, topk_ids, fn)), device)
            mem = f"  saved {rec['saved_mem_gib']:6.2f} GiB  peak {rec['peak_mem_gib']:6.2f} GiB"
        log(f"{tag} {ps:<6} {rec['ms']:9.3f} ms {rec['tflops']:7.1f} TFLOP/s per GPU{mem}")
        if name == "serval" and ps == "fwd":
            rec.update(serval_stage_times(p, topk_ids, group, args, device, config))
            log(f"{tag} stages " + " ".join(f"{s} {t:.3f}" for s, t in rec["stage_ms"].items()) + " ms"
                + (f"; dispatch {rec['dispatch_gbps']:.4g} GB/s ({rec['dispatch_gbps'] / args.link_gbps:.0%} of "
                   f"{args.link_gbps:g})" if rec["dispatch_gbps"] else ""))
    return records


def report(records, args):
    """bench_layer's TFLOP/s tables (and plot), then serval's stages."""
    as_layer = [dict(r, gpu=f"{r['gpus']}, EP={r['ep']}") for r in records]  # bench_layer groups by 'gpu'
    records = latest(as_layer) if records else []
    print(f"\n{args.out}: {len(records)} latest records")
    if args.plot is not None and records:
        plot(records, args.plot or os.path.splitext(args.out)[0] + ".png")
    print_table(records)
    staged = [r for r in records if r.get("stage_ms")]
    if staged:
        link = staged[-1]["link_gbps"]
        # older records have other stage names (see the module docstring): every name seen, STAGES' first
        seen = {s for r in staged for s in r["stage_ms"]}
        stages = [s for s in STAGES if s in seen] + sorted(seen - set(STAGES) - {"total"}) + ["total"]
        print(f"\nserval forward by stage, ms; dispatch GB/s per GPU and direction (link {link:g} GB/s)")
        print(f"{'shape':<16}{'scope':<8}{'impl':<24}" + "".join(f"{s[:12]:>13}" for s in stages) + f"{'dispatch':>10}")
        for r in staged:
            cells = [r["stage_ms"].get(s) for s in stages]
            print(f"{r['shape']:<16}{r['scope']:<8}{r['impl']:<24}"
                  + "".join(f"{c:>13.3f}" if c is not None else f"{'-':>13}" for c in cells)
                  + (f"{r['dispatch_gbps']:>10.4g}" if r["dispatch_gbps"] else f"{'-':>10}"))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=None, help="comma-separated names (default: all)")
    parser.add_argument("--impls", default=",".join(IMPLS), help="the reference (nccl_a2a's y, grads) runs in any case")
    parser.add_argument("--scopes", default=",".join(SCOPES))
    parser.add_argument("--passes", default=",".join(PASSES))
    parser.add_argument("--warmup", type=int, default=None, help="default 10 (2 with --tiny)")
    parser.add_argument("--iters", type=int, default=None, help="default 50 (5 with --tiny)")
    parser.add_argument("--soak", type=float, default=None,
                        help="seconds of sustained load before each timed loop, CUDA (default 2, 0 with --tiny)")
    parser.add_argument("--tol", type=float, default=3e-2, help="largest rel. error vs nccl_a2a that is timed")
    parser.add_argument("--link-gbps", type=float, default=450.0,
                        help="link rate per GPU and direction, GB/s (H200 NVLink: 450; see nvidia-smi nvlink -s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="JSON list to append to (default: benchmarks/results/"
                        "h200x<P>_ep.json; with --tiny: bench_ep_tiny.json in the temp folder)")
    parser.add_argument("--plot", nargs="?", const="", default=None, help="PNG path (default: --out with .png)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes, runs on the CPU (gloo) in seconds")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present, cpu with --tiny)")
    parser.add_argument("--report-only", action="store_true", help="measure nothing (no torchrun): tables of --out")
    parser.add_argument("--variant", action="append", default=[],
                        help="'NAME: FIELD=VALUE; ...': serval with these KernelPlan / Config fields, too, as impl "
                             "'serval (NAME)' (as bench_layer.py takes it)")
    args = parser.parse_args()
    args.warmup = args.warmup if args.warmup is not None else (2 if args.tiny else 10)
    args.iters = args.iters if args.iters is not None else (5 if args.tiny else 50)
    args.soak = args.soak if args.soak is not None else (0.0 if args.tiny else 2.0)
    if args.report_only:
        if args.out is None:
            parser.error("--report-only needs --out")
        report(load_records(args.out), args)
        return
    if "RANK" not in os.environ:
        parser.error("run under torchrun, e.g. torchrun --nproc-per-node 8 benchmarks/bench_ep.py")
    variants = parse_variants(parser, args.variant, torch.device("cpu"))

    # one process per GPU: nccl on the GPUs, gloo on the CPU
    device_type = args.device or ("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    group, rank, P = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    if args.out is None:
        args.out = os.path.join(tempfile.gettempdir(), "bench_ep_tiny.json") if args.tiny else \
            f"benchmarks/results/h200x{P}_ep.json"

    table = EP_TINY_SHAPES if args.tiny else EP_SHAPES
    shape_names = args.shapes.split(",") if args.shapes else list(table)
    impls, scopes, passes = args.impls.split(","), args.scopes.split(","), args.passes.split(",")
    for given, known in [(shape_names, table), (impls, IMPLS), (scopes, SCOPES), (passes, PASSES)]:
        if set(given) - set(known):
            parser.error(f"unknown {sorted(set(given) - set(known))}; known: {', '.join(known)}")
    if P < 2 or any(table[s][2] % P for s in shape_names):
        parser.error(f"EP needs 2 or more ranks dividing every shape's E; got {P} ranks")
    info = env_info(device)
    info["gpus"] = f"{P}x {info.pop('gpu')}"
    log(f"EP={P}: {info['gpus']}, torch {info['torch']}, triton {info['triton']}; impls: {', '.join(impls)}; "
        f"NCCL_NVLS_ENABLE={os.environ['NCCL_NVLS_ENABLE']} TORCH_SYMM_MEM_DISABLE_MULTICAST="
        f"{os.environ['TORCH_SYMM_MEM_DISABLE_MULTICAST']} NVSHMEM_DISABLE_NVLS={os.environ['NVSHMEM_DISABLE_NVLS']}")

    for shape_name in shape_names:
        inp = make_rank_inputs(table[shape_name], rank, P, device, args.seed)
        for scope in scopes:
            if scope == "layer" and not inp["shape"][-1]:
                continue  # no shared expert: layer == routed
            ref = bench_layer.reference(functools.partial(nccl_a2a, group=group), inp, scope, passes)
            runs = [(name, name, None) for name in impls]
            if "serval" in impls:
                at = impls.index("serval") + 1
                runs[at:at] = [("serval", f"serval ({label})", settings) for label, settings in variants]
            for name, label, settings in runs:
                records = bench_impl(name, inp, ref, shape_name, scope, passes, group, args, device, info, label,
                                     settings)
                if rank == 0:
                    save_records(records, args.out)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            del ref
        del inp

    if rank == 0:
        report(load_records(args.out), args)
    dist.barrier(group)  # leave together: a rank tearing down gloo while another still runs can abort at exit
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
