"""RMSNorm + modulation, and the tanh-gated residual of a post-norm: Lumina-2 / NewBie NextDiT.

ComfyUI (comfy/ldm/lumina/model.py, JointTransformerBlock.forward) computes, in x's dtype,
for the attention half and again for the MLP half,

    h = modulate(self.attention_norm1(x), scale_msa)         # rmsnorm(x) * (1 + scale[:, None])
    y = clamp_fp16(self.attention(h, ...))
    x = x + gate_msa.unsqueeze(1).tanh() * self.attention_norm2(y)

with RMSNorm comfy.ops' (`F.rms_norm(x, (D,), weight, eps)`, eps = norm_eps = 1e-5) and
scale, gate (B, D) chunks of the block's adaLN vector. The first line is three kernels, the
last four, each rounding to x's dtype. Here, one token row per program (grid (B * L,)), all
D values in registers, float32 inside and one rounding at each store:

  * `rms_norm_modulate(x, weight, scale)`: rmsnorm(x) * weight * (1 + scale[:, None]).
  * `gated_rms_residual(x, y, weight, gate)`: x + tanh(gate)[:, None] * rmsnorm(y) * weight.
  * `gated_rms_residual_rms_norm_modulate(...)`: that residual and the next half's pre-norm in
    one pass: reads x and y once, writes the new x and its norm-modulated form. The norm is
    taken of the new x *as stored* (rounded to x's dtype), so the pair equals
    `gated_rms_residual` followed by `rms_norm_modulate` exactly.
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
from .layernorm_modulate import MAX_D

OP, OP_GATED = "rms_norm_modulate", "gated_rms_residual"
OP_FUSED = "gated_rms_residual_rms_norm_modulate"
EPS = 1e-5  # NextDiT's norm_eps


def rms_norm_modulate_reference(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, eps: float = EPS
) -> torch.Tensor:
    """Eager reference, ComfyUI's ops in its order: F.rms_norm with the weight cast to x's
    dtype and device (comfy.ops), then `normed * (1 + scale.unsqueeze(1))` (lumina's
    `modulate`), each op rounding to x's dtype. x: (B, L, D); weight (D,); scale (B, D)."""
    normed = F.rms_norm(x, weight.shape, weight.to(x), eps)
    return normed * (1 + scale.unsqueeze(1))


def gated_rms_residual_reference(
    x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float = EPS
) -> torch.Tensor:
    """Eager reference: `x + gate.unsqueeze(1).tanh() * F.rms_norm(y, ...)`, as ComfyUI."""
    return x + gate.unsqueeze(1).tanh() * F.rms_norm(y, weight.shape, weight.to(y), eps)


