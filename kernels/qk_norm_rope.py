"""Per-head RMS norm then rotary embedding, fused: the Q/K path of Qwen-Image's attention.

ComfyUI (comfy/ldm/qwen_image/model.py, `Attention.forward`) computes, for each of q and k
of both streams, in x's dtype,

    x = to_q(h).unflatten(-1, (H, Dh))            # (B, L, H, Dh), Dh = 128
    x = F.rms_norm(x, (Dh,), weight, eps=1e-6)    # comfy.ops RMSNorm over Dh
    x = apply_rotary_emb(x, freqs)                # 2x2 rotations of the pairs (x[2i], x[2i+1])

and the attention then views the result as (B, H, L, Dh). That is about seven elementwise
kernels per tensor, each reading and writing the whole activation and rounding to bf16.
The Triton kernel here reads x once (plus the small weight and rotation table) and writes
the output once, directly in the layout attention wants, rounding to x's dtype only at the
store.

`freqs` is ComfyUI's table, `pe_embedder(ids).squeeze(1).unsqueeze(2).to(x.dtype)`:
(B or 1, L, 1, Dh/2, 2, 2), where freqs[b, l, 0, i] is the matrix [[cos, -sin], [sin, cos]]
of pair i, applied as out[2i + r] = F[i, r, 0] * x[2i] + F[i, r, 1] * x[2i + 1]. The kernel
loads all four entries, so any 2x2 table gives ComfyUI's result.
"""

import torch
import torch.nn.functional as F

from ._triton import (
    DTYPES,
    HAS_TRITON,
    custom_op,
    fast_launch,
    grad_reason,
    log_fallback_once,
    tl,
    triton,
    unsupported,
)
from .fp8_linear import Unscaled

OP = "qk_norm_rope"
_LAYOUTS = ("bhld", "blhd")
# Largest head size the kernel takes: a program holds BLOCK_H whole heads in registers.
MAX_HEAD_DIM = 256
# Elements per tile, [BLOCK_H, D_BLOCK]: 8 heads of 128 (Qwen-Image: 24 heads, 3 programs a
# token), 16 of 64, 4 of 256.
_TILE = 1024


def _check_layout(out_layout: str) -> None:
    if out_layout not in _LAYOUTS:
        raise ValueError(f"out_layout is {out_layout!r}; use 'bhld' or 'blhd'")


def _out_shape(x: torch.Tensor, out_layout: str) -> tuple[int, int, int, int]:
    b, seq, h, d = x.shape
    return (b, h, seq, d) if out_layout == "bhld" else (b, seq, h, d)


def apply_rotary_emb(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """ComfyUI's `apply_rotary_emb` (comfy/ldm/qwen_image/model.py), op for op.

    x: (B, L, H, Dh); freqs: (B or 1, L, 1, Dh/2, 2, 2). Each product and the sum round to
    the promoted dtype of x and freqs.
    """
    if x.shape[1] == 0:
        return x
    t_ = x.reshape(*x.shape[:-1], -1, 1, 2)
    t_out = freqs[..., 0] * t_[..., 0] + freqs[..., 1] * t_[..., 1]
    return t_out.reshape(*x.shape)


def qk_norm_rope_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    freqs: torch.Tensor,
    eps: float = 1e-6,
    out_layout: str = "bhld",
) -> torch.Tensor:
    """Eager reference, the same ops in the same dtypes as ComfyUI's Qwen-Image attention.

    x: (B, L, H, Dh), any float dtype and strides. weight: (Dh,), cast to x's dtype and
    device as comfy.ops does (`comfy.rmsnorm.rms_norm`: F.rms_norm in x's dtype, which
    rounds x * rsqrt(mean(x^2) + eps) and then the product with weight). freqs:
    (B or 1, L, 1, Dh/2, 2, 2), normally in x's dtype. Then ComfyUI's `apply_rotary_emb`,
    and a contiguous copy in `out_layout`: (B, H, L, Dh) for "bhld", the layout attention
    takes, or (B, L, H, Dh) for "blhd". The result is in x's dtype (a float32 freqs with a
    bfloat16 x would promote the rotation; it is rounded back).
    """
    _check_layout(out_layout)
    y = F.rms_norm(x, weight.shape, weight.to(x), eps)
    y = apply_rotary_emb(y, freqs).to(x.dtype)
    if out_layout == "bhld":
        y = y.transpose(1, 2)
    return y.contiguous()


