"""gated_residual and gated_residual_layernorm_modulate (Qwen-Image MMDiT) against float64.

On CPU the Triton kernels run through Triton's interpreter (TRITON_INTERPRET=1, set by
conftest), so row counts stay small; the `gpu` cases take the real image stream (B=1,
L=24905, D=3072, bf16). Tolerance rule (flash-attention's): the kernel's max error against
float64 may be at most twice the error of ComfyUI's own same-dtype ops, plus two ulps of the
output's magnitude. ComfyUI's `x + gate * y` rounds twice and the kernel once, so the kernel
is usually the closer of the two; `test_single_rounding` holds it to that.
"""

import copy
import math

import pytest
import torch

from qwen_turbo.kernels import gated_residual as mod
from qwen_turbo.kernels.fp8_linear import Unscaled
from qwen_turbo.kernels.gated_residual import (
    gated_residual,
    gated_residual_layernorm_modulate,
    gated_residual_layernorm_modulate_reference,
    gated_residual_reference,
)
from qwen_turbo.kernels.layernorm_modulate import (
    MAX_D,
    layernorm_modulate,
    layernorm_modulate_reference,
)
from tests.harness.models import host_rope
from tests.kernels.common import (
    DTYPES,
    assert_error_rule,
    assert_logged_once,
    needs_cuda,
    needs_triton,
    ulps,
)

OP, OP_FUSED = "gated_residual", "gated_residual_layernorm_modulate"  # as the log names them
# what `kernel_only` makes fail
REFERENCES = (mod, "gated_residual_reference", "gated_residual_layernorm_modulate_reference")


def _inputs(shape, dtype, seed, device="cpu", modulation=False):
    """x (B, L, D) with a non-zero mean, y (B, L, D), gate (B, D); with `modulation` also
    shift and scale (B, D). All rounded to `dtype`."""
    g = torch.Generator().manual_seed(seed)
    b, _, d = shape
    x = torch.randn(shape, generator=g) * 2 + 3
    y = torch.randn(shape, generator=g)
    gate = torch.randn(b, d, generator=g) * 0.5
    ts = [x, y, gate]
    if modulation:
        ts += [torch.randn(b, d, generator=g), torch.randn(b, d, generator=g) * 0.5]
    return [t.to(dtype=dtype, device=device) for t in ts]


def _rule(out, exact, eager):
    """Kernel error vs float64 <= 2 x (eager same-dtype error vs float64) + 2 ulps."""
    assert out.dtype == eager.dtype and out.shape == eager.shape
    assert not out.isnan().any()
    assert_error_rule(out, exact, eager, ulps(2, out.dtype, exact))


def _assert_close_to_fp64(out, x, y, gate):
    exact = gated_residual_reference(x.double(), y.double(), gate.double())
    _rule(out, exact, gated_residual_reference(x, y, gate))


def _assert_fused_close_to_fp64(h, out, x, y, gate, shift, scale):
    """Both outputs: h against the float64 residual; out against the float64 LayerNorm +
    modulation of the *rounded* h (the kernel normalises h as stored, as the block reads it)."""
    _assert_close_to_fp64(h, x, y, gate)
    exact = layernorm_modulate_reference(h.double(), shift.double(), scale.double())
    _rule(out, exact, layernorm_modulate_reference(h, shift, scale))


def _ulp(v, dtype):
    """One ulp of the float64 values v in `dtype` (the subnormal step below the normal range)."""
    fi = torch.finfo(dtype)
    _, e = torch.frexp(v.abs())
    return torch.ldexp(torch.ones_like(v), e - 1).clamp_min(fi.tiny) * fi.eps


def _rounding_excess(out, x, y, gate):
    """Elementwise |out - exact| beyond one rounding of a float32 computation, as a fraction of
    the allowed bound (<= 1 passes): half an ulp of the dtype (a whole ulp for bf16 under the
    interpreter, which truncates float32 -> bf16 stores) plus float32 error on gate * y."""
    xd, gy = x.double(), gate.double().unsqueeze(1) * y.double()
    exact = xd + gy
    half = 1.0 if out.dtype == torch.bfloat16 and not out.is_cuda else 0.5
    ulp = _ulp(torch.maximum(out.double().abs(), exact.abs()), out.dtype)
    eps32 = torch.finfo(torch.float32).eps
    bound = half * ulp + eps32 * (gy.abs() + exact.abs())
    return ((out.double() - exact).abs() / bound).max().item()


