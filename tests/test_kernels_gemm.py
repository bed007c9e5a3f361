"""The Triton stages (serval.kernels: grouped GEMMs and row kernels) against the torch stages (serval.stages).

On a machine without CUDA the kernels run in Triton's CPU interpreter on tiny shapes
(H, I not multiples of the tiles, several routing shapes); with CUDA, the GPU tests at
real sizes run too. Every kernel output is NaN-poisoned before the kernel runs
(SERVAL_POISON_OUTPUTS=1), so an element a kernel forgets to write shows as NaN; every
kernel runs twice and must give bitwise-identical results.

Tolerances: bf16 roundings (to nearest, in the interpreter too: `common.to_dtype`) and
fp32 sums in another order than the torch stages', so elementwise checks allow a few ulps
plus a small absolute term for cancellation; an indexing or masking bug gives O(1) errors, far outside them.
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

from serval import stages  # noqa: E402
from serval.kernels import common, gemm_stages, in_gemm_pull, rows, swiglu  # noqa: E402
from serval.plan import STAGES, KernelPlan, Target, TileConfig, choose_plan  # noqa: E402
from serval.schedule import build_schedule, dense_schedule  # noqa: E402
from serval.values import new_pull_flags  # noqa: E402

CUDA = torch.cuda.is_available() and not common.INTERPRET
DEVICE = "cuda" if CUDA else "cpu"
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (sm_90 for TMA)")


def triton_plan(use_tma=True, dtype=torch.bfloat16, **fields) -> KernelPlan:
    """The plan chosen here, with every stage on the Triton GEMM (the engine these tests check)."""
    plan = choose_plan(HIDDEN, dtype, common.target())
    return dataclasses.replace(plan, gate_up_engine="triton", down_engine="triton", down_dgrad_engine="triton",
                               gate_up_dgrad_engine="triton", use_tma=use_tma, **fields)

# ---------------------------------------------------------------- inputs

# (tokens, slots, experts, how topk_ids are drawn) for the interpreter-sized cases
ROUTINGS = {
    "random": (40, 3, 5, "random"),
    "empty_experts": (33, 2, 6, "two_experts"),  # experts 0, 2, 3, 5 get no rows
    "one_expert": (37, 1, 4, "last_expert"),  # every token to the last expert
    "k1": (50, 1, 3, "random"),
    "one_token": (1, 4, 6, "random"),
}
HIDDEN, INTER = 80, 48  # not multiples of the interpreter's 32-wide N/K tiles


def make_topk_ids(num_tokens, top_k, num_experts, how, generator):
    if how == "random":  # k distinct experts per token, as a top-k router gives
        return torch.rand(num_tokens, num_experts, generator=generator).argsort(dim=1)[:, :top_k]
    if how == "two_experts":
        return torch.tensor([1, 4])[torch.randint(0, 2, (num_tokens, top_k), generator=generator)]
    if how == "last_expert":
        return torch.full((num_tokens, top_k), num_experts - 1)
    raise ValueError(how)


def make_case(routing: str, block_m: int = 16, hidden: int = HIDDEN, inter: int = INTER, seed: int = 0,
              device: str = DEVICE):
    """Fresh random bf16 inputs and the schedule for one routing case."""
    num_tokens, top_k, num_experts, how = ROUTINGS[routing] if isinstance(routing, str) else routing
    g = torch.Generator().manual_seed(seed)
    topk_ids = make_topk_ids(num_tokens, top_k, num_experts, how, g)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=torch.bfloat16)

    case = dict(
        x=randn(num_tokens, hidden),
        d_y=randn(num_tokens, hidden),
        w_gate=randn(num_experts, inter, hidden, scale=hidden**-0.5),
        w_up=randn(num_experts, inter, hidden, scale=hidden**-0.5),
        w_down=randn(num_experts, hidden, inter, scale=inter**-0.5),
        router_weights=torch.rand(num_tokens, top_k, generator=g).to(device),
        schedule=build_schedule(topk_ids.to(device), num_experts, block_m),
    )
    return case


def make_dense_case(num_tokens=45, block_m=16, hidden=HIDDEN, inter=INTER, seed=1, device=DEVICE):
    """The shared expert: one expert, every token once (rows = tokens), router weight 1."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=torch.bfloat16)

    return dict(
        x=randn(num_tokens, hidden),
        d_y=randn(num_tokens, hidden),
        w_gate=randn(1, inter, hidden, scale=hidden**-0.5),
        w_up=randn(1, inter, hidden, scale=hidden**-0.5),
        w_down=randn(1, hidden, inter, scale=inter**-0.5),
        router_weights=torch.ones(num_tokens, 1, device=device),
        schedule=dense_schedule(num_tokens, block_m, device),
    )


