"""serval.ops.quantize / dequantize: the Triton kernel (the interpreter here, `backend="triton"`) bit for bit
against the torch reference on every variant, and both against the rule in serval.ops' docstring, checked
independently (float64 math and a brute-force nearest-E4M3 search)."""

import itertools

import pytest
import torch
import triton
import triton.language as tl

from conftest import CUDA, requires_cuda
from serval import ops
from serval.kernels.quantize import _div_by_block_scale
from serval.ops import E4M3_MAX, QuantizedTensor, dequantize


def quantize(t, **kwargs):
    """serval.ops.quantize; backend="triton" on CPU tensors runs the kernel on the GPU where there is one (the
    interpreter where there is none) and brings the results back, so every test checks the kernel that runs."""
    if kwargs.get("backend") != "triton" or not CUDA or t.is_cuda:
        return ops.quantize(t, **kwargs)
    if kwargs.get("row_scale") is not None:
        kwargs["row_scale"] = kwargs["row_scale"].cuda()
    q, deq = ops.quantize(t.cuda(), **kwargs)
    return q._replace(data=q.data.cpu(), scale=q.scale.cpu()), None if deq is None else deq.cpu()

BLOCKS = [(1, 32), (32, 1), (1, 128), (128, 1), (128, 128), (32, 32)]
FORMATS = ["e8m0", "fp32"]
BACKENDS = ["torch", "triton"]

# every finite E4M3 value, by code 0x00..0x7E (non-negative; the code order is the value order)
E4M3_POSITIVE = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).double()


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()])


def same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    """The same bits, a NaN matching any NaN: a GPU's arithmetic makes its own NaN payload (torch on CUDA
    0x7FFFFFFF where the CPU keeps 0x7FC00000), which no rule of the format fixes."""
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    if x.dtype in (torch.float32, torch.bfloat16):
        nan = x.isnan()
        return torch.equal(nan, y.isnan()) and torch.equal(bits(x)[~nan], bits(y)[~nan])
    return torch.equal(bits(x), bits(y))


def assert_same(a, b):
    """Two quantize results are the same bits (data, scale, dequantized)."""
    (qa, da), (qb, db) = a, b
    assert qa.data.dtype == qb.data.dtype == torch.float8_e4m3fn
    assert qa.block == qb.block and qa.transposed == qb.transposed
    assert qa.data.shape == qb.data.shape and qa.scale.shape == qb.scale.shape
    assert same_bits(qa.data, qb.data), "data differ"
    assert same_bits(qa.scale, qb.scale), "scales differ"
    assert (da is None) == (db is None)
    if da is not None:
        assert same_bits(da, db), "dequantized values differ"


def varied(*shape, seed=0, dtype=torch.bfloat16):
    """Random values over many magnitudes (per column and per row), with a zero region, exact powers of two
    times 448, bf16 subnormals and e4m3 rounding ties."""
    gen = torch.Generator().manual_seed(seed)
    cols, rows = shape[-1], shape[-2]
    t = torch.randn(*shape, generator=gen) * torch.logspace(-4, 4, cols)
    t = t * torch.logspace(-2, 2, rows)[:, None]
    t[..., :40, :40] = 0  # zero blocks: (32, 32) and the 32-blocks here, a zero row and column for 128
    t[..., 60, :] = 0
    t[..., :, 70] = 0
    t[..., 128:, 256:] = 0  # [.., 130, 260]: the last (partial) 128 x 128 block
    t[..., 50, :8] = torch.tensor([448.0, -448.0, 896.0, 448 * 2.0 ** -20, 2.0 ** -130, -(2.0 ** -133),
                                   2.0 ** -126, 9.0])
    t[..., 45:48, 45:48] = 2.0 ** -128
    if rows >= 128 and cols >= 256:  # tiny blocks (e = -127, bf16 subnormals) for 32-blocks, (1, 128), (128, 1)
        for region, scale in [((slice(96, 128), slice(128, 256)), -128), ((100, slice(0, 128)), -125),
                              ((slice(0, 128), 80), -131)]:
            t[(...,) + region] = torch.randn(t[(...,) + region].shape, generator=gen) * 2.0 ** scale
    return t.to(dtype)


def e4m3_nearest(q: torch.Tensor) -> torch.Tensor:
    """The rule's step 4 by brute force: uint8 codes of the E4M3 values nearest to q (float64), ties to the
    even code, saturated to +-448, sign kept (also on zero)."""
    a = q.abs().clamp_max(E4M3_MAX)
    hi = torch.searchsorted(E4M3_POSITIVE, a).clamp(max=0x7E)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - E4M3_POSITIVE[lo], E4M3_POSITIVE[hi] - a
    code = torch.where(d_lo < d_hi, lo, torch.where(d_hi < d_lo, hi, torch.where(lo % 2 == 0, lo, hi)))
    return (code | torch.where(torch.signbit(q), 0x80, 0)).to(torch.uint8)


