"""The fused passes (serval.kernels.fused_pass): the forward's gate/up + SwiGLU and down, and the backward's down
dgrad + SwiGLU backward and gate/up dgrad, each pass in one persistent launch, bit for bit the staged Triton path
(`triton_gemm.gate_up_swiglu` then `down`; `down_dgrad_swiglu_partials` then `gate_up_dgrad`; same TileConfigs).

On the CPU the kernels run in Triton's interpreter (programs one after another: program 0 takes every task, in the
task order) on small shapes whose H and I are not multiples of the tiles; every output is NaN-poisoned before the
run (SERVAL_POISON_OUTPUTS=1), and outputs are compared through integer views (bit equality, the poison of rows
past the used M-tiles included). The task order is checked as a pure function and against its device-side decode.
With CUDA, the GPU tests run the kernel at a realistic size (and under a CUDA graph), where programs really race;
without it, one test still compiles the kernel for sm_90a (the plan's Hopper tiles) in a child process.
"""

from __future__ import annotations

import dataclasses
import os
import re

import pytest
import torch
import triton
import triton.language as tl

if not torch.cuda.is_available():  # before serval.kernels is imported (conftest.py does the same)
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("SERVAL_POISON_OUTPUTS", "1")

from conftest import check_sync_free_and_graph_replay  # noqa: E402
from sm90 import compile_in_child  # noqa: E402
from serval.kernels import common, fused_launch as fl, in_gemm_pull, rows, triton_gemm  # noqa: E402
from serval.kernels import task_order as to  # noqa: E402
from serval.values import new_pull_flags, new_sync  # noqa: E402
from serval.ops import quantize  # noqa: E402
from serval.plan import KernelPlan, TileConfig  # noqa: E402
from serval.schedule import build_schedule, dense_schedule  # noqa: E402

