"""Expert parallelism on the CPU: gloo processes sharing memory, against EP=1 on the concatenated batch.

Every rank builds the same problem from one seed, runs serval.moe on its N tokens and E/P experts
with group=<gloo group>, and checks that y, d_x, d_router_weights and its experts' weight gradients
are BITWISE equal to the EP=1 layer on the concatenated batch (row order and reduction order do not
depend on P), and that two runs are identical; a skewed routing drops nothing, however many of the group's
rows one rank receives (they stream through the macrobatch ring, `serval.macrobatch`). On CUDA (every rank on
one GPU, or one GPU a rank) each rank's step also runs with no host sync and replays from a CUDA graph to the same
bits, every rank capturing and replaying at once.
"""

import dataclasses
import datetime
import json
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import serval
from serval.plan import choose_plan
from conftest import (CUDA, check_sync_free_and_graph_replay, make_layer, make_routing, rel_err, requires_cuda,
                      requires_interpreter)

N, H, I, E, K, SHARED = 24, 32, 16, 8, 2, 16
SWIGLU_LIMIT = 0.9


def problem(world_size, kind, num_tokens, seed=0, inter=I):
    x, weights, shared = make_layer(world_size * num_tokens, H, inter, E, shared_inter=SHARED, seed=seed)
    rw, ids = make_routing(world_size * num_tokens, E, K, kind=kind, seed=seed)
    d_y = torch.randn(world_size * num_tokens, H, generator=torch.Generator().manual_seed(seed + 1))
    return x, rw, ids, weights, shared, d_y


def layer_grads(x, rw, ids, weights, shared, d_y, joined=False, **kwargs):
    """(y, the gradients of x, rw, w_gate, w_up, w_down and the shared weights); joined: the gate and up weights
    passed as one [E, 2I, H] tensor (w_up=None), its gradient split back into the two for comparison."""
    if joined:
        weights = [torch.cat(weights[:2], dim=1), weights[2]]
    inputs = [t.detach().clone().requires_grad_() for t in (x, rw, *weights, *shared)]
    routed = inputs[2:4] if joined else inputs[2:5]
    if joined:
        routed = [routed[0], None, routed[1]]
    y = serval.moe(inputs[0], inputs[1], ids, *routed, tuple(inputs[4 + (not joined):]), swiglu_limit=SWIGLU_LIMIT,
                   **kwargs)
    grads = list(torch.autograd.grad(y, inputs, d_y))
    if joined:
        assert grads[2].is_contiguous() and grads[2].shape == weights[0].shape
        grads[2:3] = grads[2].chunk(2, dim=1)
    return (y.detach(), *grads)


