"""Gated residual add, and the same fused with the next LayerNorm + modulation: Qwen-Image MMDiT.

ComfyUI (comfy/ldm/qwen_image/model.py, QwenImageTransformerBlock.forward) computes, in x's
dtype,

    hidden_states = hidden_states + img_gate1 * img_attn_output     # gate1: (B, 1, D)
    img_normed2 = self.img_norm2(hidden_states)                      # LayerNorm, no affine
    img_modulated2, img_gate2 = self._modulate(img_normed2, img_mod2)

The first line is two kernels (gate * y, then + x) that round twice; the last two are the
`layernorm_modulate` op. Here:

  * `gated_residual(x, y, gate)`: x + gate[:, None] * y, float32 inside, rounded once.
    Grid (B * L, cdiv(D, BLOCK_D)); one [BLOCK_D] chunk of one token row per program. y may
    be an fp8 GEMM's `Unscaled` output, finished (row scale, bias) in float32 as it is read.
  * `gated_residual_layernorm_modulate(x, y, gate, shift, scale)`: the residual and the next
    pre-norm in one pass, one token row per program: reads x and y once, writes the new x and
    its LayerNorm-modulated form. The norm is taken of the new x *as stored* (rounded to x's
    dtype), so the pair equals `gated_residual` followed by `layernorm_modulate` exactly.
"""

import torch

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
from .fp8_linear import Unscaled
from .layernorm_modulate import _why_not as _why_not_layernorm
from .layernorm_modulate import layernorm_modulate_reference

OP = "gated_residual"
OP_FUSED = "gated_residual_layernorm_modulate"
# The residual kernel's chunk of a row: 1024 values, 4 warps, 8 per thread (one 16-byte load
# of bf16). D = 3072 is three chunks with no masked lanes.
MAX_BLOCK_D = 1024


