"""The CUDA transport (serval.transport.symm): its row kernels on virtual ranks, and the real thing.

* Virtual ranks (CPU interpreter here, the GPU where there is one): the pull and push kernels
  only see a table of base addresses, so P ordinary tensors in one process stand in for P
  ranks' symmetric buffers. Random row layouts (a random partition of the P*N*k global sources
  over the ranks, shuffled, with padding rows; some sources unrouted), P = 1, 2, 4, bf16 and
  fp32, C = 1 (router weights), 36 (not a whole number of 16-byte vectors in bf16) and 520
  (two column blocks), each against a torch reference, bitwise, twice.
* Processes (GPU only): P = 1, 2, 4 spawned processes with torch symmetric memory, all on one
  GPU when there are fewer GPUs than ranks (TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1, gloo
  group: NCCL refuses two ranks on one GPU), one GPU each with nccl otherwise. Each rank pulls
  and pushes random rows and checks them against a reference built from every rank's data
  (all-gathered through the transport), twice, then again from a replayed CUDA graph. A last
  test lets one rank skip a barrier and checks that its peer gets an error, not a hang.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import time

import pytest
import torch

if not torch.cuda.is_available():  # before serval is imported (conftest.py does the same)
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("SERVAL_POISON_OUTPUTS", "1")

from serval.kernels import common  # noqa: E402
from serval.transport import symm  # noqa: E402

CUDA = torch.cuda.is_available() and not common.INTERPRET
DEVICE = "cuda" if CUDA else "cpu"
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")

SENTINEL = 7.0  # what a slot no row writes keeps in the virtual-rank push test


def make_layouts(world_size, num_tokens, top_k, *, seed, fill=0.8, pad=0.3, equal_rows=False):
    """row_source [R_p] int32 for each rank p: a `fill` fraction of the global sources
    (rank * N + token) * k + slot, each given to one random rank, shuffled with -1 padding rows.
    equal_rows: every rank gets the same R (padding makes up the difference)."""
    gen = torch.Generator().manual_seed(seed)
    num_sources = world_size * num_tokens * top_k
    used = torch.randperm(num_sources, generator=gen)[: round(fill * num_sources)]
    owner = torch.randint(0, world_size, (used.numel(),), generator=gen)
    mine = [used[owner == p] for p in range(world_size)]
    extra = [int(torch.randint(0, int(pad * m.numel()) + 3, (1,), generator=gen)) for m in mine]
    target = max(m.numel() + e for m, e in zip(mine, extra))
    layouts = []
    for m, e in zip(mine, extra):
        num_pad = target - m.numel() if equal_rows else e
        rows = torch.cat([m, torch.full((num_pad,), -1, dtype=torch.int64)])
        layouts.append(rows[torch.randperm(rows.numel(), generator=gen)].to(torch.int32))
    return layouts


def reference_pull(all_tokens, row_source, top_k):
    """rows[r] = all_tokens[global token of row r]; zeros on padding rows."""
    source = row_source.to(torch.int64)
    rows = all_tokens[source.clamp(min=0) // top_k]
    return torch.where((source >= 0)[:, None], rows, torch.zeros_like(rows))


def reference_push(all_rows, layouts, world_size, num_slots, fill_value=0.0):
    """[P, N*k, C]: every rank's rows in their global sources' slots; fill_value where no row wrote."""
    cols, dtype, device = all_rows[0].shape[1], all_rows[0].dtype, all_rows[0].device
    slots = torch.full((world_size * num_slots, cols), fill_value, dtype=dtype, device=device)
    for rows, source in zip(all_rows, layouts):
        source = source.to(device=device, dtype=torch.int64)
        valid = source >= 0
        slots[source[valid]] = rows[valid]
    return slots.view(world_size, num_slots, cols)


def _random(shape, dtype, seed, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)


# --------------------------------------------------------------------------------------
# Virtual ranks: the kernels alone, P buffers in one process
# --------------------------------------------------------------------------------------

def _table(buffers):
    return torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device=DEVICE)


def _alignments(buffers, cols):
    """The host's choice, and the scalar path forced where the host would vectorise."""
    aligned = symm.vector_aligned([b.data_ptr() for b in buffers], cols, buffers[0].element_size())
    return [True, False] if aligned else [False]


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cols", [1, 36, 520])
def test_pull_virtual_ranks(world_size, dtype, cols):
    num_tokens, top_k = 5, 3
    tokens = [_random((num_tokens, cols), dtype, seed=100 + p) for p in range(world_size)]
    all_tokens = torch.cat(tokens)
    layouts = make_layouts(world_size, num_tokens, top_k, seed=world_size * 1000 + cols)
    table = _table(tokens)
    for aligned in _alignments(tokens, cols):
        for p, layout in enumerate(layouts):
            layout = layout.to(DEVICE)
            expected = reference_pull(all_tokens, layout, top_k)
            first = symm.pull_rows(table, layout, num_tokens, top_k, cols, dtype, aligned=aligned)
            second = symm.pull_rows(table, layout, num_tokens, top_k, cols, dtype, aligned=aligned)
            assert torch.equal(first, expected), (p, aligned)
            assert torch.equal(first, second)


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cols", [1, 36, 520])
def test_push_virtual_ranks(world_size, dtype, cols):
    num_tokens, top_k = 5, 3
    num_slots = num_tokens * top_k
    layouts = make_layouts(world_size, num_tokens, top_k, seed=world_size * 2000 + cols)
    # rank 0's rows are a column slice of a wider tensor: a row stride that is not C
    wide = _random((layouts[0].numel(), cols + 8), dtype, seed=7)
    all_rows = [wide[:, 3:3 + cols]] + [_random((layouts[p].numel(), cols), dtype, seed=200 + p)
                                        for p in range(1, world_size)]
    expected = reference_push(all_rows, layouts, world_size, num_slots, fill_value=SENTINEL)
    slots = [torch.full((num_slots, cols), SENTINEL, dtype=dtype, device=DEVICE) for _ in range(world_size)]
    table = _table(slots)
    for aligned in _alignments(slots, cols):
        for repeat in range(2):
            for buffer in slots:
                buffer.fill_(SENTINEL)
            # every virtual rank pushes (the kernel of each rank runs after the previous one's)
            for rows, layout in zip(all_rows, layouts):
                symm.push_rows(table, rows, layout.to(DEVICE), num_slots, aligned=aligned)
            for p in range(world_size):
                assert torch.equal(slots[p], expected[p]), (p, aligned, repeat)