# (B, L, D): tiny and real widths (3072 = 3 full 1024-chunks; 96 one masked chunk), odd L.
SHAPES = [(2, 17, 64), (2, 1, 3072), (2, 5, 3072), (1, 17, 96)]


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_fp64(dtype, shape):
    x, y, gate = _inputs(shape, dtype, seed=shape[1] * 31 + shape[2])
    out = torch.full_like(x, float("nan"))  # poisoned: every element must be written
    mod._launch(x, y, gate, out)
    _assert_close_to_fp64(out, x, y, gate)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_single_rounding(kernel_only, dtype):
    """Each element is within one rounding of the exact x + gate * y; the bound is tight
    enough that ComfyUI's two roundings (gate * y, then + x) break it in float16."""
    x, y, gate = _inputs((2, 5, 3072), dtype, seed=12)
    assert _rounding_excess(gated_residual(x, y, gate), x, y, gate) <= 1
    if dtype == torch.float16:
        assert _rounding_excess(gated_residual_reference(x, y, gate), x, y, gate) > 1


@needs_triton
def test_row_chunks_with_partial_last(kernel_only, monkeypatch):
    """D = 80 in 32-wide chunks: a row split over three programs, the last half masked."""
    monkeypatch.setattr(mod, "MAX_BLOCK_D", 32)
    x, y, gate = _inputs((2, 17, 80), torch.float32, seed=13)
    out = torch.full_like(x, float("nan"))
    mod._launch(x, y, gate, out)
    _assert_close_to_fp64(out, x, y, gate)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_public_function(kernel_only, dtype):
    x, y, gate = _inputs((2, 17, 96), dtype, seed=1)
    out = gated_residual(x, y, gate)
    assert out.is_contiguous()
    _assert_close_to_fp64(out, x, y, gate)


@needs_triton
def test_many_rows_odd_length(kernel_only):
    x, y, gate = _inputs((2, 257, 64), torch.bfloat16, seed=2)
    _assert_close_to_fp64(gated_residual(x, y, gate), x, y, gate)


def _as_block_views(x, y, gate, *mods):
    """The layouts the block hands over: x the image part of a joint [text; image] sequence
    (strided rows), y a transposed view (D not contiguous: copied first), gate and the
    modulation as chunks of a (B, 6D) vector (strided rows, taken as they are)."""
    b, n, d = x.shape
    joint = torch.cat([torch.zeros(b, 7, d, dtype=x.dtype), x], dim=1)
    y = y.transpose(1, 2).contiguous().transpose(1, 2)
    pad = torch.ones(b, (5 - len(mods)) * d, dtype=x.dtype)
    chunks = torch.cat([gate, *mods, pad], dim=1).chunk(6, dim=-1)
    return joint[:, 7:], y, *chunks[: 1 + len(mods)]


@needs_triton
def test_non_contiguous_inputs(kernel_only):
    x, y, gate = _as_block_views(*_inputs((2, 17, 96), torch.bfloat16, seed=5))
    assert not x.is_contiguous() and x.stride(-1) == 1
    assert y.stride(-1) != 1 and gate.stride(0) == 6 * 96
    out = gated_residual(x, y, gate)
    assert out.is_contiguous()
    _assert_close_to_fp64(out, x, y, gate)


@needs_triton
def test_launch_into_strided_out():
    """The launcher writes a strided view (a slice of a joint sequence) and nothing else."""
    x, y, gate = _inputs((2, 17, 64), torch.float32, seed=6)
    joint = torch.full((2, 17 + 5, 64), float("nan"))
    out = mod._launch(x, y, gate, joint[:, 5:])
    _assert_close_to_fp64(out, x, y, gate)
    assert joint[:, :5].isnan().all()


@needs_triton
def test_empty_input(kernel_only):
    x, y, gate = _inputs((2, 0, 64), torch.bfloat16, seed=0)
    assert gated_residual(x, y, gate).shape == x.shape
    _, _, _, shift, scale = _inputs((2, 0, 64), torch.bfloat16, seed=0, modulation=True)
    h, out = gated_residual_layernorm_modulate(x, y, gate, shift, scale)
    assert h.shape == out.shape == x.shape


# The fused residual + LayerNorm + modulation.

