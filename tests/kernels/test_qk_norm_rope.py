"""Fused per-head RMS norm + RoPE (Qwen-Image attention Q/K) against a float64 reference.

On CPU the Triton kernel runs through Triton's interpreter (TRITON_INTERPRET=1, set by
conftest), at a few ms a program, so sequences are short; the `gpu` case takes the real
24905-token sequence. Rotation tables come from ComfyUI's own EmbedND and Qwen-Image ids.
"""

from types import SimpleNamespace

import pytest
import torch

from qwen_turbo.kernels import qk_norm_rope as mod
from qwen_turbo.kernels.fp8_linear import Unscaled
from qwen_turbo.kernels.qk_norm_rope import (
    qk_norm_rope,
    qk_norm_rope_into,
    qk_norm_rope_reference,
)
from tests.harness.models import host_rope
from tests.kernels.common import (
    DTYPES,
    assert_cuda_graph_replays,
    assert_error_rule,
    assert_logged_once,
    needs_cuda,
    needs_triton,
    rotations,
    ulps,
)

LAYOUTS = ["bhld", "blhd"]
OP = "qk_norm_rope"  # as the fallback log names it
REFERENCES = (mod, "qk_norm_rope_reference")  # what `kernel_only` makes fail

# The rotation tables come from ComfyUI's own code (EmbedND, process_img): every host.
pytestmark = pytest.mark.host