def gated_rms_residual_rms_norm_modulate_reference(
    x, y, weight, gate, weight_next, scale_next, eps: float = EPS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager reference: (h, rms_norm_modulate_reference(h, ...)), h the gated residual."""
    h = gated_rms_residual_reference(x, y, weight, gate, eps)
    return h, rms_norm_modulate_reference(h, weight_next, scale_next, eps)


if HAS_TRITON:
    from .layernorm_modulate import _num_warps, _unit_stride

    @triton.jit
    def _tanh(g):
        """float32 tanh within a few ulps (Triton has none its interpreter runs): below
        |g| = 1/4, where 1 - 2 / (exp(2|g|) + 1) cancels, the odd Taylor polynomial to g^9
        (truncation < 1e-8 relative); that form above (exp overflowing to inf gives 1)."""
        a = tl.abs(g)
        a2 = a * a
        p = a2 * (0.13333333333333333 + a2 * (-0.05396825396825397 + a2 * 0.021869488536155203))
        p = a + a * a2 * (-0.3333333333333333 + p)
        t = tl.where(a < 0.25, p, 1.0 - tl.div_rn(2.0, tl.exp(2.0 * a) + 1.0))
        return tl.where(g < 0, -t, t)

    @triton.jit
    def _rms_row(v, mask, w_ptr, offs, D, eps):
        """v * rsqrt(mean(v^2) + eps) * weight for one float32 row v (masked lanes hold 0).
        sqrt_rn / div_rn are IEEE-rounded, not the approximate rsqrt; the mean of squares is
        never negative. ComfyUI rounds the norm to x's dtype; here it stays float32."""
        rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(v * v, axis=0) / D + eps))
        return v * rstd * tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)

    @fast_launch
    @triton.jit
    def _rms_norm_modulate_kernel(
        x_ptr, w_ptr, s_ptr, out_ptr, L, D, stride_xb, stride_xl, stride_sb, stride_ob,
        stride_ol, eps, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        """One program: token row (b, l), all D values. x, out: (B, L, D) with unit stride
        along D; weight (D,) contiguous; scale (B, D) with unit stride along D."""
        row = tl.program_id(0)
        # int64 offsets: B * L * D passes 2^31 in large batches.
        b = (row // L).to(tl.int64)
        t = (row % L).to(tl.int64)
        offs = tl.arange(0, BLOCK_D)
        mask = offs < D
        x = tl.load(x_ptr + b * stride_xb + t * stride_xl + offs, mask=mask, other=0.0)
        s = tl.load(s_ptr + b * stride_sb + offs, mask=mask, other=0.0).to(tl.float32)
        # 1 + scale stays float32 (ComfyUI rounds it to x's dtype first); one rounding.
        m = _rms_row(x.to(tl.float32), mask, w_ptr, offs, D, eps) * (1.0 + s)
        tl.store(out_ptr + b * stride_ob + t * stride_ol + offs, m.to(out_ptr.dtype.element_ty),
                 mask=mask)  # fmt: skip

    @fast_launch
    @triton.jit
    def _gated_rms_residual_kernel(
        x_ptr, y_ptr, w_ptr, g_ptr, wn_ptr, sn_ptr, h_ptr, out_ptr, L, D, stride_xb,
        stride_xl, stride_yb, stride_yl, stride_gb, stride_sb, stride_hb, stride_hl,
        stride_ob, stride_ol, eps, NEXT: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        """One program: token row (b, l), all D values. x, y, h, out: (B, L, D) with unit
        stride along D; weights (D,) contiguous; gate, scale_next (B, D) with unit stride
        along D. h = x + tanh(gate) * rmsnorm(y) * w; with NEXT, out = rmsnorm(h) * w_next *
        (1 + scale_next) of h as stored (otherwise wn, sn and out are unused)."""
        row = tl.program_id(0)
        b = (row // L).to(tl.int64)
        t = (row % L).to(tl.int64)
        offs = tl.arange(0, BLOCK_D)
        mask = offs < D
        x = tl.load(x_ptr + b * stride_xb + t * stride_xl + offs, mask=mask, other=0.0)
        y = tl.load(y_ptr + b * stride_yb + t * stride_yl + offs, mask=mask, other=0.0)
        g = tl.load(g_ptr + b * stride_gb + offs, mask=mask, other=0.0).to(tl.float32)
        normed = _rms_row(y.to(tl.float32), mask, w_ptr, offs, D, eps)
        h = (x.to(tl.float32) + _tanh(g) * normed).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + b * stride_hb + t * stride_hl + offs, h, mask=mask)
        if NEXT:
            # Normalise h as stored (masked lanes are 0), as the next half reads it.
            s = tl.load(sn_ptr + b * stride_sb + offs, mask=mask, other=0.0).to(tl.float32)
            m = _rms_row(h.to(tl.float32), mask, wn_ptr, offs, D, eps) * (1.0 + s)
            out = out_ptr + b * stride_ob + t * stride_ol + offs
            tl.store(out, m.to(out_ptr.dtype.element_ty), mask=mask)

    def _launch(x, weight, scale, eps: float, out: torch.Tensor) -> torch.Tensor:
        """Run `_rms_norm_modulate_kernel` into `out` ((B, L, D), x's dtype, unit stride
        along D, other strides free); inputs as the kernel takes them, D <= MAX_D."""
        if out.numel() == 0:
            return out
        b, n, d = x.shape
        block_d = triton.next_power_of_2(d)
        _rms_norm_modulate_kernel[(b * n,)](
            x, weight, scale, out, n, d, x.stride(0), x.stride(1), scale.stride(0),
            out.stride(0), out.stride(1), eps, BLOCK_D=block_d, num_warps=_num_warps(block_d),
        )  # fmt: skip
        return out

    def _launch_gated(x, y, weight, gate, eps, h, weight_next=None, scale_next=None, out=None):
        """Run `_gated_rms_residual_kernel` into `h` (and, given weight_next, scale_next and
        out, the next pre-norm into `out`); returns h, or (h, out). Layouts as `_launch`."""
        nxt = out is not None
        if h.numel() == 0:
            return (h, out) if nxt else h
        b, n, d = x.shape
        block_d = triton.next_power_of_2(d)
        wn, sn, o = (weight_next, scale_next, out) if nxt else (weight, gate, h)
        _gated_rms_residual_kernel[(b * n,)](
            x, y, weight, gate, wn, sn, h, o, n, d, x.stride(0), x.stride(1), y.stride(0),
            y.stride(1), gate.stride(0), sn.stride(0), h.stride(0), h.stride(1), o.stride(0),
            o.stride(1), eps, NEXT=nxt, BLOCK_D=block_d, num_warps=_num_warps(block_d),
        )  # fmt: skip
        return (h, out) if nxt else h

    def _empty(x: torch.Tensor) -> torch.Tensor:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)

    @custom_op("qwen_turbo::rms_norm_modulate")
    def _rms_norm_modulate_op(
        x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, eps: float
    ) -> torch.Tensor:
        return _launch(*map(_unit_stride, (x, weight, scale)), eps, _empty(x))

    @_rms_norm_modulate_op.register_fake
    def _(x, weight, scale, eps):
        return _empty(x)

    @custom_op("qwen_turbo::gated_rms_residual")
    def _gated_rms_residual_op(
        x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float
    ) -> torch.Tensor:
        return _launch_gated(*map(_unit_stride, (x, y, weight, gate)), eps, _empty(x))

    @_gated_rms_residual_op.register_fake
    def _(x, y, weight, gate, eps):
        return _empty(x)

    @custom_op("qwen_turbo::gated_rms_residual_rms_norm_modulate")
    def _gated_rms_residual_rms_norm_modulate_op(
        x: torch.Tensor,
        y: torch.Tensor,
        weight: torch.Tensor,
        gate: torch.Tensor,
        weight_next: torch.Tensor,
        scale_next: torch.Tensor,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, y, w, g, wn, sn = map(_unit_stride, (x, y, weight, gate, weight_next, scale_next))
        return _launch_gated(x, y, w, g, eps, _empty(x), wn, sn, _empty(x))

    @_gated_rms_residual_rms_norm_modulate_op.register_fake
    def _(x, y, weight, gate, weight_next, scale_next, eps):
        return _empty(x), _empty(x)


def _why_not(x, y=None, weights=(), mods=()) -> str | None:
    """Why the kernels cannot take x (and y) with (D,) weights and (B, D) scales or gates."""
    reason = common_reason(x)
    if reason is not None:
        return reason
    if x.ndim != 3:
        return f"x has {x.ndim} dims; the kernel takes (B, L, D)"
    b, _, d = x.shape
    if y is not None and (y.shape != x.shape or y.dtype != x.dtype or y.device != x.device):
        return f"y ({tuple(y.shape)}, {y.dtype}, {y.device}) is not as x ({tuple(x.shape)}, " \
               f"{x.dtype}, {x.device})"  # fmt: skip
    for w in weights:
        if w.shape != (d,):
            return f"weight of shape {tuple(w.shape)} is not (D,) = ({d},)"
    for m in mods:
        if m.shape != (b, d) or m.dtype != x.dtype or m.device != x.device:
            return f"scale or gate ({tuple(m.shape)}, {m.dtype}, {m.device}) is not (B, D) = " \
                   f"{(b, d)} in x's dtype {x.dtype} on {x.device}"  # fmt: skip
    if d > MAX_D:
        return f"D = {d} is wider than the kernel's row ({MAX_D})"
    return grad_reason(x, y, *weights, *mods)


def rms_norm_modulate(x, weight, scale, eps: float = EPS) -> torch.Tensor:
    """rmsnorm(x) * weight * (1 + scale[:, None]) over D.

    x: (B, L, D), bfloat16, float16 or float32, any strides (a last dim that is not
    contiguous is copied first). weight: (D,), cast to x's dtype and device as comfy.ops
    does. scale: (B, D), x's dtype and device, any strides. Returns a new contiguous tensor in
    x's dtype, computed in float32 and rounded once. Anything else (other dtypes or shapes,
    D > MAX_D, autograd, no Triton) uses the eager reference."""
    reason = _why_not(x, weights=(weight,), mods=(scale,))
    if reason is not None:
        log_fallback_once(OP, reason)
        return rms_norm_modulate_reference(x, weight, scale, eps)
    return _rms_norm_modulate_op(x, weight.to(x), scale, eps)


def gated_rms_residual(x, y, weight, gate, eps: float = EPS) -> torch.Tensor:
    """x + tanh(gate)[:, None] * rmsnorm(y) * weight.

    x, y: (B, L, D) plain tensors of one dtype (bfloat16, float16, float32), any strides;
    weight: (D,), cast to x's dtype; gate: (B, D) in x's dtype. A new contiguous tensor in
    x's dtype, float32 inside, rounded once. Anything else uses the eager reference."""
    reason = _why_not(x, y, (weight,), (gate,))
    if reason is not None:
        log_fallback_once(OP_GATED, reason)
        return gated_rms_residual_reference(x, y, weight, gate, eps)
    return _gated_rms_residual_op(x, y, weight.to(x), gate, eps)


def gated_rms_residual_rms_norm_modulate(
    x, y, weight, gate, weight_next, scale_next, eps: float = EPS
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, rms_norm_modulate(h, weight_next, scale_next)), h = gated_rms_residual(x, y, ...),
    in one pass, inputs as those take them; the pair equals theirs bit for bit."""
    reason = _why_not(x, y, (weight, weight_next), (gate, scale_next))
    if reason is not None:
        log_fallback_once(OP_FUSED, reason)
        return gated_rms_residual_rms_norm_modulate_reference(
            x, y, weight, gate, weight_next, scale_next, eps
        )
    wn = weight_next.to(x)
    return _gated_rms_residual_rms_norm_modulate_op(x, y, weight.to(x), gate, wn, scale_next, eps)
