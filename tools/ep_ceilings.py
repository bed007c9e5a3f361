"""
The plain data-movement ceilings of expert parallelism on the GPUs of one host, at MoE message sizes:
what serval's dispatch (pull) and combine (push) could reach at best, beside what NCCL reaches.

  nccl_a2a  dist.all_to_all_single of [P * R / (P - 1), H] bf16 rows (each peer gets its equal share)
  pull      serval's pull kernel (transport.symm.pull_rows): every one of the R rows read from a peer's
            symmetric buffer into local memory, the peers taken in turn row by row
  push      serval's push kernel (transport.symm.push_rows): every row written into a peer's buffer
  ce_read   the copy engines: local.copy_(peer's buffer), one peer after another (cudaMemcpy peer-to-peer)
  local     the pull kernel reading this GPU's own buffer: the HBM copy rate of the same kernel
  comm<G>   the gate/up GEMM's communication programs alone (serval.kernels.in_gemm_pull.pull_tiles, as a plan
            with pull_programs = G runs them): G persistent programs pulling the same rows 128 at a time, as they
            do inside the GEMM; how many SMs a dispatch under the GEMM needs (--comm-programs; --comm-block-c
            columns a step, default KernelPlan().pull_block_c)

R = --rows remote rows per GPU (the MoE message: N * k * (P - 1) / P rows of H, e.g. 4096 tokens, k = 8 at
EP=8 is ~28k rows), H = --hidden. GB/s = R * H * 2 bytes moved across GPUs (local: copied) per GPU and
direction over the median time of one call (--iters calls after --warmup, CUDA events, the largest over the
ranks). Two modes: "all" (every rank moves at once: NVLink busy both ways, as in a layer) and "one" (rank 0
alone, the others wait: one direction). No barriers inside the timed calls: the kernels alone.
Each transfer is checked once against the peers' data before it is timed.

  torchrun --nproc-per-node 8 tools/ep_ceilings.py               # -> benchmarks/results/h200x8_ceilings.json
  TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 torchrun --nproc-per-node 2 tools/ep_ceilings.py --one-gpu \
      --rows 512 --iters 3                                       # smoke test on one GPU (figures meaningless)
"""

import os

# NVLink multicast (NVLS) stays off (see /work/shared/ENVIRONMENT.md): before torch.distributed initialises
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import argparse
import json
import statistics
import sys

import torch
import torch.distributed as dist
import triton
import triton.language as tl

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results")
sys.path.insert(0, os.path.dirname(RESULTS))
import bench_layer  # noqa: E402  (puts this checkout's serval first on the path)

from serval.kernels import gemm_tile, in_gemm_pull  # noqa: E402
from serval.plan import KernelPlan  # noqa: E402
from serval.transport import symm  # noqa: E402

IMPLS = ["nccl_a2a", "pull", "push", "ce_read", "local"]
COMM_BLOCK_M = 128  # rows per step of a communication program (the gate/up GEMM's M-tile)


@triton.jit
def _comm_programs_kernel(pull, a, row_source_ptr, num_m_tiles, K, BLOCK_M: tl.constexpr, P: tl.constexpr):
    """The communication programs alone, as the GEMMs run them (the epoch read from pull.epoch): top_k 1 (a row's
    source is its owner's token row), no proxy fence (nothing reads the rows with TMA here)."""
    in_gemm_pull.pull_tiles(pull, a, row_source_ptr, tl.load(pull.epoch), num_m_tiles, K, BLOCK_M, P)


MODES = ["all", "one"]


def median_ms(fn, warmup, iters):
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def pattern(owner, row, hidden):
    """Rank `owner`'s buffer rows `row` [R]: small integers in bf16, recomputable on any rank."""
    col = torch.arange(hidden, device=row.device)
    return ((row[:, None] * hidden + col + owner[:, None] * 7) % 251).to(torch.bfloat16)