def test_pull_push_round_trip_virtual_ranks():
    """A full layout (every source routed once): pull then push gives every rank its own tokens back,
    each token repeated in its k slots: the dispatch/combine pair the layer builds on."""
    world_size, num_tokens, top_k, cols = 3, 4, 2, 24
    tokens = [_random((num_tokens, cols), torch.bfloat16, seed=300 + p) for p in range(world_size)]
    layouts = [t.to(DEVICE) for t in make_layouts(world_size, num_tokens, top_k, seed=5, fill=1.0)]
    slots = [torch.zeros((num_tokens * top_k, cols), dtype=torch.bfloat16, device=DEVICE)
             for _ in range(world_size)]
    token_table, slot_table = _table(tokens), _table(slots)
    pulled = [symm.pull_rows(token_table, layout, num_tokens, top_k, cols, torch.bfloat16, aligned=True)
              for layout in layouts]
    for rows, layout in zip(pulled, layouts):
        symm.push_rows(slot_table, rows, layout, num_tokens * top_k, aligned=True)
    for p in range(world_size):
        assert torch.equal(slots[p], tokens[p].repeat_interleave(top_k, dim=0))


def test_vector_aligned():
    assert symm.vector_aligned([0, 256], 8, 2)
    assert not symm.vector_aligned([0, 256], 36, 2)  # 72-byte rows
    assert symm.vector_aligned([0, 256], 36, 4)  # 144-byte rows
    assert not symm.vector_aligned([0, 264], 8, 2)
    assert symm.vector_aligned([0, 256], 0, 2)