def worker(rank, world_size, init_file, kind, backend, macrobatch_size, device, num_tokens, pull_programs,
           precision="bf16", inter=I, fused=(), quantize_weights_once=False, frozen=False, joined=False):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(minutes=5))
    try:
        group = dist.group.WORLD
        x, rw, ids, weights, shared, d_y = problem(world_size, kind, num_tokens, inter=inter)
        if precision != "bf16" and device == "cpu":  # the FP8 precisions take bf16 inputs
            x, d_y = x.bfloat16(), d_y.bfloat16()
            weights, shared = [w.bfloat16() for w in weights], tuple(w.bfloat16() for w in shared)
        if device != "cpu":  # "cuda": every rank on the one GPU (correctness only, never timing); "cuda-per-rank"
            gpu = torch.device("cuda", rank if device == "cuda-per-rank" else 0)
            torch.cuda.set_device(gpu)
            x, rw, ids, d_y = x.to(gpu, torch.bfloat16), rw.to(gpu), ids.to(gpu), d_y.to(gpu, torch.bfloat16)
            weights = [w.to(gpu, torch.bfloat16) for w in weights]
            shared = tuple(w.to(gpu, torch.bfloat16) for w in shared)
            device = "cuda"
        tokens = slice(rank * num_tokens, (rank + 1) * num_tokens)
        experts = slice(rank * E // world_size, (rank + 1) * E // world_size)
        block_m = 128 if device == "cuda" or precision != "bf16" else 16
        # pull_programs: the gate/up GEMM and the down dgrad pull their own rows with that many programs (same
        # results)
        # fused: KernelPlan flags set (fused_forward: the forward's dispatch, routed GEMMs and combine in one
        # launch; fused_backward: the backward's pull of d_y, dgrads and push of d_x in one launch)
        plan = None
        if fused:
            from serval.kernels import common
            plan = dataclasses.replace(choose_plan(x.shape[1], x.dtype, common.target()), **dict.fromkeys(fused, True))
        config = serval.Config(block_m=block_m, backend=backend, macrobatch_size=macrobatch_size,
                               comm_sms_forward=pull_programs or None, comm_sms_backward=pull_programs or None,
                               minibatch_size=2 * block_m if pull_programs else None, precision=precision,
                               kernel_plan=plan)
        local = (x[tokens], rw[tokens], ids[tokens], [w[experts] for w in weights], shared, d_y[tokens])
        # quantize_weights_once: the rank's FP8 expert weights made once (serval.quantize_expert_weights)
        made = serval.quantize_expert_weights(*local[3], precision) if quantize_weights_once else None
        ep = layer_grads(*local, group=group, config=config, expert_weights=made, joined=joined)
        if not (backend == "triton" and device == "cpu"):  # the interpreter runs programs one after another: a
            # second run could only repeat the first (CI time)
            again = layer_grads(*local, group=group, config=config, expert_weights=made, joined=joined)
            assert all(torch.equal(a, b) for a, b in zip(ep, again)), "EP run is not repeatable"
        if device == "cuda":  # every rank at once: no host sync in the step, and its CUDA graph replays its bits
            check_sync_free_and_graph_replay(
                lambda: layer_grads(*local, group=group, config=config, expert_weights=made, joined=joined), ep)
        full = layer_grads(x, rw, ids, weights, shared, d_y,
                           config=serval.Config(block_m=block_m, backend=backend, precision=precision))
        y, d_x, d_rw, d_wg, d_wu, d_wd, *d_shared = ep
        if frozen:  # frozen experts: no weight gradient asked for (their GEMMs skipped), d_x and d_rw unchanged
            x_leaf, rw_leaf = (t.detach().clone().requires_grad_() for t in local[:2])
            y_frozen = serval.moe(x_leaf, rw_leaf, local[2], *local[3], local[4], swiglu_limit=SWIGLU_LIMIT,
                                  group=group, config=config)
            assert torch.equal(y_frozen, y)
            d_x_frozen, d_rw_frozen = torch.autograd.grad(y_frozen, (x_leaf, rw_leaf), local[5])
            assert torch.equal(d_x_frozen, d_x) and torch.equal(d_rw_frozen, d_rw), "frozen experts"
        assert torch.equal(y, full[0][tokens]), "y differs from EP=1"
        assert torch.equal(d_x, full[1][tokens]), "d_x differs from EP=1"
        assert torch.equal(d_rw, full[2][tokens]), "d_router_weights differs from EP=1"
        for name, got, want in (("w_gate", d_wg, full[3]), ("w_up", d_wu, full[4]), ("w_down", d_wd, full[5])):
            assert torch.equal(got, want[experts]), f"d_{name} differs from EP=1"
        # the shared expert is replicated: each rank's gradient is its own tokens' contribution
        shared_leaves = [w.detach().clone().requires_grad_() for w in shared]
        own_shared = torch.autograd.grad(serval.reference.mlp(x[tokens], *shared_leaves, swiglu_limit=SWIGLU_LIMIT),
                                         shared_leaves, d_y[tokens])
        for got, want in zip(d_shared, own_shared):
            assert rel_err(got, want) < (2e-2 if device == "cuda" or precision != "bf16" else 1e-5)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def without_numpy_worker(rank, *args):
    """`worker` where numpy is unusable, as after a plain `pip install -e .` (torch without numpy raises
    this from Tensor.numpy); the EP layer on CPU must not need it."""
    def no_numpy(self, *a, **k):
        raise RuntimeError("Numpy is not available")

    torch.Tensor.numpy = no_numpy
    worker(rank, *args)


def misuse_worker(rank, world_size, init_file, scenario):
    """Ranks that pass inconsistent or bad input: every rank gets the same clear ValueError (never an
    abort or a hang), and the group stays usable."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(minutes=2))
    try:
        group = dist.group.WORLD
        x, rw, ids, weights, shared, d_y = problem(world_size, "random", N)
        tokens = slice(rank * N, (rank + 1) * N)
        experts = slice(rank * E // world_size, (rank + 1) * E // world_size)
        config = serval.Config(block_m=16, backend="torch")
        local = [x[tokens], rw[tokens], ids[tokens], [w[experts] for w in weights], shared, d_y[tokens]]
        if scenario == "num_tokens":  # rank 1 has fewer tokens
            if rank == 1:
                local = [t[:N - 4] for t in local[:3]] + [local[3], shared, local[5][:N - 4]]
            with pytest.raises(ValueError, match=r"num_tokens \(x.shape\[0\]\): \[24, 20\]"):
                layer_grads(*local, group=group, config=config)
        elif scenario == "dtype":  # rank 1 runs in fp64: its peers would read its buffers as another dtype
            if rank == 1:
                local = [t.double() for t in local[:2]] + [local[2], [w.double() for w in local[3]],
                                                           tuple(w.double() for w in shared), local[5].double()]
            with pytest.raises(ValueError, match=r"dtype \(x.dtype\): \['float32', 'float64'\]"):
                layer_grads(*local, group=group, config=config)
        elif scenario == "ids_dtype":  # int64 ids on rank 0, int32 on rank 1: allowed, the same bits
            good = layer_grads(*local, group=group, config=config)
            if rank == 1:
                local[2] = local[2].int()
            again = layer_grads(*local, group=group, config=config)
            assert all(torch.equal(a, b) for a, b in zip(good, again))
        elif scenario == "expert_ids":  # rank 1 passes an id past E: a host check on CPU, on every rank
            if rank == 1:
                local[2] = local[2].clone()
                local[2][3, 1] = E
            with pytest.raises(ValueError, match=r"topk_ids must hold expert ids in \[0, 8\)"):
                layer_grads(*local, group=group, config=config)
        elif scenario == "expert_ids_deferred":  # the CUDA path's logic (no host check) on CPU
            serval.api._checks_on_host = lambda device, debug: debug
            good = layer_grads(*local, group=group, config=config)
            bad = list(local)
            if rank == 1:
                bad[2] = bad[2].clone()
                bad[2][3, 1] = -1
            y, d_x, _, _, _, d_w_down, *_ = layer_grads(*bad, group=group, config=config)
            assert torch.isnan(y).all() and torch.isnan(d_x).all() and torch.isnan(d_w_down).all()
            with pytest.raises(ValueError, match="topk_ids must hold expert ids in .* in an earlier step"):
                layer_grads(*local, group=group, config=config)
            again = layer_grads(*local, group=group, config=config)  # reported once: the next step runs
            assert all(torch.equal(a, b) for a, b in zip(good, again))
        dist.barrier()  # leave together: a gloo peer that exits early can abort the others
    finally:
        dist.destroy_process_group()


def stop_early_worker(rank, world_size, init_file, device, result_file, stopping_rank=None):
    """Every rank runs a step; then `stopping_rank` (default the last) stops (it never enters the second step)
    and the others must get an error within Config.peer_timeout_s, not hang. The outcome goes to result_file
    (written by the lowest rank still running) for the test to check; the processes leave with os._exit, since a
    rank that timed out cannot tear the group down cleanly (and on CUDA its context is lost)."""
    stopping_rank = world_size - 1 if stopping_rank is None else stopping_rank
    reporter = 1 if stopping_rank == 0 else 0
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(minutes=2))
    done = result_file + ".done"
    x, rw, ids, weights, shared, d_y = problem(world_size, "random", N)
    if device == "cuda":
        torch.cuda.set_device(0)
        x, rw, ids, d_y = x.cuda().bfloat16(), rw.cuda(), ids.cuda(), d_y.cuda().bfloat16()
        weights, shared = [w.cuda().bfloat16() for w in weights], tuple(w.cuda().bfloat16() for w in shared)
    tokens = slice(rank * N, (rank + 1) * N)
    experts = slice(rank * E // world_size, (rank + 1) * E // world_size)
    config = serval.Config(block_m=128 if device == "cuda" else 16, backend="auto" if device == "cuda" else "torch",
                           peer_timeout_s=2.0)
    local = (x[tokens], rw[tokens], ids[tokens], [w[experts] for w in weights], shared, d_y[tokens])
    layer_grads(*local, group=dist.group.WORLD, config=config)
    if device == "cuda":
        torch.cuda.synchronize()
    if rank == stopping_rank:  # stops here: waits (bounded) until the reporter has its outcome, then leaves
        deadline = time.monotonic() + 120
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.1)
        os._exit(0)
    start = time.monotonic()
    try:
        layer_grads(*local, group=dist.group.WORLD, config=config)
        if device == "cuda":
            torch.cuda.synchronize()
        outcome = "no error"
    except RuntimeError as error:
        outcome = str(error)
    if rank == reporter:
        with open(result_file, "w") as f:
            json.dump({"outcome": outcome, "elapsed_s": time.monotonic() - start}, f)
        open(done, "w").close()
    os._exit(0)


def stopped_rank_outcome(world_size, tmp_path, device, stopping_rank=None):
    result = tmp_path / "outcome.json"
    mp.spawn(stop_early_worker, args=(world_size, str(tmp_path / "init"), device, str(result), stopping_rank),
             nprocs=world_size, join=True)
    return json.loads(result.read_text())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_torch_stage_gemms_do_not_depend_on_where_the_rows_sit(dtype):
    """EP=P's bits rest on each expert's GEMMs being those of EP=1, though a rank's rows start at another row
    of a buffer of another size. The torch stages' fallback GEMMs (operands torch._grouped_mm does not take:
    here rows of 17 and 33 values, not 16-byte multiples) compute each expert segment on its own."""
    from serval import stages
    from serval.schedule import Schedule

    gen = torch.Generator().manual_seed(0)
    inner, outer, rows = 17, 33, 48
    seg_a = torch.randn(rows, inner, generator=gen, dtype=dtype)
    seg_b = torch.randn(rows, outer, generator=gen, dtype=dtype)
    weight = torch.randn(1, outer, inner, generator=gen, dtype=dtype)
    results = []
    for lo, capacity in ((0, 64), (96, 256)):  # one expert's rows at row lo of a buffer of `capacity` rows
        i32 = dict(dtype=torch.int32)
        schedule = Schedule(torch.tensor([rows], **i32), torch.tensor([lo, lo + rows], **i32),
                            torch.zeros(capacity, **i32), torch.zeros(1, 1, **i32), torch.zeros(capacity // 16, **i32),
                            1, 16)
        a, b = torch.zeros(capacity, inner, dtype=dtype), torch.zeros(capacity, outer, dtype=dtype)
        a[lo:lo + rows], b[lo:lo + rows] = seg_a, seg_b
        results.append((stages.weight_grad(a, b, schedule), stages.grouped_mm(a, weight, schedule)[lo:lo + rows]))
    assert all(torch.equal(x, y) for x, y in zip(*results))


@pytest.mark.parametrize("stopping_rank", [1, 0])
def test_ep_rank_that_stops_is_an_error_not_a_hang(stopping_rank, tmp_path):
    """The CPU transport's barriers are bounded by Config.peer_timeout_s on every rank (rank 0 stopping too, which
    gloo's monitored barrier did not bound on the others): the ranks still running get a RuntimeError that names
    the wait and the missing rank."""
    outcome = stopped_rank_outcome(2, tmp_path, "cpu", stopping_rank)
    assert "waited 2 s (Config.peer_timeout_s)" in outcome["outcome"], outcome
    assert f"ranks that did not arrive: [{stopping_rank}]" in outcome["outcome"], outcome
    assert outcome["elapsed_s"] < 30, outcome


@requires_cuda
def test_ep_rank_that_stops_on_one_gpu(tmp_path, monkeypatch):
    """On CUDA, torch's signal-pad barrier (bounded by Config.peer_timeout_s) traps on the ranks still
    running: a CUDA error at their next sync, never a hang."""
    monkeypatch.setenv("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    outcome = stopped_rank_outcome(2, tmp_path, "cuda")
    assert "CUDA error" in outcome["outcome"] or "illegal" in outcome["outcome"], outcome
    assert outcome["elapsed_s"] < 60, outcome


def run(world_size, tmp_path, kind="random", backend="torch", macrobatch_size=None, device="cpu", num_tokens=N,
        pull_programs=0, precision="bf16", inter=I, fused=(), quantize_weights_once=False, frozen=False,
        joined=False):
    """pull_programs: Config.comm_sms_forward and comm_sms_backward in the ranks (the gate/up GEMM and the down
    dgrad pulling their own rows). fused: KernelPlan flags set ("fused_forward", "fused_backward").
    macrobatch_size: Config.macrobatch_size (the ring's size in tokens). joined: each rank passes its gate and up
    weights as one [E_local, 2I, H] tensor (w_up=None), as transformers holds them."""
    mp.spawn(worker, args=(world_size, str(tmp_path / "init"), kind, backend, macrobatch_size, device, num_tokens,
                           pull_programs, precision, inter, fused, quantize_weights_once, frozen, joined),
             nprocs=world_size,
             join=True)


def push_worker(rank, world_size, init_file):
    """The CPU transport's push: a partial layout zero-fills (default) or keeps stale slots (complete=True);
    copy=False hands out the slot buffer itself."""
    from serval.transport.cpu import SharedMemoryTransport
    from test_transport_symm import make_layouts, reference_push

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        num_tokens, top_k, cols = 6, 2, 5
        transport = SharedMemoryTransport(dist.group.WORLD, num_tokens, top_k)
        layouts = make_layouts(world_size, num_tokens, top_k, seed=7, fill=0.6)
        all_rows = [torch.randn(layout.numel(), cols, generator=torch.Generator().manual_seed(p))
                    for p, layout in enumerate(layouts)]
        expected = reference_push(all_rows, layouts, world_size, num_tokens * top_k)[rank]
        first = transport.push(all_rows[rank], layouts[rank], copy=False)
        assert torch.equal(first, expected)
        first.fill_(7.0)  # stale contents: zeroed by the next push, kept by a complete one
        second = transport.push(all_rows[rank], layouts[rank])
        assert torch.equal(second, expected) and second.data_ptr() != first.data_ptr()
        first.fill_(7.0)
        third = transport.push(all_rows[rank], layouts[rank], complete=True, copy=False)
        assert third.data_ptr() == first.data_ptr()
        stale = reference_push(all_rows, layouts, world_size, num_tokens * top_k, fill_value=7.0)[rank]
        assert torch.equal(third, stale)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_cpu_transport_push_options(tmp_path):
    mp.spawn(push_worker, args=(2, str(tmp_path / "init")), nprocs=2, join=True)


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_ep_bitwise_equals_ep1(world_size, tmp_path):
    run(world_size, tmp_path)


@pytest.mark.parametrize("precision,inter", [("bf16", I), ("fp8_blockwise", 128)])
def test_ep_joined_gate_up_weight(precision, inter, tmp_path):
    """Each rank's gate and up weights as one [E_local, 2I, H] tensor (transformers' gate_up_proj): bitwise EP=1,
    its gradient one tensor (the torch stages)."""
    run(2, tmp_path, precision=precision, inter=inter, joined=True)


@requires_interpreter
@pytest.mark.parametrize("variant", ["staged", "fused"])
def test_ep_joined_gate_up_weight_in_interpreter(variant, tmp_path):
    """The joined weight read in place by the kernels at EP, through the ring (skewed routing, windows): staged,
    and both passes fused with pull programs."""
    run(2, tmp_path, kind="skewed", backend="triton", macrobatch_size=8, pull_programs=2 if variant == "fused" else 0,
        fused=("fused_forward", "fused_backward") if variant == "fused" else (), joined=True)


def test_ep_frozen_experts(tmp_path):
    """Experts that need no gradient at EP=2: their weight-gradient GEMMs are skipped on every rank (the
    transport calls are not); y, d_x and d_router_weights unchanged."""
    run(2, tmp_path, frozen=True)


@pytest.mark.parametrize("precision,inter", [("mxfp8", I), ("fp8_blockwise", 128)])
def test_ep_fp8_bitwise_equals_ep1(precision, inter, tmp_path):
    run(2, tmp_path, precision=precision, inter=inter)


def test_ep_fp8_expert_weights_made_once(tmp_path):
    """Each rank passes its experts' weights quantized once (serval.quantize_expert_weights): bitwise EP=1."""
    run(2, tmp_path, precision="fp8_blockwise", inter=128, quantize_weights_once=True)


