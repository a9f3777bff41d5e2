"""Fused channel RMS norm + SiLU (Wan / Qwen-Image VAE) against a float64 reference.

On CPU the Triton kernel runs through Triton's interpreter (TRITON_INTERPRET=1, set by
conftest), so sizes are small; the `gpu` cases take real 2512x2512 activations.
"""

import pytest
import torch

from qwen_turbo.kernels import channel_rms_norm_silu as mod
from qwen_turbo.kernels.channel_rms_norm_silu import (
    ChannelRMSNormSiLU,
    channel_rms_norm_silu,
    channel_rms_norm_silu_reference,
)
from tests.kernels.common import (
    DTYPES,
    assert_cuda_graph_replays,
    assert_error_rule,
    assert_logged_once,
    needs_cuda,
    needs_triton,
    ulps,
)

OP = "channel_rms_norm_silu"  # as the fallback log names it
REFERENCES = (mod, "channel_rms_norm_silu_reference")  # what `kernel_only` makes fail


def _inputs(shape, dtype, seed, bias=True, param_shape=None, device="cpu"):
    """x with a non-zero mean, random gamma and bias, all rounded to `dtype`."""
    g = torch.Generator().manual_seed(seed)
    c = shape[1]
    param_shape = param_shape or (c,) + (1,) * (len(shape) - 2)
    x = torch.randn(shape, generator=g) * 2 + 0.5
    gamma = torch.randn(param_shape, generator=g) * 0.5 + 1
    b = torch.randn(param_shape, generator=g) if bias else None
    to = dict(dtype=dtype, device=device)
    return x.to(**to), gamma.to(**to), (None if b is None else b.to(**to))


def _assert_close_to_fp64(out, x, gamma, bias, silu):
    """Flash-attention's rule: the kernel's error against float64 is at most ~2x the error of
    the same-dtype PyTorch reference, plus one rounding of the output scale."""
    assert out.dtype == x.dtype and out.shape == x.shape and out.is_contiguous()
    assert not out.isnan().any()
    args = (None if bias is None else bias.double(), silu)
    exact = channel_rms_norm_silu_reference(x.double(), gamma.double(), *args)
    eager = channel_rms_norm_silu_reference(x, gamma, bias, silu)
    assert_error_rule(out, exact, eager, ulps(1, x.dtype, exact))