# ---------------------------------------------------------------- checks


def valid_rows(schedule):
    return schedule.row_source >= 0


def assert_close(actual, expected, rows=None, name=""):
    """Elementwise within a few bf16 ulps (+ 1% of the largest value), and no NaN where checked."""
    if rows is not None:
        actual, expected = actual[rows], expected[rows]
    actual, expected = actual.float(), expected.float()
    assert not torch.isnan(actual).any(), f"{name}: NaN (an element the kernel did not write)"
    rtol = 3e-2 if common.INTERPRET else 1.6e-2
    atol = 1e-2 * expected.abs().max().clamp(min=1e-6)
    bad = (actual - expected).abs() > rtol * expected.abs() + atol
    assert not bad.any(), (
        f"{name}: {int(bad.sum())} of {bad.numel()} elements off; first at {bad.nonzero()[0].tolist()}: "
        f"{actual[bad][0].item()} vs {expected[bad][0].item()}")


def rel_err(actual, expected):
    actual, expected = actual.float(), expected.float()
    return ((actual - expected).norm() / expected.norm().clamp(min=1e-12)).item()


def assert_bitwise_equal(first, second, name=""):
    """Bitwise, NaN fill included (torch.equal would call two NaNs different)."""
    as_tuple = lambda t: t if isinstance(t, tuple) else (t,)  # noqa: E731
    for a, b in zip(as_tuple(first), as_tuple(second)):
        view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        assert torch.equal(a.view(view), b.view(view)), f"{name}: two runs differ"


def run_twice(fn, *args, **kwargs):
    first = fn(*args, **kwargs)
    assert_bitwise_equal(first, fn(*args, **kwargs), getattr(fn, "__name__", ""))
    return first


# ---------------------------------------------------------------- row kernels


@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_gather(routing):
    case = make_case(routing)
    out = run_twice(rows.gather, case["x"], case["schedule"])
    # exact, padding rows (all zeros, as the stage promises) included
    assert torch.equal(out, stages.gather(case["x"], case["schedule"]))


def test_gather_dense():
    case = make_dense_case()
    assert torch.equal(run_twice(rows.gather, case["x"], case["schedule"]), stages.gather(case["x"], case["schedule"]))


@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("with_shared", [False, True])
def test_combine_and_sum_slots(routing, with_shared):
    case = make_case(routing)
    schedule = case["schedule"]
    g = torch.Generator().manual_seed(5)
    expert_out = torch.randn(schedule.capacity, HIDDEN, generator=g).to(device=DEVICE, dtype=torch.bfloat16)
    shared = case["d_y"] if with_shared else None
    y = run_twice(rows.combine, expert_out, case["router_weights"], schedule, shared)
    assert_close(y, stages.combine(expert_out, case["router_weights"], schedule, shared), name="combine")
    d_x = run_twice(rows.sum_slots, expert_out, schedule, shared)
    assert_close(d_x, stages.sum_slots(expert_out, schedule, shared), name="sum_slots")


def test_combine_dense_shared():
    case = make_dense_case()
    schedule = case["schedule"]
    expert_out = rows.gather(case["d_y"], schedule)
    y = run_twice(rows.combine, expert_out, case["router_weights"], schedule, case["x"])
    assert_close(y, stages.combine(expert_out, case["router_weights"], schedule, case["x"]), name="combine")


# ---------------------------------------------------------------- grouped GEMMs

TMA_CHOICES = [False, True]  # pointer loads / tensor descriptors (both run in the 3.9 interpreter)


def _forward_reference(case, limit):
    return stages.gate_up_swiglu(case["x"], case["w_gate"], case["w_up"], case["schedule"], limit)


@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("limit", [None, 0.5])
@pytest.mark.parametrize("a_source", ["rows_tma", "rows_tma_tma_stores", "rows_pointers"])
def test_gate_up_swiglu(routing, limit, a_source):
    case = make_case(routing)
    schedule = case["schedule"]
    plan = triton_plan(use_tma=a_source != "rows_pointers")
    if a_source == "rows_tma_tma_stores":  # TMA loads, TMA stores of h in the epilogue
        plan = dataclasses.replace(plan, gate_up_tiles=dataclasses.replace(plan.gate_up_tiles, epi_tma_stores=True))
    gate_up, h = run_twice(gemm_stages.gate_up_swiglu, case["x"], case["w_gate"], case["w_up"], schedule, limit,
                           plan=plan)
    ref_gate_up, ref_h = _forward_reference(case, limit)
    assert gate_up.shape == (schedule.num_packed, 2 * INTER)  # packed: no padding rows
    assert_close(gate_up, ref_gate_up, name="gate_up")
    assert_close(h, ref_h, valid_rows(schedule), "h")