FUSED_SHAPES = [(2, 17, 64), (2, 5, 3072), (1, 17, 96)]


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", FUSED_SHAPES)
def test_fused_matches_fp64(dtype, shape):
    x, y, gate, shift, scale = _inputs(shape, dtype, seed=shape[2] + 1, modulation=True)
    h = torch.full_like(x, float("nan"))
    out = torch.full_like(x, float("nan"))
    mod._launch_fused(x, y, gate, shift, scale, 1e-6, h, out)
    _assert_fused_close_to_fp64(h, out, x, y, gate, shift, scale)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_equals_the_two_kernels(kernel_only, dtype):
    """Same bits as gated_residual then layernorm_modulate: the norm reads h as stored."""
    x, y, gate, shift, scale = _inputs((2, 17, 96), dtype, seed=14, modulation=True)
    h, out = gated_residual_layernorm_modulate(x, y, gate, shift, scale)
    h2 = gated_residual(x, y, gate)
    torch.testing.assert_close(h, h2, rtol=0, atol=0)
    torch.testing.assert_close(out, layernorm_modulate(h2, shift, scale), rtol=0, atol=0)
    _assert_fused_close_to_fp64(h, out, x, y, gate, shift, scale)


@needs_triton
def test_fused_non_contiguous_inputs(kernel_only):
    args = _as_block_views(*_inputs((2, 17, 96), torch.bfloat16, seed=15, modulation=True))
    h, out = gated_residual_layernorm_modulate(*args)
    assert h.is_contiguous() and out.is_contiguous()
    _assert_fused_close_to_fp64(h, out, *args)


@needs_triton
def test_fused_launch_into_strided_outs():
    x, y, gate, shift, scale = _inputs((2, 17, 64), torch.float32, seed=16, modulation=True)
    joint = torch.full((2, 2, 17 + 5, 64), float("nan"))
    h, out = mod._launch_fused(x, y, gate, shift, scale, 1e-6, joint[:, 0, 5:], joint[:, 1, 5:])
    _assert_fused_close_to_fp64(h, out, x, y, gate, shift, scale)
    assert joint[:, :, :5].isnan().all()


def _unscaled_inputs(shape, dtype, seed):
    """x, an `Unscaled` y (raw, row scales of 1e-2 .. 1e2, bias) and gate, in `dtype`."""
    x, raw, gate = _inputs(shape, dtype, seed)
    b, n, d = shape
    g = torch.Generator().manual_seed(seed + 1)
    row_scale = 10.0 ** (torch.rand(b * n, 1, generator=g) * 4 - 2)
    return x, Unscaled(raw, row_scale, torch.randn(d, generator=g).to(dtype)), gate


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 7, 3072), (2, 5, 123)])
def test_unscaled_y(kernel_only, dtype, shape):
    """An fp8 GEMM's `Unscaled` output, finished in float32 as it is read: against float64,
    within the rule's bound for the same sum with y finished first (in float64)."""
    x, y, gate = _unscaled_inputs(shape, dtype, seed=shape[2])
    out = gated_residual(x, y, gate)
    y64 = y.raw.double() * y.row_scale.double().reshape(*shape[:2], 1) + y.bias.double()
    exact = gated_residual_reference(x.double(), y64, gate.double())
    _rule(out, exact, gated_residual_reference(x, y.value(), gate))


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_unscaled_y(kernel_only, dtype):
    """The residual and the next pre-norm with an `Unscaled` y: h as `gated_residual` gives
    it, and out the LayerNorm-modulated h as stored."""
    x, y, gate = _unscaled_inputs((2, 5, 256), dtype, seed=9)
    _, _, _, shift, scale = _inputs((2, 5, 256), dtype, seed=10, modulation=True)
    h, out = gated_residual_layernorm_modulate(x, y, gate, shift, scale)
    torch.testing.assert_close(h, gated_residual(x, y, gate), rtol=0, atol=0)
    torch.testing.assert_close(out, layernorm_modulate(h, shift, scale), rtol=0, atol=0)


def test_unscaled_y_falls_back(fresh_log):
    """A non-contiguous unscaled output: the reference, on y finished first."""
    x, y, gate = _unscaled_inputs((1, 3, 64), torch.float32, seed=4)
    y = y._replace(raw=y.raw.mT.contiguous().mT)
    out = gated_residual(x, y, gate)
    expected = gated_residual_reference(x, y.value(), gate)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert_logged_once(fresh_log, OP, "not contiguous with a scale per row")


# Fallbacks: each branch of the dispatchers sends the call to the reference, logged once.


def _assert_falls_back(x, y, gate, caplog, reason):
    out = gated_residual(x, y, gate)
    torch.testing.assert_close(out, gated_residual_reference(x, y, gate), rtol=0, atol=0)
    assert_logged_once(caplog, OP, reason)


def _assert_fused_falls_back(args, caplog, reason):
    h, out = gated_residual_layernorm_modulate(*args)
    h_ref, out_ref = gated_residual_layernorm_modulate_reference(*args)
    torch.testing.assert_close(h, h_ref, rtol=0, atol=0)
    torch.testing.assert_close(out, out_ref, rtol=0, atol=0)
    assert_logged_once(caplog, OP_FUSED, reason)


