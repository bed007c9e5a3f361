"""The block-scaled FP8 grouped GEMMs (serval.kernels.fp8_gemm): the Triton engine against a float64 emulation of
the recipe (CPU interpreter on small shapes, and the GPU), routings with empty experts, one expert, one token,
k = 1, sizes that are not multiples of 128; the Gluon engine against the Triton engine on the H200 (GPU only)."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import CUDA, make_routing, requires_cuda
from serval.kernels import fp8_gemm, gluon_common
from serval.schedule import build_schedule

FP8_MAX = 448.0
DEVICE = "cuda" if CUDA else "cpu"


# ---------------------------------------------------------------- operands (a local stand-in for serval.ops.quantize)


def quantize_blocks(v: torch.Tensor, block_rows: int, block_cols: int):
    """Block-scaled e4m3 of v [..., rows, cols]: per (block_rows x block_cols) block s = max(amax, 1e-12) / 448
    (fp32), data = (v / s).clamp(+-448) in e4m3. Returns (data, scale [..., ceil(rows/br), ceil(cols/bc)])."""
    v = v.float()
    *lead, rows, cols = v.shape
    rb, cb = math.ceil(rows / block_rows), math.ceil(cols / block_cols)
    padded = torch.zeros(*lead, rb * block_rows, cb * block_cols, dtype=torch.float32, device=v.device)
    padded[..., :rows, :cols] = v
    blocks = padded.view(*lead, rb, block_rows, cb, block_cols)
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., rb, cb]
    scale = amax.clamp_min(1e-12) / FP8_MAX
    full = scale.repeat_interleave(block_rows, -2).repeat_interleave(block_cols, -1)[..., :rows, :cols]
    data = (v / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return data, scale.contiguous()


def dequantize_blocks(data: torch.Tensor, scale: torch.Tensor, block_rows: int, block_cols: int) -> torch.Tensor:
    rows, cols = data.shape[-2:]
    full = scale.double().repeat_interleave(block_rows, -2).repeat_interleave(block_cols, -1)[..., :rows, :cols]
    return data.double() * full


def routed_rows(schedule, cols, gen, device):
    """[R, cols] float rows: random on rows holding a source, zero on padding rows."""
    v = torch.randn(schedule.capacity, cols, generator=gen)
    v[schedule.row_source.cpu() < 0] = 0
    return v.to(device)


def reference_gemm(a_data, a_scale, b_data, b_scale, schedule):
    """float64 (out [R, N], |a| @ |b|^T [R, N], used rows): rows past expert_offsets[E] are not compared."""
    a = dequantize_blocks(a_data, a_scale, 1, 128)
    b = dequantize_blocks(b_data, b_scale, 128, 128)
    offsets = schedule.expert_offsets.tolist()
    out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float64, device=a.device)
    size = torch.zeros_like(out)
    for e in range(schedule.num_experts):
        out[offsets[e]:offsets[e + 1]] = a[offsets[e]:offsets[e + 1]] @ b[e].T
        size[offsets[e]:offsets[e + 1]] = a[offsets[e]:offsets[e + 1]].abs() @ b[e].T.abs()
    return out, size, offsets[-1]


def reference_wgrad(a_data, a_scale, b_data, b_scale, schedule):
    """float64 (out [E, M, N], |a| @ |b|^T over each segment)."""
    a = dequantize_blocks(a_data, a_scale, 1, 128)
    b = dequantize_blocks(b_data, b_scale, 1, 128)
    offsets = schedule.expert_offsets.tolist()
    segments = [(a[:, offsets[e]:offsets[e + 1]], b[:, offsets[e]:offsets[e + 1]])
                for e in range(schedule.num_experts)]
    return (torch.stack([x @ y.T for x, y in segments]), torch.stack([x.abs() @ y.abs().T for x, y in segments]))


def assert_close(got, ref, size, what):
    """A bf16 result of an fp32-accumulated sum: within one bf16 unit of the exact value (one rounding, to
    nearest in the interpreter too: `common.to_dtype`), plus 2^-12 of the sum of |products| for the fp32
    accumulation and the fp8 MMA's limited internal accumulator precision."""
    assert not got.isnan().any(), f"{what}: NaN (unwritten) elements"
    err = (got.double() - ref).abs()
    bound = ref.abs() * 2 ** -7 + size * 2 ** -12 + 1e-30
    excess = (err / bound).max().item() if err.numel() else 0.0
    assert excess <= 1, f"{what}: max error {err.max().item():.3g}, {excess:.3g}x the bound"