class _FakeHandle:
    def __init__(self, log):
        self.log = log

    def barrier(self, channel, timeout_ms):
        self.log.append(("barrier", channel, timeout_ms))


class _FakeBuffer:
    """A _PeerBuffer whose rank 1 is a local tensor the test fills in, and whose barrier only logs."""

    def __init__(self, shape, dtype, log):
        self.local = torch.zeros(shape, dtype=dtype, device=DEVICE)
        self.peer = torch.zeros(shape, dtype=dtype, device=DEVICE)
        self.handle = _FakeHandle(log)
        self.addresses = [self.local.data_ptr(), self.peer.data_ptr()]
        self.table = torch.tensor(self.addresses, dtype=torch.int64, device=DEVICE)
        self.aligned = symm.vector_aligned(self.addresses, shape[1], self.local.element_size())


class _TwoRankTransport(symm.SymmetricMemoryTransport):
    """The transport's own pull/push code as rank 0 of 2, with a passive rank 1 (its buffers are
    plain tensors this process sets and reads) in place of symmetric memory."""

    def __init__(self, num_tokens, top_k):  # noqa: super().__init__ needs a process group and CUDA
        self.rank, self.world_size, self.num_tokens, self.top_k = 0, 2, num_tokens, top_k
        self.device, self.timeout_ms, self.channel = torch.device(DEVICE), 1234, 3
        self._buffers = {}
        self.log = []

    def _buffer(self, role, rows, cols, dtype):
        key = (role, rows, cols, dtype)
        if key not in self._buffers:
            self._buffers[key] = _FakeBuffer((rows, cols), dtype, self.log)
        return self._buffers[key]


def test_transport_methods_two_ranks():
    num_tokens, top_k, cols, dtype = 4, 2, 24, torch.bfloat16
    num_slots = num_tokens * top_k
    transport = _TwoRankTransport(num_tokens, top_k)
    layout = make_layouts(2, num_tokens, top_k, seed=3, fill=0.6)[0].to(DEVICE)

    tokens = _random((num_tokens, cols), dtype, seed=1)
    peer_tokens = _random((num_tokens, cols), dtype, seed=2)
    transport._buffer("tokens", num_tokens, cols, dtype).peer.copy_(peer_tokens)
    rows = transport.pull(tokens, layout)
    assert torch.equal(rows, reference_pull(torch.cat([tokens, peer_tokens]), layout, top_k))
    assert transport.log == [("barrier", 3, 1234)] * 2

    pushed = _random((layout.numel(), cols), dtype, seed=4)
    slot_buffer = transport._buffer("slots", num_slots, cols, dtype)
    slot_buffer.local.fill_(SENTINEL)  # stale data from an earlier push: zeroed unless complete=True
    slots = transport.push(pushed, layout)
    expected = reference_push([pushed], [layout], 2, num_slots)
    assert torch.equal(slots, expected[0]) and torch.equal(slot_buffer.peer, expected[1])
    assert slots.data_ptr() != slot_buffer.local.data_ptr()  # a copy
    assert len(transport.log) == 4

    slot_buffer.local.fill_(SENTINEL)
    slot_buffer.peer.zero_()
    view = transport.push(pushed, layout, complete=True, copy=False)
    assert view.data_ptr() == slot_buffer.local.data_ptr()
    expected = reference_push([pushed], [layout], 2, num_slots, fill_value=SENTINEL)
    assert torch.equal(view, expected[0])

    # all_gather over the symmetric buffers (no host sync with any group backend): any leading size, any dtype
    for t in (torch.arange(num_tokens * top_k, dtype=torch.int64, device=DEVICE).view(num_tokens, top_k),
              _random((6, 3), torch.float32, seed=5), _random((7,), torch.float32, seed=6)):
        flat = t.reshape(t.shape[0], -1)
        peer = (flat * 3 + 1).to(t.dtype)
        transport._buffer("gather", flat.shape[0], flat.shape[1], t.dtype).peer.copy_(peer)
        before = len(transport.log)
        gathered = transport.all_gather(t)
        assert torch.equal(gathered, torch.cat([t, peer.view(t.shape)]))
        assert transport.log[before:] == [("barrier", 3, 1234)] * 2

    with pytest.raises(ValueError, match="N = 4"):
        transport.pull(tokens[:3], layout)
    with pytest.raises(ValueError, match="row sources"):
        transport.push(pushed[:2], layout)