def rule(t: torch.Tensor, block, scale_format, row_scale=None):
    """The rule computed independently (float64, no frexp, no torch fp8 cast): (data uint8 codes, scale) for
    2-D t, in t's orientation; t must be finite."""
    v = (t.float() * row_scale[:, None] if row_scale is not None else t.float()).to(torch.bfloat16).double()
    rows, cols = v.shape
    br, bc = block
    n_r, n_c = -(-rows // br), -(-cols // bc)
    codes = torch.empty(rows, cols, dtype=torch.uint8)
    scale = torch.empty(n_r, n_c, dtype=torch.uint8 if scale_format == "e8m0" else torch.float32)
    for i, j in itertools.product(range(n_r), range(n_c)):
        blk = v[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
        amax = blk.abs().max().item()
        if scale_format == "e8m0":
            # smallest e with amax <= 448 * 2^e (exact in float64), clamped; zero -> -127
            e = -127
            if amax > 0:
                e = int(torch.tensor(amax / E4M3_MAX).log2().ceil().item())
                while amax > E4M3_MAX * 2.0 ** e:
                    e += 1
                while e > -200 and amax <= E4M3_MAX * 2.0 ** (e - 1):
                    e -= 1
                e = max(-127, min(127, e))
            scale[i, j] = e + 127
            q = blk * 2.0 ** -e
        else:
            s = torch.tensor(max(amax, 1e-12), dtype=torch.float32) / torch.tensor(E4M3_MAX, dtype=torch.float32)
            scale[i, j] = s
            q = (blk.float() / s).double()  # IEEE fp32 division
        codes[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = e4m3_nearest(q)
    return codes, scale


# --- the kernel against the reference, every variant ---------------------------------------------------------

@pytest.mark.parametrize("block", BLOCKS, ids=str)
@pytest.mark.parametrize("scale_format", FORMATS)
@pytest.mark.parametrize("transpose", [False, True], ids=["rows", "transposed"])
def test_kernel_matches_reference(block, scale_format, transpose):
    cases = [
        # 3-D bf16 weights-like [E, R, C], edges partial for every block, dequantized values
        dict(t=varied(2, 130, 260, seed=1), dequantized=True),
        # 2-D fp32 (not bf16: the rounding first), non-contiguous, row_scale, partial edges
        dict(t=varied(96, 200, seed=2, dtype=torch.float32).t(), row_scale=torch.rand(200) * 4 + 0.01,
             dequantized=True),
        # 2-D fp16, no dequantized output
        dict(t=varied(64, 96, seed=3).to(torch.float16), dequantized=False),
    ]
    for case in cases:
        kwargs = dict(block=block, scale_format=scale_format, transpose=transpose, **case)
        ref = quantize(backend="torch", **kwargs)
        assert_same(quantize(backend="triton", **kwargs), ref)
        q, deq = ref
        t = case["t"]
        rows, cols = t.shape[-2:]
        n_r, n_c = -(-rows // block[0]), -(-cols // block[1])
        assert q.data.shape == t.shape[:-2] + ((cols, rows) if transpose else (rows, cols))
        assert q.scale.shape == t.shape[:-2] + ((n_c, n_r) if transpose else (n_r, n_c))
        assert q.scale.dtype == (torch.uint8 if scale_format == "e8m0" else torch.float32)
        assert q.data.is_contiguous() and q.scale.is_contiguous()
        if deq is not None:
            assert deq.shape == t.shape and deq.dtype == (torch.bfloat16 if scale_format == "e8m0" else torch.float32)
            # the dequantized output is dequantize() of the un-transposed result
            back = dequantize(q, deq.dtype)
            assert torch.equal(bits(back.transpose(-1, -2) if transpose else back), bits(deq))


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_and_inf_propagate(backend):
    t = varied(64, 256, seed=4)
    t[3, 5] = float("nan")
    t[40, 200] = float("-inf")
    for block, scale_format in itertools.product([(1, 32), (32, 1), (128, 128)], FORMATS):
        kwargs = dict(block=block, scale_format=scale_format, dequantized=True)
        q, deq = quantize(t, backend=backend, **kwargs)
        assert_same((q, deq), quantize(t, backend="torch", **kwargs))
        br, bc = block
        bad = torch.zeros(q.scale.shape, dtype=torch.bool)
        bad[3 // br, 5 // bc] = bad[40 // br, 200 // bc] = True
        if scale_format == "e8m0":
            assert torch.equal(q.scale == 255, bad)
        else:
            assert torch.equal(q.scale.isnan(), bad)
        bad_elements = bad.repeat_interleave(br, 0)[:64].repeat_interleave(bc, 1)[:, :256]
        assert torch.equal(bits(q.data) == 0x7F, bad_elements)  # the finite blocks hold no NaN
        assert torch.equal(deq.isnan(), bad_elements)


def test_check_finite_raises():
    t = torch.randn(64, 64)
    quantize(t, check_finite=True)
    bad = t.clone()
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match="t holds NaN or Inf"):
        quantize(bad, check_finite=True)
    bad[1, 2] = float("inf")
    with pytest.raises(ValueError, match="t holds NaN or Inf"):
        quantize(bad, check_finite=True, scale_format="fp32")
    with pytest.raises(ValueError, match="row_scale holds NaN"):
        quantize(t, row_scale=torch.full((64,), float("nan")), check_finite=True)
    big = t.clone()
    big[0, 0] = 3.4e38  # finite in fp32, Inf in bf16
    with pytest.raises(ValueError, match="overflows"):
        quantize(big, check_finite=True)
    with pytest.raises(ValueError, match="overflows"):
        quantize(t, row_scale=torch.full((64,), 3e38), check_finite=True, scale_format="fp32")


# --- the rule, checked independently --------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale_format", FORMATS)
def test_against_the_rule(backend, scale_format):
    t = varied(72, 160, seed=5, dtype=torch.float32)  # fp32 values, not bf16: rounded first
    t[60, 100:132] = torch.linspace(-500, 500, 32)  # a block with values beyond 448 (after scaling: in range)
    for block in [(1, 32), (32, 1), (1, 128), (128, 1), (128, 128)]:
        codes, scale = rule(t, block, scale_format)
        q, _ = quantize(t, block=block, scale_format=scale_format, backend=backend)
        assert torch.equal(bits(q.data), codes), block
        assert torch.equal(bits(q.scale), bits(scale)), block
    rs = torch.rand(72) * 3
    codes, scale = rule(t, (1, 32), scale_format, row_scale=rs)
    q, _ = quantize(t, row_scale=rs, scale_format=scale_format, backend=backend)
    assert torch.equal(bits(q.data), codes) and torch.equal(bits(q.scale), bits(scale))


def _e4m3_probe_values():
    """Every E4M3 value, every midpoint between neighbours (exact ties), and the bf16 neighbours of each
    midpoint, with both signs: all bf16-exact. Subnormals (steps of 2^-9) included."""
    grid = E4M3_POSITIVE
    mids = (grid[1:] + grid[:-1]) / 2
    mids_bf16 = mids.to(torch.bfloat16)
    assert torch.equal(mids_bf16.double(), mids)
    near = torch.cat([mids_bf16.nextafter(torch.tensor(1e9, dtype=torch.bfloat16)),
                      mids_bf16.nextafter(torch.tensor(-1e9, dtype=torch.bfloat16))]).double()
    values = torch.cat([grid, mids, near, torch.tensor([2.0 ** -11, 2.0 ** -12, 3 * 2.0 ** -11])])
    return torch.cat([values, -values])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale_format", FORMATS)
def test_e4m3_rounding_ties_subnormals_and_saturation(backend, scale_format):
    values = _e4m3_probe_values()
    # one row per 128-block, each holding +-448 so the scale is exactly 1 (e8m0 byte 127; fp32 448 / 448)
    n = -(-values.numel() // 126)
    values = torch.cat([values, torch.zeros(n * 126 - values.numel(), dtype=torch.float64)]).view(n, 126)
    rows = torch.cat([torch.tensor([[448.0, -448.0]], dtype=torch.float64).expand(n, 2), values], dim=1)
    t = rows.float()
    q, deq = quantize(t, block=(1, 128), scale_format=scale_format, backend=backend, dequantized=True)
    assert torch.equal(q.scale, torch.full((n, 1), 127, dtype=torch.uint8) if scale_format == "e8m0"
                       else torch.ones(n, 1))
    assert torch.equal(bits(q.data), e4m3_nearest(rows))
    assert torch.equal(deq.double(), q.data.double())  # scale 1: the dequantized values are the e4m3 values
    # ties to even, spelled out: 1 + 2^-4 between 1 (0x38) and 1.125 (0x39); 3 * 2^-10 between 2^-9 (0x01)
    # and 2^-8 (0x02); 2^-10 between 0 and 2^-9 (-0 keeps its sign); 1.1875 between 1.125 and 1.25 (0x3A)
    probe = torch.tensor([[448.0, 1 + 2 ** -4, 3 * 2 ** -10, 2 ** -10, -(2 ** -10), 1.1875] + [0.0] * 26])
    q, _ = quantize(probe, scale_format=scale_format, backend=backend)
    assert bits(q.data)[0, :6].tolist() == [0x7E, 0x38, 0x02, 0x00, 0x80, 0x3A]


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp32_scale_saturation(backend):
    """With fp32 scales q = v / s can land just above 448 (s rounded down): it saturates to 448, not NaN."""
    cand = torch.arange(0x4380, 0x4480, dtype=torch.int16).view(torch.bfloat16).float()  # bf16 in [256, 1024)
    s = cand / E4M3_MAX
    over = cand[(cand / s) > E4M3_MAX]
    assert over.numel() > 0
    t = torch.zeros(over.numel(), 32)
    t[:, 0] = over
    t[:, 1] = -over
    q, _ = quantize(t, scale_format="fp32", backend=backend)
    assert (bits(q.data)[:, 0] == 0x7E).all() and (bits(q.data)[:, 1] == 0xFE).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_e8m0_scale_edges(backend, dtype):
    """The ceil at amax = 448 * 2^k exactly, the next bf16 above, zero blocks, bf16 subnormals, the bf16
    rounding of fp32 input before the amax."""
    ks = [-100, -10, -1, 0, 1, 10, 100]
    t = torch.zeros(2 * len(ks) + 4, 32)
    for i, k in enumerate(ks):
        t[2 * i, 3] = 448 * 2.0 ** k  # exactly 448 * 2^k: e = k, stored as 448
        t[2 * i + 1, 3] = -448 * 2.0 ** k * (1 + 2 ** -7)  # the next bf16 up: e = k + 1
    zero, sub, rounded, tiny = range(2 * len(ks), 2 * len(ks) + 4)
    t[sub, :4] = torch.tensor([2.0 ** -130, -(2.0 ** -133), 3 * 2.0 ** -133, 2.0 ** -127])  # bf16 subnormals
    t[rounded, 0] = 448 * (1 + 2 ** -9)  # fp32; bf16(t) = 448 exactly -> e = 0 (not 1)
    t[rounded, 1] = 1 + 3 * 2 ** -4 - 2 ** -10  # bf16 -> 1.1875, a tie -> 1.25 (directly it would be 1.125)
    t[tiny, :2] = torch.tensor([448 * 2.0 ** -127, 448 * 2.0 ** -128])  # e = -127 exactly (not clamped)
    if dtype == torch.bfloat16:
        t[rounded, :2] = torch.tensor([448.0, 1.25])
    t = t.to(dtype)
    q, deq = quantize(t, backend=backend, dequantized=True)
    expected = []
    for k in ks:
        expected += [k + 127, k + 128]
    expected += [0, 0, 127, 0]  # zero, subnormal (floor), rounded, tiny
    assert q.scale[:, 0].tolist() == expected
    for i in range(len(ks)):
        assert bits(q.data)[2 * i, 3] == 0x7E  # 448
        assert q.data[2 * i + 1, 3].float() == -224.0  # -448 (1 + 2^-7) / 2 = -226.75 -> -224
    assert (bits(q.data)[zero] == 0).all() and (deq[zero] == 0).all()
    # subnormal block: e = -127, q = v * 2^127: 2^-3, -2^-6, 3 * 2^-6, 1
    assert q.data[sub, :4].float().tolist() == [2 ** -3, -(2 ** -6), 3 * 2 ** -6, 1.0]
    assert deq[sub, :4].float().tolist() == [2.0 ** -130, -(2.0 ** -133), 3 * 2.0 ** -133, 2.0 ** -127]
    assert q.data[rounded, :2].float().tolist() == [448.0, 1.25]
    assert q.data[tiny, :2].float().tolist() == [448.0, 224.0]
    codes, scale = rule(t, (1, 32), "e8m0")
    assert torch.equal(bits(q.data), codes) and torch.equal(q.scale, scale)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp32_scale_zero_block_and_floor(backend):
    t = torch.zeros(2, 32)
    t[1, 0] = 1e-14  # below the 1e-12 floor: s = 1e-12 / 448
    q, deq = quantize(t, scale_format="fp32", backend=backend, dequantized=True)
    floor = torch.tensor(1e-12, dtype=torch.float32) / torch.tensor(448.0)
    assert torch.equal(q.scale, floor.expand(2, 1))
    assert (q.data[0].float() == 0).all() and (deq[0] == 0).all()
    codes, _ = rule(t, (1, 32), "fp32")
    assert torch.equal(bits(q.data), codes)


@pytest.mark.parametrize("backend", BACKENDS)
def test_row_scale_is_one_bf16_rounding(backend):
    t = torch.randn(40, 96)
    rs = torch.rand(40) * 10
    for scale_format in FORMATS:
        a = quantize(t, row_scale=rs, scale_format=scale_format, backend=backend, dequantized=True)
        b = quantize((t * rs[:, None]).to(torch.bfloat16), scale_format=scale_format, backend="torch", dequantized=True)
        assert_same(a, b)


def test_mxfp8_rowwise_and_colwise():
    """The MXFP8 contract: every nonzero block's amax lands in (224, 448] after scaling, values within half
    an e4m3 ulp, zero blocks stay zero; column blocks (32, 1) are the row blocks of the transpose."""
    torch.manual_seed(0)
    # blocks of very different magnitudes, bf16 values (the rule rounds to bf16 first)
    t = (torch.randn(64, 96) * torch.logspace(-3, 3, 96)).to(torch.bfloat16).float()
    t[0, :32] = 0  # an all-zero block
    row, _ = quantize(t, block=(1, 32))
    col, _ = quantize(t, block=(32, 1))
    col_t, _ = quantize(t, block=(32, 1), transpose=True)
    assert row.data.dtype == torch.float8_e4m3fn and row.scale.dtype == torch.uint8
    assert row.scale.shape == (64, 3) and col.scale.shape == (2, 96) and col_t.scale.shape == (96, 2)
    assert torch.equal(bits(col_t.data), bits(col.data).t()) and torch.equal(col_t.scale, col.scale.t())
    for q in (row, col):
        back = dequantize(q)
        br, bc = q.block
        scale = torch.exp2(q.scale.float() - 127).repeat_interleave(br, 0).repeat_interleave(bc, 1)
        # round to nearest e4m3: half an ulp of 3 mantissa bits, or of the subnormal step 2^-9 (times the scale)
        assert ((back - t).abs() <= t.abs() * 2 ** -4 + scale * 2 ** -10).all()
    amax = t.view(64, 3, 32).abs().amax(-1)
    scaled = amax / torch.exp2(row.scale.float() - 127)
    nonzero = amax > 0
    assert ((scaled[nonzero] > 224) & (scaled[nonzero] <= 448)).all()
    assert (dequantize(row)[0, :32] == 0).all()
    assert torch.equal(dequantize(col_t), dequantize(col).t())


def test_dequantize_formats_and_3d():
    w = varied(3, 130, 260, seed=6)
    for scale_format, block in itertools.product(FORMATS, [(128, 128), (1, 128)]):
        q, deq = quantize(w, block=block, scale_format=scale_format, dequantized=True)
        qt, _ = quantize(w, block=block, scale_format=scale_format, transpose=True)
        assert isinstance(q, QuantizedTensor) and q.block == block and not q.transposed and qt.transposed
        assert torch.equal(dequantize(q, deq.dtype), deq)
        assert torch.equal(dequantize(qt), dequantize(q).transpose(1, 2))
        # half an e4m3 ulp: 2^-4 relative (3 mantissa bits), or half the subnormal step 2^-9 times the scale
        scale = dequantize(QuantizedTensor(torch.ones_like(q.data), q.scale, q.block, False))
        err = (dequantize(q) - w.float()).abs()
        assert (err <= w.float().abs() * (2 ** -4 + 2 ** -20) + scale * 2 ** -10).all()


@pytest.mark.parametrize("block", BLOCKS)
def test_dequantize_kernel_matches_reference(block):
    """The dequantize kernel (GPU, or the interpreter) bit for bit against the torch reference: both scale
    formats, bf16 and fp32 out, transposed copies, 2-D and 3-D, partial edge blocks, NaN blocks, E8M0 byte 0."""
    t = varied(2, 150, 300, seed=9)
    t[1, 7, 9] = float("nan")
    t[0, :block[0], :block[1]] = 0  # a zero block: e8m0 byte 0 (the subnormal scale 2^-127)
    for scale_format, transpose in itertools.product(FORMATS, [False, True]):
        q, _ = quantize(t, block=block, scale_format=scale_format, transpose=transpose)
        for qq in (q, q._replace(data=q.data[0], scale=q.scale[0])):
            device = "cuda" if CUDA else "cpu"
            on_device = qq._replace(data=qq.data.to(device), scale=qq.scale.to(device))
            for dtype in (torch.bfloat16, torch.float32):
                got = dequantize(on_device, dtype, backend="triton").cpu()
                assert same_bits(got, dequantize(qq, dtype, backend="torch")), (scale_format, transpose, dtype)


def test_empty_and_default_outputs():
    q, deq = quantize(torch.zeros(0, 64))
    assert q.data.shape == (0, 64) and q.scale.shape == (0, 2) and deq is None
    q, _ = quantize(torch.zeros(0, 64), backend="triton", block=(128, 1), transpose=True)
    assert q.data.shape == (64, 0) and q.scale.shape == (64, 0)


def test_bad_arguments():
    t = torch.randn(64, 64)
    with pytest.raises(ValueError, match="t must be a 2-D"):
        quantize(torch.randn(64))
    with pytest.raises(ValueError, match="t must be a 2-D"):
        quantize(torch.randn(2, 2, 64, 64))
    with pytest.raises(ValueError, match="t must be a 2-D"):
        quantize(torch.ones(64, 64, dtype=torch.int32))
    with pytest.raises(ValueError, match="t must be a 2-D"):
        quantize(t.numpy())
    for block in [(64, 1), (1, 64), (32, 128), (1, 32, 1), 32, "1x32"]:
        with pytest.raises(ValueError, match="block must be one of"):
            quantize(t, block=block)
    with pytest.raises(ValueError, match="scale_format must be one of"):
        quantize(t, scale_format="e5m2")
    with pytest.raises(ValueError, match="transpose must be a bool"):
        quantize(t, transpose=1)
    with pytest.raises(ValueError, match="backend must be one of"):
        quantize(t, backend="cuda")
    with pytest.raises(ValueError, match="row_scale needs a 2-D t"):
        quantize(torch.randn(2, 64, 64), row_scale=torch.ones(64))
    for rs in [torch.ones(63), torch.ones(64, dtype=torch.bfloat16), torch.ones(64, 1), 2.0]:
        with pytest.raises(ValueError, match=r"row_scale must be an fp32 tensor of shape \[R\] = \(64,\)"):
            quantize(t, row_scale=rs)


@requires_cuda
def test_cuda_kernel_matches_reference():
    """On the GPU: the kernel (the default there) against the reference run on the same device."""
    for block, scale_format, transpose in itertools.product(BLOCKS, FORMATS, [False, True]):
        for t, rs in [(varied(2, 1000, 1100, seed=7).cuda(), None),
                      (varied(1000, 1100, seed=8, dtype=torch.float32).cuda(), torch.rand(1000, device="cuda"))]:
            t[..., 7, 9] = float("nan")
            kwargs = dict(block=block, scale_format=scale_format, transpose=transpose, row_scale=rs, dequantized=True)
            assert_same(quantize(t, **kwargs), quantize(t, backend="torch", **kwargs))
            probe = _e4m3_probe_values().to(device="cuda", dtype=torch.float32)
            probe = torch.cat([probe, torch.full((-probe.numel() % 128,), 448.0, device="cuda")]).view(-1, 128)
            kwargs.pop("row_scale")
            assert_same(quantize(probe, **kwargs), quantize(probe, backend="torch", **kwargs))


@triton.jit
def _divide(x_ptr, amax_ptr, fast_ptr, ieee_ptr, n, BLOCK: tl.constexpr):
    """x / (amax / 448) for a vector x and one amax per program column: the kernel's way and div_rn."""
    amax = tl.load(amax_ptr + tl.program_id(1))
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    scale = tl.math.div_rn(tl.maximum(amax, 1e-12), 448.0)
    out = tl.program_id(1).to(tl.int64) * n + offs
    tl.store(fast_ptr + out, _div_by_block_scale(x, scale, tl.math.div_rn(1.0, scale)), mask=offs < n)
    tl.store(ieee_ptr + out, tl.math.div_rn(x, scale), mask=offs < n)


def test_block_scale_division_is_the_ieee_quotient():
    """The fp32-scale quantizer divides by one reciprocal per block and an fma correction
    (`quantize._div_by_block_scale`): for every bf16 x with |x| <= amax (the quantizer's inputs are bf16
    values) and scale = amax / 448 as the kernel rounds it, the IEEE quotient bit for bit wherever E4M3 does not
    round it to zero, and below 2^-10 (zero in E4M3) where it does (there fp32 underflow can move it). The GPU
    checks every positive finite bf16 amax; the interpreter a sample (powers of two, their neighbours, 448's
    multiples, the 1e-12 floor, random ones)."""
    every_bf16 = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    finite = every_bf16[every_bf16.isfinite()]
    positive = finite[finite > 0].unique()
    device = "cuda" if CUDA else "cpu"
    if not CUDA:
        g = torch.Generator().manual_seed(0)
        picks = [positive[torch.randint(len(positive), (24,), generator=g)],
                 torch.tensor([1e-12, 1e-13, 448.0, 896.0, 224.0, 1.0, 3.0, 7.0, 3.3895e38])]
        for e in range(-130, 128, 11):
            p = torch.tensor(2.0 ** e)
            picks.append(torch.stack([p, torch.nextafter(p, p * 2), torch.nextafter(p, p * 0)]))
        amaxes = torch.cat(picks).bfloat16().float().unique()
    else:
        amaxes = positive
    x, amaxes = finite.to(device), amaxes.to(device)
    block = 8192
    for chunk in amaxes.split(4096):
        fast = torch.empty(len(chunk), len(x), device=device)
        ieee = torch.empty_like(fast)
        _divide[(triton.cdiv(len(x), block), len(chunk))](x, chunk, fast, ieee, len(x), BLOCK=block)
        valid = x.abs()[None, :] <= chunk[:, None]
        e4m3_range = valid & (ieee.abs() >= 2.0**-10)  # half of E4M3's smallest subnormal: below it, zero
        assert not bool(((bits(fast) != bits(ieee)) & e4m3_range).any())
        assert not bool(((fast.abs() >= 2.0**-10) & valid & ~e4m3_range).any())


def test_mxfp8_quantize_of_the_contract():
    """serval.ops.mxfp8_quantize(t, rowwise, colwise): quantize's e8m0 format, 32-blocks along either dim."""
    from serval.ops import mxfp8_quantize

    t = torch.randn(64, 96)
    row, col = mxfp8_quantize(t, rowwise=True, colwise=True)
    assert torch.equal(row.data.view(torch.uint8), quantize(t, block=(1, 32))[0].data.view(torch.uint8))
    assert torch.equal(col.scale, quantize(t, block=(32, 1))[0].scale)
    assert row.scale.shape == (64, 3) and col.scale.shape == (2, 96)
    assert mxfp8_quantize(t)[1] is None
    with pytest.raises(ValueError, match="rowwise"):
        mxfp8_quantize(t, rowwise=False)
    with pytest.raises(TypeError, match="mxfp8_quantize: t must be bf16, fp16 or fp32, got float64"):
        mxfp8_quantize(t.double())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("transpose", [False, True])
def test_out_writes_into_halves_of_one_buffer(backend, transpose):
    """quantize(..., out=views) gives the bits of quantizing alone, written where the views are (no copy to
    join two quantized tensors)."""
    device = "cuda" if backend == "triton" and CUDA else "cpu"  # the kernel: on the GPU where there is one
    a, b = varied(3, 256, 200, seed=11).to(device), varied(3, 256, 200, seed=12).to(device)
    kwargs = dict(block=(128, 128), scale_format="fp32", transpose=transpose, backend=backend)
    qa, qb = (ops.quantize(w, **kwargs)[0] for w in (a, b))
    dim = 2 if transpose else 1
    data = torch.cat([qa.data, qb.data], dim).fill_(0)  # the joined shapes; contents overwritten below
    scale = torch.cat([qa.scale, qb.scale], dim).fill_(0)
    for w, half in ((a, 0), (b, 1)):
        views = [x.narrow(dim, half * x.shape[dim] // 2, x.shape[dim] // 2) for x in (data, scale)]
        ops.quantize(w, **kwargs, out=views)
    assert torch.equal(bits(data), bits(torch.cat([qa.data, qb.data], dim)))
    assert torch.equal(bits(scale), bits(torch.cat([qa.scale, qb.scale], dim)))
    with pytest.raises(ValueError, match="out must be"):
        ops.quantize(a, **kwargs, out=(data, scale))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block,transpose", [((1, 128), False), ((128, 1), True), ((32, 1), False)])
def test_rows_of_quantizes_the_gathered_rows(backend, block, transpose):
    """rows_of=(row_source, k): the bits of quantizing t's gathered rows (zeros where -1), without making them."""
    device = "cuda" if backend == "triton" and CUDA else "cpu"
    t = varied(80, 300, seed=21).to(device)
    gen = torch.Generator().manual_seed(3)
    row_source = torch.randint(-1, 80 * 2, (256,), generator=gen, dtype=torch.int32).to(device)
    rows = torch.where((row_source >= 0)[:, None], t[row_source.long().clamp(min=0) // 2], 0)
    rw = torch.rand(256, generator=gen).to(device)
    for kwargs in (dict(), dict(row_scale=rw, dequantized=True)):
        kwargs.update(block=block, scale_format="fp32", transpose=transpose, backend=backend)
        assert_same(ops.quantize(t, rows_of=(row_source, 2), **kwargs), ops.quantize(rows, **kwargs))
    with pytest.raises(ValueError, match="rows_of"):
        ops.quantize(t, block=block, rows_of=(row_source.float(), 2))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block,scale_format", [((128, 128), "fp32"), ((32, 32), "e8m0")])
def test_both_layouts_from_one_read(backend, block, scale_format):
    """quantize_both_layouts: the bits of quantize without and with transpose (partial edge blocks too), also
    written into views of joined buffers (out / out_t)."""
    device = "cuda" if backend == "triton" and CUDA else "cpu"
    w = varied(3, 256, 200, seed=31).to(device).bfloat16()
    kwargs = dict(block=block, scale_format=scale_format, backend=backend)
    want = ops.quantize(w, **kwargs)[0], ops.quantize(w, transpose=True, **kwargs)[0]
    got = ops.quantize_both_layouts(w, **kwargs)
    for g, x in zip(got, want):
        assert g.transposed == x.transposed and g.block == x.block
        assert torch.equal(bits(g.data), bits(x.data)) and torch.equal(bits(g.scale), bits(x.scale))
    data, data_t = torch.zeros(3, 512, 200, dtype=torch.float8_e4m3fn, device=device), \
        torch.zeros(3, 200, 512, dtype=torch.float8_e4m3fn, device=device)
    scale, scale_t = (torch.zeros(s, dtype=want[0].scale.dtype, device=device)
                      for s in ((3, 2 * want[0].scale.shape[1], want[0].scale.shape[2]),
                                (3, want[1].scale.shape[1], 2 * want[1].scale.shape[2])))
    n_r = want[0].scale.shape[1]
    ops.quantize_both_layouts(w, **kwargs, out=(data.narrow(1, 256, 256), scale.narrow(1, n_r, n_r)),
                              out_t=(data_t.narrow(2, 256, 256), scale_t.narrow(2, n_r, n_r)))
    assert torch.equal(bits(data[:, 256:]), bits(want[0].data)) and torch.equal(bits(scale[:, n_r:]),
                                                                                bits(want[0].scale))
    assert torch.equal(bits(data_t[:, :, 256:]), bits(want[1].data)) and torch.equal(bits(scale_t[:, :, n_r:]),
                                                                                     bits(want[1].scale))
    with pytest.raises(ValueError, match="square blocks"):
        ops.quantize_both_layouts(w, block=(1, 128), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block,scale_format", [((1, 32), "e8m0"), ((32, 1), "e8m0"), ((1, 128), "fp32"),
                                                ((128, 1), "fp32"), ((32, 32), "e8m0")])
def test_round_trip_is_quantize_dequantized(backend, block, scale_format, monkeypatch):
    """round_trip: quantize(..., dequantized=True)'s dequantized values bit for bit (with row_scale, rows_of, a 3-D
    t, NaN), and no quantized copy made: the kernel allocates only the values it returns."""
    device = "cuda" if backend == "triton" and CUDA else "cpu"
    t = varied(96, 200, seed=5).to(device)
    t[3, 7] = float("nan")
    gen = torch.Generator().manual_seed(4)
    row_source = torch.randint(-1, 96 * 2, (160,), generator=gen, dtype=torch.int32).to(device)
    rw = torch.rand(160, generator=gen).to(device)
    cases = [(t, {}), (t.reshape(2, 48, 200), {}), (t, dict(rows_of=(row_source, 2), row_scale=rw))]
    for source, kwargs in cases:
        kwargs.update(block=block, scale_format=scale_format, backend=backend)
        got = ops.round_trip(source, **kwargs)
        want = ops.quantize(source, dequantized=True, **kwargs)[1]
        assert got.dtype == want.dtype and got.shape == want.shape
        assert same_bits(got, want)
    if backend == "triton":
        from serval.kernels import common
        made = []
        real_empty = common.empty
        monkeypatch.setattr(common, "empty", lambda *a: made.append(a[1]) or real_empty(*a))
        ops.round_trip(t, block=block, scale_format=scale_format, backend=backend)
        assert made == [torch.bfloat16 if scale_format == "e8m0" else torch.float32], made


ROUND_TRIP_CHILD = r"""
import sys
import torch
sys.path.insert(0, "tests")
from sm90 import compile_launch_in_this_child
from serval.kernels import quantize

block, fp32_scale, quantized = (int(sys.argv[1]), int(sys.argv[2])), sys.argv[3] == "fp32", sys.argv[4] == "1"
compile_launch_in_this_child(quantize, "_quantize_kernel", lambda: quantize.quantize(
    torch.zeros(1, 256, 512, dtype=torch.bfloat16), block, fp32_scale, False, None, True, quantized=quantized),
    sys.argv[5])
"""


@pytest.mark.parametrize("block,scale_format", [((1, 32), "e8m0"), ((32, 1), "e8m0"), ((1, 128), "fp32")])
def test_round_trip_kernel_compiles_for_sm90_storing_only_its_values(block, scale_format, tmp_path):
    """The quantizer's round-trip variant (no quantized copy) compiles for sm_90a without a GPU, with fewer global
    stores than the quantizer that also stores the E4M3 data and scales."""
    from sm90 import compile_in_child

    stores = []
    for quantized in (0, 1):
        path = tmp_path / str(quantized)
        path.mkdir()
        compile_in_child(ROUND_TRIP_CHILD, [*block, scale_format, quantized], path)
        stores.append(sum("st.global" in line for line in (path / "kernel.ptx").read_text().splitlines()))
    assert 0 < stores[0] < stores[1], f"global stores: round trip {stores[0]}, with the quantized copy {stores[1]}"
