"""layernorm_modulate (Qwen-Image pre-norm + adaLN modulation) against a float64 reference.

On CPU the Triton kernel runs through Triton's interpreter (TRITON_INTERPRET=1, set by
conftest), about 5 ms per token row, so row counts stay small; the `gpu` cases take the real
1328x1328 image stream (B=1, L=24905, D=3072, bf16).
Tolerance rule (flash-attention's): the kernel's max error against float64 may be at most
twice the error of ComfyUI's own same-dtype ops, plus two ulps of the output's magnitude.
"""

import pytest
import torch

from qwen_turbo.kernels import layernorm_modulate as mod
from qwen_turbo.kernels.layernorm_modulate import (
    layernorm_modulate,
    layernorm_modulate_reference,
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

OP = "layernorm_modulate"  # as the fallback log names it
REFERENCES = (mod, "layernorm_modulate_reference")  # what `kernel_only` makes fail


def _inputs(shape, dtype, seed, device="cpu", mean=3.0, std=2.0):
    """x (B, L, D) with a non-zero mean; shift, scale (B, D); all rounded to `dtype`."""
    g = torch.Generator().manual_seed(seed)
    b, _, d = shape
    x = torch.randn(shape, generator=g) * std + mean
    shift = torch.randn(b, d, generator=g)
    scale = torch.randn(b, d, generator=g) * 0.5
    to = dict(dtype=dtype, device=device)
    return x.to(**to), shift.to(**to), scale.to(**to)


def _assert_close_to_fp64(out, x, shift, scale):
    """Kernel error vs float64 <= 2 x (ComfyUI's same-dtype error vs float64) + 2 ulps."""
    assert out.dtype == x.dtype and out.shape == x.shape
    assert not out.isnan().any()
    exact = layernorm_modulate_reference(x.double(), shift.double(), scale.double())
    eager = layernorm_modulate_reference(x, shift, scale)
    assert_error_rule(out, exact, eager, ulps(2, x.dtype, exact))


# (B, L, D): tiny and real widths (3072 is Qwen-Image's; 96 is not a power of 2), odd L.
SHAPES = [(2, 17, 64), (2, 1, 3072), (2, 5, 3072), (1, 17, 96)]


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_fp64(dtype, shape):
    x, shift, scale = _inputs(shape, dtype, seed=shape[1] * 31 + shape[2])
    out = torch.full_like(x, float("nan"))  # poisoned: every element must be written
    mod._launch(x, shift, scale, 1e-6, out)
    _assert_close_to_fp64(out, x, shift, scale)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_public_function(kernel_only, dtype):
    x, shift, scale = _inputs((2, 17, 96), dtype, seed=1)
    out = layernorm_modulate(x, shift, scale)
    assert out.is_contiguous()
    _assert_close_to_fp64(out, x, shift, scale)


@needs_triton
def test_many_rows_odd_length(kernel_only):
    """L = 257 (two batches, 514 programs): row indexing past one wave of programs."""
    x, shift, scale = _inputs((2, 257, 64), torch.bfloat16, seed=2)
    _assert_close_to_fp64(layernorm_modulate(x, shift, scale), x, shift, scale)


@needs_triton
@pytest.mark.parametrize("mean,std", [(1000.0, 0.01), (-300.0, 1e-3)])
def test_large_mean_small_spread_float32(kernel_only, mean, std):
    """|mean| / std = 1e5: float32 statistics must not cancel. (PyTorch's CPU layer_norm is
    off by ~1e-2 on these unit-variance outputs; the kernel's corrected mean keeps ~1e-6.)"""
    x, shift, scale = _inputs((2, 3, 3072), torch.float32, seed=3, mean=mean, std=std)
    out = layernorm_modulate(x, shift, scale)
    _assert_close_to_fp64(out, x, shift, scale)
    exact = layernorm_modulate_reference(x.double(), shift.double(), scale.double())
    assert (out.double() - exact).abs().max().item() < 1e-5


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_constant_row_gives_shift(kernel_only, dtype):
    """A constant row has variance 0: the normalised row is 0, so the output is shift,
    not NaN (eps keeps rstd finite) and not rounding noise times 1/sqrt(eps)."""
    x, shift, scale = _inputs((2, 3, 96), dtype, seed=4)
    x[1, 2] = 3.0
    x[0, 0] = 0.0
    out = layernorm_modulate(x, shift, scale)
    torch.testing.assert_close(out[1, 2], shift[1], rtol=0, atol=0)
    torch.testing.assert_close(out[0, 0], shift[0], rtol=0, atol=0)


def _transposed(shape, dtype, seed):
    """x as a (B, D, L) tensor seen transposed: D is not the contiguous dim (copied first)."""
    x, shift, scale = _inputs(shape, dtype, seed)
    return x.transpose(1, 2).contiguous().transpose(1, 2), shift, scale


def _joint_slice(shape, dtype, seed):
    """x as the image part of a joint [text; image] sequence, shift/scale as chunks of a
    (B, 6D) modulation vector, as in the block: strided rows, taken without a copy."""
    b, n, d = shape
    x, shift, scale = _inputs(shape, dtype, seed)
    joint = torch.cat([torch.zeros(b, 7, d, dtype=dtype), x], dim=1)
    mods = torch.cat([shift, scale, torch.ones(b, 4 * d, dtype=dtype)], dim=1)
    return joint[:, 7:], *mods.chunk(6, dim=-1)[:2]


@needs_triton
@pytest.mark.parametrize("make", [_transposed, _joint_slice])
def test_non_contiguous_inputs(kernel_only, make):
    x, shift, scale = make((2, 17, 96), torch.bfloat16, seed=5)
    assert not x.is_contiguous()
    if make is _joint_slice:
        assert x.stride(-1) == 1 and shift.stride(0) == 6 * 96 and not shift.is_contiguous()
    out = layernorm_modulate(x, shift, scale)
    assert out.is_contiguous()
    _assert_close_to_fp64(out, x, shift, scale)


@needs_triton
def test_launch_into_strided_out():
    """The launcher writes a strided view (a slice of a joint sequence) and nothing else."""
    x, shift, scale = _inputs((2, 17, 64), torch.float32, seed=6)
    joint = torch.full((2, 17 + 5, 64), float("nan"))
    out = mod._launch(x, shift, scale, 1e-6, joint[:, 5:])
    _assert_close_to_fp64(out, x, shift, scale)
    assert joint[:, :5].isnan().all()


@needs_triton
@pytest.mark.parametrize("eps", [1e-6, 1e-2])
def test_eps_is_used(kernel_only, eps):
    x, shift, scale = _inputs((1, 3, 64), torch.float32, seed=7, mean=0.0, std=0.05)
    out = layernorm_modulate(x, shift, scale, eps=eps)
    ref = layernorm_modulate_reference(x.double(), shift.double(), scale.double(), eps)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@needs_triton
def test_empty_input(kernel_only):
    x, shift, scale = _inputs((2, 0, 64), torch.bfloat16, seed=0)
    assert layernorm_modulate(x, shift, scale).shape == x.shape


# Fallbacks: each branch of the dispatcher sends the call to the reference, logged once.


def _assert_falls_back(x, shift, scale, caplog, reason):
    out = layernorm_modulate(x, shift, scale)
    ref = layernorm_modulate_reference(x, shift, scale)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert_logged_once(caplog, OP, reason)


def test_fallback_mixed_dtypes(fresh_log):
    """float32 modulation with bf16 x: ComfyUI's ops promote to float32; so does the fallback."""
    x, _, _ = _inputs((1, 3, 64), torch.bfloat16, seed=0)
    _, shift, scale = _inputs((1, 3, 64), torch.float32, seed=0)
    _assert_falls_back(x, shift, scale, fresh_log, "differs from x's torch.bfloat16")
    assert layernorm_modulate(x, shift, scale).dtype == torch.float32


def test_fallback_4d_input(fresh_log):
    """(B, T, L, D) with (B, 1, D) modulation broadcasts in the reference; the kernel takes 3-D."""
    x, shift, scale = _inputs((2, 6, 64), torch.float32, seed=0)
    x = x.reshape(2, 2, 3, 64)
    _assert_falls_back(x, shift[:, None], scale[:, None], fresh_log, "x has 4 dims")


def test_fallback_shape_mismatch(fresh_log):
    """One (1, D) modulation for a batch of 2 still broadcasts in the reference."""
    x, shift, scale = _inputs((2, 3, 64), torch.float32, seed=0)
    _assert_falls_back(x, shift[:1], scale[:1], fresh_log, "is not (B, D) = (2, 64)")


def test_fallback_too_wide(fresh_log):
    d = mod.MAX_D + 8
    x, shift, scale = _inputs((1, 2, d), torch.bfloat16, seed=0)
    _assert_falls_back(x, shift, scale, fresh_log, f"D = {d} is wider")


@needs_triton
def test_no_grad_takes_the_kernel(kernel_only):
    x, shift, scale = _inputs((1, 3, 64), torch.float32, seed=0)
    scale.requires_grad_()
    with torch.no_grad():
        _assert_close_to_fp64(layernorm_modulate(x, shift, scale), x, shift, scale)


# ComfyUI's own block: img_norm1 + _modulate, the step the kernel replaces.


@pytest.mark.host
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_comfyui_block_norm1_modulate(dtype):
    import comfy.ops
    from comfy.ldm.qwen_image.model import QwenImageTransformerBlock

    d = 64
    block = QwenImageTransformerBlock(
        dim=d,
        num_attention_heads=2,
        attention_head_dim=32,
        dtype=dtype,
        operations=comfy.ops.disable_weight_init,
    )
    g = torch.Generator().manual_seed(10)
    with torch.no_grad():  # disable_weight_init leaves the modulation Linear uninitialised
        for p in block.img_mod.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    temb = torch.randn(2, d, generator=g).to(dtype)
    x = (torch.randn(2, 17, d, generator=g) * 2 + 3).to(dtype)
    with torch.inference_mode():  # as ComfyUI samples
        img_mod1 = block.img_mod(temb).chunk(2, dim=-1)[0]  # (B, 3D): shift, scale, gate
        comfy_out, gate = block._modulate(block.img_norm1(x), img_mod1)
        shift, scale, _ = img_mod1.chunk(3, dim=-1)  # strided (B, D) views, as the block has
        ref = layernorm_modulate_reference(x, shift, scale)
        out = layernorm_modulate(x, shift, scale)
    assert gate.shape == (2, 1, d)
    torch.testing.assert_close(comfy_out, ref, rtol=0, atol=0)  # the reference is ComfyUI's
    _assert_close_to_fp64(out, x, shift, scale)


# GPU: the real Qwen-Image image stream, int64 offsets, CUDA graphs.


def _gpu_check(out, x, shift, scale):
    """float32 stands in for float64 on the GPU: its error is far below bfloat16's."""
    exact = layernorm_modulate_reference(x.float(), shift.float(), scale.float())
    eager = layernorm_modulate_reference(x, shift, scale)
    assert_error_rule(out, exact, eager, ulps(2, x.dtype, exact))


@pytest.mark.gpu
@needs_cuda
def test_gpu_real_size_bf16(kernel_only):
    """The image stream at the size the Optimized Loader targets: one sample, 24905 tokens
    (odd), D = 3072."""
    x, shift, scale = _inputs((1, 24905, 3072), torch.bfloat16, seed=1, device="cuda")
    out = layernorm_modulate(x, shift, scale)
    _gpu_check(out, x, shift, scale)


@pytest.mark.gpu
@pytest.mark.slow
@needs_cuda
def test_gpu_offsets_past_2_pow_31(kernel_only):
    """30 x 24905 x 3072 = 2.3 G elements: the last sample starts past 2^31."""
    shape = (30, 24905, 3072)
    x = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
    assert x.numel() > 2**31 and (shape[0] - 1) * shape[1] * shape[2] > 2**31
    last, shift, scale = _inputs((1,) + shape[1:], torch.bfloat16, seed=2, device="cuda")
    x[-1:] = last
    shift, scale = shift.expand(shape[0], -1).contiguous(), scale.expand(shape[0], -1).contiguous()
    out = layernorm_modulate(x, shift, scale)
    _gpu_check(out[-1:], last, shift[-1:], scale[-1:])
    torch.testing.assert_close(out[0], shift[0].expand(shape[1], -1), rtol=0, atol=0)


@pytest.mark.gpu
@needs_cuda
def test_gpu_cuda_graph_capture(kernel_only):
    x, shift, scale = _inputs((2, 4097, 3072), torch.bfloat16, seed=3, device="cuda")
    assert_cuda_graph_replays(lambda: layernorm_modulate(x, shift, scale), x, 1)