def gated_residual_reference(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Eager reference, ComfyUI's `x + gate.unsqueeze(1) * y` in x's dtype (two roundings).

    x, y: (B, L, D); gate: (B, D), or anything that broadcasts after `unsqueeze(1)`.
    (ComfyUI's second residual of the block, `torch.addcmul(x, gate2, y)`, rounds once, as the
    kernel does.)
    """
    return x + gate.unsqueeze(1) * y


def gated_residual_layernorm_modulate_reference(
    x: torch.Tensor,
    y: torch.Tensor,
    gate: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager reference: (h, layernorm_modulate_reference(h)) with h the gated residual."""
    h = gated_residual_reference(x, y, gate)
    return h, layernorm_modulate_reference(h, shift, scale, eps)


if HAS_TRITON:
    from .layernorm_modulate import _ln_modulate_row, _num_warps, _unit_stride

    @fast_launch
    @triton.jit
    def _gated_residual_kernel(
        x_ptr,
        y_ptr,
        rs_ptr,
        b_ptr,
        gate_ptr,
        out_ptr,
        L,
        D,
        stride_xb,
        stride_xl,
        stride_yb,
        stride_yl,
        stride_gb,
        stride_ob,
        stride_ol,
        ROW_SCALE: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        """One program: values [j * BLOCK_D, (j + 1) * BLOCK_D) of token row (b, l).

        x, y, out: (B, L, D) with unit stride along D; gate: (B, D) with unit stride along D.
        With ROW_SCALE and HAS_BIAS, y is y * rs[b * L + l] + bias (rs float32 (B * L,),
        bias (D,)). The grid is (B * L, cdiv(D, BLOCK_D)).
        """
        row = tl.program_id(0)
        # int64 offsets: B * L * D passes 2^31 at batch 2 and ~2600 px.
        b = (row // L).to(tl.int64)
        t = (row % L).to(tl.int64)
        offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        mask = offs < D
        x = tl.load(x_ptr + b * stride_xb + t * stride_xl + offs, mask=mask, other=0.0)
        y = tl.load(y_ptr + b * stride_yb + t * stride_yl + offs, mask=mask, other=0.0)
        y = y.to(tl.float32)
        if ROW_SCALE:
            y = y * tl.load(rs_ptr + row)
        if HAS_BIAS:
            y += tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(gate_ptr + b * stride_gb + offs, mask=mask, other=0.0)
        # float32 product and sum, one rounding to x's dtype (ComfyUI rounds gate * y first).
        h = x.to(tl.float32) + g.to(tl.float32) * y
        out = out_ptr + b * stride_ob + t * stride_ol + offs
        tl.store(out, h.to(out_ptr.dtype.element_ty), mask=mask)

    @fast_launch
    @triton.jit
    def _gated_residual_layernorm_modulate_kernel(
        x_ptr,
        y_ptr,
        rs_ptr,
        b_ptr,
        gate_ptr,
        shift_ptr,
        scale_ptr,
        h_ptr,
        out_ptr,
        L,
        D,
        stride_xb,
        stride_xl,
        stride_yb,
        stride_yl,
        stride_gb,
        stride_shift_b,
        stride_scale_b,
        stride_hb,
        stride_hl,
        stride_ob,
        stride_ol,
        eps,
        ROW_SCALE: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        """One program: one token row (b, l), all D values.

        x, y, h, out: (B, L, D) with unit stride along D; gate, shift, scale: (B, D) with unit
        stride along D. The grid is (B * L,). h = x + gate * y; out = its LN-modulated form.
        y is finished as in `_gated_residual_kernel` (ROW_SCALE, HAS_BIAS).
        """
        row = tl.program_id(0)
        b = (row // L).to(tl.int64)
        t = (row % L).to(tl.int64)
        offs = tl.arange(0, BLOCK_D)
        mask = offs < D
        x = tl.load(x_ptr + b * stride_xb + t * stride_xl + offs, mask=mask, other=0.0)
        y = tl.load(y_ptr + b * stride_yb + t * stride_yl + offs, mask=mask, other=0.0)
        y = y.to(tl.float32)
        if ROW_SCALE:
            y = y * tl.load(rs_ptr + row)
        if HAS_BIAS:
            y += tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(gate_ptr + b * stride_gb + offs, mask=mask, other=0.0)
        h = x.to(tl.float32) + g.to(tl.float32) * y
        h = h.to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + b * stride_hb + t * stride_hl + offs, h, mask=mask)
        # Normalise the stored (rounded) h, as the next block reads it: the output then equals
        # layernorm_modulate(h) bit for bit. Masked lanes are 0 and stay out of the statistics.
        m = _ln_modulate_row(
            h.to(tl.float32),
            mask,
            shift_ptr + b * stride_shift_b,
            scale_ptr + b * stride_scale_b,
            offs,
            D,
            eps,
        )
        out = out_ptr + b * stride_ob + t * stride_ol + offs
        tl.store(out, m.to(out_ptr.dtype.element_ty), mask=mask)

    def _launch(
        x: torch.Tensor,
        y: torch.Tensor,
        gate: torch.Tensor,
        out: torch.Tensor,
        row_scale: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the residual kernel into `out`.

        x, y, out: (B, L, D), each with stride 1 along D (other strides free); gate: (B, D)
        on x's device with stride 1 along D; row_scale, bias: y's `Unscaled` parts or None.
        Inputs of any float dtype are upcast to float32; out's dtype is the result's.
        """
        if out.numel() == 0:
            return out
        b, n, d = x.shape
        block_d = min(triton.next_power_of_2(d), MAX_BLOCK_D)
        grid = (b * n, triton.cdiv(d, block_d))
        _gated_residual_kernel[grid](
            x,
            y,
            gate if row_scale is None else row_scale,
            gate if bias is None else bias,
            gate,
            out,
            n,
            d,
            x.stride(0),
            x.stride(1),
            y.stride(0),
            y.stride(1),
            gate.stride(0),
            out.stride(0),
            out.stride(1),
            ROW_SCALE=row_scale is not None,
            HAS_BIAS=bias is not None,
            BLOCK_D=block_d,
            num_warps=max(1, min(4, block_d // 256)),
        )
        return out

    def _launch_fused(
        x: torch.Tensor,
        y: torch.Tensor,
        gate: torch.Tensor,
        shift: torch.Tensor,
        scale: torch.Tensor,
        eps: float,
        h: torch.Tensor,
        out: torch.Tensor,
        row_scale: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the fused kernel into `h` (the new x) and `out` (its LN-modulated form), y
        finished by row_scale and bias (an `Unscaled`'s, or None).

        x, y, h, out: (B, L, D), each with stride 1 along D; gate, shift, scale: (B, D) with
        stride 1 along D. h and out have x's dtype (the norm reads h as rounded to h's
        dtype). D <= layernorm_modulate.MAX_D.
        """
        if out.numel() == 0:
            return h, out
        b, n, d = x.shape
        block_d = triton.next_power_of_2(d)
        _gated_residual_layernorm_modulate_kernel[(b * n,)](
            x,
            y,
            gate if row_scale is None else row_scale,
            gate if bias is None else bias,
            gate,
            shift,
            scale,
            h,
            out,
            n,
            d,
            x.stride(0),
            x.stride(1),
            y.stride(0),
            y.stride(1),
            gate.stride(0),
            shift.stride(0),
            scale.stride(0),
            h.stride(0),
            h.stride(1),
            out.stride(0),
            out.stride(1),
            eps,
            ROW_SCALE=row_scale is not None,
            HAS_BIAS=bias is not None,
            BLOCK_D=block_d,
            num_warps=_num_warps(block_d),
        )
        return h, out

    def _empty(x: torch.Tensor) -> torch.Tensor:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)

    @custom_op("qwen_turbo::gated_residual")
    def _gated_residual_op(
        x: torch.Tensor,
        y: torch.Tensor,
        gate: torch.Tensor,
        row_scale: torch.Tensor | None,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        args = [_unit_stride(t) for t in (x, y, gate)]
        return _launch(*args, _empty(x), row_scale, bias)

    @_gated_residual_op.register_fake
    def _(x, y, gate, row_scale, bias):
        return _empty(x)

    @custom_op("qwen_turbo::gated_residual_layernorm_modulate")
    def _gated_residual_layernorm_modulate_op(
        x: torch.Tensor,
        y: torch.Tensor,
        gate: torch.Tensor,
        shift: torch.Tensor,
        scale: torch.Tensor,
        eps: float,
        row_scale: torch.Tensor | None,
        bias: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        args = [_unit_stride(t) for t in (x, y, gate, shift, scale)]
        return _launch_fused(*args, eps, _empty(x), _empty(x), row_scale, bias)

    @_gated_residual_layernorm_modulate_op.register_fake
    def _(x, y, gate, shift, scale, eps, row_scale, bias):
        return _empty(x), _empty(x)


def _why_not(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> str | None:
    """Why the residual kernel cannot take this call, or None when it can."""
    reason = common_reason(x)
    if reason is not None:
        return reason
    if x.ndim != 3:
        return f"x has {x.ndim} dims; the kernel takes (B, L, D)"
    if y.shape != x.shape:
        return f"y of shape {tuple(y.shape)} is not x's {tuple(x.shape)}"
    b, _, d = x.shape
    if gate.shape != (b, d):
        return f"gate of shape {tuple(gate.shape)} is not (B, D) = {(b, d)}"
    if y.dtype != x.dtype or gate.dtype != x.dtype:
        return f"y ({y.dtype}) or gate ({gate.dtype}) differs from x's dtype {x.dtype}"
    if y.device != x.device or gate.device != x.device:
        return f"y on {y.device} or gate on {gate.device}, x on {x.device}"
    return grad_reason(x, y, gate)


def gated_residual(
    x: torch.Tensor, y: "torch.Tensor | Unscaled", gate: torch.Tensor
) -> torch.Tensor:
    """x + gate[:, None] * y.

    x, y: (B, L, D), bfloat16, float16 or float32, any strides (a view whose last dim is not
    contiguous is copied first); y may be an `Unscaled` whose raw is (B, L, D) and contiguous
    (an fp8 GEMM's output, finished in float32 as it is read). gate: (B, D), x's dtype and
    device, any strides. Returns a new contiguous (B, L, D) tensor in x's dtype: product and
    sum in float32, one rounding (ComfyUI's `x + gate.unsqueeze(1) * y` rounds twice).
    Anything else (other dtypes or shapes, autograd, no Triton) uses the eager reference.
    """
    y, row_scale, bias, reason = _parts(y)
    reason = reason or _why_not(x, y, gate)
    if reason is not None:
        log_fallback_once(OP, reason)
        y = y if row_scale is None else Unscaled(y, row_scale, bias).value()
        return gated_residual_reference(x, y, gate)
    return _gated_residual_op(x, y, gate, row_scale, bias)


def _parts(y):
    """(y or an `Unscaled`'s raw, row scales, bias, why the kernels cannot finish it)."""
    if not isinstance(y, Unscaled):
        return y, None, None, None
    return y.raw, y.row_scale, y.bias, _unscaled_reason(*y)


def _unscaled_reason(y: torch.Tensor, row_scale: torch.Tensor, bias: torch.Tensor | None):
    """Why the kernels cannot finish this `Unscaled` as they read it, or None."""
    if not y.is_contiguous() or row_scale.numel() != y.numel() // max(1, y.shape[-1]):
        return "the unscaled GEMM output is not contiguous with a scale per row"
    if row_scale.dtype != torch.float32 or row_scale.device != y.device:
        return "the row scales are not float32 on the output's device"
    if bias is not None and (bias.shape != y.shape[-1:] or bias.stride(0) != 1
                             or bias.device != y.device):  # fmt: skip
        return f"the bias of shape {tuple(bias.shape)} is not ({y.shape[-1]},) on y's device"
    return None


def gated_residual_layernorm_modulate(
    x: torch.Tensor,
    y: "torch.Tensor | Unscaled",
    gate: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, LayerNorm(h) * (1 + scale[:, None]) + shift[:, None]) with h = x + gate[:, None] * y.

    x, y: (B, L, D), bfloat16, float16 or float32, any strides; gate, shift, scale: (B, D),
    x's dtype and device; D <= layernorm_modulate.MAX_D. Returns two new contiguous
    (B, L, D) tensors in x's dtype. h is rounded once (as `gated_residual`), and the norm is
    taken of h as rounded, so the pair equals `gated_residual` then `layernorm_modulate`
    exactly. y may be an `Unscaled`, as in `gated_residual`. Anything else uses the eager
    reference.
    """
    y, row_scale, bias, reason = _parts(y)
    reason = reason or _why_not(x, y, gate) or _why_not_layernorm(x, shift, scale)
    if reason is not None:
        log_fallback_once(OP_FUSED, reason)
        y = y if row_scale is None else Unscaled(y, row_scale, bias).value()
        return gated_residual_layernorm_modulate_reference(x, y, gate, shift, scale, eps)
    return _gated_residual_layernorm_modulate_op(x, y, gate, shift, scale, eps, row_scale, bias)
