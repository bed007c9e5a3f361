"""The weight-gradient kernel's window mode (serval.values.WgradWindow) against one pass.

The routed rows stream through the kernel in windows of whole M-tiles (serval.schedule.windows: the
macrobatch ring), an expert's fp32 sums carried from window to window in two ping-pong buffers; the result
must be the one-pass result bit for bit, every output written by exactly one window, and nothing else
touched. CPU: TRITON_INTERPRET=1 (conftest), tiny shapes, block_m 16/32, and the Hopper configs compiled for
sm_90a (shared memory). GPU: block_m 128, bf16, real-ish sizes.
"""

from __future__ import annotations

import pytest
import torch

from serval.schedule import CARRY_IN, CARRY_OUT, FINISH, build_schedule, windows
from serval.values import WgradWindow

wg = pytest.importorskip("serval.kernels.weight_grad")
# the one-pass tests' device, tile rows and routings (that module skips itself where the kernels cannot run)
from test_kernels_wgrad import BLOCK_M, DEVICE, ON_GPU, _routing, gpu_only  # noqa: E402


def _case(kind, n, k, e, p, q, dtype, block_m, seed=0):
    """A schedule and the routed operands a [R, p], b [R, q] (zero padding rows)."""
    gen = torch.Generator().manual_seed(seed)
    schedule = build_schedule(_routing(kind, n, k, e, gen).to(DEVICE), e, block_m=block_m)
    used = (schedule.row_source >= 0)[:, None]
    a = (torch.randn(schedule.capacity, p, generator=gen).to(DEVICE) * used).to(dtype)
    b = (torch.randn(schedule.capacity, q, generator=gen).to(DEVICE) * used).to(dtype)
    return schedule, a, b


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t's bit patterns (NaN compares equal to itself)."""
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32).clone()


