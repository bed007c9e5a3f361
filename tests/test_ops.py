"""serval.ops.mxfp8_quantize against the OCP MX definition."""

import pytest
import torch

from serval.ops import mxfp8_dequantize, mxfp8_quantize


def test_mxfp8_rowwise_and_colwise():
    torch.manual_seed(0)
    t = torch.randn(64, 96) * torch.logspace(-3, 3, 96)  # blocks of very different magnitudes
    t[0, :32] = 0  # an all-zero block
    row, col = mxfp8_quantize(t, rowwise=True, colwise=True)
    assert row.data.dtype == torch.float8_e4m3fn and row.scale.dtype == torch.uint8
    assert row.scale.shape == (64, 3) and col.scale.shape == (2, 96)
    for q in (row, col):
        back = mxfp8_dequantize(q)
        scale = torch.exp2(q.scale.float() - 127).repeat_interleave(32, dim=q.dim)
        # round to nearest e4m3: half an ulp of 3 mantissa bits, or of the subnormal step 2^-9 (times the scale)
        assert ((back - t).abs() <= t.abs() * 2 ** -4 + scale * 2 ** -10).all()
    # the scale puts every block's amax in (224, 448] before the cast: nothing saturates
    amax = t.view(64, 3, 32).abs().amax(-1)
    scaled = amax / torch.exp2(row.scale.float() - 127)
    nonzero = amax > 0
    assert ((scaled[nonzero] > 224) & (scaled[nonzero] <= 448)).all()
    assert (mxfp8_dequantize(row)[0, :32] == 0).all()


def test_mxfp8_bad_input():
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp8_quantize(torch.randn(4, 40))
    with pytest.raises(ValueError, match="2-D"):
        mxfp8_quantize(torch.randn(4))