def transfers(rows, hidden, rank, world_size, device, group, comm_programs, comm_block_c):
    """(rows, {impl: (fn, check)}): fn() moves the rows once; check() moves them and says whether they are right.
    Remote row r of this rank belongs to peer (rank + 1 + r % (P - 1)) % P: the peers in turn."""
    share = rows // (world_size - 1)  # rows per peer
    rows = share * (world_size - 1)
    r = torch.arange(rows, device=device)
    of = lambda owner: torch.full_like(r, owner)
    buffer = symm._PeerBuffer((rows, hidden), torch.bfloat16, device, group, rank)  # read by pull, ce_read
    buffer.local.copy_(pattern(of(rank), r, hidden))
    slots = symm._PeerBuffer((rows, hidden), torch.bfloat16, device, group, rank)  # written by push
    owner = (rank + 1 + r % (world_size - 1)) % world_size
    # pull: my row r is row r of its owner's buffer (top_k = 1: source = owner * rows + row)
    pull_source = owner * rows + r
    # push: my row r lands in its owner's buffer at (my index among its writers) * share + r // (P - 1)
    push_source = owner * rows + (rank - owner - 1) % world_size * share + r // (world_size - 1)
    outgoing = pattern(of(rank), r, hidden)

    def pull(source=pull_source):
        return symm.pull_rows(buffer.table, source, rows, 1, hidden, torch.bfloat16, aligned=buffer.aligned)

    def push():
        symm.push_rows(slots.table, outgoing, push_source, rows, aligned=slots.aligned)

    def check_push():  # once every rank has pushed, writer w's rows to me sit at (its writer index) * share
        push()
        torch.cuda.synchronize()
        dist.barrier(group)  # every rank's push is done
        ok = True
        for w in range(world_size):
            if w != rank:
                sent = r[(w + 1 + r % (world_size - 1)) % world_size == rank]
                at = (w - rank - 1) % world_size * share
                ok &= torch.equal(slots.local[at:at + share], pattern(of(w)[:share], sent, hidden))
        return ok

    peers = [(rank + 1 + j) % world_size for j in range(world_size - 1)]
    offsets = [(a - base) // 2 for a, base in zip(buffer.addresses, buffer.handle.buffer_ptrs)]
    peer_views = [buffer.handle.get_buffer(p, (share, hidden), torch.bfloat16, offsets[p]) for p in peers]
    landing = torch.empty(rows, hidden, dtype=torch.bfloat16, device=device)

    def ce_read():
        for j, view in enumerate(peer_views):
            landing[j * share:(j + 1) * share].copy_(view)

    # the communication programs: the pull's rows, padded with -1 rows to whole M-tiles
    num_m_tiles = triton.cdiv(rows, COMM_BLOCK_M)
    comm_source = torch.full((num_m_tiles * COMM_BLOCK_M,), -1, dtype=torch.int32, device=device)
    comm_source[:rows] = pull_source
    comm_out = torch.empty(num_m_tiles * COMM_BLOCK_M, hidden, dtype=torch.bfloat16, device=device)
    comm_flags = torch.zeros(num_m_tiles, dtype=torch.int32, device=device)

    # the pull's bundles as the GEMMs pass them (`in_gemm_pull.kernel_arguments`): epoch 1, never bumped (every
    # call publishes its flags with 1 again), no round trip
    comm_epoch = torch.ones(1, dtype=torch.int32, device=device)
    comm_tables = in_gemm_pull.PullTables(buffer.table, rows, 1, comm_flags, comm_epoch, None)
    comm_a = gemm_tile.Rows(comm_out, comm_out.stride(0), comm_out.shape[0])

    def comm(programs):
        steps = in_gemm_pull.PullSteps(programs, comm_block_c, buffer.aligned, 0, False, False)
        _comm_programs_kernel[(programs,)](comm_tables, comm_a, comm_source, num_m_tiles, hidden,
                                           BLOCK_M=COMM_BLOCK_M, P=steps, num_warps=8)

    def check_comm(programs):
        comm(programs)
        return torch.equal(comm_out[:rows], pattern(owner, r, hidden)) and not comm_out[rows:].any()

    send = outgoing[:share].repeat(world_size, 1)
    recv = torch.empty_like(send)
    nccl = lambda: dist.all_to_all_single(recv, send, group=group)
    first_rows = lambda ranks: torch.cat([pattern(of(p)[:share], r[:share], hidden) for p in ranks])
    return rows, {
        "pull": (pull, lambda: torch.equal(pull(), pattern(owner, r, hidden))),
        "push": (push, check_push),
        "ce_read": (ce_read, lambda: (ce_read(), torch.equal(landing, first_rows(peers)))[1]),
        "nccl_a2a": (nccl, lambda: (nccl(), torch.equal(recv, first_rows(range(world_size))))[1]),
        "local": (lambda: pull(rank * rows + r), lambda: torch.equal(pull(rank * rows + r), buffer.local)),
        **{f"comm{g}": (lambda g=g: comm(g), lambda g=g: check_comm(g)) for g in comm_programs},
    }


def all_ranks(ok, device):
    """Whether `ok` holds on every rank."""
    t = torch.tensor([float(ok)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return t.item() > 0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="2048,8192,16384,28672",
                        help="remote rows per GPU, comma-separated (rounded down to a multiple of P - 1)")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--comm-programs", default="4,8,16,32",
                        help="G of the comm<G> rows, comma-separated (empty: none)")
    parser.add_argument("--comm-block-c", type=int, default=KernelPlan().pull_block_c,
                        help="columns a communication program moves per step (default: KernelPlan's pull_block_c)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--one-gpu", action="store_true",
                        help="all ranks on GPU 0 (TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1): a smoke test")
    parser.add_argument("--out", default=None, help="JSON list to append to (default: benchmarks/results/"
                                                    "h200x<P>_ceilings.json)")
    args = parser.parse_args()

    # one GPU: NCCL refuses two ranks on a device, so gloo carries the few host-side collectives (no nccl_a2a)
    dist.init_process_group("gloo" if args.one_gpu else "nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size < 2:
        raise SystemExit("ep_ceilings.py needs at least 2 ranks (torchrun --nproc-per-node P)")
    device = torch.device("cuda", 0 if args.one_gpu else int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    group = dist.group.WORLD
    info = bench_layer.env_info(device)
    info["gpus"] = f"{world_size}x {info['gpu']}" + (" (one GPU, smoke test)" if args.one_gpu else "")
    comm_programs = [int(g) for g in args.comm_programs.split(",") if g]
    impls = [i for i in args.impls.split(",") if not (args.one_gpu and i == "nccl_a2a")]
    impls += [f"comm{g}" for g in comm_programs]
    host = torch.device("cpu") if args.one_gpu else device  # where the small reductions run
    records = []
    for wanted_rows in map(int, args.rows.split(",")):
        rows, moves = transfers(wanted_rows, args.hidden, rank, world_size, device, group, comm_programs,
                                args.comm_block_c)
        mbytes = rows * args.hidden * 2 / 1e6
        for impl in impls:
            fn, check = moves[impl]
            ok = all_ranks(bool(check()), host)
            for mode in MODES:
                if mode == "one" and impl in ("nccl_a2a", "local"):
                    continue  # a collective needs every rank; local moves nothing across GPUs
                dist.barrier(group)
                torch.cuda.synchronize()
                active = mode == "all" or rank == 0
                ms = median_ms(fn, args.warmup, args.iters) if active else 0.0
                torch.cuda.synchronize()
                t = torch.tensor([ms], dtype=torch.float64, device=host)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                ms = t.item()
                rec = dict(impl=impl, mode=mode, ep=world_size, rows=rows, hidden=args.hidden, mbytes=mbytes,
                           ms=ms, gbps=mbytes / 1e3 / (ms * 1e-3), checked=ok, **info)
                if impl.startswith("comm"):
                    rec["block_c"] = args.comm_block_c
                records.append(rec)
                if rank == 0:
                    print(f"{impl:<9}{mode:<5}{rows:>7} rows {mbytes:8.1f} MB {ms:8.3f} ms {rec['gbps']:7.1f} GB/s"
                          f"{'' if ok else '  WRONG DATA'}", flush=True)
    if rank == 0:
        out = args.out or os.path.join(RESULTS, f"h200x{world_size}_ceilings.json")
        old = json.load(open(out)) if os.path.exists(out) else []
        with open(out, "w") as f:
            json.dump(old + records, f, indent=1)
        print(f"\n{out}: GB/s per GPU and direction")
        sizes = sorted({r["rows"] for r in records})
        print(f"{'impl':<10}{'mode':<6}" + "".join(f"{s:>10}" for s in sizes))
        for impl in impls:
            for mode in MODES:
                cells = {r["rows"]: r["gbps"] for r in records if r["impl"] == impl and r["mode"] == mode}
                if cells:
                    print(f"{impl:<10}{mode:<6}" + "".join(f"{cells.get(s, float('nan')):>10.1f}" for s in sizes))
    dist.barrier(group)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