def _axes(dh):
    """Qwen-Image's (16, 56, 56) split of 128 head dims, scaled to dh (each part even)."""
    first = dh // 8
    return [first, (dh - first) // 2, (dh - first) // 2]


def _freqs(n_txt, h, w, dh, batch, dtype, device="cpu"):
    """The rotation table of `n_txt` text tokens then an h x w image, as Qwen-Image builds it:
    ComfyUI's own image ids (process_img), text ids from its _forward, ComfyUI's EmbedND.
    Returns (batch, n_txt + h * w, 1, dh / 2, 2, 2) in `dtype`."""
    from comfy.ldm.flux.layers import EmbedND
    from comfy.ldm.qwen_image.model import QwenImageTransformer2DModel

    latent = torch.zeros(batch, 16, 1, 2 * h, 2 * w, device=device)
    _, img_ids, _ = QwenImageTransformer2DModel.process_img(SimpleNamespace(patch_size=2), latent)
    txt_start = max(w // 2, h // 2)
    txt_ids = torch.arange(txt_start, txt_start + n_txt, device=device)
    txt_ids = txt_ids.reshape(1, -1, 1).repeat(batch, 1, 3)
    ids = torch.cat((txt_ids, img_ids), dim=1)
    pe = EmbedND(dim=dh, theta=10000, axes_dim=_axes(dh))
    return pe(ids).squeeze(1).unsqueeze(2).to(dtype)


# (n_txt, h, w) giving the odd sequence lengths 1, 17 and 263.
SEQ = {1: (0, 1, 1), 17: (5, 3, 4), 263: (38, 15, 15)}


def _inputs(shape, dtype, seed, device="cpu", batch_freqs=None):
    """x ~ N(0.3, 1.5), weight ~ N(1, 0.5) rounded to `dtype`, and the EmbedND table."""
    b, seq, h, dh = shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 1.5 + 0.3
    weight = torch.randn(dh, generator=g) * 0.5 + 1
    freqs = _freqs(*SEQ[seq], dh, batch_freqs or b, dtype, device)
    return x.to(dtype=dtype, device=device), weight.to(dtype=dtype, device=device), freqs


def _assert_close_to_fp64(out, x, weight, freqs, out_layout="bhld", eps=1e-6):
    """Flash-attention's rule: the kernel's error against float64 is at most 2x the error of
    the same-dtype ComfyUI ops, plus one rounding of the output scale."""
    b, seq, h, dh = x.shape
    shape = (b, h, seq, dh) if out_layout == "bhld" else (b, seq, h, dh)
    assert out.dtype == x.dtype and out.shape == shape and out.is_contiguous()
    assert not out.isnan().any()
    exact = qk_norm_rope_reference(x.double(), weight.double(), freqs.double(), eps, out_layout)
    eager = qk_norm_rope_reference(x, weight, freqs, eps, out_layout)
    assert_error_rule(out, exact, eager, ulps(1, x.dtype, exact))


def _poisoned(x, out_layout):
    """A NaN-filled output buffer and its (B, L, H, Dh)-indexed view for the launcher."""
    b, seq, h, dh = x.shape
    if out_layout == "bhld":
        buf = torch.full((b, h, seq, dh), float("nan"), dtype=x.dtype)
        return buf, buf.transpose(1, 2)
    buf = torch.full((b, seq, h, dh), float("nan"), dtype=x.dtype)
    return buf, buf


# (B, L, H, Dh, layout): Qwen-Image's 24 heads of 128 (3 programs a token) and 2 heads (one
# partial head block), Dh 64 (16 heads a program), odd lengths 1 and 17, both layouts.
CASES = [
    (2, 1, 24, 128, "bhld"),
    (2, 17, 2, 128, "blhd"),
    (1, 17, 24, 128, "bhld"),
    (1, 17, 24, 64, "blhd"),
    (1, 17, 2, 64, "bhld"),
]


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,seq,h,dh,out_layout", CASES)
def test_kernel_matches_fp64(dtype, b, seq, h, dh, out_layout):
    x, weight, freqs = _inputs((b, seq, h, dh), dtype, seed=seq * 31 + h + dh)
    buf, view = _poisoned(x, out_layout)  # every element must be written
    assert mod._launch(x, weight, freqs, 1e-6, view) is view
    _assert_close_to_fp64(buf, x, weight, freqs, out_layout)


@needs_triton
def test_public_function_real_heads_odd_length(kernel_only):
    """24 heads of 128 over 263 tokens (38 text + 15 x 15 image), bfloat16 as in the model.
    789 programs: about 10 s in the interpreter, so one layout (CASES cover the other)."""
    x, weight, freqs = _inputs((1, 263, 24, 128), torch.bfloat16, seed=263)
    _assert_close_to_fp64(qk_norm_rope(x, weight, freqs), x, weight, freqs)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_public_function_dtypes(kernel_only, dtype):
    x, weight, freqs = _inputs((2, 17, 3, 128), dtype, seed=5)
    _assert_close_to_fp64(qk_norm_rope(x, weight, freqs), x, weight, freqs)


@needs_triton
@pytest.mark.parametrize("out_layout", LAYOUTS)
def test_non_contiguous_qkv_slice(kernel_only, out_layout):
    """k from a fused (B, L, 3 * H * Dh) projection: strides (3 H Dh L, 3 H Dh, Dh, 1)."""
    b, seq, h, dh = 2, 17, 3, 128
    g = torch.Generator().manual_seed(7)
    qkv = (torch.randn(b, seq, 3 * h * dh, generator=g) * 1.5).to(torch.bfloat16)
    k = qkv[..., h * dh : 2 * h * dh].unflatten(-1, (h, dh))
    assert not k.is_contiguous() and k.stride() == (3 * h * dh * seq, 3 * h * dh, dh, 1)
    _, weight, freqs = _inputs((b, seq, h, dh), torch.bfloat16, seed=7)
    out = qk_norm_rope(k, weight, freqs, out_layout=out_layout)
    _assert_close_to_fp64(out, k, weight, freqs, out_layout)


@needs_triton
def test_non_unit_last_stride(kernel_only):
    """x with a transposed (L, Dh) pair: the head row is strided, not contiguous."""
    x, weight, freqs = _inputs((1, 17, 2, 64), torch.float16, seed=8)
    x = x.permute(0, 3, 2, 1).contiguous().permute(0, 3, 2, 1)
    assert x.stride(-1) != 1
    _assert_close_to_fp64(qk_norm_rope(x, weight, freqs), x, weight, freqs)


@needs_triton
def test_head_size_not_a_power_of_two(kernel_only):
    """Dh = 96: the tile is 128 wide, the last 32 dims and 16 rotations masked."""
    x, weight, freqs = _inputs((2, 17, 3, 96), torch.bfloat16, seed=9)
    buf, view = _poisoned(x, "bhld")
    mod._launch(x, weight, freqs, 1e-6, view)
    _assert_close_to_fp64(buf, x, weight, freqs)


@needs_triton
def test_freqs_shared_by_the_batch(kernel_only):
    """A (1, ...) table serves every sample (batch stride 0), as an expanded one does."""
    x, weight, freqs = _inputs((2, 17, 2, 64), torch.bfloat16, seed=10, batch_freqs=1)
    out = qk_norm_rope(x, weight, freqs)
    _assert_close_to_fp64(out, x, weight, freqs)
    expanded = freqs.expand(2, *freqs.shape[1:])
    torch.testing.assert_close(out, qk_norm_rope(x, weight, expanded), rtol=0, atol=0)


@needs_triton
def test_freqs_sliced_from_the_joint_table(kernel_only):
    """The image part [:, n_txt:] of the joint text+image table, as a fused attention would
    pass it: not contiguous, read through its strides without a copy."""
    b, h, dh = 2, 2, 64
    n_txt, ih, iw = SEQ[17]
    joint = _freqs(n_txt, ih, iw, dh, b, torch.bfloat16)
    freqs = joint[:, n_txt:]
    assert not freqs.is_contiguous()
    g = torch.Generator().manual_seed(10)
    x = torch.randn(b, ih * iw, h, dh, generator=g).to(torch.bfloat16)
    weight = (torch.randn(dh, generator=g) * 0.5 + 1).to(torch.bfloat16)
    _assert_close_to_fp64(qk_norm_rope(x, weight, freqs), x, weight, freqs)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_any_2x2_table_per_sample(kernel_only, dtype):
    """ComfyUI's tables repeat across the batch and are rotations; the kernel reads each
    sample's table and all four entries of each matrix, so random matrices that differ
    per sample must work too."""
    x, weight, _ = _inputs((2, 17, 3, 64), dtype, seed=18)
    g = torch.Generator().manual_seed(18)
    freqs = torch.randn(2, 17, 1, 32, 2, 2, generator=g).to(dtype)
    buf, view = _poisoned(x, "bhld")
    mod._launch(x, weight, freqs, 1e-6, view)
    _assert_close_to_fp64(buf, x, weight, freqs)


@needs_triton
def test_float32_table_and_weight_with_bf16_x(kernel_only):
    """A float32 weight is rounded to x's dtype (as comfy.ops casts it); a float32 table is
    read as is, and the result is still bfloat16."""
    x, weight, freqs = _inputs((2, 17, 2, 64), torch.bfloat16, seed=11)
    freqs32 = _freqs(*SEQ[17], 64, 2, torch.float32)
    out = qk_norm_rope(x, weight.float(), freqs32)
    _assert_close_to_fp64(out, x, weight, freqs32)


@needs_triton
def test_launcher_writes_slices_of_a_joint_buffer(kernel_only):
    """Text and image q, normed with their own weights, written into one (B, H, L, Dh)
    buffer at their offsets: the joint query attention takes, with no cat or transpose."""
    b, h, dh = 2, 3, 64
    n_txt, ih, iw = SEQ[17]
    g = torch.Generator().manual_seed(12)
    txt = torch.randn(b, n_txt, h, dh, generator=g).to(torch.bfloat16)
    img = torch.randn(b, ih * iw, h, dh, generator=g).to(torch.bfloat16)
    w_txt, w_img = (torch.randn(2, dh, generator=g) * 0.5 + 1).to(torch.bfloat16)
    freqs = _freqs(n_txt, ih, iw, dh, b, torch.bfloat16)
    joint = torch.full((b, h, 17, dh), float("nan"), dtype=torch.bfloat16)
    mod._launch(txt, w_txt, freqs[:, :n_txt], 1e-6, joint[:, :, :n_txt].transpose(1, 2))
    mod._launch(img, w_img, freqs[:, n_txt:], 1e-6, joint[:, :, n_txt:].transpose(1, 2))
    _assert_close_to_fp64(joint[:, :, :n_txt].contiguous(), txt, w_txt, freqs[:, :n_txt])
    _assert_close_to_fp64(joint[:, :, n_txt:].contiguous(), img, w_img, freqs[:, n_txt:])


@needs_triton
def test_zero_head_gives_zero(kernel_only):
    """An all-zero head: rstd = 1/sqrt(eps), 0 * rstd = 0, no NaN."""
    x, weight, freqs = _inputs((1, 1, 2, 128), torch.float16, seed=13)
    x[0, 0, 1] = 0
    out = qk_norm_rope(x, weight, freqs)
    assert torch.equal(out[0, 1, 0], torch.zeros(128, dtype=torch.float16))
    _assert_close_to_fp64(out, x, weight, freqs)


@needs_triton
@pytest.mark.parametrize("out_layout", LAYOUTS)
def test_empty_sequence(kernel_only, out_layout):
    x = torch.zeros(2, 0, 3, 64, dtype=torch.bfloat16)
    freqs = torch.zeros(2, 0, 1, 32, 2, 2, dtype=torch.bfloat16)
    out = qk_norm_rope(x, torch.ones(64, dtype=torch.bfloat16), freqs, out_layout=out_layout)
    assert out.shape == ((2, 3, 0, 64) if out_layout == "bhld" else (2, 0, 3, 64))


def test_bad_layout_is_an_error():
    x, weight, freqs = _inputs((1, 1, 2, 64), torch.float32, seed=0)
    with pytest.raises(ValueError, match="'bhld' or 'blhd'"):
        qk_norm_rope(x, weight, freqs, out_layout="bshd")


# Fallbacks: each branch of the dispatcher sends the call to the reference, logged once.


def _assert_falls_back(x, weight, freqs, caplog, reason):
    out = qk_norm_rope(x, weight, freqs)
    ref = qk_norm_rope_reference(x, weight, freqs)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert out.is_contiguous()
    assert_logged_once(caplog, OP, reason)


def test_fallback_float64_table(fresh_log):
    """A float64 table with a float32 x: ComfyUI's op promotes; the result is rounded back."""
    x, weight, freqs = _inputs((1, 1, 2, 64), torch.float32, seed=0)
    _assert_falls_back(x, weight, freqs.double(), fresh_log, "freqs torch.float64")


def test_fallback_3d_input(fresh_log):
    """x without its batch axis, (L, H, Dh): not the kernel's; the reference broadcasts."""
    x, weight, freqs = _inputs((1, 1, 2, 64), torch.float32, seed=0)
    _assert_falls_back(x[0], weight, freqs[0], fresh_log, "3 dims")


def test_fallback_head_size_too_large(fresh_log):
    """Dh > 256 does not fit a program's tile; the reference still computes it."""
    x = torch.randn(1, 3, 2, 258, generator=torch.Generator().manual_seed(0))
    freqs = rotations((1, 3, 1, 129, 2, 2))
    _assert_falls_back(x, torch.ones(258), freqs, fresh_log, "head size 258")


def test_fallback_odd_head_size(fresh_log):
    """An odd Dh has no pairs to rotate: the fallback raises ComfyUI's own reshape error."""
    x = torch.randn(1, 3, 2, 5, generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError):
        qk_norm_rope(x, torch.ones(5), rotations((1, 3, 1, 2, 2, 2)))
    assert_logged_once(fresh_log, OP, "head size 5 is odd")


def test_fallback_weight_shape(fresh_log):
    """A (H, Dh) weight makes F.rms_norm normalise whole tokens, not heads: the reference."""
    x, weight, freqs = _inputs((1, 1, 2, 64), torch.float32, seed=0)
    weight = torch.stack([weight, weight.flip(0)])
    _assert_falls_back(x, weight, freqs, fresh_log, "weight has shape (2, 64)")


@pytest.mark.parametrize(
    "shape,reason",
    [
        ((2, 17, 2, 32, 2, 2), "freqs has shape (2, 17, 2, 32, 2, 2)"),  # one table a head
        ((1, 1, 1, 32, 2, 2), "freqs has shape (1, 1, 1, 32, 2, 2)"),  # one for all tokens
    ],
)
def test_fallback_freqs_that_broadcast(fresh_log, shape, reason):
    """Tables the kernel does not index but ComfyUI's op broadcasts: the reference."""
    x, weight, _ = _inputs((2, 17, 2, 64), torch.float32, seed=0)
    _assert_falls_back(x, weight, rotations(shape), fresh_log, reason)


@pytest.mark.parametrize(
    "shape,reason",
    [
        ((3, 17, 1, 32, 2, 2), "not (2 or 1, 17, 1, 32, 2, 2)"),  # batch 3 for x's 2
        ((2, 263, 1, 32, 2, 2), "freqs has shape (2, 263"),  # another sequence length
        ((2, 17, 32, 2, 2), "freqs has shape (2, 17, 32, 2, 2)"),  # no head axis
    ],
)
def test_fallback_freqs_mismatch(fresh_log, shape, reason):
    """A table for other tokens: the fallback raises the error ComfyUI's op raises."""
    x, weight, _ = _inputs((2, 17, 2, 64), torch.float32, seed=0)
    freqs = rotations(shape)
    with pytest.raises(RuntimeError):
        qk_norm_rope(x, weight, freqs)
    assert_logged_once(fresh_log, OP, reason)


def test_fallback_freqs_on_another_device(fresh_log):
    x, weight, freqs = _inputs((1, 1, 2, 64), torch.float32, seed=0)
    with pytest.raises((RuntimeError, NotImplementedError)):
        qk_norm_rope(x, weight, freqs.to("meta"))
    assert_logged_once(fresh_log, OP, "freqs is on meta")


# Against ComfyUI's real Attention module: its q and k, as they reach attention.


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_comfyui_attention(kernel_only, monkeypatch, dtype):
    """Run ComfyUI's Qwen-Image `Attention.forward` with the attention call replaced by a
    recorder; the reference must give its joint q and k bit for bit, and the kernel,
    writing text and image parts into one (B, H, L, Dh) buffer, the fp64 rule."""
    import comfy.ldm.qwen_image.model as qwen
    import comfy.ops

    b, heads, dh, dim = 2, 2, 32, 64
    n_txt, ih, iw = SEQ[17]
    g = torch.Generator().manual_seed(16)
    attn = qwen.Attention(
        query_dim=dim,
        dim_head=dh,
        heads=heads,
        out_dim=dim,
        bias=True,
        eps=1e-6,
        dtype=dtype,
        operations=comfy.ops.disable_weight_init,
    )
    with torch.no_grad():
        for name, p in attn.named_parameters():
            scale, shift = (0.5, 1.0) if name.startswith("norm") else (dim**-0.5, 0.0)
            p.copy_(torch.randn(p.shape, generator=g) * scale + shift)
    img = torch.randn(b, ih * iw, dim, generator=g).to(dtype)
    txt = torch.randn(b, n_txt, dim, generator=g).to(dtype)
    freqs = _freqs(n_txt, ih, iw, dh, b, dtype)

    seen = {}

    class Recorded(Exception):
        pass

    def record(q, k, v, heads, mask=None, skip_reshape=False, **kwargs):
        # (B, H, L, Dh) on newer hosts; v0.3.64 passes (B, L, H * Dh), which backends view so
        for name, t in (("q", q), ("k", k)):
            seen[name] = t if skip_reshape else t.unflatten(-1, (heads, -1)).transpose(1, 2)
        raise Recorded

    monkeypatch.setattr(qwen, "optimized_attention_masked", record)
    with torch.inference_mode():  # as ComfyUI samples
        with pytest.raises(Recorded):
            attn(img, txt, image_rotary_emb=host_rope(freqs))
        for name, (img_proj, txt_proj, img_norm, txt_norm) in {
            "q": (attn.to_q, attn.add_q_proj, attn.norm_q, attn.norm_added_q),
            "k": (attn.to_k, attn.add_k_proj, attn.norm_k, attn.norm_added_k),
        }.items():
            comfy_out = seen[name]
            joint = torch.full((b, heads, n_txt + ih * iw, dh), float("nan"), dtype=dtype)
            refs, exacts = [], []
            for proj, norm, hidden, sl in (
                (txt_proj, txt_norm, txt, slice(0, n_txt)),
                (img_proj, img_norm, img, slice(n_txt, None)),
            ):
                x = proj(hidden).unflatten(-1, (heads, -1))
                mod._launch(x, norm.weight, freqs[:, sl], 1e-6, joint[:, :, sl].transpose(1, 2))
                _assert_close_to_fp64(joint[:, :, sl].contiguous(), x, norm.weight, freqs[:, sl])
                refs.append(qk_norm_rope_reference(x, norm.weight, freqs[:, sl]))
                w64, f64 = norm.weight.double(), freqs[:, sl].double()
                exacts.append(qk_norm_rope_reference(x.double(), w64, f64))
            if hasattr(qwen, "apply_rope1"):  # comfy-kitchen's RoPE rounds its own way
                exact = torch.cat(exacts, dim=2)
                assert_error_rule(joint, exact, comfy_out, ulps(1, dtype, exact))
            else:
                torch.testing.assert_close(torch.cat(refs, dim=2), comfy_out, rtol=0, atol=0)


# GPU: the real Qwen-Image sequence (256 text + 157 x 157 image tokens), 24 heads of 128.


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("out_layout", LAYOUTS)
def test_gpu_real_size_bf16(kernel_only, out_layout):
    b, n_txt, ih, iw, h, dh = 1, 256, 157, 157, 24, 128
    seq = n_txt + ih * iw
    assert seq == 24905
    g = torch.Generator().manual_seed(17)
    qkv = (torch.randn(b, seq, 3 * h * dh, generator=g) * 1.5 + 0.3).to("cuda", torch.bfloat16)
    x = qkv[..., : h * dh].unflatten(-1, (h, dh))  # q of a fused projection
    weight = (torch.randn(dh, generator=g) * 0.5 + 1).to("cuda", torch.bfloat16)
    freqs = _freqs(n_txt, ih, iw, dh, b, torch.bfloat16, device="cuda")
    out = qk_norm_rope(x, weight, freqs, out_layout=out_layout)
    # float32 stands in for float64 here: its error is far below bfloat16's
    args = (weight.float(), freqs.float(), 1e-6, out_layout)
    exact = qk_norm_rope_reference(x.float(), *args)
    eager = qk_norm_rope_reference(x, weight, freqs, 1e-6, out_layout)
    assert out.shape == eager.shape and out.is_contiguous()
    assert_error_rule(out, exact, eager, 1e-2)


@pytest.mark.gpu
@needs_cuda
def test_gpu_cuda_graph_capture(kernel_only):
    x, weight, freqs = _inputs((1, 263, 24, 128), torch.bfloat16, seed=19, device="cuda")
    assert_cuda_graph_replays(lambda: qk_norm_rope(x, weight, freqs), x, 1)


# qk_norm_rope_into: each stream written into its rows of one joint (B, L_txt + L_img, H, Dh)
# buffer (the Optimized Loader's joint attention), so no torch.cat follows.


def _streams(b, h, dh, dtype, seed, device="cpu"):
    """Text then image x (B, L, H, Dh), each with its own norm weight and its slice of the
    joint rotation table: SEQ[17]'s 5 text and 3 x 4 image tokens. Returns a list of
    (x, weight, freqs, rows of the joint sequence)."""
    n_txt, ih, iw = SEQ[17]
    g = torch.Generator().manual_seed(seed)
    freqs = _freqs(n_txt, ih, iw, dh, b, dtype, device)
    streams = []
    for rows in (slice(0, n_txt), slice(n_txt, n_txt + ih * iw)):
        x = torch.randn(b, rows.stop - rows.start, h, dh, generator=g) * 1.5 + 0.3
        weight = torch.randn(dh, generator=g) * 0.5 + 1
        to = {"dtype": dtype, "device": device}
        streams.append((x.to(**to), weight.to(**to), freqs[:, rows], rows))
    return streams


def _joint_cat(streams):
    """What the rows must hold: the two streams' qk_norm_rope in (B, L, H, Dh), concatenated."""
    return torch.cat([qk_norm_rope(x, w, f, out_layout="blhd") for x, w, f, _ in streams], dim=1)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_into_joint_buffer_equals_cat(kernel_only, dtype):
    """Text and image rows written into one poisoned joint buffer: the same bits as the two
    qk_norm_rope calls concatenated, and every element written."""
    streams = _streams(2, 3, 64, dtype, seed=20)
    joint = torch.full((2, 17, 3, 64), float("nan"), dtype=dtype)
    for x, weight, freqs, rows in streams:
        view = joint[:, rows]
        assert qk_norm_rope_into(x, weight, freqs, view) is view
    torch.testing.assert_close(joint, _joint_cat(streams), rtol=0, atol=0)
    for x, weight, freqs, rows in streams:
        _assert_close_to_fp64(joint[:, rows].contiguous(), x, weight, freqs, "blhd")


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_into_unscaled_input(kernel_only, dtype):
    """An fp8 GEMM's `Unscaled` (B, L, H * Dh) output, finished in float32 as it is read:
    the kernel's float32 result for that value, rounded to `dtype` once (one ulp apart at
    most: Triton's interpreter truncates to bfloat16)."""
    x, weight, freqs = _inputs((2, 17, 3, 64), dtype, seed=22)
    g = torch.Generator().manual_seed(23)
    y = Unscaled(x.flatten(2), torch.rand(34, 1, generator=g) * 3 + 0.1,
                 torch.randn(192, generator=g).to(dtype))  # fmt: skip
    out = torch.full(x.shape, float("nan"), dtype=dtype)
    qk_norm_rope_into(y, weight, freqs, out)
    finished = y.raw.float() * y.row_scale.reshape(2, 17, 1) + y.bias.float()
    expected = qk_norm_rope(finished.reshape(x.shape), weight, freqs, out_layout="blhd")
    ulp = torch.finfo(dtype).eps * expected.abs()
    assert ((out.float() - expected).abs() <= ulp).all()


def test_into_unscaled_falls_back(fresh_log):
    """Where the kernel cannot run (a float64 table), y is finished first, then the
    reference runs."""
    x, weight, freqs = _inputs((1, 17, 2, 64), torch.float32, seed=24)
    y = Unscaled(x.flatten(2), torch.rand(17, 1) + 0.5, torch.randn(128))
    out = qk_norm_rope_into(y, weight, freqs.double(), torch.empty_like(x))
    expected = qk_norm_rope_reference(y.value().unflatten(-1, (2, 64)), weight, freqs.double(),
                                      1e-6, "blhd")  # fmt: skip
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert_logged_once(fresh_log, "qk_norm_rope", "dtypes x torch.float32, freqs torch.float64")


def _out_view(kind, b, seq, h, dh, dtype):
    """A NaN-filled buffer and the (B, L, H, Dh) view of it to write: the image rows of a
    joint sequence with 2 rows after them, the k slot of a fused (B, L, 3, H, Dh) qkv, or a
    (B, H, L, Dh) buffer seen through a transpose."""
    nan = float("nan")
    if kind == "joint_rows":
        buf = torch.full((b, 5 + seq + 2, h, dh), nan, dtype=dtype)
        return buf, buf[:, 5 : 5 + seq]
    if kind == "qkv_slot":
        buf = torch.full((b, seq, 3, h, dh), nan, dtype=dtype)
        return buf, buf[:, :, 1]
    buf = torch.full((b, h, seq, dh), nan, dtype=dtype)
    return buf, buf.transpose(1, 2)


@needs_triton
@pytest.mark.parametrize("kind", ["joint_rows", "qkv_slot", "bhld"])
def test_into_writes_the_view_and_nothing_else(kernel_only, kind):
    x, weight, freqs = _inputs((2, 17, 3, 64), torch.bfloat16, seed=21)
    buf, view = _out_view(kind, *x.shape, x.dtype)
    qk_norm_rope_into(x, weight, freqs, view)
    expected = qk_norm_rope(x, weight, freqs, out_layout="blhd")
    torch.testing.assert_close(view, expected, rtol=0, atol=0)
    assert not view.isnan().any()
    assert buf.isnan().sum().item() == buf.numel() - view.numel()  # the rest untouched


@pytest.mark.parametrize(
    "shape,dtype",
    [
        ((1, 17, 2, 64), torch.bfloat16),  # batch
        ((2, 16, 2, 64), torch.bfloat16),  # sequence
        ((2, 17, 3, 64), torch.bfloat16),  # heads
        ((2, 17, 2, 64), torch.float32),  # dtype
    ],
)
def test_into_mismatched_out_is_an_error(shape, dtype):
    x, weight, freqs = _inputs((2, 17, 2, 64), torch.bfloat16, seed=0)
    out = torch.full(shape, float("nan"), dtype=dtype)
    with pytest.raises(
        ValueError, match=r"out is \(.*\) torch\.\w+, x is \(2, 17, 2, 64\) torch.bfloat16"
    ):
        qk_norm_rope_into(x, weight, freqs, out)
    assert out.isnan().all()


def test_into_fallback_writes_its_rows_only(no_interpreter, fresh_log):
    """Each stream's rows hold the reference (B, L, H, Dh) result, the rest is untouched."""
    streams = _streams(2, 3, 64, torch.float32, seed=24)
    joint = torch.full((2, 17 + 2, 3, 64), float("nan"))
    for x, weight, freqs, rows in streams:
        view = joint[:, rows]
        assert qk_norm_rope_into(x, weight, freqs, view) is view
    expected = [qk_norm_rope_reference(x, w, f, 1e-6, "blhd") for x, w, f, _ in streams]
    torch.testing.assert_close(joint[:, :17], torch.cat(expected, dim=1), rtol=0, atol=0)
    assert joint[:, 17:].isnan().all()
    assert_logged_once(fresh_log, OP, "tensors on cpu")


@pytest.mark.gpu
@needs_cuda
def test_gpu_into_real_size_equals_cat(kernel_only):
    """Qwen-Image's 256 text + 157 x 157 image tokens, 24 heads of 128, bfloat16."""
    b, n_txt, ih, iw, h, dh = 1, 256, 157, 157, 24, 128
    g = torch.Generator().manual_seed(27)
    freqs = _freqs(n_txt, ih, iw, dh, b, torch.bfloat16, device="cuda")
    joint = torch.full(
        (b, n_txt + ih * iw, h, dh), float("nan"), dtype=torch.bfloat16, device="cuda"
    )
    expected = []
    for rows in (slice(0, n_txt), slice(n_txt, None)):
        n = joint[:, rows].shape[1]
        x = (torch.randn(b, n, h, dh, generator=g) * 1.5 + 0.3).to("cuda", torch.bfloat16)
        weight = (torch.randn(dh, generator=g) * 0.5 + 1).to("cuda", torch.bfloat16)
        qk_norm_rope_into(x, weight, freqs[:, rows], joint[:, rows])
        expected.append(qk_norm_rope(x, weight, freqs[:, rows], out_layout="blhd"))
    torch.testing.assert_close(joint, torch.cat(expected, dim=1), rtol=0, atol=0)