@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("use_tma", TMA_CHOICES)
def test_down(routing, use_tma):
    case = make_case(routing)
    schedule = case["schedule"]
    h = _forward_reference(case, None)[1]
    out = run_twice(gemm_stages.down, h, case["w_down"], schedule, plan=triton_plan(use_tma))
    assert_close(out, stages.down(h, case["w_down"], schedule), valid_rows(schedule), "down")


# the SwiGLU-backward epilogue's output stores: TMA or pointers (the packed gate/up reads are pointer loads)
EPILOGUE_IO = {"tma_stores": dict(epi_tma_stores=True), "pointer_stores": dict(epi_tma_stores=False)}


def _dgrad_plan(epilogue_io, use_tma, dtype=torch.bfloat16):
    plan = triton_plan(use_tma, dtype)
    return dataclasses.replace(plan, down_dgrad_tiles=dataclasses.replace(plan.down_dgrad_tiles,
                                                                          **EPILOGUE_IO[epilogue_io]))


@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("limit", [None, 0.5])
@pytest.mark.parametrize("use_tma", TMA_CHOICES)
@pytest.mark.parametrize("epilogue_io", list(EPILOGUE_IO))
def test_down_dgrad_swiglu(routing, limit, use_tma, epilogue_io):
    if epilogue_io != "tma_stores" and use_tma is False:
        pytest.skip("the epilogue I/O choice only matters with TMA")
    case = make_case(routing)
    schedule = case["schedule"]
    gate_up = _forward_reference(case, limit)[0]
    d_y_rows = stages.gather(case["d_y"], schedule)
    args = (d_y_rows, case["w_down"], gate_up, case["router_weights"], schedule, limit)
    d_gate_up, h_weighted, d_rw_rows = run_twice(gemm_stages.down_dgrad_swiglu, *args,
                                                 plan=_dgrad_plan(epilogue_io, use_tma))
    ref = stages.down_dgrad_swiglu(*args)
    rows_ok = valid_rows(schedule)
    assert_close(d_gate_up, ref[0], rows_ok, "d_gate_up")
    assert_close(h_weighted, ref[1], rows_ok, "h_weighted")
    assert_close(d_rw_rows, ref[2], rows_ok, "d_rw_rows")
    assert d_rw_rows.dtype == torch.float32
    # rows past the used tiles are defined: zero
    used = int(schedule.expert_offsets[-1])
    assert torch.equal(d_rw_rows[used:], torch.zeros_like(d_rw_rows[used:]))


@pytest.mark.parametrize("inter", [INTER, 40])  # 40: the last 16-column group is partly past I
def test_router_weight_grad_does_not_depend_on_the_tiles(inter):
    """d_rw_rows is bit for bit the same for every down dgrad tile width and epilogue split (every engine sums a
    row in swiglu.d_rw_group_sums' order), and so is what the rest of the stage writes. block_k stays fixed: the
    interpreter's emulated dot rounds once per K step."""
    case = make_case("random", inter=inter)
    schedule = case["schedule"]
    gate_up = _forward_reference(case, 0.5)[0]
    args = (stages.gather(case["d_y"], schedule), case["w_down"], gate_up, case["router_weights"], schedule, 0.5)
    base = triton_plan().down_dgrad_tiles
    outs = []
    for block_n, epi_split in [(16, 1), (32, 2), (64, 1), (64, 4), (128, 2)]:
        tiles = dataclasses.replace(base, block_n=block_n, epi_split=epi_split)
        outs.append(gemm_stages.down_dgrad_swiglu(*args, plan=triton_plan(down_dgrad_tiles=tiles)))
    used = valid_rows(schedule)
    for out in outs[1:]:
        for name, got, want in zip(("d_gate_up", "h_weighted", "d_rw_rows"), out, outs[0]):
            assert torch.equal(got[used], want[used]), name
    with pytest.raises(ValueError, match="multiple of 16 columns"):
        gemm_stages.down_dgrad_swiglu(*args, plan=triton_plan(
            down_dgrad_tiles=dataclasses.replace(base, block_n=32, epi_split=4)))


