"""LayerNorm (no affine) followed by adaLN modulation, fused: the Qwen-Image MMDiT pre-norm.

ComfyUI (comfy/ldm/qwen_image/model.py, QwenImageTransformerBlock) computes, in x's dtype,

    normed = F.layer_norm(x, (D,), eps=1e-6)                       # img_norm1 / txt_norm1 ...
    out = torch.addcmul(shift.unsqueeze(1), normed, 1 + scale.unsqueeze(1))   # _modulate

with shift, scale the (B, D) chunks of the block's modulation vector. That is three kernels
(layer_norm, 1 + scale, addcmul), the first two passes reading or writing the whole (B, L, D)
activation. The Triton kernel here reads x once and writes the output once: one program per
token row holds all D values in registers, the statistics and the modulation are float32, and
the result is rounded to x's dtype once.
"""

import torch
import torch.nn.functional as F

from ._triton import (
    HAS_TRITON,
    common_reason,
    custom_op,
    fast_launch,
    grad_reason,
    log_fallback_once,
    tl,
    triton,
)

OP = "layernorm_modulate"
# Largest row one program holds in registers (Qwen-Image: D = 3072, a 4096-wide block). Past
# this the row would spill; such widths use the reference.
MAX_D = 8192


def layernorm_modulate_reference(
    x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """Eager reference, ComfyUI's exact ops and order, each rounded to x's dtype.

    x: (B, L, D). shift, scale: (B, D), or anything that broadcasts against x after
    `unsqueeze(1)`. F.layer_norm without affine, then torch.addcmul(shift, normed, 1 + scale);
    note `1 + scale` is itself rounded to the dtype (bf16 keeps 8 bits of it).
    """
    normed = F.layer_norm(x, (x.shape[-1],), eps=eps)
    return torch.addcmul(shift.unsqueeze(1), normed, 1 + scale.unsqueeze(1))


if HAS_TRITON:

    def _num_warps(block_d: int) -> int:
        """Warps for a row of block_d values (Liger's LayerNorm choice): 4096 -> 8 warps,
        16 float32 values per thread, i.e. two 16-byte loads of bf16 per thread."""
        if block_d >= 8192:
            return 16
        if block_d >= 2048:
            return 8
        return 4

    @triton.jit
    def _ln_modulate_row(x, mask, shift_ptr, scale_ptr, offs, D, eps):
        """LayerNorm of one float32 row x (masked lanes hold 0), times (1 + scale) plus shift.

        shift_ptr, scale_ptr point at this row's (D,) modulation vectors; the result is float32.
        """
        mean = tl.sum(x, axis=0) / D
        xc = tl.where(mask, x - mean, 0.0)
        # The float32 sum of D values near a large mean is off by a few ulps of the *sum*
        # (mean 1000, std 0.01: ~1% of std), and that error would shift every output. One more
        # reduction over the centred row, whose sum is small, corrects the mean (the correction
        # term of Chan, Golub & LeVeque's corrected two-pass algorithm, applied to the row
        # itself so the outputs gain too); it costs no memory traffic.
        xc = tl.where(mask, xc - tl.sum(xc, axis=0) / D, 0.0)
        # Two-pass variance on the register-resident row: sum((x - mean)^2) has no cancellation,
        # unlike E[x^2] - mean^2 (which loses everything when |mean| >> std). It cannot be
        # negative; the clamp keeps that invariant explicit for any future one-pass rewrite.
        var = tl.maximum(tl.sum(xc * xc, axis=0) / D, 0.0)
        # sqrt_rn / div_rn are IEEE-rounded, not the approximate rsqrt.
        rstd = tl.div_rn(1.0, tl.sqrt_rn(var + eps))
        shift = tl.load(shift_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        scale = tl.load(scale_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        # 1 + scale stays float32 here; ComfyUI rounds it to x's dtype first.
        return (xc * rstd) * (1.0 + scale) + shift

    @fast_launch
    @triton.jit
    def _layernorm_modulate_kernel(
        x_ptr,
        shift_ptr,
        scale_ptr,
        out_ptr,
        L,
        D,
        stride_xb,
        stride_xl,
        stride_shift_b,
        stride_scale_b,
        stride_ob,
        stride_ol,
        eps,
        BLOCK_D: tl.constexpr,
    ):
        """One program: one token row (b, l), all D values.

        x, out: (B, L, D) with unit stride along D (any batch and token strides); shift,
        scale: (B, D) with unit stride along D. The grid is (B * L,), batch-major.
        """
        row = tl.program_id(0)
        # int64 offsets: B * L * D passes 2^31 at batch 2 and ~2600 px (24905 x 3072 = 76 M per
        # sample at 2512 px), and strided views (a slice of a joint sequence) pass it sooner.
        b = (row // L).to(tl.int64)
        t = (row % L).to(tl.int64)
        offs = tl.arange(0, BLOCK_D)
        mask = offs < D
        x = tl.load(x_ptr + b * stride_xb + t * stride_xl + offs, mask=mask, other=0.0)
        y = _ln_modulate_row(
            x.to(tl.float32),
            mask,
            shift_ptr + b * stride_shift_b,
            scale_ptr + b * stride_scale_b,
            offs,
            D,
            eps,
        )
        # The only rounding to x's dtype.
        out = out_ptr + b * stride_ob + t * stride_ol + offs
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=mask)

    def _launch(
        x: torch.Tensor,
        shift: torch.Tensor,
        scale: torch.Tensor,
        eps: float,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """Run the kernel into `out`.

        x, out: (B, L, D), same dtype, each with stride 1 along D (other strides free);
        shift, scale: (B, D) on x's device with stride 1 along D, any float dtype (upcast to
        float32). D <= MAX_D.
        """
        if out.numel() == 0:
            return out
        b, n, d = x.shape
        block_d = triton.next_power_of_2(d)
        _layernorm_modulate_kernel[(b * n,)](
            x,
            shift,
            scale,
            out,
            n,
            d,
            x.stride(0),
            x.stride(1),
            shift.stride(0),
            scale.stride(0),
            out.stride(0),
            out.stride(1),
            eps,
            BLOCK_D=block_d,
            num_warps=_num_warps(block_d),
        )
        return out

    def _unit_stride(t: torch.Tensor) -> torch.Tensor:
        """t itself when its last dim is contiguous (the kernel takes any other strides)."""
        return t if t.stride(-1) == 1 else t.contiguous()

    @custom_op("qwen_turbo::layernorm_modulate")
    def _layernorm_modulate_op(
        x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float
    ) -> torch.Tensor:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        return _launch(_unit_stride(x), _unit_stride(shift), _unit_stride(scale), eps, out)

    @_layernorm_modulate_op.register_fake
    def _(x, shift, scale, eps):
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _why_not(x: torch.Tensor, *mods: torch.Tensor) -> str | None:
    """Why the Triton path cannot take x with its (B, D) modulation vectors, or None.

    Shared with the fused gated-residual op, which has the same limits on its LayerNorm.
    """
    reason = common_reason(x)
    if reason is not None:
        return reason
    if x.ndim != 3:
        return f"x has {x.ndim} dims; the kernel takes (B, L, D)"
    b, _, d = x.shape
    for m in mods:
        if m.shape != (b, d):
            return f"modulation of shape {tuple(m.shape)} is not (B, D) = {(b, d)}"
        if m.dtype != x.dtype:
            return f"modulation dtype {m.dtype} differs from x's {x.dtype}"
        if m.device != x.device:
            return f"modulation on {m.device}, x on {x.device}"
    if d > MAX_D:
        return f"D = {d} is wider than the kernel's row ({MAX_D})"
    return grad_reason(x, *mods)


def layernorm_modulate(
    x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """LayerNorm(x) over D (no affine) * (1 + scale[:, None]) + shift[:, None].

    x: (B, L, D), bfloat16, float16 or float32, any strides (a view whose last dim is not
    contiguous is copied first). shift, scale: (B, D), x's dtype and device, any strides.
    Returns a new contiguous (B, L, D) tensor in x's dtype. Mean and variance (two-pass,
    clamped at 0) and the modulation are float32, rounded to x's dtype once. Anything else
    (other dtypes or shapes, D > MAX_D, autograd, no Triton) uses the eager reference.
    """
    reason = _why_not(x, shift, scale)
    if reason is not None:
        log_fallback_once(OP, reason)
        return layernorm_modulate_reference(x, shift, scale, eps)
    return _layernorm_modulate_op(x, shift, scale, eps)
