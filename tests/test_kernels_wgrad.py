"""The grouped weight-gradient kernel (serval.kernels.weight_grad) against serval.stages.

CPU: run under TRITON_INTERPRET=1 (tiny shapes, block_m 16/32); the lead's conftest sets it, with
SERVAL_POISON_OUTPUTS=1 so an output element the kernel never writes shows up as NaN.
GPU: the same checks at block_m 128, plus real-size bf16 cases (relative error < 1e-2).
"""

from __future__ import annotations

import pytest
import torch

from serval import stages
from serval.kernels import common
from serval.plan import WGRAD_CONFIGS
from serval.schedule import build_schedule

wg = pytest.importorskip("serval.kernels.weight_grad")

ON_GPU = torch.cuda.is_available() and not common.INTERPRET
if not (ON_GPU or common.INTERPRET):
    pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1", allow_module_level=True)

DEVICE = "cuda" if ON_GPU else "cpu"
BLOCK_M = 128 if ON_GPU else 16
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (sm_90)")


def _routing(kind: str, n: int, k: int, e: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "random":  # k distinct experts per token, uniformly
        return torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)])
    if kind == "empty":  # only the odd experts get tokens: the even ones must come out exactly zero
        used = torch.arange(1, e, 2)
        return torch.stack([used[torch.randperm(len(used), generator=gen)[:k]] for _ in range(n)])
    if kind == "one_expert":  # every token on expert e-2 (k must be 1)
        return torch.full((n, k), e - 2)
    if kind == "skewed":  # Zipf-like: expert j drawn with weight 1/(j+1)
        probs = 1.0 / torch.arange(1, e + 1, dtype=torch.float64)
        return torch.stack([torch.multinomial(probs, k, replacement=False, generator=gen) for _ in range(n)])
    raise ValueError(kind)


def _case(kind, n, k, e, p, q, dtype=torch.float32, block_m=BLOCK_M, seed=0):
    """A schedule and backward-like operands: a [R, p] routed rows (zero padding rows), x [n, q] tokens."""
    gen = torch.Generator().manual_seed(seed)
    ids = _routing(kind, n, k, e, gen)
    schedule = build_schedule(ids.to(DEVICE), e, block_m=block_m)
    x = torch.randn(n, q, generator=gen).to(DEVICE, dtype)
    a_tokens = torch.randn(n * k, p, generator=gen).to(DEVICE, dtype)
    source = schedule.row_source.long()
    a = torch.where((source >= 0)[:, None], a_tokens[source.clamp(min=0)], 0).to(dtype)
    return schedule, a, x


def _check_close(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not torch.isnan(out).any(), "unwritten (NaN-poisoned) or NaN output"
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)
    else:  # bf16: one rounding of the output, sums in a different order
        rel = ((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30)).item()
        assert rel < 1e-2, rel
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.float().abs().max().item())


def _assert_empty_experts_zero(outs, schedule):
    empty = (schedule.tokens_per_expert == 0).nonzero().flatten().tolist()
    for out in outs:
        for e in empty:
            assert torch.equal(out[e], torch.zeros_like(out[e])), f"expert {e} has no rows but nonzero grad"


CASES = [  # kind, N, k, E, P(=I), Q(=H)
    ("random", 24, 2, 5, 40, 48),
    ("empty", 20, 2, 6, 48, 80),
    ("one_expert", 30, 1, 4, 48, 40),
    ("random", 17, 1, 3, 32, 32),  # k = 1
    ("random", 1, 2, 4, 48, 80),  # one token
    ("skewed", 40, 3, 8, 24, 56),
]


@pytest.mark.parametrize("kind,n,k,e,i,h", CASES)
def test_gate_up_weight_grad(kind, n, k, e, i, h):
    schedule, d_gate_up, x = _case(kind, n, k, e, 2 * i, h)
    d_w_gate, d_w_up = wg.gate_up_weight_grad(d_gate_up, x, schedule)
    ref_gate, ref_up = stages.gate_up_weight_grad(d_gate_up, x, schedule)
    assert d_w_gate.is_contiguous() and d_w_up.is_contiguous()
    _check_close(d_w_gate, ref_gate, torch.float32)
    _check_close(d_w_up, ref_up, torch.float32)
    _assert_empty_experts_zero((d_w_gate, d_w_up), schedule)


@pytest.mark.parametrize("kind,n,k,e,i,h", CASES)
def test_down_weight_grad(kind, n, k, e, i, h):
    schedule, d_y_rows, _ = _case(kind, n, k, e, h, 1, seed=1)
    h_weighted = torch.randn(schedule.capacity, i, device=DEVICE) * (schedule.row_source >= 0)[:, None]
    ref = stages.down_weight_grad(d_y_rows, h_weighted, schedule)
    for flatten in (True, False):  # the one-loop and the loop-per-tile kernels
        out = wg.grouped_wgrad(d_y_rows, h_weighted, schedule, flatten=flatten)[0]
        _check_close(out, ref, torch.float32)
        _assert_empty_experts_zero((out,), schedule)
    assert torch.equal(wg.down_weight_grad(d_y_rows, h_weighted, schedule), out)