@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("use_tma", TMA_CHOICES)
def test_gate_up_dgrad(routing, use_tma):
    case = make_case(routing)
    schedule = case["schedule"]
    g = torch.Generator().manual_seed(3)
    d_gate_up = torch.randn(schedule.capacity, 2 * INTER, generator=g).to(device=DEVICE, dtype=torch.bfloat16)
    d_gate_up[~valid_rows(schedule)] = 0  # as the down dgrad leaves padding rows
    out = run_twice(gemm_stages.gate_up_dgrad, d_gate_up, case["w_gate"], case["w_up"], schedule,
                    plan=triton_plan(use_tma))
    ref = stages.gate_up_dgrad(d_gate_up, case["w_gate"], case["w_up"], schedule)
    assert_close(out, ref, valid_rows(schedule), "d_x_rows")


def _push_case(case, stage):
    """(the stage's GEMM as fn(plan=..., push_to=...), its output columns) for the pushing-epilogue test."""
    schedule = case["schedule"]
    if stage == "down":
        h = _forward_reference(case, None)[1]
        return (lambda **kw: gemm_stages.down(h, case["w_down"], schedule, **kw)), case["w_down"].shape[1]
    g = torch.Generator().manual_seed(3)
    inter = case["w_gate"].shape[1]
    d_gate_up = torch.randn(schedule.capacity, 2 * inter, generator=g).to(case["x"].device, torch.bfloat16)
    return (lambda **kw: gemm_stages.gate_up_dgrad(d_gate_up, case["w_gate"], case["w_up"], schedule, **kw),
            case["w_gate"].shape[2])