# ---------------------------------------------------------------- cases

CASES = {
    "random": dict(tokens=48, experts=4, top_k=2, kind="random", k=256, n=256),
    "ragged K and N": dict(tokens=40, experts=3, top_k=2, kind="random", k=320, n=200),
    "empty experts": dict(tokens=30, experts=6, top_k=2, kind="empty", k=160, n=144),
    "one expert, k=1": dict(tokens=70, experts=4, top_k=1, kind="one", k=128, n=96),
    "one token": dict(tokens=1, experts=4, top_k=2, kind="random", k=48, n=64),
}


def make_case(tokens, experts, top_k, kind, k, n, block_m=128, seed=0):
    gen = torch.Generator().manual_seed(seed)
    _, ids = make_routing(tokens, experts, top_k, kind=kind, seed=seed)
    schedule = build_schedule(ids.to(DEVICE), experts, block_m)
    a_data, a_scale = quantize_blocks(routed_rows(schedule, k, gen, DEVICE), 1, 128)
    # weights with a spread of magnitudes across blocks, so the scales matter
    w = torch.randn(experts, n, k, generator=gen) * torch.rand(experts, 1, k, generator=gen).add(0.05)
    b_data, b_scale = quantize_blocks(w.to(DEVICE), 128, 128)
    return schedule, a_data, a_scale, b_data, b_scale