def test_fallback_mixed_dtypes(fresh_log):
    """A float32 gate with bf16 x and y: ComfyUI's ops promote to float32; so does the
    fallback (the kernel would return bf16)."""
    x, y, _ = _inputs((1, 3, 64), torch.bfloat16, seed=0)
    gate = _inputs((1, 3, 64), torch.float32, seed=0)[2]
    _assert_falls_back(x, y, gate, fresh_log, "differs from x's dtype torch.bfloat16")
    assert gated_residual(x, y, gate).dtype == torch.float32


def test_fallback_4d_input(fresh_log):
    x, y, gate = _inputs((2, 6, 64), torch.float32, seed=0)
    x, y = x.reshape(2, 2, 3, 64), y.reshape(2, 2, 3, 64)
    _assert_falls_back(x, y, gate[:, None], fresh_log, "x has 4 dims")


def test_fallback_y_shape_mismatch(fresh_log):
    """y broadcast over tokens (B, 1, D) still works in the reference."""
    x, y, gate = _inputs((2, 3, 64), torch.float32, seed=0)
    _assert_falls_back(x, y[:, :1], gate, fresh_log, "is not x's (2, 3, 64)")


def test_fallback_gate_shape_mismatch(fresh_log):
    """One (1, D) gate for a batch of 2 still broadcasts in the reference."""
    x, y, gate = _inputs((2, 3, 64), torch.float32, seed=0)
    _assert_falls_back(x, y, gate[:1], fresh_log, "gate of shape (1, 64) is not (B, D)")


def test_fused_fallback_modulation_shape(fresh_log):
    x, y, gate, shift, scale = _inputs((2, 3, 64), torch.float32, seed=0, modulation=True)
    args = (x, y, gate, shift[:1], scale)
    _assert_fused_falls_back(args, fresh_log, "modulation of shape (1, 64) is not (B, D)")


def test_fused_fallback_too_wide(fresh_log):
    """Rows wider than one program holds use the reference (the plain residual does not)."""
    d = MAX_D + 8
    args = _inputs((1, 2, d), torch.bfloat16, seed=0, modulation=True)
    _assert_fused_falls_back(args, fresh_log, f"D = {d} is wider")


@needs_triton
def test_wide_rows_take_the_residual_kernel(kernel_only):
    """The plain residual has no width limit: its rows are split into chunks."""
    x, y, gate = _inputs((1, 2, MAX_D + 8), torch.bfloat16, seed=0)
    _assert_close_to_fp64(gated_residual(x, y, gate), x, y, gate)


# ComfyUI's own QwenImageTransformerBlock, its elementwise steps done by the kernels.