def check_push(case, stage, world_size, use_tma):
    """The GEMM's pushing epilogue (PUSH) on P virtual ranks: P slot buffers in this process, the schedule's
    N*k sources split over them (owner = source // num_slots). Every source's slot holds exactly the row
    the plain GEMM makes, bit for bit; slots no source maps to keep their NaN poison (nothing written out
    of range; padding rows write nothing)."""
    from serval.peers import PeerSlots
    from serval.transport import symm

    schedule = case["schedule"]
    gemm, cols = _push_case(case, stage)
    plan = triton_plan(use_tma)
    rows = gemm(plan=plan)
    num_sources = case["x"].shape[0] * schedule.top_k
    num_slots = -(-num_sources // world_size) + 1  # one slot per rank that no source maps to
    buffers = [torch.full((num_slots, cols), float("nan"), dtype=torch.bfloat16, device=rows.device)
               for _ in range(world_size)]
    addresses = [b.data_ptr() for b in buffers]
    for aligned in {False, symm.vector_aligned(addresses, cols, 2)}:
        for b in buffers:
            b.fill_(float("nan"))
        table = torch.tensor(addresses, dtype=torch.int64, device=rows.device)
        source = schedule.row_source.to(torch.int64)
        owner, local = source // num_slots, source % num_slots
        assert gemm(plan=plan, push_to=PeerSlots(table, num_slots, cols, torch.bfloat16, aligned)) is None
        valid = source >= 0
        got = torch.stack(buffers)[owner[valid], local[valid]]
        assert torch.equal(got.view(torch.int16), rows[valid].view(torch.int16)), f"{stage}: pushed rows differ"
        written = torch.zeros(world_size, num_slots, dtype=torch.bool, device=rows.device)
        written[owner[valid], local[valid]] = True
        assert torch.isnan(torch.stack(buffers)[~written].float()).all(), f"{stage}: a slot no row maps to was written"


def check_pull(case, world_size, use_tma, limit=None, quant_block=0):
    """The gate/up GEMM pulling its own rows (pull_from, communication programs) from P virtual ranks' token
    buffers: consecutive chunks of x, each padded with NaN tokens no source maps to (a read of one would
    show). Bitwise the gate_up and h of the plain GEMM on x. quant_block 32 (mxfp8): the pull round-trips the
    rows, bitwise the plain GEMM on x quantized and dequantized along H (`serval.ops.quantize`); the down dgrad
    pulling the same rows as d_y keeps them as pulled and reads the round trip."""
    from serval.ops import quantize
    from serval.peers import PeerTokens
    from serval.transport import symm

    schedule, x = case["schedule"], case["x"]
    args = (case["w_gate"], case["w_up"], schedule, limit)
    plan = triton_plan(use_tma, pull_programs=2, dgrad_pull_programs=2)
    x_read = quantize(x, block=(1, quant_block), scale_format="e8m0", dequantized=True)[1] if quant_block else x
    want = gemm_stages.gate_up_swiglu(x_read, *args, plan=plan)
    dgrad = (case["w_down"], want[0], case["router_weights"], schedule, limit)
    want_dgrad = gemm_stages.down_dgrad_swiglu(rows.gather(x_read, schedule), *dgrad, plan=plan)
    flags = new_pull_flags(schedule.capacity // 16, x.device)
    per_rank = -(-x.shape[0] // world_size) + 1
    padded = torch.full((world_size * per_rank, x.shape[1]), float("nan"), dtype=x.dtype, device=x.device)
    padded[: x.shape[0]] = x
    buffers = [padded[p * per_rank:(p + 1) * per_rank].clone() for p in range(world_size)]
    addresses = [b.data_ptr() for b in buffers]
    table = torch.tensor(addresses, dtype=torch.int64, device=x.device)
    for aligned in {False, symm.vector_aligned(addresses, x.shape[1], 2)}:
        source = PeerTokens(table, per_rank, schedule.top_k, x.shape[1], x.dtype, aligned)
        for _ in range(2):  # the second call waits for the next epoch, not the first call's flags
            got = gemm_stages.gate_up_swiglu(torch.empty_like(x), *args, plan=plan, pull_from=source, pull_flags=flags,
                                             quant_block=quant_block)
            assert_bitwise_equal(got, want, "gate_up_swiglu pulling its rows")
        if quant_block:
            pulled = torch.full((schedule.capacity, x.shape[1]), float("nan"), dtype=x.dtype, device=x.device)
            got = gemm_stages.down_dgrad_swiglu(pulled, *dgrad, plan=plan, pull_from=source, pull_flags=flags,
                                                quant_block=quant_block)
            assert_bitwise_equal(got, want_dgrad, "down_dgrad_swiglu pulling and round-tripping its rows")
            used = int(schedule.expert_offsets[-1])  # the pull covers the used M-tiles
            assert_bitwise_equal(pulled[:used], rows.gather(x, schedule)[:used], "the rows as pulled")


@pytest.mark.parametrize("routing", ["random", "empty_experts", "one_expert", "one_token"])
@pytest.mark.parametrize("world_size", [1, 3])
@pytest.mark.parametrize("use_tma", TMA_CHOICES)
def test_gate_up_pulls_its_rows(routing, world_size, use_tma):
    check_pull(make_case(routing), world_size, use_tma)


@pytest.mark.parametrize("routing", ["random", "one_token"])
def test_pulls_round_trip_their_rows(routing):
    """mxfp8's staged GEMMs at EP with pull programs (Config.comm_sms_*): H = 48, a partial last block."""
    check_pull(make_case(routing, hidden=48), 3, TMA_CHOICES[0], limit=None, quant_block=32)


@pytest.mark.parametrize("routing", ["random", "empty_experts", "one_token"])
@pytest.mark.parametrize("world_size", [1, 3])
@pytest.mark.parametrize("stage", ["down", "gate_up_dgrad"])
@pytest.mark.parametrize("use_tma", TMA_CHOICES)
def test_push_from_epilogue(routing, world_size, stage, use_tma):
    check_push(make_case(routing), stage, world_size, use_tma)


@pytest.mark.parametrize("use_tma", TMA_CHOICES)
def test_shared_expert_dense_schedule(use_tma):
    """All four GEMMs on the shared expert's schedule (one expert, rows = tokens, rw = 1)."""
    case = make_dense_case()
    schedule, limit = case["schedule"], 0.75
    plan = triton_plan(use_tma)
    rows_ok = valid_rows(schedule)
    gate_up, h = gemm_stages.gate_up_swiglu(case["x"], case["w_gate"], case["w_up"], schedule, limit, plan=plan)
    ref_gate_up, ref_h = _forward_reference(case, limit)
    assert_close(gate_up, ref_gate_up, name="gate_up")
    assert_close(h, ref_h, rows_ok, "h")
    assert_close(gemm_stages.down(ref_h, case["w_down"], schedule, plan=plan),
                 stages.down(ref_h, case["w_down"], schedule), rows_ok, "down")
    d_y_rows = stages.gather(case["d_y"], schedule)
    args = (d_y_rows, case["w_down"], ref_gate_up, case["router_weights"], schedule, limit)
    for name, got, ref in zip(("d_gate_up", "h_weighted", "d_rw_rows"),
                              gemm_stages.down_dgrad_swiglu(*args, plan=plan), stages.down_dgrad_swiglu(*args)):
        assert_close(got, ref, rows_ok, name)
    d_gate_up = stages.down_dgrad_swiglu(*args)[0]
    assert_close(gemm_stages.gate_up_dgrad(d_gate_up, case["w_gate"], case["w_up"], schedule, plan=plan),
                 stages.gate_up_dgrad(d_gate_up, case["w_gate"], case["w_up"], schedule), rows_ok, "d_x_rows")


@pytest.mark.parametrize("limit", [None, 0.5])
def test_backward_recomputes_forward_h_exactly(limit):
    """With router weight 1, h_weighted of the down dgrad is bitwise the h the forward kernel stored."""
    case = make_case("random")
    schedule = case["schedule"]
    plan = triton_plan()
    gate_up, h = gemm_stages.gate_up_swiglu(case["x"], case["w_gate"], case["w_up"], schedule, limit, plan=plan)
    ones = torch.ones_like(case["router_weights"])
    d_y_rows = stages.gather(case["d_y"], schedule)
    _, h_weighted, _ = gemm_stages.down_dgrad_swiglu(d_y_rows, case["w_down"], gate_up, ones, schedule, limit,
                                                     plan=plan)
    rows_ok = valid_rows(schedule)
    assert_bitwise_equal(h_weighted[rows_ok], h[rows_ok], "h")


@pytest.mark.parametrize("use_tma", TMA_CHOICES)
def test_fp32_operands(use_tma):
    """fp32 operands: exact fp32 dot products, no rounding step, so the stages agree to fp32 accumulation order."""
    case = {k: v.float() if torch.is_tensor(v) and v.dtype == torch.bfloat16 else v
            for k, v in make_case("random").items()}
    schedule, limit = case["schedule"], 0.5
    rows_ok = valid_rows(schedule)
    plan = triton_plan(use_tma, torch.float32)

    def check(got, ref, name):
        if name != "gate_up":  # gate_up is packed: every row holds a source
            got, ref = got[rows_ok], ref[rows_ok]
        assert got.dtype == ref.dtype == torch.float32, name
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item(), msg=name)

    gate_up, h = gemm_stages.gate_up_swiglu(case["x"], case["w_gate"], case["w_up"], schedule, limit, plan=plan)
    ref_gate_up, ref_h = _forward_reference(case, limit)
    check(gate_up, ref_gate_up, "gate_up")
    check(h, ref_h, "h")
    check(gemm_stages.down(ref_h, case["w_down"], schedule, plan=plan),
          stages.down(ref_h, case["w_down"], schedule), "down")
    args = (stages.gather(case["d_y"], schedule), case["w_down"], ref_gate_up, case["router_weights"], schedule, limit)
    got, ref = gemm_stages.down_dgrad_swiglu(*args, plan=plan), stages.down_dgrad_swiglu(*args)
    for name, a, b in zip(("d_gate_up", "h_weighted", "d_rw_rows"), got, ref):
        check(a, b, name)
    check(gemm_stages.gate_up_dgrad(ref[0], case["w_gate"], case["w_up"], schedule, plan=plan),
          stages.gate_up_dgrad(ref[0], case["w_gate"], case["w_up"], schedule), "d_x_rows")


def test_tile_smaller_than_schedule_block():
    """A kernel M-tile may divide the schedule's block_m (each tile still has one expert)."""
    case = make_case("random", block_m=32)
    schedule = case["schedule"]
    tiles = TileConfig(16, 32, 32, group_m=3)
    plan = triton_plan(gate_up_tiles=tiles, down_tiles=tiles)
    gate_up, h = gemm_stages.gate_up_swiglu(case["x"], case["w_gate"], case["w_up"], schedule, None, plan=plan)
    ref_gate_up, ref_h = _forward_reference(case, None)
    assert_close(gate_up, ref_gate_up, name="gate_up")
    out = gemm_stages.down(ref_h, case["w_down"], schedule, plan=plan)
    assert_close(out, stages.down(ref_h, case["w_down"], schedule), valid_rows(schedule), "down")


@pytest.mark.parametrize("capability, version, interpret", [
    (None, "3.9", True), ((9, 0), "3.6", False), ((9, 0), "3.9", False), ((10, 0), "3.6", False)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hidden", [2048, 7168])
def test_choose_plan(capability, version, interpret, dtype, hidden):
    """choose_plan is a pure function of its inputs; every plan it returns is consistent; the Gluon engines
    are chosen only for bf16 on sm_90 with a Triton release in GLUON_VERSIONS."""
    target = Target(capability, version, interpret)
    plan = choose_plan(hidden, dtype, target)
    assert plan == choose_plan(hidden, dtype, target)
    for stage in STAGES:
        tiles = plan.tiles(stage)
        assert tiles.block_n % tiles.epi_split == 0 and tiles.epi_split in (1, 2, 4)
    gluon = capability == (9, 0) and version == "3.6" and dtype == torch.bfloat16
    engines = (plan.down_engine, plan.down_dgrad_engine, plan.gate_up_dgrad_engine)
    assert engines == (("cooperative", "pingpong", "cooperative") if gluon else ("triton",) * 3)
    assert plan.gate_up_engine == ("cooperative" if gluon and hidden <= 4096 else "triton")
    assert plan.use_tma == (capability is not None and not interpret)
    assert plan.pull_programs == 0


def test_plan_rejects_unknown_engines():
    with pytest.raises(ValueError, match="down_engine"):
        KernelPlan(down_engine="pingpong")
    with pytest.raises(ValueError, match="pull_programs"):
        KernelPlan(pull_programs=-1)
    with pytest.raises(ValueError, match="dgrad_pull_programs"):
        KernelPlan(dgrad_pull_programs=True)
    with pytest.raises(ValueError, match="minibatch_rows"):
        KernelPlan(minibatch_rows=0)


def test_pulling_gemms_take_their_tiles_minibatch_by_minibatch(monkeypatch):
    """A GEMM with pull programs groups its tile order by minibatch: KernelPlan.minibatch_rows in whole M-tiles,
    or MoK's rule (serval.plan) on the SMs left to compute."""
    from serval import plan

    monkeypatch.setattr(common, "num_sms", lambda *a: 132)
    schedule = build_schedule(torch.zeros(64, 2, dtype=torch.long), 4, 128)
    pull = in_gemm_pull.Pull(None, 20, 256, None, None)
    tiles = TileConfig(128, 128, 64)
    args = (schedule, 7168, 2048, torch.device("cpu"))
    assert gemm_stages._pulling_tiles(tiles, KernelPlan(minibatch_rows=512), pull, *args).group_m == 4
    rule = plan.layer_minibatch_rows(7168, 2048, 112, 128)
    assert gemm_stages._pulling_tiles(tiles, KernelPlan(), pull, *args).group_m == rule // 128 == 14


# ---------------------------------------------------------------- sm_90a, without a GPU

PULL_GEMM_CHILD = r"""
import sys
import torch
sys.path.insert(0, "tests")
from sm90 import compile_launch_in_this_child
from serval.kernels import in_gemm_pull, triton_gemm
from serval.peers import PeerTokens
from serval.plan import KernelPlan
from serval.schedule import build_schedule
from serval.values import new_pull_flags

hidden, inter, quant_block, E, N, P = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), 4, 256, 2
schedule = build_schedule(torch.stack([torch.arange(N) % E, (torch.arange(N) + 1) % E], 1), E, 128)
bf16 = dict(dtype=torch.bfloat16)
plan = KernelPlan()
source = PeerTokens(torch.zeros(P, dtype=torch.int64), N // P, 2, hidden, torch.bfloat16, True)
pull = in_gemm_pull.Pull(source, 8, plan.pull_block_c, *new_pull_flags(schedule.capacity // 128, "cpu"),
                         quant_block)
compile_launch_in_this_child(triton_gemm, "_grouped_gemm_kernel", lambda: triton_gemm.gate_up_swiglu(
    torch.zeros(schedule.capacity, hidden, **bf16), torch.zeros(E, inter, hidden, **bf16),
    torch.zeros(E, inter, hidden, **bf16), schedule, 7.0, plan.gate_up_tiles, True, pull=pull), sys.argv[4])
"""


@pytest.mark.skipif(CUDA, reason="the GPU tests run the kernel itself")
@pytest.mark.parametrize("quant_block", [0, 32])
def test_gate_up_with_pull_programs_compiles_for_sm90a(quant_block, tmp_path):
    """The gate/up GEMM with pull programs (the dispatch inside the GEMM at EP), with the plan's Hopper tiles,
    compiles for sm_90a with its wgmma pipelined: no printf in it on the GPU (ptxas's C7510 warning would say
    that a function call serialized every wgmma of the kernel), spilling nothing; also with the pull's mxfp8 round
    trip (64-column steps)."""
    from sm90 import compile_in_child

    shared, report = compile_in_child(PULL_GEMM_CHILD, [512, 256, quant_block], tmp_path)
    assert shared <= 232448, f"{shared} bytes of shared memory"
    assert "C7510" not in report, report
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", report)]
    assert spills and max(spills) == 0, report


# ---------------------------------------------------------------- GPU, real sizes

GPU_SHAPE = dict(num_tokens=4096, top_k=8, num_experts=8, hidden=2048, inter=768)


def _gpu_case(how="random", seed=0):
    s = GPU_SHAPE
    routing = (s["num_tokens"], s["top_k"], s["num_experts"], how)
    return make_case(routing, block_m=128, hidden=s["hidden"], inter=s["inter"], seed=seed, device="cuda")


@needs_cuda
@pytest.mark.parametrize("how", ["random", "last_expert"])
@pytest.mark.parametrize("use_tma", [True, False])
def test_gpu_all_stages(how, use_tma):
    case = _gpu_case(how)
    schedule, limit = case["schedule"], 7.0
    rows_ok = valid_rows(schedule)

    def check(got, ref, name):
        if name != "gate_up":  # gate_up is packed: every row holds a source
            got, ref = got[rows_ok], ref[rows_ok]
        assert not torch.isnan(got).any(), name
        assert rel_err(got, ref) < 1e-2, f"{name}: rel err {rel_err(got, ref)}"

    ref_gate_up, ref_h = _forward_reference(case, limit)
    plan = triton_plan(use_tma)
    gate_up, h = run_twice(gemm_stages.gate_up_swiglu, case["x"], case["w_gate"], case["w_up"], schedule, limit,
                           plan=plan)
    check(gate_up, ref_gate_up, "gate_up")
    check(h, ref_h, "h")
    check(run_twice(gemm_stages.down, ref_h, case["w_down"], schedule, plan=plan),
          stages.down(ref_h, case["w_down"], schedule), "down")
    d_y_rows = stages.gather(case["d_y"], schedule)
    args = (d_y_rows, case["w_down"], ref_gate_up, case["router_weights"], schedule, limit)
    ref = stages.down_dgrad_swiglu(*args)
    for epilogue_io in EPILOGUE_IO:
        got = run_twice(gemm_stages.down_dgrad_swiglu, *args, plan=_dgrad_plan(epilogue_io, use_tma))
        for name, a, b in zip(("d_gate_up", "h_weighted", "d_rw_rows"), got, ref):
            check(a, b, f"{name} ({epilogue_io})")
    check(run_twice(gemm_stages.gate_up_dgrad, ref[0], case["w_gate"], case["w_up"], schedule, plan=plan),
          stages.gate_up_dgrad(ref[0], case["w_gate"], case["w_up"], schedule), "d_x_rows")


@needs_cuda
@pytest.mark.parametrize("how,quant_block", [("random", 0), ("last_expert", 0), ("random", 32)])
def test_gpu_gate_up_pulls_its_rows(how, quant_block):
    check_pull(_gpu_case(how), world_size=4, use_tma=True, limit=7.0, quant_block=quant_block)


@needs_cuda
@pytest.mark.parametrize("stage", ["down", "gate_up_dgrad"])
def test_gpu_push_from_epilogue(stage):
    check_push(_gpu_case(), stage, world_size=4, use_tma=True)


@needs_cuda
def test_gpu_rows():
    case = _gpu_case()
    schedule = case["schedule"]
    assert torch.equal(run_twice(rows.gather, case["x"], schedule), stages.gather(case["x"], schedule))
    expert_out = stages.gather(case["d_y"], schedule)
    for shared in (None, case["x"]):
        y = run_twice(rows.combine, expert_out, case["router_weights"], schedule, shared)
        assert rel_err(y, stages.combine(expert_out, case["router_weights"], schedule, shared)) < 1e-2
        d_x = run_twice(rows.sum_slots, expert_out, schedule, shared)
        assert rel_err(d_x, stages.sum_slots(expert_out, schedule, shared)) < 1e-2


@triton.jit
def _sigmoid_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n)
    tl.store(out_ptr + offsets, swiglu.sigmoid(x), mask=offsets < n)


def test_swiglu_sigmoid():
    """The epilogues' sigmoid (ex2 + rcp special-function ops on the GPU, tl.sigmoid in the interpreter) against
    torch.sigmoid in fp64: a few ulps relative, plus the rounding of x * log2(e) in fp32 (|x| * 6e-8 relative)
    on the GPU; absolute where fp32 underflows (subnormal results flush to zero); the ends exact, NaN kept."""
    device = "cuda" if CUDA else "cpu"
    x = torch.cat([torch.linspace(-100, 100, 20001), torch.randn(4000) * 4,
                   torch.tensor([0.0, -0.0, 88.0, -88.0, 104.0, -104.0, 1e30, -1e30, float("inf"), float("-inf"),
                                 float("nan")])]).to(device)
    out = torch.full_like(x, -1.0)
    _sigmoid_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    ref = torch.sigmoid(x.double())
    finite = ~x.isnan()
    err = (out[finite].double() - ref[finite]).abs()
    tol = (1e-6 + 1e-7 * x[finite].double().abs().clamp(max=200)) * ref[finite] + 1e-30
    assert (err <= tol).all(), err.max()
    assert out[x == float("inf")].item() == 1.0 and out[x == float("-inf")].item() == 0.0
    assert out[x.isnan()].isnan().all()