def test_transport_needs_cuda():
    with pytest.raises(ValueError, match="CUDA"):
        symm.SymmetricMemoryTransport(None, 4, 2, "cpu")


# --------------------------------------------------------------------------------------
# Processes: the transport itself (GPU only)
# --------------------------------------------------------------------------------------

PROCESS_TIMEOUT_S = 600  # the ranks time-slice one GPU: barriers take milliseconds each
BARRIER_TIMEOUT_MS = 120_000


def _init(rank, world_size, init_file):
    """The process group and device of one spawned rank."""
    import torch.distributed as dist

    os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    one_gpu = torch.cuda.device_count() < world_size
    device = torch.device("cuda", 0 if one_gpu else rank)
    torch.cuda.set_device(device)
    dist.init_process_group("gloo" if one_gpu else "nccl", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=PROCESS_TIMEOUT_S))
    return device


def _gather(transport, t):
    """transport.all_gather, bf16 as raw bytes (gloo, which the one-GPU runs use, may lack bf16)."""
    if t.dtype == torch.bfloat16:
        return transport.all_gather(t.view(torch.uint8)).view(torch.bfloat16)
    return transport.all_gather(t)


def _check_round(transport, device, layouts, dtype, cols, seed, *, complete):
    """One pull and one push of random rows, twice each, against references from all ranks' data."""
    rank, world_size, num_tokens, top_k = transport.rank, transport.world_size, transport.num_tokens, transport.top_k
    num_slots = num_tokens * top_k
    layout = layouts[rank].to(device)

    tokens = _random((num_tokens, cols), dtype, seed=seed + rank, device=device)
    all_tokens = _gather(transport, tokens)
    for p in range(world_size):  # all_gather itself, against each rank's own seed
        assert torch.equal(all_tokens[p * num_tokens:(p + 1) * num_tokens],
                           _random((num_tokens, cols), dtype, seed=seed + p, device=device))
    expected_rows = reference_pull(all_tokens, layout, top_k)
    first = transport.pull(tokens, layout)
    second = transport.pull(tokens, layout)
    assert torch.equal(first, expected_rows), (rank, dtype, cols)
    assert torch.equal(first, second)

    rows = _random((layout.numel(), cols), dtype, seed=seed + 100 + rank, device=device)
    all_rows = _gather(transport, rows).view(world_size, layout.numel(), cols)
    all_layouts = transport.all_gather(layout).view(world_size, -1)
    expected_slots = reference_push(list(all_rows), list(all_layouts), world_size, num_slots)[rank]
    first = transport.push(rows, layout, complete=complete)
    second = transport.push(rows, layout, complete=complete, copy=False)
    assert torch.equal(first, expected_slots), (rank, dtype, cols)
    assert torch.equal(first, second)


def _check_graph(transport, device, layouts, dtype, cols, seed):
    """pull + push captured in one CUDA graph, replayed on new data."""
    rank, num_tokens, top_k = transport.rank, transport.num_tokens, transport.top_k
    layout = layouts[rank].to(device)
    tokens = torch.zeros((num_tokens, cols), dtype=dtype, device=device)
    rows = torch.zeros((layout.numel(), cols), dtype=dtype, device=device)
    transport.pull(tokens, layout)  # warm-up: buffers are allocated (collectively) outside the capture
    transport.push(rows, layout)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pulled = transport.pull(tokens, layout)
        slots = transport.push(rows, layout)
    for step in range(2):
        tokens.copy_(_random(tokens.shape, dtype, seed=seed + 10 * step + rank, device=device))
        rows.copy_(_random(rows.shape, dtype, seed=seed + 10 * step + 5 + rank, device=device))
        graph.replay()
        all_tokens = _gather(transport, tokens)
        all_rows = _gather(transport, rows).view(transport.world_size, layout.numel(), cols)
        all_layouts = transport.all_gather(layout).view(transport.world_size, -1)
        assert torch.equal(pulled, reference_pull(all_tokens, layout, top_k)), (rank, step)
        expected = reference_push(list(all_rows), list(all_layouts), transport.world_size, num_tokens * top_k)
        assert torch.equal(slots, expected[rank]), (rank, step)
    torch.cuda.synchronize()