if HAS_TRITON:

    def _block_h(h: int, d_block: int) -> int:
        """Heads per program: all H when they fit the tile, else _TILE // D_BLOCK of them."""
        return max(1, min(triton.next_power_of_2(h), _TILE // d_block))

    @fast_launch
    @triton.jit
    def _qk_norm_rope_kernel(
        x_ptr,
        rs_ptr,
        b_ptr,
        w_ptr,
        f_ptr,
        out_ptr,
        L,
        H,
        sx_b,
        sx_l,
        sx_h,
        sx_d,
        sf_b,
        sf_l,
        so_b,
        so_l,
        so_h,
        so_d,
        eps,
        ROW_SCALE: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        D: tl.constexpr,
        BLOCK_H: tl.constexpr,
        HALF_BLOCK: tl.constexpr,
    ):
        """One program: BLOCK_H heads of one token (b, l).

        Grid (B * L, cdiv(H, BLOCK_H)). x and out are indexed as (B, L, H, D) through their
        strides (out is a view of a (B, H, L, D) or (B, L, H, D) buffer); the weight is
        contiguous (D,) and each token's (D/2, 2, 2) block of the table is contiguous. With
        ROW_SCALE and HAS_BIAS x is an `Unscaled` GEMM output: x * rs[b * L + l] + bias
        (rs float32 (B * L,), bias (H * D,)).
        """
        tok = tl.program_id(0)
        hb = tl.program_id(1)
        # int64 for every offset: a fused qkv of 10 samples of 24905 tokens (3 x 24 x 128
        # values a token) holds 2.3 G elements, past 2^31.
        b = (tok // L).to(tl.int64)
        pos = (tok % L).to(tl.int64)
        offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, 2 * HALF_BLOCK)
        mask_d = offs_d < D
        mask = (offs_h < H)[:, None] & mask_d[None, :]
        offs_h64 = offs_h.to(tl.int64)[:, None]
        offs_d64 = offs_d.to(tl.int64)[None, :]
        # A whole head is one row: with sx_d = 1 (specialised by Triton) a contiguous load.
        x_offs = b * sx_b + pos * sx_l + offs_h64 * sx_h + offs_d64 * sx_d
        x = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
        if ROW_SCALE:
            x = x * tl.load(rs_ptr + tok)
        if HAS_BIAS:
            x += tl.load(b_ptr + offs_h64 * D + offs_d64, mask=mask, other=0.0).to(tl.float32)

        # RMS over each head, in float32; masked dims (D < D_BLOCK) add 0. The mean of squares
        # is never negative, so no clamp is needed; sqrt_rn and div_rn are IEEE-rounded where
        # tl.rsqrt is an approximation, so float32 stays within an ulp or two of PyTorch.
        ms = tl.sum(x * x, axis=1) / D
        rstd = tl.div_rn(1.0, tl.sqrt_rn(ms + eps))
        w = tl.load(w_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        # ComfyUI rounds x * rstd to x's dtype before the weight; here it stays float32.
        y = x * rstd[:, None] * w[None, :]

        # Pairs (y[2i], y[2i+1]) as two [BLOCK_H, HALF_BLOCK] halves: the split is of
        # registers, the load above stays one contiguous row.
        y_even, y_odd = tl.split(tl.reshape(y, (BLOCK_H, HALF_BLOCK, 2)))
        # The token's rotations, f[i, r, c] at 4 i + 2 r + c: 4 * HALF_BLOCK contiguous values.
        offs_i = tl.arange(0, HALF_BLOCK)
        f_offs = b * sf_b + pos * sf_l + offs_i.to(tl.int64)[:, None] * 4
        f_offs = f_offs + tl.arange(0, 4)[None, :]
        f = tl.load(f_ptr + f_offs, mask=(offs_i < D // 2)[:, None], other=0.0)
        f_c0, f_c1 = tl.split(tl.reshape(f.to(tl.float32), (HALF_BLOCK, 2, 2)))  # f[:, :, c]
        f00, f10 = tl.split(f_c0)
        f01, f11 = tl.split(f_c1)
        out_even = f00[None, :] * y_even + f01[None, :] * y_odd
        out_odd = f10[None, :] * y_even + f11[None, :] * y_odd
        out = tl.reshape(tl.join(out_even, out_odd), (BLOCK_H, 2 * HALF_BLOCK))

        # The only rounding to the output dtype; ComfyUI rounds after each of ~6 ops.
        o_offs = b * so_b + pos * so_l + offs_h64 * so_h + offs_d64 * so_d
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=mask)

    def _launch(
        x: torch.Tensor,
        weight: torch.Tensor,
        freqs: torch.Tensor,
        eps: float,
        out: torch.Tensor,
        row_scale: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the kernel into `out` (x finished by row_scale and bias, an `Unscaled`'s).

        x: (B, L, H, Dh), any strides. weight: contiguous (Dh,) on x's device, any float
        dtype (upcast to float32; the dispatcher rounds it to x's dtype first, as ComfyUI).
        freqs: (B or 1, L, 1, Dh/2, 2, 2) with each token's (Dh/2, 2, 2) block contiguous.
        out: (B, L, H, Dh), any strides and float dtype, written and returned: e.g.
        `buf.transpose(1, 2)` for a (B, H, L, Dh) buffer, or a slice of a joint text+image
        buffer such as `joint[:, :, n_txt:].transpose(1, 2)`.
        """
        if out.numel() == 0:
            return out
        b, seq, h, d = x.shape
        d_block = triton.next_power_of_2(d)
        block_h = _block_h(h, d_block)
        grid = (b * seq, triton.cdiv(h, block_h))
        _qk_norm_rope_kernel[grid](
            x,
            weight if row_scale is None else row_scale,
            weight if bias is None else bias,
            weight,
            freqs,
            out,
            seq,
            h,
            *x.stride(),
            freqs.stride(0) if freqs.shape[0] > 1 else 0,  # one table for the whole batch
            freqs.stride(1),
            *out.stride(),
            eps,
            ROW_SCALE=row_scale is not None,
            HAS_BIAS=bias is not None,
            D=d,
            BLOCK_H=block_h,
            HALF_BLOCK=d_block // 2,
            num_warps=4 if block_h * d_block >= 1024 else 2,
        )
        return out

    @custom_op("qwen_turbo::qk_norm_rope")
    def _qk_norm_rope_op(
        x: torch.Tensor,
        weight: torch.Tensor,
        freqs: torch.Tensor,
        eps: float,
        out_layout: str,
    ) -> torch.Tensor:
        if freqs.stride()[-3:] != (4, 2, 1):
            freqs = freqs.contiguous()
        out = x.new_empty(_out_shape(x, out_layout))
        view = out.transpose(1, 2) if out_layout == "bhld" else out
        _launch(x, weight.contiguous(), freqs, eps, view)
        return out

    @_qk_norm_rope_op.register_fake
    def _(x, weight, freqs, eps, out_layout):
        return x.new_empty(_out_shape(x, out_layout))

    @custom_op("qwen_turbo::qk_norm_rope_into", mutates_args=("out",))
    def _qk_norm_rope_into_op(
        x: torch.Tensor,
        weight: torch.Tensor,
        freqs: torch.Tensor,
        eps: float,
        out: torch.Tensor,
        row_scale: torch.Tensor | None,
        bias: torch.Tensor | None,
    ) -> None:
        if freqs.stride()[-3:] != (4, 2, 1):
            freqs = freqs.contiguous()
        _launch(x, weight.contiguous(), freqs, eps, out, row_scale, bias)


def _why_not(x: torch.Tensor, weight: torch.Tensor, freqs: torch.Tensor) -> str | None:
    """Why the Triton path cannot take this call, or None when it can."""
    reason = unsupported(x)
    if reason is not None:
        return reason
    if x.dtype not in DTYPES or freqs.dtype not in DTYPES:
        return (
            f"dtypes x {x.dtype}, freqs {freqs.dtype} are not supported "
            "(bfloat16, float16, float32)"
        )
    if x.ndim != 4:
        return f"x has {x.ndim} dims; the kernel takes (B, L, H, Dh)"
    b, seq, _, d = x.shape
    if d % 2 or d > MAX_HEAD_DIM:
        return f"head size {d} is odd or larger than {MAX_HEAD_DIM}"
    if tuple(weight.shape) != (d,):
        return f"weight has shape {tuple(weight.shape)}, not ({d},)"
    if freqs.ndim != 6 or freqs.shape[0] not in (1, b) or freqs.shape[1:] != (seq, 1, d // 2, 2, 2):
        return f"freqs has shape {tuple(freqs.shape)}, not ({b} or 1, {seq}, 1, {d // 2}, 2, 2)"
    if freqs.device != x.device:
        return f"freqs is on {freqs.device}, x on {x.device}"
    return grad_reason(x, weight, freqs)


def qk_norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    freqs: torch.Tensor,
    eps: float = 1e-6,
    out_layout: str = "bhld",
) -> torch.Tensor:
    """apply_rotary_emb(F.rms_norm(x, (Dh,), weight, eps), freqs), in attention's layout.

    x: (B, L, H, Dh), bfloat16, float16 or float32, any strides: the `unflatten(-1, (H, Dh))`
    of a linear output, or a slice of a fused qkv projection. Dh even, at most 256.
    weight: (Dh,), cast to x's dtype and device as ComfyUI does.
    freqs: (B or 1, L, 1, Dh/2, 2, 2) rotation table on x's device, as ComfyUI's Qwen-Image
    builds it (in x's dtype; bfloat16, float16 and float32 are all read exactly).
    out_layout: "bhld" returns a contiguous (B, H, L, Dh) tensor, the layout attention
    takes with skip_reshape=True; "blhd" returns a contiguous (B, L, H, Dh) tensor, whose
    flatten(2) is what ComfyUI passes to attention today.
    The result is in x's dtype. The mean of squares and the whole epilogue are float32, with
    one final rounding. Other inputs (dtypes, devices, shapes, autograd) use the eager
    reference, which gives ComfyUI's result bit for bit.
    """
    _check_layout(out_layout)
    reason = _why_not(x, weight, freqs)
    if reason is not None:
        log_fallback_once(OP, reason)
        return qk_norm_rope_reference(x, weight, freqs, eps, out_layout)
    return _qk_norm_rope_op(x, weight.to(x), freqs, eps, out_layout)


def qk_norm_rope_into(
    x: "torch.Tensor | Unscaled",
    weight: torch.Tensor,
    freqs: torch.Tensor,
    out: torch.Tensor,
    eps: float = 1e-6,
) -> torch.Tensor:
    """`qk_norm_rope` written into `out`, a (B, L, H, Dh) view of any strides in x's dtype: for
    example the text or image rows of a joint (B, L_txt + L_img, H, Dh) buffer, so the two
    streams need no concatenation afterwards. x may be an fp8 GEMM's `Unscaled` (B, L, H * Dh)
    output, finished in float32 as it is read. Returns out."""
    row_scale = bias = None
    if isinstance(x, Unscaled):
        row_scale, bias = x.row_scale, x.bias
        if bias is not None and (bias.stride(0) != 1 or bias.device != x.raw.device):
            x = x.value().unflatten(-1, (out.shape[2], -1))  # finished first
            row_scale = bias = None
        else:
            x = x.raw.unflatten(-1, (out.shape[2], -1))
    if out.shape != x.shape or out.dtype != x.dtype:
        raise ValueError(f"out is {tuple(out.shape)} {out.dtype}, x is {tuple(x.shape)} {x.dtype}")
    reason = _why_not(x, weight, freqs) or grad_reason(out)
    if reason is not None:
        log_fallback_once(OP, reason)
        if row_scale is not None:
            x = Unscaled(x.flatten(2), row_scale, bias).value().unflatten(-1, x.shape[2:])
        return out.copy_(qk_norm_rope_reference(x, weight, freqs, eps, "blhd"))
    _qk_norm_rope_into_op(x, weight.to(x), freqs, eps, out, row_scale, bias)
    return out