# (shape, silu, bias): the Wan/Qwen VAE widths, odd maps, 4-D and 5-D with T = 1 and 2.
CASES = [
    ((2, 96, 17, 29), True, True),
    ((2, 192, 5, 157), False, True),
    ((2, 384, 1, 1), True, False),
    ((2, 96, 1, 17, 29), False, False),
    ((2, 192, 2, 5, 157), True, True),
    ((2, 384, 2, 1, 1), False, True),
]


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,silu,bias", CASES)
def test_kernel_matches_fp64(dtype, shape, silu, bias):
    x, gamma, b = _inputs(shape, dtype, seed=shape[1] * 7 + len(shape), bias=bias)
    out = torch.full_like(x, float("nan"))  # poisoned: every element must be written
    b_flat = None if b is None else b.reshape(-1)
    mod._launch(x, gamma.reshape(-1), b_flat, silu, 1e-12, out)
    _assert_close_to_fp64(out, x, gamma, b, silu)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("silu", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_public_function_silu_and_bias(kernel_only, dtype, silu, bias):
    x, gamma, b = _inputs((2, 96, 17, 29), dtype, seed=3, bias=bias)
    out = channel_rms_norm_silu(x, gamma, b, silu=silu)
    _assert_close_to_fp64(out, x, gamma, b, silu)


def _channels_last_4d(shape, dtype, seed):
    x, gamma, b = _inputs(shape, dtype, seed)
    return x.to(memory_format=torch.channels_last), gamma, b


def _channels_last_5d(shape, dtype, seed):
    x, gamma, b = _inputs(shape, dtype, seed)
    return x.permute(0, 2, 3, 4, 1).contiguous().permute(0, 4, 1, 2, 3), gamma, b


def _sliced(shape, dtype, seed):
    wider = shape[:-1] + (shape[-1] + 3,)
    x, gamma, b = _inputs(wider, dtype, seed)
    return x[..., 1:-2], gamma, b


@needs_triton
@pytest.mark.parametrize(
    "make,shape",
    [
        (_channels_last_4d, (2, 96, 17, 29)),
        (_channels_last_5d, (2, 192, 2, 5, 29)),
        (_sliced, (2, 96, 1, 17, 29)),
        (_sliced, (2, 384, 5, 7)),
    ],
)
def test_non_contiguous_input(kernel_only, make, shape):
    x, gamma, b = make(shape, torch.bfloat16, seed=11)
    assert not x.is_contiguous() and x.shape == shape
    out = channel_rms_norm_silu(x, gamma, b)
    _assert_close_to_fp64(out, x, gamma, b, True)


@needs_triton
@pytest.mark.parametrize("param_shape", [(96,), (1, 96, 1, 1), (96, 1, 1, 1)])
def test_gamma_shapes_and_float32_params(kernel_only, param_shape):
    """Any C-element gamma/bias works; float32 params are rounded to x's dtype, as ComfyUI."""
    x, gamma, b = _inputs((2, 96, 5, 7), torch.bfloat16, 5, param_shape=param_shape)
    _, gamma32, b32 = _inputs((2, 96, 5, 7), torch.float32, 5, param_shape=param_shape)
    out = channel_rms_norm_silu(x, gamma32, b32)
    _assert_close_to_fp64(out, x, gamma.reshape(96, 1, 1), b.reshape(96, 1, 1), True)


@needs_triton
@pytest.mark.parametrize("c", [96, 192])
def test_channel_chunks_when_c_exceeds_the_tile(kernel_only, monkeypatch, c):
    """The two-sweep path (C > MAX_C_BLOCK), here with 64-channel chunks, one partial."""
    monkeypatch.setattr(mod, "MAX_C_BLOCK", 64)
    assert mod._block_sizes(c, 85)[0] == 64
    x, gamma, b = _inputs((2, c, 5, 17), torch.float32, seed=c)
    out = torch.full_like(x, float("nan"))
    mod._launch(x, gamma.reshape(-1), b.reshape(-1), True, 1e-12, out)
    _assert_close_to_fp64(out, x, gamma, b, True)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_vector_gives_bias_not_nan(kernel_only, dtype):
    """F.normalize clamps the norm at eps; the kernel must not divide 0 by 0 (float16 eager
    does: 1e-12 underflows to 0 in float16)."""
    x, gamma, b = _inputs((1, 96, 3, 5), dtype, seed=2)
    x[:, :, 1, 2] = 0
    out = channel_rms_norm_silu(x, gamma, b, silu=False)
    assert not out.isnan().any()
    torch.testing.assert_close(out[0, :, 1, 2], b.reshape(-1), rtol=0, atol=0)


@needs_triton
def test_empty_input(kernel_only):
    x, gamma, b = _inputs((0, 96, 3, 5), torch.bfloat16, seed=0)
    assert channel_rms_norm_silu(x, gamma, b).shape == x.shape


# Fallbacks: each branch of the dispatcher sends the call to the reference, logged once.


def _assert_falls_back(x, gamma, b, caplog, reason):
    out = channel_rms_norm_silu(x, gamma, b)
    ref = channel_rms_norm_silu_reference(x, gamma, b)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert_logged_once(caplog, OP, reason)


def test_fallback_3d_input(fresh_log):
    x, gamma, b = _inputs((2, 96, 17), torch.float32, seed=0)
    _assert_falls_back(x, gamma, b, fresh_log, "3 dims")


def test_fallback_gamma_not_per_channel(fresh_log):
    """A per-sample (B, C, 1, 1) gamma still broadcasts in the reference, as in ComfyUI."""
    x, _, b = _inputs((2, 96, 3, 5), torch.float32, seed=0)
    gamma = torch.randn(2, 96, 1, 1, generator=torch.Generator().manual_seed(1))
    _assert_falls_back(x, gamma, b, fresh_log, "one value per channel")


# The module wrapper against ComfyUI's own RMS_norm (+ nn.SiLU).


@pytest.mark.parametrize(
    "shape,silu,bias", [((2, 96, 17, 29), True, False), ((2, 192, 2, 5, 29), False, True)]
)
@pytest.mark.host
def test_wrapper_matches_comfyui_rms_norm(shape, silu, bias):
    from comfy.ldm.wan.vae import RMS_norm

    g = torch.Generator().manual_seed(9)
    c = shape[1]
    norm = RMS_norm(c, images=len(shape) == 4, bias=bias)  # float32 params, as loaded
    with torch.no_grad():
        norm.gamma.copy_(torch.randn(norm.gamma.shape, generator=g) * 0.5 + 1)
        if bias:
            norm.bias.copy_(torch.randn(norm.bias.shape, generator=g))
    fused = ChannelRMSNormSiLU(norm, silu=silu)
    assert fused.gamma is norm.gamma and fused.state_dict().keys() == norm.state_dict().keys()
    x = (torch.randn(shape, generator=g) * 2 + 0.5).to(torch.bfloat16)
    with torch.inference_mode():  # as ComfyUI runs the VAE
        comfy = torch.nn.SiLU()(norm(x)) if silu else norm(x)
        out = fused(x)
    assert out.dtype == comfy.dtype and out.shape == comfy.shape
    gamma = norm.gamma.detach().to(x)
    b = None if norm.bias is None else norm.bias.detach().to(x)
    torch.testing.assert_close(
        comfy, channel_rms_norm_silu_reference(x, gamma, b, silu), rtol=0, atol=0
    )
    _assert_close_to_fp64(out, x, gamma, b, silu)


@pytest.mark.host
def test_wrapper_rejects_channel_last_norm():
    from comfy.ldm.wan.vae import RMS_norm

    with pytest.raises(ValueError, match="channel_first"):
        ChannelRMSNormSiLU(RMS_norm(96, channel_first=False), silu=True)


# GPU: real VAE activation sizes, int64 offsets, CUDA graphs.


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", [(1, 96, 2512, 2512), (1, 384, 2, 628, 628)])
def test_gpu_large_bf16(kernel_only, shape):
    x, gamma, b = _inputs(shape, torch.bfloat16, seed=1, device="cuda")
    out = channel_rms_norm_silu(x, gamma, b)
    # float32 stands in for float64 here: its error is far below bfloat16's
    exact = channel_rms_norm_silu_reference(x.float(), gamma.float(), b.float())
    assert_error_rule(out, exact, channel_rms_norm_silu_reference(x, gamma, b), 1e-2)


@pytest.mark.gpu
@pytest.mark.slow
@needs_cuda
def test_gpu_offsets_past_2_pow_31(kernel_only):
    """4 x 96 x 2512 x 2512 = 2.4 G elements: the last sample starts past 2^31."""
    shape = (4, 96, 2512, 2512)
    x = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
    x[3:], gamma, b = _inputs((1,) + shape[1:], torch.bfloat16, seed=2, device="cuda")
    assert x.numel() > 2**31
    out = channel_rms_norm_silu(x, gamma, b)
    ref = channel_rms_norm_silu_reference(x[3:].float(), gamma.float(), b.float())
    err = (out[3:].float() - ref).abs().max().item()
    assert err <= 0.05, err


@pytest.mark.gpu
@needs_cuda
def test_gpu_cuda_graph_capture(kernel_only):
    x, gamma, b = _inputs((1, 192, 2, 157, 113), torch.bfloat16, seed=3, device="cuda")
    assert_cuda_graph_replays(lambda: channel_rms_norm_silu(x, gamma, b), x, -1)