def _transport_worker(rank, world_size, init_file):
    import torch.distributed as dist

    device = _init(rank, world_size, init_file)
    try:
        num_tokens, top_k = 48, 4
        transport = symm.SymmetricMemoryTransport(None, num_tokens, top_k, device, timeout_ms=BARRIER_TIMEOUT_MS)
        assert (transport.rank, transport.world_size) == (rank, world_size)
        partial = make_layouts(world_size, num_tokens, top_k, seed=11, fill=0.7, equal_rows=True)
        full = make_layouts(world_size, num_tokens, top_k, seed=12, fill=1.0, equal_rows=True)
        cases = [(torch.bfloat16, 256), (torch.bfloat16, 36), (torch.float32, 1), (torch.float32, 520)]
        for i, (dtype, cols) in enumerate(cases):
            _check_round(transport, device, partial, dtype, cols, seed=1000 * i, complete=False)
            _check_round(transport, device, full, dtype, cols, seed=1000 * i + 500, complete=True)
        _check_graph(transport, device, partial, torch.bfloat16, 256, seed=99)
        torch.cuda.synchronize()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _timeout_worker(rank, world_size, init_file, result_dir):
    """Rank 0 pulls, rank 1 never does: rank 0's barrier must give up after its timeout and the
    error must reach Python. os._exit: a process whose CUDA context trapped must not run destructors."""
    device = _init(rank, world_size, init_file)
    transport = symm.SymmetricMemoryTransport(None, 8, 2, device, timeout_ms=2_000)
    tokens = torch.ones((8, 64), dtype=torch.bfloat16, device=device)
    transport._buffer("tokens", 8, 64, torch.bfloat16)  # the collective allocation, on both ranks
    torch.cuda.synchronize()
    outcome = "skipped"
    if rank == 0:
        start = time.monotonic()
        try:
            transport.pull(tokens, torch.zeros(4, dtype=torch.int32, device=device))
            torch.cuda.synchronize()
            outcome = "no error"
        except Exception as error:  # noqa: BLE001 (torch raises RuntimeError; a Triton launch may raise its own)
            outcome = f"error after {time.monotonic() - start:.1f} s: {error}"
    else:
        time.sleep(30)
    with open(os.path.join(result_dir, f"rank{rank}"), "w") as f:
        f.write(outcome)
    os._exit(0)


def _spawn(fn, world_size, *args):
    """Run fn(rank, world_size, init_file, *args) in world_size fresh processes; bounded."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        context = mp.start_processes(fn, args=(world_size, init_file, *args), nprocs=world_size,
                                     join=False, start_method="spawn")
        deadline = time.monotonic() + PROCESS_TIMEOUT_S
        while not context.join(timeout=5):
            if time.monotonic() > deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                pytest.fail(f"{fn.__name__} with {world_size} ranks did not finish in {PROCESS_TIMEOUT_S} s")


@requires_cuda
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_transport_processes(world_size):
    _spawn(_transport_worker, world_size)


@requires_cuda
def test_barrier_timeout_is_an_error():
    with tempfile.TemporaryDirectory() as result_dir:
        _spawn(_timeout_worker, 2, result_dir)
        with open(os.path.join(result_dir, "rank0")) as f:
            outcome = f.read()
    assert outcome.startswith("error after"), outcome
    assert float(outcome.split()[2]) < 60, outcome