@pytest.mark.parametrize("world_size", [2, 4])
def test_ep_skewed_routing_drops_nothing(world_size, tmp_path):
    """Every token's first slot on expert 0 (rank 0 receives P times its balanced load) on the torch stages,
    which take every row at once: bitwise equal to EP=1."""
    run(world_size, tmp_path, kind="skewed", macrobatch_size=N // 2)


@requires_interpreter
@pytest.mark.parametrize("variant,precision", [("staged", "bf16"), ("in-gemm-pull", "bf16"), ("fused", "bf16"),
                                               ("staged", "mxfp8"), ("in-gemm-pull", "mxfp8"), ("fused", "mxfp8"),
                                               ("staged", "fp8_blockwise")])
def test_ep_macrobatch_ring_in_interpreter(variant, precision, tmp_path):
    """A skewed routing through a ring of a few tiles (macrobatch_size 8 tokens: 16-row windows in bf16, 128-row
    ones in the FP8 precisions (their block_m), several a pass, some empty): the kernels stream the rows window by
    window, every pass variant, bitwise equal to EP=1; mxfp8 with I = 32 (its backward fuses too); fp8_blockwise
    (I = 128) with 80 tokens a rank, so that an expert's 160 rows span two windows (its FP8 weight gradients carry
    their fp32 sums from one to the next)."""
    fp8_blockwise = precision == "fp8_blockwise"
    run(2, tmp_path, kind="skewed", backend="triton", macrobatch_size=8, pull_programs=2 if variant != "staged" else 0,
        fused=("fused_forward", "fused_backward") if variant == "fused" else (), precision=precision,
        inter={"mxfp8": 32, "fp8_blockwise": 128}.get(precision, I), num_tokens=80 if fp8_blockwise else N)


@requires_interpreter
@pytest.mark.parametrize("pull_programs,precision", [(0, "bf16"), (2, "bf16"), (2, "mxfp8")])
def test_ep_triton_kernels_in_interpreter(pull_programs, precision, tmp_path):
    """The staged kernels at EP (the default ring holds every row: one pass), with and without pull programs; mxfp8's
    pull programs round-trip the rows they pull (I = 32)."""
    run(2, tmp_path, backend="triton", pull_programs=pull_programs, precision=precision,
        inter=32 if precision == "mxfp8" else I)


@requires_interpreter
@pytest.mark.parametrize("precision,inter", [("bf16", I), ("mxfp8", 32)])
def test_ep_fused_passes_in_interpreter(precision, inter, tmp_path):
    """Each pass in one launch: the forward's pull, routed GEMMs and combine push (KernelPlan.fused_forward) and the
    backward's pull of d_y, dgrads and push of d_x (fused_backward), 2 pull programs each: bitwise equal to EP=1
    (whose passes are the staged kernels); in mxfp8 too (I = 32: the backward fuses, its blocks whole per half)."""
    run(2, tmp_path, backend="triton", pull_programs=2, fused=("fused_forward", "fused_backward"),
        precision=precision, inter=inter)


@requires_cuda
@pytest.mark.parametrize("precision,inter", [("bf16", I), ("mxfp8", 128)])
def test_ep_fused_passes_on_one_gpu(precision, inter, tmp_path, monkeypatch):
    """Both passes fused (KernelPlan.fused_forward and fused_backward, 8 pull programs) on the CUDA path: bitwise
    equal to EP=1, in bf16 and mxfp8."""
    monkeypatch.setenv("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    run(2, tmp_path, backend="auto", device="cuda", pull_programs=8, fused=("fused_forward", "fused_backward"),
        precision=precision, inter=inter)


def test_ep_cpu_without_numpy(tmp_path):
    mp.spawn(without_numpy_worker, args=(2, str(tmp_path / "init"), "random", "torch", None, "cpu", N, 0),
             nprocs=2, join=True)


def group_freed_worker(rank, world_size, init_file):
    """After a layer step at EP, destroy_process_group and serval's exit hook leave no reference to the group: it
    is freed then, not in interpreter teardown, where gloo aborts the process."""
    import gc
    import weakref

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(minutes=2))
    group = weakref.ref(dist.group.WORLD)
    x, rw, ids, weights, shared, d_y = problem(world_size, "random", N)
    tokens = slice(rank * N, (rank + 1) * N)
    experts = slice(rank * E // world_size, (rank + 1) * E // world_size)
    layer_grads(x[tokens], rw[tokens], ids[tokens], [w[experts] for w in weights], shared, d_y[tokens],
                group=group(), config=serval.Config(block_m=16, backend="torch"))
    dist.barrier()
    dist.destroy_process_group()
    serval.workspace._release_workspaces()  # what the exit hook does
    gc.collect()
    assert group() is None, "the process group outlived destroy_process_group"


def test_ep_process_group_is_freed_at_destroy(tmp_path):
    mp.spawn(group_freed_worker, args=(2, str(tmp_path / "init")), nprocs=2, join=True)


@pytest.mark.parametrize("scenario", ["num_tokens", "dtype", "ids_dtype", "expert_ids", "expert_ids_deferred"])
def test_ep_bad_input_is_the_same_error_on_every_rank(scenario, tmp_path):
    mp.spawn(misuse_worker, args=(2, str(tmp_path / "init"), scenario), nprocs=2, join=True)


@requires_cuda
@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_ep_symmetric_memory_on_one_gpu(world_size, tmp_path, monkeypatch):
    """The CUDA path (symmetric-memory transport, Triton kernels), several processes on one GPU."""
    monkeypatch.setenv("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    run(world_size, tmp_path, backend="auto", device="cuda")


@requires_cuda
@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
def test_ep_in_gemm_pulls_on_one_gpu(precision, tmp_path, monkeypatch):
    """comm_sms_forward / comm_sms_backward > 0 on the CUDA path: the gate/up GEMM and the down dgrad pull their
    rows themselves (bounded flag waits; mxfp8: round-tripped as pulled); bitwise equal to EP=1."""
    monkeypatch.setenv("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    run(2, tmp_path, backend="auto", device="cuda", pull_programs=8, precision=precision,
        inter=128 if precision == "mxfp8" else I)


@requires_cuda
@pytest.mark.parametrize("precision,fused", [("bf16", ()), ("bf16", ("fused_forward", "fused_backward")),
                                             ("mxfp8", ()), ("fp8_blockwise", ())])
def test_ep_joined_gate_up_weight_on_one_gpu(precision, fused, tmp_path, monkeypatch):
    """The joined [E_local, 2I, H] gate/up weight on the CUDA path at EP=2 (symmetric memory, the kernels reading it
    in place; staged and fused): bitwise equal to EP=1."""
    monkeypatch.setenv("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    run(2, tmp_path, backend="auto", device="cuda", precision=precision, inter=128, fused=fused,
        pull_programs=8 if fused else 0, joined=True)


@requires_cuda
@pytest.mark.parametrize("precision", ["mxfp8", "fp8_blockwise"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_ep_fp8_symmetric_memory_on_one_gpu(world_size, precision, tmp_path, monkeypatch):
    """The FP8 layer at EP on the CUDA path is bitwise equal to EP=1 in the same precision."""
    monkeypatch.setenv("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    run(world_size, tmp_path, backend="auto", device="cuda", precision=precision, inter=128)


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_ep_one_gpu_per_rank(world_size, tmp_path, monkeypatch):
    """The CUDA path with one process per GPU (a multi-GPU machine): bitwise equal to EP=1 on one GPU."""
    if not CUDA or torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs")
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    run(world_size, tmp_path, backend="auto", device="cuda-per-rank")


@requires_cuda
@pytest.mark.parametrize("world_size,variant,precision", [(2, "staged", "bf16"), (4, "staged", "bf16"),
                                                         (2, "in-gemm-pull", "bf16"), (2, "fused", "bf16"),
                                                         (4, "fused", "bf16"), (8, "fused", "bf16"),
                                                         (2, "staged", "mxfp8"), (2, "in-gemm-pull", "mxfp8"),
                                                         (2, "fused", "mxfp8"),
                                                         (2, "staged", "fp8_blockwise")])
def test_ep_macrobatch_ring_on_one_gpu(world_size, variant, precision, tmp_path, monkeypatch):
    """A skewed routing through a ring of 256 tokens (512 rows) on the CUDA path: 512 tokens a rank, rank 0
    receives P times its balanced load, in several windows; bitwise equal to EP=1 (FP8 precisions: I = 128)."""
    monkeypatch.setenv("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    run(world_size, tmp_path, kind="skewed", backend="auto", macrobatch_size=256, device="cuda", num_tokens=512,
        pull_programs=8 if variant != "staged" else 0,
        fused=("fused_forward", "fused_backward") if variant == "fused" else (), precision=precision,
        inter=I if precision == "bf16" else 128)
