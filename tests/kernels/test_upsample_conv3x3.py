"""upsample_conv3x3 (phase decomposition) against interpolate + conv2d in float64."""

import pytest
import torch

from qwen_turbo.kernels import upsample_conv3x3 as op

# the fast path may differ from the same-dtype reference by a few roundings of the output
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def _case(c_in, c_out, h, w, dtype, seed, batch=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, c_in, h, w, generator=g) + 0.5
    wt = torch.randn(c_out, c_in, 3, 3, generator=g) / (9 * c_in) ** 0.5
    b = torch.randn(c_out, generator=g)
    return x.to(dtype), wt.to(dtype), b.to(dtype)


def _err(out, ref64):
    return ((out.double() - ref64).abs().max() / ref64.abs().max()).item()


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize(
    "c_in,c_out,h,w", [(96, 48, 17, 29), (384, 192, 5, 7), (128, 128, 13, 9), (8, 3, 1, 1)]
)
def test_matches_upsample_then_conv(dtype, c_in, c_out, h, w):
    x, wt, b = _case(c_in, c_out, h, w, dtype, seed=c_in + h)
    out = op.upsample_conv3x3(x, wt, b)
    ref64 = op.upsample_conv3x3_reference(x.double(), wt.double(), b.double())
    same_dtype = op.upsample_conv3x3_reference(x, wt, b) if dtype != torch.float16 else None
    assert out.shape == (1, c_out, 2 * h, 2 * w) and out.dtype == dtype
    assert torch.isfinite(out).all()
    bound = TOL[dtype]
    if same_dtype is not None:
        bound = max(bound, 2 * _err(same_dtype, ref64) + 1e-6)
    assert _err(out, ref64) <= bound


def test_non_contiguous_input_batch_and_no_bias():
    x, wt, _ = _case(32, 16, 11, 7, torch.float32, seed=3, batch=2)
    xs = x.permute(0, 1, 3, 2)  # (2, 32, 7, 11), strided
    out = op.upsample_conv3x3(xs, wt)
    torch.testing.assert_close(out, op.upsample_conv3x3_reference(xs, wt), rtol=1e-5, atol=1e-5)


def test_phase_weights_are_exact_tap_sums():
    wt = torch.randn(2, 3, 3, 3, dtype=torch.float64)
    w4 = op.phase_weights(wt)
    # phase (0, 0): rows (i-1, i) = [W0, W1+W2], same for columns
    torch.testing.assert_close(w4[0:2, :, 0, 0], wt[:, :, 0, 0])
    torch.testing.assert_close(w4[0:2, :, 1, 1], wt[:, :, 1:, 1:].sum((-1, -2)))
    # phase (1, 1): rows (i, i+1) = [W0+W1, W2]
    torch.testing.assert_close(w4[6:8, :, 0, 0], wt[:, :, :2, :2].sum((-1, -2)))


def test_mismatched_weight_falls_back():
    x, _, _ = _case(8, 4, 5, 6, torch.float32, seed=5)
    wt = torch.randn(4, 8, 5, 5)
    out = op.upsample_conv3x3(x, wt)  # not a 3x3: the reference raises as conv2d would not
    assert out.shape == (1, 4, 8, 10)


def test_module_falls_back_for_5d_and_sees_weight_updates():
    conv = torch.nn.Conv2d(6, 3, 3, padding=1)
    seq = torch.nn.Sequential(torch.nn.Upsample(scale_factor=2.0, mode="nearest"), conv)
    m = op.UpsampleConv3x3(conv, seq)
    assert dict(m.named_parameters()).keys() == dict(seq.named_parameters()).keys()
    x = torch.randn(2, 6, 5, 4)
    torch.testing.assert_close(m(x), seq(x), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        conv.weight.mul_(-2.0)  # patched in place, as ComfyUI may do
    torch.testing.assert_close(m(x), seq(x), rtol=1e-5, atol=1e-5)
    seen = []
    m5 = op.UpsampleConv3x3(conv, lambda t: seen.append(t.shape) or t)
    x5 = torch.randn(1, 6, 1, 5, 4)
    assert m5(x5) is x5 and seen == [x5.shape]  # 5-D input goes to the original module


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("c_in,c_out,h", [(384, 192, 314), (384, 192, 628), (192, 96, 1256)])
def test_qwen_decoder_stages_on_gpu(c_in, c_out, h):
    x, wt, b = (t.cuda() for t in _case(c_in, c_out, h, h, torch.bfloat16, seed=h))
    out = op.upsample_conv3x3(x, wt, b)
    ref = op.upsample_conv3x3_reference(x.float(), wt.float(), b.float())
    same = op.upsample_conv3x3_reference(x, wt, b)
    assert _err(out, ref.double()) <= 2 * _err(same, ref.double()) + 1e-3