@pytest.mark.parametrize("case", CASES)
def test_grouped_gemm_matches_emulation(case):
    schedule, a_data, a_scale, b_data, b_scale = make_case(**CASES[case])
    out = torch.full((schedule.capacity, b_data.shape[1]), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    got = fp8_gemm.grouped_gemm(a_data, a_scale, b_data, b_scale, schedule, out=out, engine="triton")
    assert got is out
    ref, size, used = reference_gemm(a_data, a_scale, b_data, b_scale, schedule)
    assert_close(got[:used], ref[:used], size[:used], case)


def test_grouped_gemm_block_m_256_and_default_out():
    schedule, a_data, a_scale, b_data, b_scale = make_case(**CASES["random"], block_m=256)
    got = fp8_gemm.grouped_gemm(a_data, a_scale, b_data, b_scale, schedule)
    ref, size, used = reference_gemm(a_data, a_scale, b_data, b_scale, schedule)
    assert got.dtype == torch.bfloat16 and got.shape == (schedule.capacity, b_data.shape[1])
    assert_close(got[:used], ref[:used], size[:used], "block_m 256")


def test_grouped_gemm_scales_apply_per_block():
    """Each 128-K block of a row, and each 128 x 128 weight block, carries its own scale."""
    schedule, a_data, a_scale, b_data, b_scale = make_case(**CASES["ragged K and N"])
    a_scale = a_scale * torch.tensor([1.0, 2.0 ** 10, 2.0 ** -7], device=DEVICE)
    b_scale = b_scale * torch.tensor([[2.0 ** -5], [2.0 ** 6]], device=DEVICE)
    got = fp8_gemm.grouped_gemm(a_data, a_scale, b_data, b_scale, schedule, engine="triton")
    ref, size, used = reference_gemm(a_data, a_scale, b_data, b_scale, schedule)
    assert_close(got[:used], ref[:used], size[:used], "scaled blocks")


def test_grouped_gemm_deterministic():
    schedule, a_data, a_scale, b_data, b_scale = make_case(**CASES["ragged K and N"])
    first = fp8_gemm.grouped_gemm(a_data, a_scale, b_data, b_scale, schedule)
    second = fp8_gemm.grouped_gemm(a_data, a_scale, b_data, b_scale, schedule)
    used = int(schedule.expert_offsets[-1])
    assert torch.equal(first[:used], second[:used])


@pytest.mark.parametrize("case", CASES)
def test_weight_grad_matches_emulation(case):
    cfg = CASES[case]
    schedule, *_ = make_case(**cfg)
    gen = torch.Generator().manual_seed(1)
    m, n = cfg["n"], cfg["k"] - 16  # any M, N (rows of the along-tokens operands)
    a_data, a_scale = quantize_blocks(routed_rows(schedule, m, gen, DEVICE).T.contiguous(), 1, 128)
    b_data, b_scale = quantize_blocks(routed_rows(schedule, n, gen, DEVICE).T.contiguous(), 1, 128)
    got = fp8_gemm.weight_grad(a_data, a_scale, b_data, b_scale, schedule, engine="triton")
    assert got.shape == (schedule.num_experts, m, n) and got.dtype == torch.bfloat16
    ref, size = reference_wgrad(a_data, a_scale, b_data, b_scale, schedule)
    assert_close(got, ref, size, case)
    counts = schedule.tokens_per_expert.tolist()
    for e, count in enumerate(counts):
        if count == 0:
            assert torch.equal(got[e], torch.zeros_like(got[e])), f"expert {e} has no rows: zeros expected"
    if case == "empty experts":
        assert 0 in counts
    again = fp8_gemm.weight_grad(a_data, a_scale, b_data, b_scale, schedule, engine="triton")
    assert torch.equal(got, again)


WINDOW_CASES = {  # tokens, experts, top_k, kind: an expert of 3 M-tiles (a window carries in and out), the others
    "skewed": (260, 4, 2, "skewed"),  # ragged
    "one expert, k=1": (300, 3, 1, "one"),  # empty
}


def window_case(case, m=48, n=40):
    """A schedule and weight-gradient operands (a [m, R], b [n, R] quantized along R) for WINDOW_CASES[case]."""
    tokens, experts, top_k, kind = WINDOW_CASES[case]
    schedule = build_schedule(make_routing(tokens, experts, top_k, kind=kind)[1].to(DEVICE), experts, 128)
    gen = torch.Generator().manual_seed(1)
    operands = (*quantize_blocks(routed_rows(schedule, m, gen, DEVICE).T.contiguous(), 1, 128),
                *quantize_blocks(routed_rows(schedule, n, gen, DEVICE).T.contiguous(), 1, 128))
    return schedule, operands


def windowed_weight_grad(a_data, a_scale, b_data, b_scale, schedule, rows, **kwargs):
    """fp8_gemm.weight_grad window by window over `rows` rows (serval.schedule.windows), each window's operands
    copied out as the macrobatch ring quantizes them (contiguous [M, window rows]); checks that each launch writes
    only its FINISH experts' outputs, every expert's exactly once, and never its carry_in."""
    from serval.values import WgradWindow
    from serval.schedule import CARRY_OUT, FINISH, windows

    m, n, E = a_data.shape[0], b_data.shape[0], schedule.num_experts
    out = torch.full((E, m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    carries = [torch.full((m, n), float("nan"), device=DEVICE) for _ in range(2)]
    finished = torch.zeros(E, dtype=torch.int64)
    for j, w in enumerate(windows(schedule, rows)):
        cols = slice(w.start, w.start + w.schedule.capacity)
        blocks = slice(w.start // 128, (w.start + w.schedule.capacity) // 128)
        a, b = (t[:, cols].contiguous() for t in (a_data, b_data))
        sa, sb = (t[:, blocks].contiguous() for t in (a_scale, b_scale))
        window = WgradWindow(w.expert_phase, carries[j % 2], carries[(j + 1) % 2], (out,))
        before, carry_in = out.clone(), window.carry_in.clone()
        assert fp8_gemm.weight_grad(a, sa, b, sb, w.schedule, window=window, **kwargs) is out
        phase = w.expert_phase.cpu()
        done = ((phase & FINISH) != 0).to(DEVICE)
        assert torch.equal(out[~done].view(torch.int16), before[~done].view(torch.int16)), f"window {j}"
        assert not out[done].isnan().any(), f"window {j} left a finished expert's gradient unwritten"
        assert torch.equal(window.carry_in.view(torch.int32), carry_in.view(torch.int32)), f"window {j}"
        if (phase & CARRY_OUT).any():
            assert not window.carry_out.isnan().any(), f"window {j} left part of its carry_out unwritten"
        finished += (phase & FINISH) != 0
    assert torch.equal(finished, torch.ones(E, dtype=torch.int64)), finished
    return out


@pytest.mark.parametrize("case", WINDOW_CASES)
def test_weight_grad_windows_bitwise_one_pass(case):
    """The macrobatch ring's windows (1 and 2 M-tiles, and one window of everything) give the one launch's bits:
    the sums carried in fp32 from window to window, the K steps in the same order."""
    from serval.values import WgradWindow
    from serval.schedule import windows

    schedule, operands = window_case(case)
    one_pass = fp8_gemm.weight_grad(*operands, schedule, engine="triton")
    for rows in (128, 256, schedule.capacity + 128):
        got = windowed_weight_grad(*operands, schedule, rows, engine="triton")
        assert torch.equal(got, one_pass), f"windows of {rows} rows: not the one-pass bits"
    transposed = torch.zeros(40, 48, device=DEVICE)
    bad = WgradWindow(windows(schedule, schedule.capacity)[0].expert_phase, transposed, transposed.clone(),
                      (torch.zeros(schedule.num_experts, 48, 40, dtype=torch.bfloat16, device=DEVICE),))
    with pytest.raises(ValueError, match="carry_in"):
        fp8_gemm.weight_grad(*operands, schedule, window=bad)


def test_validation_errors():
    schedule, a_data, a_scale, b_data, b_scale = make_case(**CASES["random"])
    gg = fp8_gemm.grouped_gemm
    with pytest.raises(ValueError, match="a_data"):
        gg(a_data.float(), a_scale, b_data, b_scale, schedule)
    with pytest.raises(ValueError, match="a_scale"):
        gg(a_data, a_scale[:, :1], b_data, b_scale, schedule)
    with pytest.raises(ValueError, match="b_scale"):
        gg(a_data, a_scale, b_data, b_scale.double(), schedule)
    with pytest.raises(ValueError, match="b_data"):
        gg(a_data, a_scale, b_data[:, :, :128], b_scale, schedule)
    with pytest.raises(ValueError, match="multiple of 16"):
        gg(a_data[:, :40], a_scale[:, :1], b_data[:, :, :40], b_scale[:, :, :1], schedule)
    with pytest.raises(ValueError, match="out"):
        gg(a_data, a_scale, b_data, b_scale, schedule, out=torch.empty(3, 3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="engine"):
        gg(a_data, a_scale, b_data, b_scale, schedule, engine="cublas")
    if not gluon_common.available():
        with pytest.raises(ValueError, match="gluon"):
            gg(a_data, a_scale, b_data, b_scale, schedule, engine="gluon")
    with pytest.raises(ValueError, match="block_m"):
        small = build_schedule(make_routing(8, 2, 1)[1].to(DEVICE), 2, 64)
        x = torch.zeros(8, small.capacity, device=DEVICE).to(torch.float8_e4m3fn)
        s = torch.ones(8, 1, device=DEVICE)
        fp8_gemm.weight_grad(x, s, x, s, small)


# ---------------------------------------------------------------- GPU: the Gluon engine against the Triton engine

requires_gluon = pytest.mark.skipif(not gluon_common.available(),
                                    reason="the Gluon FP8 engine needs an sm_90 GPU and Triton 3.6")

GPU_CASES = {
    "kimi gate/up": dict(tokens=2048, experts=8, top_k=2, kind="random", k=7168, n=4096),
    "kimi down": dict(tokens=2048, experts=8, top_k=2, kind="random", k=2048, n=7168),
    "ragged": dict(tokens=333, experts=6, top_k=2, kind="empty", k=320, n=200),
    "one expert": dict(tokens=300, experts=4, top_k=1, kind="one", k=256, n=384),
    "one token": dict(tokens=1, experts=4, top_k=2, kind="random", k=128, n=128),
    "narrow": dict(tokens=200, experts=3, top_k=2, kind="random", k=48, n=136),  # weight_grad's N = 48: 64-wide tiles
}


def assert_engines_agree(got, want, what):
    """The engines run the same instruction sequence per element (fp8 wgmma from zero per 128-K step, one fp32
    fma promotion, one bf16 rounding), so they should agree bit for bit; a different wgmma N-width between
    them could change the MMA's internal rounding, so one bf16 rounding step is tolerated (and reported)."""
    assert not got.isnan().any(), f"{what}: NaN (unwritten) elements"
    diff = (got.float() - want.float()).abs()
    assert (diff <= want.float().abs() * 2 ** -8 + 1e-30).all(), (
        f"{what}: {(diff > 0).sum().item()} elements differ, max {diff.max().item():.3g}")


@requires_cuda
@pytest.mark.parametrize("case", ["kimi gate/up", "ragged"])
def test_triton_engine_on_gpu_matches_emulation(case):
    schedule, a_data, a_scale, b_data, b_scale = make_case(**GPU_CASES[case])
    got = fp8_gemm.grouped_gemm(a_data, a_scale, b_data, b_scale, schedule, engine="triton")
    ref, size, used = reference_gemm(a_data, a_scale, b_data, b_scale, schedule)
    assert_close(got[:used], ref[:used], size[:used], case)


@requires_gluon
@pytest.mark.parametrize("case", GPU_CASES)
def test_gluon_grouped_gemm_matches_triton(case):
    schedule, a_data, a_scale, b_data, b_scale = make_case(**GPU_CASES[case])
    n = b_data.shape[1]
    out = torch.full((schedule.capacity, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    got = fp8_gemm.grouped_gemm(a_data, a_scale, b_data, b_scale, schedule, out=out, engine="gluon")
    want = fp8_gemm.grouped_gemm(a_data, a_scale, b_data, b_scale, schedule, engine="triton")
    used = int(schedule.expert_offsets[-1])
    assert_engines_agree(got[:used], want[:used], case)
    again = fp8_gemm.grouped_gemm(a_data, a_scale, b_data, b_scale, schedule, engine="gluon")
    assert torch.equal(got[:used], again[:used])


@requires_gluon
@pytest.mark.parametrize("case", GPU_CASES)
def test_gluon_weight_grad_matches_triton(case):
    cfg = GPU_CASES[case]
    schedule, *_ = make_case(**cfg)
    gen = torch.Generator().manual_seed(1)
    m, n = cfg["n"], cfg["k"]
    a_data, a_scale = quantize_blocks(routed_rows(schedule, m, gen, "cuda").T.contiguous(), 1, 128)
    b_data, b_scale = quantize_blocks(routed_rows(schedule, n, gen, "cuda").T.contiguous(), 1, 128)
    got = fp8_gemm.weight_grad(a_data, a_scale, b_data, b_scale, schedule, engine="gluon")
    want = fp8_gemm.weight_grad(a_data, a_scale, b_data, b_scale, schedule, engine="triton")
    assert_engines_agree(got, want, case)
    assert torch.equal(got, fp8_gemm.weight_grad(a_data, a_scale, b_data, b_scale, schedule, engine="gluon"))


@requires_gluon
@pytest.mark.parametrize("case", WINDOW_CASES)
def test_gluon_weight_grad_windows_bitwise_one_pass(case):
    """The Gluon engine window by window (its carries loaded into and stored from the wgmma accumulator's layout)
    gives its own one-launch bits; 128-wide and 64-wide N tiles."""
    for m, n in ((1024, 768), (256, 48)):
        schedule, operands = window_case(case, m, n)
        one_pass = fp8_gemm.weight_grad(*operands, schedule, engine="gluon")
        for rows in (128, 256):
            got = windowed_weight_grad(*operands, schedule, rows, engine="gluon")
            assert torch.equal(got, one_pass), f"{m} x {n}, windows of {rows} rows: not the one-pass bits"


@requires_gluon
def test_auto_engine_is_gluon_on_hopper(monkeypatch):
    from serval.kernels import gluon_fp8
    calls = []
    real = gluon_fp8.grouped_gemm
    monkeypatch.setattr(gluon_fp8, "grouped_gemm", lambda *a: calls.append(1) or real(*a))
    schedule, a_data, a_scale, b_data, b_scale = make_case(**GPU_CASES["one token"])
    fp8_gemm.grouped_gemm(a_data, a_scale, b_data, b_scale, schedule)
    assert calls == [1]


# ---------------------------------------------------------------- the SwiGLU row passes that quantize their outputs

ROW_PASS_CASES = {  # (tokens, experts, top_k, kind, inter, scale block, scale format, swiglu_limit)
    "random": (48, 4, 2, "random", 256, 128, "fp32", None),
    "empty experts, limit": (30, 6, 2, "empty", 128, 128, "fp32", 0.5),
    "one expert, k=1": (70, 4, 1, "one", 128, 128, "fp32", None),
    "one token": (1, 4, 2, "random", 256, 128, "fp32", 7.0),
    "e8m0 blocks of 32": (40, 3, 2, "random", 96, 32, "e8m0", None),
}


def _row_pass_case(tokens, experts, top_k, kind, inter, block, scale_format, limit, device, seed=0):
    from serval.ops import quantize

    gen = torch.Generator().manual_seed(seed)
    router_weights, ids = make_routing(tokens, experts, top_k, kind=kind, seed=seed)
    schedule = build_schedule(ids.to(device), experts, 128)
    gate_up_rows = (routed_rows(schedule, 2 * inter, gen, device) * 2).bfloat16()
    gate_up_rows[1 % gate_up_rows.shape[0], :block] = 0  # a zero block
    d_h_raw = routed_rows(schedule, inter, gen, device).bfloat16()
    row_rw = torch.rand(schedule.capacity, generator=gen).to(device)
    kept = quantize(gate_up_rows[torch.as_tensor(_packed_rows(schedule))], block=(1, block),
                    scale_format=scale_format)[0]
    return schedule, gate_up_rows, d_h_raw, row_rw, kept


def _packed_rows(schedule):
    from serval.schedule import packed_rows
    return packed_rows(schedule)


def _assert_quantized_equal(got, want, rows, what):
    assert got.block == want.block and got.transposed == want.transposed, what
    assert torch.equal(got.data[rows].view(torch.uint8), want.data[rows].view(torch.uint8)), f"{what}: data"
    assert torch.equal(got.scale[rows].view(torch.uint8), want.scale[rows].view(torch.uint8)), f"{what}: scale"


@pytest.mark.parametrize("case", ROW_PASS_CASES)
def test_swiglu_row_passes_quantize_as_the_quantizer(case):
    """The FP8 SwiGLU row passes (serval.kernels.swiglu_rows) give bit for bit the torch stages' outputs: h and
    d_gate_up, their quantized copies along the row (serval.ops.quantize's rule), the kept pre-activations in
    packed rows, and d_rw_rows within fp32 rounding (its sum runs in another order); twice the same bits."""
    from serval import stages
    from serval.kernels import swiglu_rows
    from serval.schedule import packed_index

    *_, inter, block, scale_format, limit = ROW_PASS_CASES[case]
    schedule, gate_up_rows, d_h_raw, row_rw, kept = _row_pass_case(*ROW_PASS_CASES[case], DEVICE)
    want = stages.swiglu_fp8(gate_up_rows, schedule, limit, block, scale_format)
    runs = [swiglu_rows.swiglu_fp8(gate_up_rows, schedule, limit, block, scale_format) for _ in range(2)]
    used = packed_index(schedule) >= 0
    for got in runs:
        assert torch.equal(got[0], want[0]), "h"
        _assert_quantized_equal(got[1], want[1], slice(None), "h rows")
        _assert_quantized_equal(got[2], want[2], slice(0, int(used.sum())), "kept gate_up")
    assert torch.equal(runs[0][2].data[:int(used.sum())].view(torch.uint8),
                       kept.data[:int(used.sum())].view(torch.uint8))

    want_d = stages.swiglu_backward_fp8(d_h_raw, kept, schedule, row_rw, limit)
    runs = [swiglu_rows.swiglu_backward_fp8(d_h_raw, kept, schedule, row_rw, limit) for _ in range(2)]
    for got in runs:
        assert torch.equal(got[0][used], want_d[0][used]), "d_gate_up"
        _assert_quantized_equal(got[1], want_d[1], used, "d_gate_up rows")
        torch.testing.assert_close(got[2][used], want_d[2][used], rtol=1e-5, atol=1e-6)
    assert torch.equal(runs[0][2], runs[1][2]), "d_rw_rows run to run"


def test_swiglu_row_passes_need_whole_blocks():
    from serval.kernels import swiglu_rows

    schedule, gate_up_rows, *_ = _row_pass_case(8, 2, 1, "random", 128, 128, "fp32", None, DEVICE)
    with pytest.raises(ValueError, match="multiple of the scale block 128"):
        swiglu_rows.swiglu_fp8(gate_up_rows[:, :192], schedule, None, 128, "fp32")