CUDA = torch.cuda.is_available() and not common.INTERPRET
DEVICE = "cuda" if CUDA else "cpu"
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (the fused kernel's programs race only there)")

HIDDEN, INTER = 80, 40  # not multiples of the 32-wide tiles: partial N and K tiles in both GEMMs
BLOCK_M = 32
TILES = TileConfig(BLOCK_M, 32, 32, group_m=2)

# (tokens, slots, experts, how topk_ids are drawn)
ROUTINGS = {
    "random": (90, 2, 5, "random"),
    "empty_experts": (72, 2, 6, "two_experts"),  # experts 0, 2, 3, 5 get no rows
    "one_expert": (70, 1, 4, "last_expert"),  # every token to the last expert
    "k1": (80, 1, 5, "random"),
    "one_token": (1, 4, 6, "random"),
}
# rows per minibatch: 1 M-tile, 2 M-tiles, one minibatch over everything, MoK's rule (serval.plan)
MINIBATCHES = {"1_tile": BLOCK_M, "2_tiles": 2 * BLOCK_M, "all": 1 << 20, "mok": None}


FIRST, SECOND = 0, 1  # the GEMM of a task (forward: gate/up, down; backward: down dgrad, gate/up dgrad)


def _tile_coords(tile_id: int, num_m_tiles: int, num_n_tiles: int, group_m: int) -> tuple[int, int]:
    """`common.tile_coords` in Python (the same arithmetic, for `task_order`)."""
    tiles_per_group = group_m * num_n_tiles
    first_m = (tile_id // tiles_per_group) * group_m
    group_size = min(num_m_tiles - first_m, group_m)
    return first_m + (tile_id % tiles_per_group) % group_size, (tile_id % tiles_per_group) // group_size


def task_order(num_m_tiles: int, n_tiles_first: int, n_tiles_second: int, minibatch_m_tiles: int,
               group_m: int | None = None) -> list[tuple[int, int, int]]:
    """A fused pass's tasks in the order programs take them: [(gemm, m_tile, n_tile)], gemm FIRST or SECOND.

    F(0), F(1), S(0), F(2), S(1), ..., F(nb - 1), S(nb - 2), S(nb - 1), where F(b) / S(b) are the first and second
    GEMM's tiles of minibatch b (M-tiles [b * MB, min((b + 1) * MB, num_m_tiles)), MB = minibatch_m_tiles), each
    in its GEMM's staged tile order with GROUP_M = group_m (default MB; MB must be a multiple of it unless one
    minibatch holds every M-tile). `task_order.task_coords` decodes a task id to the same triple: the
    Python statement the device decode is checked against."""
    for name, value in (("num_m_tiles", num_m_tiles), ("n_tiles_first", n_tiles_first),
                        ("n_tiles_second", n_tiles_second), ("minibatch_m_tiles", minibatch_m_tiles)):
        if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "num_m_tiles" else 1):
            raise ValueError(f"task_order: {name} must be an int >= {0 if name == 'num_m_tiles' else 1}, got {value!r}")
    mb = minibatch_m_tiles
    group = mb if group_m is None else group_m
    if not isinstance(group, int) or isinstance(group, bool) or group < 1 or (mb % group and mb < num_m_tiles):
        raise ValueError(f"task_order: group_m must be an int >= 1 dividing minibatch_m_tiles={mb} (unless one "
                         f"minibatch holds all {num_m_tiles} M-tiles), got {group_m!r}")
    num_minibatches = -(-num_m_tiles // mb)

    def tiles(gemm, b):
        n = n_tiles_first if gemm == FIRST else n_tiles_second
        size = min(num_m_tiles - b * mb, mb)
        return [(gemm, *_tile_coords(b * mb * n + i, num_m_tiles, n, group)) for i in range(size * n)]

    if num_minibatches == 0:
        return []
    order = tiles(FIRST, 0)
    for b in range(1, num_minibatches):
        order += tiles(FIRST, b) + tiles(SECOND, b - 1)
    return order + tiles(SECOND, num_minibatches - 1)


@triton.jit
def _task_order_kernel(out_ptr, num_m_tiles, n_first, n_second, MB: tl.constexpr, GROUP_M: tl.constexpr):
    """out[t] = (is_second, m_tile, n_tile) of every task id t, as the fused kernel decodes it."""
    for task in range(0, num_m_tiles * (n_first + n_second)):
        is_second, m_tile, n_tile = to.task_coords(task, num_m_tiles, n_first, n_second, MB, GROUP_M)
        tl.store(out_ptr + 3 * task, is_second.to(tl.int32))
        tl.store(out_ptr + 3 * task + 1, m_tile)
        tl.store(out_ptr + 3 * task + 2, n_tile)


def device_task_order(num_m_tiles: int, n_tiles_first: int, n_tiles_second: int, minibatch_m_tiles: int,
                      group_m: int | None = None, device="cpu") -> list[tuple[int, int, int]]:
    """`task_order` as the kernel decodes it on the device (`task_order.task_coords`)."""
    num_tasks = num_m_tiles * (n_tiles_first + n_tiles_second)
    out = torch.full((max(num_tasks, 1), 3), -1, dtype=torch.int32, device=device)
    _task_order_kernel[(1,)](out, num_m_tiles, n_tiles_first, n_tiles_second, MB=minibatch_m_tiles,
                             GROUP_M=minibatch_m_tiles if group_m is None else group_m)
    return [tuple(row) for row in out[:num_tasks].tolist()]


def make_topk_ids(num_tokens, top_k, num_experts, how, generator):
    if how == "random":  # k distinct experts per token
        return torch.rand(num_tokens, num_experts, generator=generator).argsort(dim=1)[:, :top_k]
    if how == "two_experts":
        return torch.tensor([1, 4])[torch.randint(0, 2, (num_tokens, top_k), generator=generator)]
    if how == "last_expert":
        return torch.full((num_tokens, top_k), num_experts - 1)
    raise ValueError(how)


def make_case(routing, hidden=HIDDEN, inter=INTER, block_m=BLOCK_M, seed=0, device=DEVICE):
    """bf16 x's rows (gathered by the schedule, padding rows zero), weights and the schedule."""
    num_tokens, top_k, num_experts, how = ROUTINGS[routing] if isinstance(routing, str) else routing
    g = torch.Generator().manual_seed(seed)
    schedule = build_schedule(make_topk_ids(num_tokens, top_k, num_experts, how, g).to(device), num_experts, block_m)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=torch.bfloat16)

    x = randn(num_tokens, hidden)
    return dict(x=x, a_rows=rows.gather(x, schedule), w_gate=randn(num_experts, inter, hidden, scale=hidden ** -0.5),
                w_up=randn(num_experts, inter, hidden, scale=hidden ** -0.5),
                w_down=randn(num_experts, hidden, inter, scale=inter ** -0.5), schedule=schedule)


def bits(t):
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_bitwise(got, want, names=("gate_up", "h", "o")):
    """torch.equal on integer views: bit equality, NaN poison (rows past the used M-tiles) included."""
    for name, a, b in zip(names, got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, f"{name}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
        assert torch.equal(bits(a), bits(b)), f"{name}: fused and staged differ"


def staged(case, limit, gate_up_tiles=TILES, down_tiles=TILES, use_tma=True):
    gate_up, h = triton_gemm.gate_up_swiglu(case["a_rows"], case["w_gate"], case["w_up"], case["schedule"], limit,
                                            gate_up_tiles, use_tma)
    return gate_up, h, triton_gemm.down(h, case["w_down"], case["schedule"], down_tiles, use_tma)


def fused(case, limit, minibatch_rows, sync=None, gate_up_tiles=TILES, down_tiles=TILES, use_tma=True):
    schedule = case["schedule"]
    if sync is None:
        sync = new_sync(schedule.capacity // min(gate_up_tiles.block_m, schedule.block_m), case["a_rows"].device)
    return fl.fused_forward(case["a_rows"], case["w_gate"], case["w_up"], case["w_down"], schedule, limit,
                            gate_up_tiles, down_tiles, use_tma, minibatch_rows, sync)[:3]


def check_written(out, schedule):
    """Every packed gate_up row and every used row of h and o was written (no NaN poison left)."""
    gate_up, h, o = out
    used = int(schedule.expert_offsets[-1])
    for name, t in (("gate_up", gate_up), ("h", h[:used]), ("o", o[:used])):
        assert not torch.isnan(t.float()).any(), f"{name}: an element the kernel did not write"


_STAGED = {}


def staged_cached(routing, limit, use_tma=True):
    key = (routing, limit, use_tma)
    if key not in _STAGED:
        case = make_case(routing)
        _STAGED[key] = case, staged(case, limit, use_tma=use_tma)
    return _STAGED[key]


# ---------------------------------------------------------------- the task order (pure Python)

ORDER_SIZES = [(0, 3, 2, 1), (1, 1, 1, 1), (1, 3, 4, 5), (5, 2, 3, 1), (5, 2, 3, 2), (7, 3, 2, 3), (8, 2, 4, 4),
               (9, 1, 1, 4), (12, 4, 3, 5), (13, 5, 2, 13), (13, 5, 2, 40)]


def check_order(order, num_m, n_first, n_second, mb):
    everything = [(FIRST, m, n) for m in range(num_m) for n in range(n_first)] + \
                 [(SECOND, m, n) for m in range(num_m) for n in range(n_second)]
    assert sorted(order) == sorted(everything) and len(order) == len(everything)  # every task exactly once
    position = {task: i for i, task in enumerate(order)}
    for m in range(num_m):  # an S tile comes after every F tile of its M-tile
        last_first = max(position[(FIRST, m, n)] for n in range(n_first))
        assert all(position[(SECOND, m, n)] > last_first for n in range(n_second))
    # minibatch by minibatch: F(0), F(1), S(0), F(2), S(1), ..., S(last)
    segments = [(gemm, m // mb) for gemm, m, _ in order]
    runs = [s for i, s in enumerate(segments) if i == 0 or s != segments[i - 1]]
    num_minibatches = -(-num_m // mb)
    want = [(FIRST, 0)] + [s for b in range(1, num_minibatches) for s in ((FIRST, b), (SECOND, b - 1))]
    assert runs == (want + [(SECOND, num_minibatches - 1)] if num_m else [])


@pytest.mark.parametrize("num_m, n_first, n_second, mb", ORDER_SIZES)
def test_task_order(num_m, n_first, n_second, mb):
    check_order(task_order(num_m, n_first, n_second, mb), num_m, n_first, n_second, mb)


def test_task_order_small_example():
    """3 M-tiles, minibatches of 2, the first GEMM 2 N-tiles, the second 1: within a minibatch M-tiles vary fastest
    (GROUP_M)."""
    F, S = FIRST, SECOND
    assert task_order(3, 2, 1, 2) == [(F, 0, 0), (F, 1, 0), (F, 0, 1), (F, 1, 1),  # F(0)
                                         (F, 2, 0), (F, 2, 1),  # F(1)
                                         (S, 0, 0), (S, 1, 0),  # S(0)
                                         (S, 2, 0)]  # S(1)


@pytest.mark.parametrize("group_m", [None, 1, 2, 4])
def test_task_order_is_each_gemms_staged_order(group_m):
    """Restricted to one GEMM, the order is that GEMM's staged launch with GROUP_M = group_m (default: the
    minibatch's M-tiles)."""
    num_m, n_first, n_second, mb = 11, 3, 2, 4
    order = task_order(num_m, n_first, n_second, mb, group_m)
    check_order(order, num_m, n_first, n_second, mb)
    group = group_m or mb
    for gemm, n in ((FIRST, n_first), (SECOND, n_second)):
        assert [t[1:] for t in order if t[0] == gemm] == [_tile_coords(i, num_m, n, group) for i in range(num_m * n)]


@pytest.mark.parametrize("num_m, n_first, n_second, mb", [s for s in ORDER_SIZES if s[0] * (s[1] + s[2]) <= 120])
def test_device_decode_matches_task_order(num_m, n_first, n_second, mb):
    """The kernel's decode of a task id (`_task_coords`, run in a kernel) gives `task_order`'s entry."""
    want = task_order(num_m, n_first, n_second, mb)
    assert device_task_order(num_m, n_first, n_second, mb, device=DEVICE) == want
    group = 2 if mb % 2 == 0 else 1
    assert (device_task_order(num_m, n_first, n_second, mb, group, device=DEVICE)
            == task_order(num_m, n_first, n_second, mb, group))


def test_task_order_errors():
    with pytest.raises(ValueError, match="group_m"):
        task_order(9, 2, 2, 4, 3)  # minibatches of 4 M-tiles would not start on groups of 3
    with pytest.raises(ValueError, match="minibatch_m_tiles"):
        task_order(3, 2, 2, 0)
    with pytest.raises(ValueError, match="n_tiles_second"):
        task_order(3, 2, 0, 1)
    with pytest.raises(ValueError, match="num_m_tiles"):
        task_order(-1, 2, 2, 1)


# ---------------------------------------------------------------- fused == staged, bit for bit


# every minibatch on the routings with several M-tiles per expert; the edge routings on 1-M-tile minibatches (the
# most flags and interleaving) and on MoK's rule
FUSED_CASES = ([(r, m) for r in ("random", "empty_experts") for m in MINIBATCHES]
               + [(r, m) for r in ("one_expert", "k1", "one_token") for m in ("1_tile", "mok")])


@pytest.mark.parametrize("routing, minibatch", FUSED_CASES)
def test_fused_equals_staged(routing, minibatch):
    case, want = staged_cached(routing, None)
    got = fused(case, None, MINIBATCHES[minibatch])
    assert_bitwise(got, want)
    check_written(got, case["schedule"])


@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_fused_equals_staged_swiglu_limit(routing):
    case, want = staged_cached(routing, 0.5)
    got = fused(case, 0.5, MINIBATCHES["2_tiles"])
    assert_bitwise(got, want)
    check_written(got, case["schedule"])


@pytest.mark.parametrize("routing", ["random", "one_token"])
def test_fused_equals_staged_pointer_path(routing):
    case, want = staged_cached(routing, 0.5, use_tma=False)
    assert_bitwise(fused(case, 0.5, MINIBATCHES["1_tile"], use_tma=False), want)


def test_each_gemm_its_own_tiles():
    """Gate/up and down tiles of different BLOCK_N / BLOCK_K / epilogue splits (one BLOCK_M): each GEMM as staged
    with its own config; the configs' group_m, flatten and the gate/up's epi_tma_stores change nothing."""
    case = make_case("random")
    gate_up_tiles = TileConfig(BLOCK_M, 16, 64, group_m=3, epi_split=2, epi_tma_stores=True)
    down_tiles = TileConfig(BLOCK_M, 64, 16, group_m=1, epi_split=4, flatten=False)
    want = staged(case, 0.5, gate_up_tiles, down_tiles)
    assert_bitwise(fused(case, 0.5, 3 * BLOCK_M, gate_up_tiles=gate_up_tiles, down_tiles=down_tiles), want)


def test_tile_rows_divide_the_schedules():
    """Kernel M-tiles of 16 rows on a schedule of 32-row blocks."""
    case = make_case("random", block_m=32)
    tiles = TileConfig(16, 32, 32)
    assert_bitwise(fused(case, None, 2 * 16, gate_up_tiles=tiles, down_tiles=tiles), staged(case, None, tiles, tiles))


def test_two_runs_and_the_sync_across_launches():
    """Two runs on one Sync are bit for bit equal; launch e used counter and flags of parity e % 2 (tasks +
    programs ids drawn, n_gu signals per used M-tile) and zeroed the other parity's; nothing is reset on the host,
    and one Sync serves problems of other shapes too."""
    case = make_case("random")
    schedule = case["schedule"]
    sync = new_sync(schedule.capacity // BLOCK_M + 3, DEVICE)
    first = fused(case, 0.5, 2 * BLOCK_M, sync)
    num_m = int(schedule.expert_offsets[-1]) // BLOCK_M
    n_gu, n_dn = -(-INTER // 32), -(-HIDDEN // 32)
    programs = min(common.num_sms(), schedule.capacity // BLOCK_M * (n_gu + n_dn))

    def check_state(epoch):
        parity = epoch % 2
        assert int(sync.epoch) == epoch
        assert int(sync.counters[parity]) == num_m * (n_gu + n_dn) + programs
        assert int(sync.counters[1 - parity]) == 0
        assert sync.flags[parity, :num_m].eq(n_gu).all() and sync.flags[parity, num_m:].eq(0).all()
        assert sync.flags[1 - parity].eq(0).all()

    check_state(1)
    assert_bitwise(fused(case, 0.5, 2 * BLOCK_M, sync), first)
    check_state(2)
    other = make_case("k1", hidden=64, inter=96, seed=1)  # another problem on the same Sync
    assert_bitwise(fused(other, None, BLOCK_M, sync), staged(other, None))
    assert int(sync.epoch) == 3 and sync.flags[0].eq(0).all()
    assert_bitwise(fused(case, 0.5, 2 * BLOCK_M, sync), first)
    check_state(4)


def test_argument_errors():
    case = make_case("one_token")
    schedule = case["schedule"]
    sync = new_sync(schedule.capacity // BLOCK_M, DEVICE)
    args = dict(a_rows=case["a_rows"], w_gate=case["w_gate"], w_up=case["w_up"], w_down=case["w_down"],
                schedule=schedule, swiglu_limit=None, gate_up_tiles=TILES, down_tiles=TILES, use_tma=True,
                minibatch_rows=None, sync=sync)

    def call(match, error=ValueError, **changes):
        with pytest.raises(error, match=match):
            fl.fused_forward(**{**args, **changes})

    call("a_rows must be", a_rows=case["a_rows"][:-1])
    call("w_up must be", w_up=case["w_up"][:, :-1])
    call("w_down must be", w_down=case["w_down"].transpose(1, 2))
    call("experts", w_gate=case["w_gate"][:-1], w_up=case["w_up"][:-1], w_down=case["w_down"][:-1])
    call("w_gate must be 3-D", w_gate=case["w_gate"][0])
    call("one dtype", TypeError, w_down=case["w_down"].float())
    call("swiglu_limit", swiglu_limit="7")
    call("minibatch_rows", minibatch_rows=0)
    call("minibatch_rows", minibatch_rows=True)
    call("one block_m", down_tiles=dataclasses.replace(TILES, block_m=16))
    call("gate_up_tiles must be", TypeError, gate_up_tiles=KernelPlan())
    call("down_tiles.epi_split", down_tiles=dataclasses.replace(TILES, epi_split=3))
    call("sync must be", TypeError, sync=(sync.counters, sync.flags, sync.epoch))
    call("sync.flags holds", sync=new_sync(schedule.capacity // BLOCK_M - 1, DEVICE))
    call("sync.epoch", sync=sync._replace(epoch=sync.epoch.long()))
    with pytest.raises(ValueError, match="num_m_tiles"):
        new_sync(-1, DEVICE)


# ---------------------------------------------------------------- the fused backward == staged, bit for bit

DGRAD_TILES = TileConfig(BLOCK_M, 32, 32, group_m=2, epi_split=2)  # the interpreter plan's dgrad tiles
BACKWARD_NAMES = ("d_gate_up", "h_weighted", "d_rw_partial", "d_x_rows")


def backward_case(routing, limit, device=DEVICE, **sizes):
    """A forward case plus the backward's inputs: d_y's rows (padding rows zero), the packed gate_up the forward
    keeps, router weights fp32 by source."""
    case = make_case(routing, device=device, **sizes)
    schedule = case["schedule"]
    g = torch.Generator().manual_seed(7)
    d_y = torch.randn(case["a_rows"].shape, generator=g).to(device, torch.bfloat16)
    case["d_y_rows"] = d_y * (schedule.row_source >= 0)[:, None]
    case["gate_up"], _ = triton_gemm.gate_up_swiglu(case["a_rows"], case["w_gate"], case["w_up"], schedule, limit,
                                                    TILES, False)
    case["router_weights"] = torch.rand(schedule.capacity, generator=g).to(device)  # capacity >= the sources
    return case


def staged_backward(case, limit, dgrad_tiles=DGRAD_TILES, gate_up_dgrad_tiles=TILES, use_tma=True):
    d_gate_up, h_weighted, d_rw_partial = triton_gemm.down_dgrad_swiglu_partials(
        case["d_y_rows"], case["w_down"], case["gate_up"], case["router_weights"], case["schedule"], limit,
        dgrad_tiles, use_tma)
    d_x_rows = triton_gemm.gate_up_dgrad(d_gate_up, case["w_gate"], case["w_up"], case["schedule"],
                                         gate_up_dgrad_tiles, use_tma)
    return d_gate_up, h_weighted, d_rw_partial, d_x_rows


def fused_backward(case, limit, minibatch_rows, sync=None, dgrad_tiles=DGRAD_TILES, gate_up_dgrad_tiles=TILES,
                   use_tma=True):
    schedule = case["schedule"]
    if sync is None:
        sync = new_sync(schedule.capacity // min(dgrad_tiles.block_m, schedule.block_m), case["d_y_rows"].device)
    return fl.fused_backward(case["d_y_rows"], case["w_down"], case["w_gate"], case["w_up"], case["gate_up"],
                             case["router_weights"], schedule, limit, dgrad_tiles, gate_up_dgrad_tiles, use_tma,
                             minibatch_rows, sync)[:4]


def check_backward_written(out, schedule):
    """Every used row of every output was written (no NaN poison left)."""
    used = int(schedule.expert_offsets[-1])
    for name, t in zip(BACKWARD_NAMES, out):
        assert not torch.isnan(t[:used].float()).any(), f"{name}: an element the kernel did not write"


BACKWARD_CASES = [("random", "1_tile", 0.5), ("empty_experts", "mok", None), ("one_expert", "1_tile", 0.5),
                  ("one_token", "2_tiles", 0.5)]


@pytest.mark.parametrize("routing, minibatch, limit", BACKWARD_CASES)
def test_fused_backward_equals_staged(routing, minibatch, limit):
    case = backward_case(routing, limit)
    got = fused_backward(case, limit, MINIBATCHES[minibatch])
    assert_bitwise(got, staged_backward(case, limit), BACKWARD_NAMES)
    check_backward_written(got, case["schedule"])


def test_fused_backward_pointer_path_and_own_tiles():
    """The pointer path, and each GEMM with its own BLOCK_N / BLOCK_K / epilogue split (one BLOCK_M)."""
    case = backward_case("k1", 0.5)
    dgrad_tiles = TileConfig(BLOCK_M, 32, 64, group_m=3, epi_split=2, epi_tma_stores=True)
    gate_up_dgrad_tiles = TileConfig(BLOCK_M, 64, 16, group_m=1, epi_split=4, flatten=False)
    want = staged_backward(case, 0.5, dgrad_tiles, gate_up_dgrad_tiles, use_tma=False)
    got = fused_backward(case, 0.5, 2 * BLOCK_M, dgrad_tiles=dgrad_tiles, gate_up_dgrad_tiles=gate_up_dgrad_tiles,
                         use_tma=False)
    assert_bitwise(got, want, BACKWARD_NAMES)


def test_fused_backward_argument_errors():
    case = backward_case("one_token", None)
    schedule = case["schedule"]
    sync = new_sync(schedule.capacity // BLOCK_M, DEVICE)
    args = dict(d_y_rows=case["d_y_rows"], w_down=case["w_down"], w_gate=case["w_gate"], w_up=case["w_up"],
                gate_up=case["gate_up"], router_weights=case["router_weights"], schedule=schedule, swiglu_limit=None,
                dgrad_tiles=DGRAD_TILES, gate_up_dgrad_tiles=TILES, use_tma=True, minibatch_rows=None, sync=sync)

    def call(match, error=ValueError, **changes):
        with pytest.raises(error, match=match):
            fl.fused_backward(**{**args, **changes})

    call("d_y_rows must be", d_y_rows=case["d_y_rows"][:-1])
    call("gate_up must be", gate_up=case["gate_up"][:, :-1])
    call("router_weights must be", router_weights=case["router_weights"].double())
    call("w_down must be", w_down=case["w_down"].transpose(1, 2))
    call("one block_m", gate_up_dgrad_tiles=dataclasses.replace(TILES, block_m=16))
    call("dgrad_tiles.epi_split", dgrad_tiles=dataclasses.replace(TILES, epi_split=3))
    call("multiple of 16 columns", dgrad_tiles=dataclasses.replace(TILES, block_n=16, epi_split=2))
    call("sync.flags holds", sync=new_sync(schedule.capacity // BLOCK_M - 1, DEVICE))


# ---------------------------------------------------------------- the shared expert's tiles in the launch

SHARED_INTER = 24  # not a multiple of the tiles


def shared_expert(case, tokens, inter=SHARED_INTER, seed=5, gate_up=None):
    """A SharedExpert over `tokens` [N, H] (x forward, d_y backward) with the case's block_m, and the dict of its
    operands the staged helpers take."""
    num_tokens, hidden = tokens.shape
    device = tokens.device
    dense = dense_schedule(num_tokens, case["schedule"].block_m, device)
    g = torch.Generator().manual_seed(seed)
    w_gate, w_up = ((torch.randn(1, inter, hidden, generator=g) * hidden ** -0.5).to(device, torch.bfloat16)
                    for _ in range(2))
    w_down = (torch.randn(1, hidden, inter, generator=g) * inter ** -0.5).to(device, torch.bfloat16)
    shared = fl.SharedExpert(rows.gather(tokens, dense), dense, w_gate, w_up, w_down, gate_up)
    operands = dict(a_rows=shared.rows, d_y_rows=shared.rows, w_gate=w_gate, w_up=w_up, w_down=w_down,
                    schedule=dense, gate_up=gate_up,
                    router_weights=torch.ones(dense.capacity, dtype=torch.float32, device=device))
    return shared, operands


def shared_sync(case, shared, block_m=BLOCK_M):
    return new_sync((case["schedule"].capacity + shared.schedule.capacity) // block_m, case["x"].device)


@pytest.mark.parametrize("routing, minibatch", [("random", "1_tile"), ("empty_experts", "mok"),
                                                ("one_token", "2_tiles")])
def test_fused_with_the_shared_expert_equals_staged(routing, minibatch):
    """The shared expert's gate/up and down tiles in the launch (its tasks first): every output of both groups bit
    for bit the staged launches'."""
    case, want = staged_cached(routing, 0.5)
    shared, operands = shared_expert(case, case["x"])
    *got, got_shared = fl.fused_forward(case["a_rows"], case["w_gate"], case["w_up"], case["w_down"],
                                        case["schedule"], 0.5, TILES, TILES, True, MINIBATCHES[minibatch],
                                        shared_sync(case, shared), shared=shared)
    assert_bitwise(got, want)
    assert_bitwise(got_shared, staged(operands, 0.5))
    check_written(got_shared, shared.schedule)


@pytest.mark.parametrize("routing, minibatch", [("random", "2_tiles"), ("one_token", "1_tile")])
def test_fused_backward_with_the_shared_expert_equals_staged(routing, minibatch):
    """The shared expert's down dgrad (router weights 1) and gate/up dgrad tiles in the backward launch: bit for bit
    the staged launches'."""
    case = backward_case(routing, 0.5)
    d_y = torch.randn(case["x"].shape, generator=torch.Generator().manual_seed(9)).to(DEVICE, torch.bfloat16)
    shared, operands = shared_expert(case, case["x"])
    gate_up, _ = triton_gemm.gate_up_swiglu(shared.rows, shared.w_gate, shared.w_up, shared.schedule, 0.5, TILES,
                                            False)
    shared, operands = shared_expert(case, d_y, gate_up=gate_up)
    *got, got_shared = fl.fused_backward(case["d_y_rows"], case["w_down"], case["w_gate"], case["w_up"],
                                         case["gate_up"], case["router_weights"], case["schedule"], 0.5, DGRAD_TILES,
                                         TILES, True, MINIBATCHES[minibatch], shared_sync(case, shared),
                                         shared=shared)
    assert_bitwise(got, staged_backward(case, 0.5), BACKWARD_NAMES)
    d_gate_up, h_weighted, _, d_x = staged_backward(operands, 0.5)
    assert_bitwise(got_shared, (d_gate_up, h_weighted, d_x), ("shared d_gate_up", "shared h", "shared d_x"))


def test_shared_expert_argument_errors():
    case = make_case("random")
    shared, _ = shared_expert(case, case["x"])
    args = dict(a_rows=case["a_rows"], w_gate=case["w_gate"], w_up=case["w_up"], w_down=case["w_down"],
                schedule=case["schedule"], swiglu_limit=None, gate_up_tiles=TILES, down_tiles=TILES, use_tma=True,
                minibatch_rows=None, sync=shared_sync(case, shared))

    def call(match, error=ValueError, **changes):
        with pytest.raises(error, match=match):
            fl.fused_forward(**args, shared=shared._replace(**changes))

    with pytest.raises(TypeError, match="shared must be None or a fused_launch.SharedExpert"):
        fl.fused_forward(**args, shared=tuple(shared))
    call("shared.rows must be", rows=shared.rows[:-1])
    call("shared.w_up must be", w_up=shared.w_up[:, :-1])
    call("shared.w_down must be", w_down=shared.w_down.transpose(1, 2))
    call("shared.w_gate must be a", w_gate=shared.w_gate.float())
    call("shared.schedule must be", schedule=case["schedule"])
    with pytest.raises(ValueError, match="sync.flags holds"):
        fl.fused_forward(**{**args, "sync": new_sync(case["schedule"].capacity // BLOCK_M, DEVICE)},
                         shared=shared)


# ---------------------------------------------------------------- mxfp8: the second GEMM's A round-tripped


def mx(t):
    """t [R, C] bf16 quantized along C in (1, 32) blocks with E8M0 scales and dequantized: what the staged mxfp8
    path feeds the second GEMM of each pass (serval.precision)."""
    return quantize(t, block=(1, 32), scale_format="e8m0", dequantized=True)[1]


MX_DGRAD_TILES = dataclasses.replace(DGRAD_TILES, epi_split=1)  # whole 32-column blocks per epilogue chunk


def staged_mxfp8(case, limit, gate_up_tiles=TILES, down_tiles=TILES, use_tma=True):
    gate_up, h = triton_gemm.gate_up_swiglu(case["a_rows"], case["w_gate"], case["w_up"], case["schedule"], limit,
                                            gate_up_tiles, use_tma)
    return gate_up, h, triton_gemm.down(mx(h), case["w_down"], case["schedule"], down_tiles, use_tma)


def staged_mxfp8_backward(case, limit, dgrad_tiles=DGRAD_TILES, gate_up_dgrad_tiles=TILES, use_tma=True):
    d_gate_up, h_weighted, d_rw_partial = triton_gemm.down_dgrad_swiglu_partials(
        case["d_y_rows"], case["w_down"], case["gate_up"], case["router_weights"], case["schedule"], limit,
        dgrad_tiles, use_tma)
    d_x_rows = triton_gemm.gate_up_dgrad(mx(d_gate_up), case["w_gate"], case["w_up"], case["schedule"],
                                         gate_up_dgrad_tiles, use_tma)
    return d_gate_up, h_weighted, d_rw_partial, d_x_rows


@pytest.mark.parametrize("routing, minibatch, limit", [("random", "1_tile", 0.5), ("empty_experts", "mok", None),
                                                       ("one_token", "2_tiles", 0.5)])
def test_mxfp8_fused_forward_equals_staged(routing, minibatch, limit):
    """quant_block=32: the down tiles read h quantized and dequantized by the gate/up tiles' epilogue, bit for bit
    the staged mxfp8 path's down(quantize(h)) (I = 40: a partial last block)."""
    case = make_case(routing)
    case["a_rows"] = mx(case["a_rows"])
    schedule = case["schedule"]
    got = fl.fused_forward(case["a_rows"], case["w_gate"], case["w_up"], case["w_down"], schedule, limit, TILES,
                           TILES, True, MINIBATCHES[minibatch], new_sync(schedule.capacity // BLOCK_M, DEVICE),
                           quant_block=32)[:3]
    assert_bitwise(got, staged_mxfp8(case, limit))
    check_written(got, schedule)


@pytest.mark.parametrize("routing, minibatch, limit", [("random", "1_tile", 0.5), ("empty_experts", "mok", None),
                                                       ("one_token", "2_tiles", 0.5)])
def test_mxfp8_fused_backward_equals_staged(routing, minibatch, limit):
    """quant_block=32: the gate/up dgrad reads d_gate_up quantized along 2I and dequantized by the dgrad tiles'
    epilogue, bit for bit the staged mxfp8 path's (I = 64: whole blocks per half)."""
    case = backward_case(routing, limit, inter=64)
    got = fl.fused_backward(case["d_y_rows"], case["w_down"], case["w_gate"], case["w_up"], case["gate_up"],
                            case["router_weights"], case["schedule"], limit, MX_DGRAD_TILES, TILES, True,
                            MINIBATCHES[minibatch], new_sync(case["schedule"].capacity // BLOCK_M, DEVICE),
                            quant_block=32)[:4]
    assert_bitwise(got, staged_mxfp8_backward(case, limit), BACKWARD_NAMES)
    check_backward_written(got, case["schedule"])


def peer_tokens(tokens, top_k, world_size=2):
    """tokens [N, H] split over `world_size` virtual ranks' token buffers (each padded with NaN tokens no source
    maps to): (the PeerTokens a pull reads, the buffers to keep alive)."""
    from serval.peers import PeerTokens

    per_rank = -(-tokens.shape[0] // world_size) + 1
    padded = torch.full((world_size * per_rank, tokens.shape[1]), float("nan"), dtype=tokens.dtype,
                        device=tokens.device)
    padded[: tokens.shape[0]] = tokens
    buffers = [padded[p * per_rank:(p + 1) * per_rank].clone() for p in range(world_size)]
    table = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device=tokens.device)
    return PeerTokens(table, per_rank, top_k, tokens.shape[1], tokens.dtype, False), buffers


@pytest.mark.parametrize("routing", ["random", "one_token"])
def test_mxfp8_fused_passes_pull_and_round_trip_their_rows(routing):
    """At EP (two virtual ranks' token buffers, 1 pull program) with quant_block: the pull programs round-trip the
    rows they pull; both passes bit for bit the staged mxfp8 path on the rows quantized after the pull, and the
    backward keeps d_y's rows as pulled in d_y_rows (the weight gradients quantize them along tokens)."""
    case = backward_case(routing, 0.5, inter=64)
    schedule = case["schedule"]
    d_y = torch.randn(case["x"].shape, generator=torch.Generator().manual_seed(4)).to(DEVICE, torch.bfloat16)
    d_y_rows = rows.gather(d_y, schedule)
    want_forward = staged_mxfp8({**case, "a_rows": mx(case["a_rows"])}, 0.5)
    want_backward = staged_mxfp8_backward({**case, "d_y_rows": mx(d_y_rows)}, 0.5)
    sync = new_sync(schedule.capacity // BLOCK_M, DEVICE)

    def pull(tokens):
        source, buffers = peer_tokens(tokens, schedule.top_k)
        return in_gemm_pull.Pull(source, 1, 32, *new_pull_flags(schedule.capacity // BLOCK_M, DEVICE)), \
            buffers

    x_pull, _x_buffers = pull(case["x"])
    got = fl.fused_forward(torch.empty_like(case["a_rows"]), case["w_gate"], case["w_up"], case["w_down"], schedule,
                           0.5, TILES, TILES, True, None, sync, pull=x_pull, quant_block=32)[:3]
    assert_bitwise(got, want_forward)
    d_y_pull, _d_y_buffers = pull(d_y)
    pulled = torch.empty_like(d_y_rows)
    got = fl.fused_backward(pulled, case["w_down"], case["w_gate"], case["w_up"], case["gate_up"],
                            case["router_weights"], schedule, 0.5, MX_DGRAD_TILES, TILES, True, None, sync,
                            pull=d_y_pull, quant_block=32)[:4]
    assert_bitwise(got, want_backward, BACKWARD_NAMES)
    used = int(schedule.expert_offsets[-1])
    assert torch.equal(bits(pulled[:used]), bits(d_y_rows[:used])), "d_y_rows: not the rows as pulled"


def test_mxfp8_argument_errors():
    case = backward_case("one_token", None)
    schedule = case["schedule"]
    sync = new_sync(schedule.capacity // BLOCK_M, DEVICE)
    forward = dict(a_rows=case["a_rows"], w_gate=case["w_gate"], w_up=case["w_up"], w_down=case["w_down"],
                   schedule=schedule, swiglu_limit=None, gate_up_tiles=TILES, down_tiles=TILES, use_tma=True,
                   minibatch_rows=None, sync=sync, quant_block=32)
    backward = dict(d_y_rows=case["d_y_rows"], w_down=case["w_down"], w_gate=case["w_gate"], w_up=case["w_up"],
                    gate_up=case["gate_up"], router_weights=case["router_weights"], schedule=schedule,
                    swiglu_limit=None, dgrad_tiles=MX_DGRAD_TILES, gate_up_dgrad_tiles=TILES, use_tma=True,
                    minibatch_rows=None, sync=sync, quant_block=32)
    for quant_block in (16, True, 32.0):
        with pytest.raises(ValueError, match="quant_block must be 0 or 32"):
            fl.fused_forward(**{**forward, "quant_block": quant_block})
    with pytest.raises(ValueError, match="quant_block needs bf16"):
        fl.fused_forward(**{**forward, **{k: forward[k].half() for k in ("a_rows", "w_gate", "w_up", "w_down")}})
    with pytest.raises(ValueError, match="epilogue chunks"):
        fl.fused_forward(**{**forward, "gate_up_tiles": dataclasses.replace(TILES, epi_split=2)})
    with pytest.raises(ValueError, match="epilogue chunks"):
        fl.fused_backward(**{**backward, "dgrad_tiles": DGRAD_TILES})
    with pytest.raises(ValueError, match="I = 40 must be a multiple"):  # a block would straddle gate and up
        fl.fused_backward(**backward)


# ---------------------------------------------------------------- sm_90a, without a GPU

COMPILE_CHILD = r"""
import sys
import torch
sys.path.insert(0, "tests")
from sm90 import compile_launch_in_this_child
from serval.kernels import fused_launch as fl
from serval.values import new_pull_flags, new_sync
from serval.kernels.gemm_stages import quant_tiles
from serval.plan import KernelPlan
from serval.schedule import build_schedule, dense_schedule

hidden, inter, E, N = int(sys.argv[1]), int(sys.argv[2]), 4, 256
backward, with_shared = sys.argv[3].startswith("backward"), sys.argv[3].endswith("shared")
quant_block = 32 if "mxfp8" in sys.argv[3] else 0
schedule = build_schedule(torch.stack([torch.arange(N) % E, (torch.arange(N) + 1) % E], 1), E, 128)
bf16 = dict(dtype=torch.bfloat16)
plan = KernelPlan()
pull = None
if sys.argv[3].endswith("_ep"):  # 8 pull programs read two ranks' token buffers (a compile: never run)
    from serval.kernels import in_gemm_pull
    from serval.peers import PeerTokens
    source = PeerTokens(torch.zeros(2, dtype=torch.int64), N // 2, 2, hidden, torch.bfloat16, True)
    pull = in_gemm_pull.Pull(source, 8, plan.pull_block_c,
                             *new_pull_flags(schedule.capacity // 128, "cpu"))
rows, w_gate, w_up = (torch.zeros(schedule.capacity, hidden, **bf16), torch.zeros(E, inter, hidden, **bf16),
                      torch.zeros(E, inter, hidden, **bf16))
w_down = torch.zeros(E, hidden, inter, **bf16)
shared = None
if with_shared:  # a shared expert of Is = I over the N tokens
    dense = dense_schedule(N, 128, "cpu")
    shared = fl.SharedExpert(torch.zeros(dense.capacity, hidden, **bf16), dense, w_gate[:1], w_up[:1], w_down[:1],
                             torch.zeros(N, 2 * inter, **bf16) if backward else None)
sync = new_sync((schedule.capacity + (N if with_shared else 0)) // 128, "cpu")
if backward:
    launch = lambda: fl.fused_backward(
        rows, w_down, w_gate, w_up, torch.zeros(schedule.num_packed, 2 * inter, **bf16), torch.zeros(2 * N), schedule,
        7.0, quant_tiles(plan.down_dgrad_tiles, quant_block), plan.gate_up_dgrad_tiles, True, None, sync,
        shared=shared, quant_block=quant_block, pull=pull)
else:
    launch = lambda: fl.fused_forward(rows, w_gate, w_up, w_down, schedule, 7.0,
                                      quant_tiles(plan.gate_up_tiles, quant_block), plan.down_tiles, True, None, sync,
                                      shared=shared, quant_block=quant_block, pull=pull)
compile_launch_in_this_child(fl, "fused_pass_kernel", launch, sys.argv[4])
"""


@pytest.mark.skipif(CUDA, reason="the GPU tests run the kernel itself")
@pytest.mark.parametrize("direction", ["forward", "backward", "forward_shared", "backward_shared", "forward_mxfp8",
                                       "backward_mxfp8", "forward_mxfp8_ep", "backward_mxfp8_ep"])
def test_compiles_for_sm90a(direction, tmp_path):
    """The fused kernel with the plan's Hopper tiles compiles for sm_90a, its shared memory fits a block (227 KB),
    ptxas spills nothing and keeps the wgmma pipelined (no function call in the kernel: no C7510 warning). Forward:
    gate/up 128 x 128 x 64 dual accumulator, down 128 x 256 x 64, the gate/up's 8 warps and 3 stages for both;
    backward: the dgrad 128 x 128 x 64 with its SwiGLU-backward epilogue in 4 chunks, the gate/up dgrad
    128 x 256 x 64 over the split K, the latter's 8 warps and 3 stages for both; "_shared": with the shared
    expert's tiles too (the same tile bodies, on its operands); "_mxfp8": quant_block 32 (the first GEMM's
    epilogue also round-trips its output through E8M0 blocks); "_ep": with 8 pull programs, which round-trip the rows
    they pull. In a child process:
    TRITON_INTERPRET=1 here makes serval's helpers interpreter functions. (On H, I that are not multiples of 16,
    320 x 200, the gate/up tiles spill some 300 bytes, in the staged kernel as here.)"""
    shared, report = compile_in_child(COMPILE_CHILD, [512, 256, direction], tmp_path)
    assert shared <= 232448, f"{shared} bytes of shared memory"
    spilled = int(re.search(r"(\d+) bytes spill stores", report).group(1))
    # mxfp8, under Triton 3.9's ptxas: the backward's round trip of d_gate and d_up spills 8 bytes (2 registers),
    # with the pull programs' round trip of the pulled rows 36 (Triton 3.6, the H200's: 56 and 84)
    assert spilled <= {"backward_mxfp8": 8, "backward_mxfp8_ep": 36}.get(direction, 0), report
    assert "C7510" not in report, report  # wgmma serialized


# ---------------------------------------------------------------- GPU, real sizes

GPU_SHAPE = dict(num_tokens=8192, top_k=4, num_experts=8, hidden=2048, inter=1024)


def gpu_case(how="random"):
    s = GPU_SHAPE
    return make_case((s["num_tokens"], s["top_k"], s["num_experts"], how), hidden=s["hidden"], inter=s["inter"],
                     block_m=128, device="cuda")


@needs_cuda
@pytest.mark.parametrize("how", ["random", "last_expert"])
@pytest.mark.parametrize("minibatch_rows", [None, 128, 1024])
def test_gpu_fused_equals_staged(how, minibatch_rows):
    """At a realistic size, the plan's tiles: bit for bit the staged path, and two runs bit for bit equal."""
    case = gpu_case(how)
    plan = KernelPlan()
    tiles = dict(gate_up_tiles=plan.gate_up_tiles, down_tiles=plan.down_tiles)
    want = staged(case, 7.0, **tiles)
    sync = new_sync(case["schedule"].capacity // 128, "cuda")
    first = fused(case, 7.0, minibatch_rows, sync, **tiles)
    assert_bitwise(first, want)
    check_written(first, case["schedule"])
    assert_bitwise(fused(case, 7.0, minibatch_rows, sync, **tiles), first)


@needs_cuda
@pytest.mark.parametrize("how", ["random", "last_expert"])
@pytest.mark.parametrize("minibatch_rows", [None, 128])
def test_gpu_fused_backward_equals_staged(how, minibatch_rows):
    """The backward at a realistic size, the plan's tiles: bit for bit the staged Triton path, two runs bit for bit
    equal, and a CUDA graph of the launch replays to the eager bits."""
    s = GPU_SHAPE
    case = backward_case((s["num_tokens"], s["top_k"], s["num_experts"], how), 7.0, device="cuda",
                         hidden=s["hidden"], inter=s["inter"], block_m=128)
    plan = KernelPlan()
    tiles = dict(dgrad_tiles=plan.down_dgrad_tiles, gate_up_dgrad_tiles=plan.gate_up_dgrad_tiles)
    want = staged_backward(case, 7.0, **tiles)
    sync = new_sync(case["schedule"].capacity // 128, "cuda")
    first = fused_backward(case, 7.0, minibatch_rows, sync, **tiles)
    assert_bitwise(first, want, BACKWARD_NAMES)
    check_backward_written(first, case["schedule"])
    assert_bitwise(fused_backward(case, 7.0, minibatch_rows, sync, **tiles), first, BACKWARD_NAMES)
    if minibatch_rows is None:
        check_sync_free_and_graph_replay(
            lambda: tuple(bits(t) for t in fused_backward(case, 7.0, None, sync, **tiles)),
            tuple(bits(t) for t in first))


@needs_cuda
def test_gpu_fused_passes_with_the_shared_expert():
    """Both passes with a shared expert (Is = 1536, not a multiple of the 256-column tiles) at a realistic size, the
    plan's tiles: every output of both groups bit for bit the staged Triton launches', two runs equal."""
    s, plan = GPU_SHAPE, KernelPlan()
    case = backward_case((s["num_tokens"], s["top_k"], s["num_experts"], "random"), 7.0, device="cuda",
                         hidden=s["hidden"], inter=s["inter"], block_m=128)
    shared, operands = shared_expert(case, case["x"], inter=1536)
    sync = shared_sync(case, shared, block_m=128)
    fwd_tiles = dict(gate_up_tiles=plan.gate_up_tiles, down_tiles=plan.down_tiles)

    def forward():
        return fl.fused_forward(case["a_rows"], case["w_gate"], case["w_up"], case["w_down"], case["schedule"], 7.0,
                                plan.gate_up_tiles, plan.down_tiles, True, None, sync, shared=shared)

    *got, got_shared = forward()
    assert_bitwise(got, staged(case, 7.0, **fwd_tiles))
    assert_bitwise(got_shared, staged(operands, 7.0, **fwd_tiles))
    assert_bitwise(forward()[3], got_shared)

    d_y = torch.randn(case["x"].shape, generator=torch.Generator().manual_seed(9)).to("cuda", torch.bfloat16)
    shared_bwd, operands_bwd = shared_expert(case, d_y, inter=1536, gate_up=got_shared[0])  # the same weights
    bwd_tiles = dict(dgrad_tiles=plan.down_dgrad_tiles, gate_up_dgrad_tiles=plan.gate_up_dgrad_tiles)
    *got, got_shared = fl.fused_backward(case["d_y_rows"], case["w_down"], case["w_gate"], case["w_up"],
                                         case["gate_up"], case["router_weights"], case["schedule"], 7.0,
                                         plan.down_dgrad_tiles, plan.gate_up_dgrad_tiles, True, 256, sync,
                                         shared=shared_bwd)
    assert_bitwise(got, staged_backward(case, 7.0, **bwd_tiles), BACKWARD_NAMES)
    d_gate_up, h_weighted, _, d_x = staged_backward(operands_bwd, 7.0, **bwd_tiles)
    assert_bitwise(got_shared, (d_gate_up, h_weighted, d_x), ("shared d_gate_up", "shared h", "shared d_x"))


@needs_cuda
@pytest.mark.parametrize("how", ["random", "last_expert"])
def test_gpu_mxfp8_fused_passes(how):
    """quant_block 32 at a realistic size with the plan's tiles (as gemm_stages adapts them): both passes bit for
    bit the staged mxfp8 path (the quantizer kernel's round trip between the GEMMs), two runs equal."""
    from serval.kernels.gemm_stages import quant_tiles

    s, plan = GPU_SHAPE, KernelPlan()
    case = backward_case((s["num_tokens"], s["top_k"], s["num_experts"], how), 7.0, device="cuda",
                         hidden=s["hidden"], inter=s["inter"], block_m=128)
    case["a_rows"], case["d_y_rows"] = mx(case["a_rows"]), mx(case["d_y_rows"])
    sync = new_sync(case["schedule"].capacity // 128, "cuda")

    def forward():
        return fl.fused_forward(case["a_rows"], case["w_gate"], case["w_up"], case["w_down"], case["schedule"], 7.0,
                                quant_tiles(plan.gate_up_tiles, 32), plan.down_tiles, True, None, sync,
                                quant_block=32)[:3]

    def backward():
        return fl.fused_backward(case["d_y_rows"], case["w_down"], case["w_gate"], case["w_up"], case["gate_up"],
                                 case["router_weights"], case["schedule"], 7.0, quant_tiles(plan.down_dgrad_tiles, 32),
                                 plan.gate_up_dgrad_tiles, True, None, sync, quant_block=32)[:4]

    got = forward()
    assert_bitwise(got, staged_mxfp8(case, 7.0, gate_up_tiles=plan.gate_up_tiles, down_tiles=plan.down_tiles))
    assert_bitwise(forward(), got)
    got = backward()
    assert_bitwise(got, staged_mxfp8_backward(case, 7.0, dgrad_tiles=plan.down_dgrad_tiles,
                                              gate_up_dgrad_tiles=plan.gate_up_dgrad_tiles), BACKWARD_NAMES)
    assert_bitwise(backward(), got, BACKWARD_NAMES)


@needs_cuda
def test_gpu_cuda_graph_replay():
    """No host sync, and a CUDA graph of the launch (the epoch bump inside) replays to the eager bits, twice."""
    case = gpu_case()
    plan = KernelPlan()
    sync = new_sync(case["schedule"].capacity // 128, "cuda")

    def step():  # integer views: the NaN poison of unwritten rows compares equal
        out = fused(case, 7.0, None, sync, gate_up_tiles=plan.gate_up_tiles, down_tiles=plan.down_tiles)
        return tuple(bits(t) for t in out)

    eager = step()
    # each check runs the launch an odd number of times (3), so the two captures replay at both epoch parities
    for _ in range(2):
        check_sync_free_and_graph_replay(step, eager)


# ---------------------------------------------------------------- in the layer (KernelPlan.fused_*)


@pytest.mark.parametrize("kind", ["empty"])  # some experts empty, the others several M-tiles
@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
def test_layer_with_the_fused_passes_equals_the_staged_layer(kind, precision, monkeypatch):
    """serval.moe with KernelPlan.fused_forward and fused_backward (each pass's two GEMMs in one launch, the shared
    expert's too): y and every gradient bit for bit the staged kernels' (EP=1), in bf16 and in mxfp8 (whose
    launches round-trip the second GEMMs' A, quant_block 32)."""
    import dataclasses

    import serval
    from conftest import make_layer, make_routing
    from serval.plan import choose_plan

    num_tokens, hidden, inter, num_experts, top_k = 40, 48, 32, 5, 2
    dtype = torch.bfloat16 if CUDA or precision != "bf16" else torch.float32
    x, weights, shared = make_layer(num_tokens, hidden, inter, num_experts, shared_inter=inter, device=DEVICE,
                                    dtype=dtype)
    router_weights, topk_ids = make_routing(num_tokens, num_experts, top_k, kind=kind, device=DEVICE)
    d_y = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
    staged_plan = choose_plan(hidden, dtype, common.target())

    def step(plan):
        leaves = [t.detach().clone().requires_grad_() for t in (x, router_weights, *weights, *shared)]
        config = serval.Config(block_m=128 if CUDA else 16 if precision == "bf16" else 32, backend="triton",
                               kernel_plan=plan, precision=precision)
        y = serval.moe(leaves[0], leaves[1], topk_ids, *leaves[2:5], tuple(leaves[5:]), config=config)
        return (y.detach(), *torch.autograd.grad(y, leaves, d_y))

    launches = []  # (pass, quant_block) of every fused launch
    for name in ("fused_forward", "fused_backward"):
        def spy(*args, _launch=getattr(fl, name), _name=name, **kwargs):
            launches.append((_name, kwargs.get("quant_block", 0)))
            return _launch(*args, **kwargs)
        monkeypatch.setattr(fl, name, spy)
    fused_out = step(dataclasses.replace(staged_plan, fused_forward=True, fused_backward=True))
    quant_block = 32 if precision == "mxfp8" else 0
    assert launches == [("fused_forward", quant_block), ("fused_backward", quant_block)]
    for got, want in zip(fused_out, step(staged_plan)):
        assert torch.equal(got, want)