def _init_block(block, seed):
    """Random weights (disable_weight_init leaves them uninitialised): Linear weights with
    1/sqrt(fan_in) scale, norm weights near 1, biases small."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in block.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if p.ndim == 2:
                p.copy_(r / math.sqrt(p.shape[1]))
            elif "norm" in name:
                p.copy_(1 + 0.1 * r)
            else:
                p.copy_(0.1 * r)


def _rotary(n, head_dim, seed):
    """Random per-position 2x2 rotations, the (1, L, 1, head_dim / 2, 2, 2) layout of
    comfy.ldm.qwen_image.model.apply_rotary_emb."""
    theta = torch.rand(n, head_dim // 2, generator=torch.Generator().manual_seed(seed)) * 6.3
    c, s = theta.cos(), theta.sin()
    return torch.stack([torch.stack([c, -s], -1), torch.stack([s, c], -1)], -2)[None, :, None]


def _block_with_kernels(block, img, txt, temb, rope):
    """QwenImageTransformerBlock.forward with its norm/modulate/residual steps replaced by
    the pack's ops (what the Optimized Loader will do); attention and MLPs are the block's."""
    img_mod1, img_mod2 = block.img_mod(temb).chunk(2, dim=-1)
    txt_mod1, txt_mod2 = block.txt_mod(temb).chunk(2, dim=-1)
    i_shift1, i_scale1, i_gate1 = img_mod1.chunk(3, dim=-1)
    i_shift2, i_scale2, i_gate2 = img_mod2.chunk(3, dim=-1)
    t_shift1, t_scale1, t_gate1 = txt_mod1.chunk(3, dim=-1)
    t_shift2, t_scale2, t_gate2 = txt_mod2.chunk(3, dim=-1)
    img_attn, txt_attn = block.attn(
        hidden_states=layernorm_modulate(img, i_shift1, i_scale1),
        encoder_hidden_states=layernorm_modulate(txt, t_shift1, t_scale1),
        encoder_hidden_states_mask=None,
        image_rotary_emb=rope,
    )
    img, img_mlp_in = gated_residual_layernorm_modulate(img, img_attn, i_gate1, i_shift2, i_scale2)
    txt, txt_mlp_in = gated_residual_layernorm_modulate(txt, txt_attn, t_gate1, t_shift2, t_scale2)
    img = gated_residual(img, block.img_mlp(img_mlp_in), i_gate2)
    txt = gated_residual(txt, block.txt_mlp(txt_mlp_in), t_gate2)
    return txt, img


@pytest.mark.host
@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_comfyui_block_forward_with_kernels(kernel_only, monkeypatch, dtype):
    """The whole block, ComfyUI's forward vs the kernels' version, both against the block run
    in float64: the kernels' error is at most ~2x ComfyUI's own."""
    import comfy.model_management
    import comfy.ops
    from comfy.ldm.qwen_image.model import QwenImageTransformerBlock

    d, heads, head_dim, n_img, n_txt = 64, 2, 32, 17, 5
    ops = comfy.ops.disable_weight_init
    block = QwenImageTransformerBlock(d, heads, head_dim, dtype=dtype, operations=ops)
    _init_block(block, seed=20)
    block64 = copy.deepcopy(block).double()
    g = torch.Generator().manual_seed(21)
    img = (torch.randn(2, n_img, d, generator=g) * 2 + 3).to(dtype)
    txt = (torch.randn(2, n_txt, d, generator=g) * 2 - 1).to(dtype)
    temb = torch.randn(2, d, generator=g).to(dtype)
    rope = host_rope(_rotary(n_txt + n_img, head_dim, seed=22))
    # Newer hosts' comfy-kitchen RoPE takes no float64; their plain torch RoPE does.
    monkeypatch.setattr(comfy.model_management, "in_training", False, raising=False)
    with torch.inference_mode():  # as ComfyUI samples
        comfy_txt, comfy_img = block(img, txt, None, temb, rope.to(dtype))
        ours_txt, ours_img = _block_with_kernels(block, img, txt, temb, rope.to(dtype))
        comfy.model_management.in_training = True
        exact_txt, exact_img = block64(img.double(), txt.double(), None, temb.double(), rope)
    _rule(ours_img, exact_img, comfy_img)
    _rule(ours_txt, exact_txt, comfy_txt)


# GPU: the real Qwen-Image image stream, int64 offsets.


def _gpu_rule(out, exact32, eager):
    """float32 stands in for float64 on the GPU: its error is far below bfloat16's."""
    assert_error_rule(out, exact32, eager, ulps(2, out.dtype, exact32))


@pytest.mark.gpu
@needs_cuda
def test_gpu_real_size_bf16(kernel_only):
    x, y, gate = _inputs((1, 24905, 3072), torch.bfloat16, seed=1, device="cuda")
    out = gated_residual(x, y, gate)
    exact = gated_residual_reference(x.float(), y.float(), gate.float())
    _gpu_rule(out, exact, gated_residual_reference(x, y, gate))
    assert _rounding_excess(out, x, y, gate) <= 1  # round-to-nearest on the GPU: half an ulp


@pytest.mark.gpu
@needs_cuda
def test_gpu_fused_real_size_bf16(kernel_only):
    args = _inputs((1, 24905, 3072), torch.bfloat16, seed=2, device="cuda", modulation=True)
    x, y, gate, shift, scale = args
    h, out = gated_residual_layernorm_modulate(*args)
    torch.testing.assert_close(h, gated_residual(x, y, gate), rtol=0, atol=0)
    exact = layernorm_modulate_reference(h.float(), shift.float(), scale.float())
    _gpu_rule(out, exact, layernorm_modulate_reference(h, shift, scale))


@pytest.mark.gpu
@pytest.mark.slow
@needs_cuda
def test_gpu_offsets_past_2_pow_31(kernel_only):
    """30 x 24905 x 3072 = 2.3 G elements: the last sample starts past 2^31."""
    shape = (30, 24905, 3072)
    assert (shape[0] - 1) * shape[1] * shape[2] > 2**31
    x = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
    y = torch.zeros_like(x)
    last = _inputs((1,) + shape[1:], torch.bfloat16, seed=3, device="cuda")
    x[-1:], y[-1:] = last[0], last[1]
    gate = last[2].expand(shape[0], -1).contiguous()
    out = gated_residual(x, y, gate)
    assert _rounding_excess(out[-1:], *last) <= 1
    assert not out[:-1].any()