def _nan(shape, dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def _windowed(a, b, schedule, rows, *, num_outputs, ring=False, **kwargs):
    """The gradient by windows of `rows` rows, checking each launch: only its FINISH experts' outputs change, and
    fully; carry_in is only read; carry_out is written whole when an expert carries out, else left alone.
    ring: each window's rows are copied into one fixed [rows, .] buffer first (the macrobatch ring)."""
    E, P, Q = schedule.num_experts, a.shape[1], b.shape[1]
    outs = tuple(_nan((E, P // num_outputs, Q), a.dtype) for _ in range(num_outputs))
    carries = [_nan((P, Q), torch.float32) for _ in range(2)]
    ring_a, ring_b = _nan((rows, P), a.dtype), _nan((rows, Q), b.dtype)
    finished = torch.zeros(E, dtype=torch.int64)
    for j, w in enumerate(windows(schedule, rows)):
        n = w.schedule.capacity
        a_w, b_w = a[w.start:w.start + n], b[w.start:w.start + n]
        if ring:
            a_w, b_w = ring_a[:n].copy_(a_w), ring_b[:n].copy_(b_w)
        phase = w.expert_phase.cpu()
        assert ((phase & CARRY_IN) != 0).sum() <= 1 and ((phase & CARRY_OUT) != 0).sum() <= 1
        window = WgradWindow(w.expert_phase, carries[j % 2], carries[(j + 1) % 2], outs)
        before = [_bits(t) for t in (*outs, window.carry_in, window.carry_out)]
        result = wg.grouped_wgrad(a_w, b_w, w.schedule, num_outputs=num_outputs, window=window, **kwargs)
        assert result is outs
        done = ((phase & FINISH) != 0).to(DEVICE)
        for out, old in zip(outs, before):
            assert torch.equal(_bits(out)[~done], old[~done]), f"window {j} wrote an expert it does not finish"
            assert not out[done].isnan().any(), f"window {j} left a finished expert's output unwritten"
        assert torch.equal(_bits(window.carry_in), before[-2]), f"window {j} wrote its carry_in"
        if (phase & CARRY_OUT).any():
            assert not window.carry_out.isnan().any(), f"window {j} left part of its carry_out unwritten"
        else:
            assert torch.equal(_bits(window.carry_out), before[-1]), f"window {j} wrote carry_out without CARRY_OUT"
        finished += (phase & FINISH) != 0
    assert torch.equal(finished, torch.ones(E, dtype=torch.int64)), finished
    return outs


def _check_windows(schedule, a, b, num_outputs, tiles, ring, **kwargs):
    """Windows of `tiles` M-tiles each (and one of the whole capacity) give the one-pass bits."""
    both = CARRY_IN | CARRY_OUT
    assert any(((w.expert_phase & both) == both).any() for w in windows(schedule, schedule.block_m)), \
        "no expert spans 3 M-tiles: no window both carries in and out"
    one_pass = wg.grouped_wgrad(a, b, schedule, num_outputs=num_outputs, **kwargs)
    for rows in [t * schedule.block_m for t in tiles] + [schedule.capacity + schedule.block_m]:
        outs = _windowed(a, b, schedule, rows, num_outputs=num_outputs, ring=ring, **kwargs)
        for out, ref in zip(outs, one_pass):
            assert torch.equal(out, ref), f"window of {rows} rows: not the one-pass bits"


CASES = [  # kind, N, k, E, P, Q, dtype, num_outputs, block_m, ring; every case has an expert of 3+ M-tiles
    ("random", 56, 2, 3, 48, 40, torch.float32, 2, 16, False),
    ("empty", 52, 2, 6, 24, 40, torch.bfloat16, 1, 16, True),
    ("one_expert", 70, 1, 4, 40, 24, torch.float32, 1, 32, True),  # BK 16 < block_m: two K steps per tile
    ("skewed", 60, 2, 6, 64, 24, torch.bfloat16, 2, 16, False),
]


@pytest.mark.skipif(ON_GPU, reason="the interpreter's tiny shapes (the GPU has its own test)")
@pytest.mark.parametrize("flatten", [True, False])
@pytest.mark.parametrize("kind,n,k,e,p,q,dtype,num_outputs,block_m,ring", CASES)
def test_windows_bitwise_one_pass(kind, n, k, e, p, q, dtype, num_outputs, block_m, ring, flatten):
    schedule, a, b = _case(kind, n, k, e, p, q, dtype, block_m)
    _check_windows(schedule, a, b, num_outputs, (1, 2, 3), ring, flatten=flatten)


@pytest.mark.skipif(ON_GPU, reason="the interpreter's tiny shapes")
@pytest.mark.parametrize("flatten", [True, False])
def test_windows_plain_order(flatten):
    """lpt=False: the carrying experts, then the others in id order, the inactive ones last."""
    schedule, a, b = _case("skewed", 50, 2, 5, 32, 24, torch.float32, 16, seed=1)
    _check_windows(schedule, a, b, 2, (2,), True, flatten=flatten, lpt=False)


@pytest.mark.skipif(ON_GPU, reason="the interpreter's TMA path (the GPU takes it by default)")
@pytest.mark.parametrize("flatten", [True, False])
def test_windows_tma(flatten):
    """Tensor descriptors for a, b and the outputs (the carries stay pointer loads and stores)."""
    schedule, a, b = _case("skewed", 50, 2, 5, 32, 24, torch.float32, 16, seed=4)
    _check_windows(schedule, a, b, 2, (1,), True, flatten=flatten, use_tma=True)


@pytest.mark.skipif(ON_GPU, reason="the interpreter's tiny shapes")
def test_window_stages():
    """gate_up_weight_grad (x regathered by the window's schedule) and down_weight_grad take the window too."""
    schedule, d_gate_up, d_y = _case("random", 20, 2, 4, 48, 32, torch.float32, 16, seed=2)
    x = torch.randn(20, 40, device=DEVICE)
    h = torch.randn(schedule.capacity, 24, device=DEVICE) * (schedule.row_source >= 0)[:, None]
    E, I2, H = schedule.num_experts, d_gate_up.shape[1], x.shape[1]
    gate_up = (_nan((E, I2 // 2, H), torch.float32), _nan((E, I2 // 2, H), torch.float32))
    down = (_nan((E, d_y.shape[1], h.shape[1]), torch.float32),)
    carries = {name: [torch.zeros(p, q, device=DEVICE) for _ in range(2)]
               for name, p, q in (("gate_up", I2, H), ("down", d_y.shape[1], h.shape[1]))}
    for j, w in enumerate(windows(schedule, 2 * schedule.block_m)):
        rows = slice(w.start, w.start + w.schedule.capacity)
        bufs = carries["gate_up"]
        window = WgradWindow(w.expert_phase, bufs[j % 2], bufs[(j + 1) % 2], gate_up)
        assert wg.gate_up_weight_grad(d_gate_up[rows], x, w.schedule, window=window) is gate_up
        bufs = carries["down"]
        window = WgradWindow(w.expert_phase, bufs[j % 2], bufs[(j + 1) % 2], down)
        assert wg.down_weight_grad(d_y[rows], h[rows], w.schedule, window=window) is down[0]
    for out, ref in zip(gate_up, wg.gate_up_weight_grad(d_gate_up, x, schedule)):
        assert torch.equal(out, ref)
    assert torch.equal(down[0], wg.down_weight_grad(d_y, h, schedule))


def test_window_rejects_bad_arguments():
    schedule, a, b = _case("random", 8, 2, 4, 32, 24, torch.float32, BLOCK_M)
    w = windows(schedule, BLOCK_M)[0]
    a_w, b_w = a[:w.schedule.capacity], b[:w.schedule.capacity]
    E, P, Q = 4, 32, 24
    good = dict(expert_phase=w.expert_phase, carry_in=torch.zeros(P, Q, device=DEVICE),
                carry_out=torch.zeros(P, Q, device=DEVICE), outs=(torch.zeros(E, P, Q, device=DEVICE),))
    wg.grouped_wgrad(a_w, b_w, w.schedule, window=WgradWindow(**good))
    shared = torch.zeros(P + 1, Q, device=DEVICE)
    bad = [
        dict(expert_phase=w.expert_phase.long()),
        dict(expert_phase=w.expert_phase[:-1]),
        dict(carry_in=torch.zeros(P, Q, device=DEVICE, dtype=torch.bfloat16)),
        dict(carry_out=torch.zeros(P, Q, device=DEVICE, dtype=torch.float64)),
        dict(carry_in=torch.zeros(P, Q + 1, device=DEVICE)),
        dict(carry_out=torch.zeros(Q, P, device=DEVICE).t()),  # strided
        dict(carry_out=good["carry_in"]),  # one buffer for both
        dict(carry_in=shared[:P], carry_out=shared[1:]),  # overlapping views
        dict(carry_in=torch.zeros(P, Q, device="meta")),
        dict(outs=good["outs"] * 2),
        dict(outs=(torch.zeros(E, P, Q, device=DEVICE, dtype=torch.bfloat16),)),
        dict(outs=(torch.zeros(E + 1, P, Q, device=DEVICE),)),
    ]
    for change in bad:
        with pytest.raises(ValueError):
            wg.grouped_wgrad(a_w, b_w, w.schedule, window=WgradWindow(**{**good, **change}))


# ---------------------------------------------------------------- sm_90a, without a GPU

WINDOW_CHILD = r"""
import sys
import torch
sys.path.insert(0, "tests")
from sm90 import compile_launch_in_this_child
from serval.kernels import weight_grad as wg
from serval.schedule import build_schedule, windows
from serval.values import WgradWindow

num_outputs, config, flatten = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "True"
E, N, P, Q = 8, 512, 1536, 2048
schedule = build_schedule(torch.stack([torch.arange(N) % E, (torch.arange(N) + 1) % E], 1), E, 128)
w = windows(schedule, 256)[0]
a = torch.zeros(w.schedule.capacity, P, dtype=torch.bfloat16)
b = torch.zeros(w.schedule.capacity, Q, dtype=torch.bfloat16)
outs = tuple(torch.zeros(E, P // num_outputs, Q, dtype=torch.bfloat16) for _ in range(num_outputs))
window = WgradWindow(w.expert_phase, torch.zeros(P, Q), torch.zeros(P, Q), outs)
compile_launch_in_this_child(wg, "_wgrad_kernel", lambda: wg.grouped_wgrad(
    a, b, w.schedule, num_outputs=num_outputs, config=config, use_tma=True, flatten=flatten, window=window),
    sys.argv[4])
"""


@pytest.mark.skipif(ON_GPU, reason="the GPU tests run the kernel itself")
@pytest.mark.parametrize("num_outputs,config,flatten", [(2, "128x256", True), (1, "128x256s", True),
                                                        (2, "128x256", False)])
def test_window_compiles_for_sm90a(num_outputs, config, flatten, tmp_path):
    """Window mode with the Hopper configs the stages pick (gate/up: 128x256, down: 128x256s) fits an sm_90 block's
    shared memory: the carry's fp32 tile, converted inside the flattened loop, once needed 128 KB more than that."""
    from sm90 import compile_in_child

    shared, report = compile_in_child(WINDOW_CHILD, [num_outputs, config, flatten], tmp_path)
    assert shared <= 232448, f"{shared} bytes of shared memory"


# ---------------------------------------------------------------- GPU, real-ish sizes

@gpu_only
@pytest.mark.parametrize("flatten", [True, False])
@pytest.mark.parametrize("num_outputs", [1, 2])
@pytest.mark.parametrize("kind", ["random", "empty", "one_expert", "skewed"])
def test_gpu_windows_bitwise_one_pass(kind, num_outputs, flatten):
    k = 1 if kind == "one_expert" else 2
    schedule, a, b = _case(kind, 2000, k, 8, 256, 512, torch.bfloat16, BLOCK_M, seed=3)
    _check_windows(schedule, a, b, num_outputs, (1, 2, 3), ring=kind in ("empty", "skewed"), flatten=flatten)