@pytest.mark.parametrize("block_m", [16, 32] if not ON_GPU else [128])
@pytest.mark.parametrize("use_tma", [False, True])
def test_variants_bitwise_equal(block_m, use_tma):
    """LPT vs plain order, the stage vs the kernel, repeated runs: identical bits."""
    schedule, d_gate_up, x = _case("skewed", 33, 2, 6, 2 * 40, 48, block_m=block_m, seed=3)
    x_rows = stages.gather(x, schedule)
    first = wg.grouped_wgrad(d_gate_up, x_rows, schedule, num_outputs=2, use_tma=use_tma)
    again = wg.grouped_wgrad(d_gate_up, x_rows, schedule, num_outputs=2, use_tma=use_tma)
    plain_order = wg.grouped_wgrad(d_gate_up, x_rows, schedule, num_outputs=2, use_tma=use_tma, lpt=False)
    for other in (again, plain_order):
        assert all(torch.equal(u, v) for u, v in zip(first, other))
    if use_tma == common.supports_tma():  # the stage takes the default path
        assert all(torch.equal(u, v) for u, v in zip(first, wg.gate_up_weight_grad(d_gate_up, x, schedule)))
    one_output = wg.grouped_wgrad(d_gate_up, x_rows, schedule, use_tma=use_tma)[0]
    ref = stages.weight_grad(d_gate_up, x_rows, schedule)
    _check_close(torch.cat(first, dim=1), ref, torch.float32)
    _check_close(one_output, ref, torch.float32)


@pytest.mark.skipif(ON_GPU, reason="the interpreter-only TMA vs pointer comparison")
def test_tma_and_pointer_paths_agree():
    schedule, a, x = _case("random", 21, 2, 5, 48, 80, block_m=32, seed=4)
    b = stages.gather(x, schedule)
    tma = wg.grouped_wgrad(a, b, schedule, use_tma=True)[0]
    ptr = wg.grouped_wgrad(a, b, schedule, use_tma=False)[0]
    assert torch.equal(tma, ptr)


def test_bf16():
    schedule, d_gate_up, x = _case("empty", 24, 2, 6, 2 * 48, 80, dtype=torch.bfloat16, seed=5)
    outs = wg.gate_up_weight_grad(d_gate_up, x, schedule)
    refs = stages.gate_up_weight_grad(d_gate_up, x, schedule)
    for out, ref in zip(outs, refs):
        _check_close(out, ref, torch.bfloat16)
    _assert_empty_experts_zero(outs, schedule)


def test_rejects_bad_shapes():
    schedule, a, x = _case("random", 8, 2, 4, 32, 32)
    with pytest.raises(ValueError):
        wg.grouped_wgrad(a[:-1], a[:-1], schedule)
    with pytest.raises(ValueError):
        wg.grouped_wgrad(a, stages.gather(x, schedule)[:-1], schedule)
    with pytest.raises(TypeError):
        wg.grouped_wgrad(a, a.double(), schedule)


# ---------------------------------------------------------------- GPU, real sizes

@gpu_only
@pytest.mark.parametrize("kind", ["random", "skewed", "one_expert"])
@pytest.mark.parametrize("h,i,e,k,n", [(2048, 768, 32, 8, 4096), (7168, 2048, 4, 1, 1024)])
def test_gpu_real_sizes_bf16(kind, h, i, e, k, n):
    if kind == "one_expert" and k != 1:
        k = 1
    schedule, d_gate_up, x = _case(kind, n, k, e, 2 * i, h, dtype=torch.bfloat16, seed=7)
    outs = wg.gate_up_weight_grad(d_gate_up, x, schedule)
    refs = stages.gate_up_weight_grad(d_gate_up, x, schedule)
    for out, ref in zip(outs, refs):
        _check_close(out, ref, torch.bfloat16)
    _assert_empty_experts_zero(outs, schedule)
    h_weighted = (torch.randn(schedule.capacity, i, device=DEVICE) * (schedule.row_source >= 0)[:, None]).bfloat16()
    d_y_rows = (torch.randn(schedule.capacity, h, device=DEVICE) * (schedule.row_source >= 0)[:, None]).bfloat16()
    out = wg.down_weight_grad(d_y_rows, h_weighted, schedule)
    _check_close(out, stages.down_weight_grad(d_y_rows, h_weighted, schedule), torch.bfloat16)
    again = wg.down_weight_grad(d_y_rows, h_weighted, schedule)
    assert torch.equal(out, again)


@gpu_only
@pytest.mark.parametrize("name", sorted(WGRAD_CONFIGS))
def test_gpu_every_config(name):
    schedule, d_gate_up, x = _case("skewed", 2048, 8, 16, 2 * 768, 2048, dtype=torch.bfloat16, seed=8)
    refs = stages.gate_up_weight_grad(d_gate_up, x, schedule)
    outs = wg.gate_up_weight_grad(d_gate_up, x, schedule, config=name)
    for out, ref in zip(outs, refs):
        _check_close(out, ref, torch.bfloat16)
