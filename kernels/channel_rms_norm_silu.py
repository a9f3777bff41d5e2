"""Channel RMS norm with an optional SiLU, fused: the Wan 2.1 / Qwen-Image VAE `RMS_norm`.

ComfyUI (comfy/ldm/wan/vae.py) computes, in x's dtype,

    F.normalize(x, dim=1) * sqrt(C) * gamma + bias        (then nn.SiLU() in most blocks)

where F.normalize divides each channel vector by max(its L2 norm, eps). That is four or five
elementwise kernels, each reading and writing the whole activation; the Triton kernel here
reads x once and writes the output once, rounding to x's dtype only at the end.
"""

import math

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

OP = "channel_rms_norm_silu"
# Largest channel block one program holds (all of C at once when C <= this): the tile is
# [C_BLOCK, S_BLOCK] and stays in registers; a larger C is swept in chunks of this size.
MAX_C_BLOCK = 1024
# Elements per tile: 8 warps x 32 lanes x 32 fp32 values (16384 only when C_BLOCK = 1024).
_TILE = 8192
# Minimum positions per tile: 16 contiguous positions per channel row keep each row at least
# one 32-byte sector (bf16), so loads stay coalesced even for C = 1024.
_MIN_S_BLOCK = 16
_MAX_S_BLOCK = 256


def _per_channel(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """View a parameter with C elements as (C, 1, ..., 1) against x; else leave it to broadcast."""
    if p.numel() == x.shape[1]:
        return p.reshape((x.shape[1],) + (1,) * (x.ndim - 2))
    return p


def channel_rms_norm_silu_reference(
    x: torch.Tensor,
    gamma: torch.Tensor,
    bias: torch.Tensor | None = None,
    silu: bool = True,
    eps: float = 1e-12,
) -> torch.Tensor:
    """Eager reference, the same ops as ComfyUI's `RMS_norm` (+ `nn.SiLU`), in x's dtype.

    x: (B, C, *spatial), any float dtype. gamma, bias: C elements (viewed as (C, 1, ..., 1))
    or any shape that broadcasts against x; cast to x's dtype and device like ComfyUI does.
    In float16 a channel vector that is all zeros gives NaN here (eps underflows to 0 in
    float16); the Triton kernel gives bias (or silu(bias)) instead.
    """
    scale = x.shape[1] ** 0.5
    y = F.normalize(x, dim=1, eps=eps) * scale * _per_channel(gamma.to(x), x)
    if bias is not None:
        y = y + _per_channel(bias.to(x), x)
    return F.silu(y) if silu else y


if HAS_TRITON:

    def _block_sizes(c: int, s: int) -> tuple[int, int, int]:
        """(C_BLOCK, S_BLOCK, num_warps) for C channels and S positions per sample."""
        c_block = min(triton.next_power_of_2(c), MAX_C_BLOCK)
        s_block = max(_MIN_S_BLOCK, min(_MAX_S_BLOCK, _TILE // c_block))
        s_block = min(s_block, triton.next_power_of_2(s))  # tiny maps (1x1) need no wide tile
        num_warps = max(1, min(16, c_block * s_block // 1024))
        return c_block, s_block, num_warps

    @triton.jit
    def _affine_silu(
        x, inv, g_ptr, b_ptr, offs_c, mask_c, HAS_BIAS: tl.constexpr, SILU: tl.constexpr
    ):
        """y = x * inv * gamma (+ bias), then optionally y * sigmoid(y); all in float32."""
        g = tl.load(g_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)
        y = x * inv[None, :] * g[:, None]
        if HAS_BIAS:
            b = tl.load(b_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)
            y = y + b[:, None]
        if SILU:
            # sigmoid(y) = 1 / (1 + exp(-y)): for y << 0, exp(-y) = inf and y * 0 = -0, no NaN.
            y = y * tl.sigmoid(y)
        return y

    @fast_launch
    @triton.jit
    def _channel_rms_norm_silu_kernel(
        x_ptr,
        gamma_ptr,
        bias_ptr,
        out_ptr,
        C,
        S,
        scale,
        eps,
        HAS_BIAS: tl.constexpr,
        SILU: tl.constexpr,
        C_BLOCK: tl.constexpr,
        S_BLOCK: tl.constexpr,
        N_CHUNKS: tl.constexpr,
    ):
        """One program: S_BLOCK positions of one sample, all C channels.

        x and out are contiguous (B, C, S); gamma and bias contiguous (C,). The grid is
        flat, B * cdiv(S, S_BLOCK) programs, sample-major.
        """
        pid = tl.program_id(0)
        n_s = tl.cdiv(S, S_BLOCK)
        b = pid // n_s
        sb = pid % n_s
        # int64 everywhere an offset is formed: B*C*S passes 2^31 for large images and video.
        base = b.to(tl.int64) * C * S
        offs_s = sb.to(tl.int64) * S_BLOCK + tl.arange(0, S_BLOCK)
        mask_s = offs_s < S
        offs_c = tl.arange(0, C_BLOCK)
        # Positions run along the contiguous dimension, so each channel row of the tile is
        # one coalesced load; the channel reduction crosses rows (axis 0).
        if N_CHUNKS == 1:
            # C <= C_BLOCK: the whole [C, S_BLOCK] tile is loaded once and kept in registers.
            mask_c = offs_c < C
            offs = base + offs_c.to(tl.int64)[:, None] * S + offs_s[None, :]
            mask = mask_c[:, None] & mask_s[None, :]
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            # Sum of squares in float32 (masked rows and columns contribute 0). float16 inputs
            # are at most 65504, so C * x^2 fits; like PyTorch's own norm, bf16/fp32 values
            # past ~1e18 overflow it (the VAE's activations are many orders smaller).
            ss = tl.sum(x * x, axis=0)
            # F.normalize: x / max(||x||, eps). sqrt_rn and div_rn are IEEE-rounded, so the
            # float32 path matches PyTorch to an ulp or two; sqrt(C) is folded into the one
            # division per position. An all-zero vector gives 0 * scale / eps = 0, not NaN.
            inv = tl.div_rn(scale, tl.maximum(tl.sqrt_rn(ss), eps))
            y = _affine_silu(x, inv, gamma_ptr, bias_ptr, offs_c, mask_c, HAS_BIAS, SILU)
            # The only rounding to x's dtype; ComfyUI rounds after every elementwise op.
            tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            # C > C_BLOCK: two sweeps over channel chunks, the second re-reading x (mostly
            # from L2, since the chunk rows of one program were read just before).
            # The trip count is the constexpr N_CHUNKS = cdiv(C, C_BLOCK), not range(0, C, ...):
            # Triton 3.6's interpreter cannot take a runtime loop bound with NumPy >= 2.4.
            ss = tl.zeros([S_BLOCK], dtype=tl.float32)
            for i in range(N_CHUNKS):
                cc = i * C_BLOCK + offs_c
                offs = base + cc.to(tl.int64)[:, None] * S + offs_s[None, :]
                mask = (cc < C)[:, None] & mask_s[None, :]
                x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                ss += tl.sum(x * x, axis=0)
            inv = tl.div_rn(scale, tl.maximum(tl.sqrt_rn(ss), eps))
            for i in range(N_CHUNKS):
                cc = i * C_BLOCK + offs_c
                mask_c = cc < C
                offs = base + cc.to(tl.int64)[:, None] * S + offs_s[None, :]
                mask = mask_c[:, None] & mask_s[None, :]
                x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                y = _affine_silu(x, inv, gamma_ptr, bias_ptr, cc, mask_c, HAS_BIAS, SILU)
                tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)

    def _launch(
        x: torch.Tensor,
        gamma: torch.Tensor,
        bias: torch.Tensor | None,
        silu: bool,
        eps: float,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """Run the kernel into `out`. x, out: contiguous, same shape and dtype, (B, C, ...);
        gamma, bias: contiguous (C,) on x's device, any float dtype (upcast to float32)."""
        if out.numel() == 0:
            return out
        b, c = x.shape[:2]
        s = math.prod(x.shape[2:])
        c_block, s_block, num_warps = _block_sizes(c, s)
        grid = (b * triton.cdiv(s, s_block),)
        _channel_rms_norm_silu_kernel[grid](
            x,
            gamma,
            gamma if bias is None else bias,  # never read when HAS_BIAS is False
            out,
            c,
            s,
            math.sqrt(c),
            eps,
            HAS_BIAS=bias is not None,
            SILU=silu,
            C_BLOCK=c_block,
            S_BLOCK=s_block,
            N_CHUNKS=triton.cdiv(c, c_block),
            num_warps=num_warps,
        )
        return out

    @custom_op("qwen_turbo::channel_rms_norm_silu")
    def _channel_rms_norm_silu_op(
        x: torch.Tensor,
        gamma: torch.Tensor,
        bias: torch.Tensor | None,
        silu: bool,
        eps: float,
    ) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        bias = None if bias is None else bias.contiguous()
        return _launch(x, gamma.contiguous(), bias, silu, eps, out)

    @_channel_rms_norm_silu_op.register_fake
    def _(x, gamma, bias, silu, eps):
        return torch.empty_like(x, memory_format=torch.contiguous_format)


def _why_not(x: torch.Tensor, gamma: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    """Why the Triton path cannot take this call, or None when it can."""
    reason = common_reason(x)
    if reason is not None:
        return reason
    if x.ndim not in (4, 5):
        return f"x has {x.ndim} dims; the kernel takes (B, C, H, W) or (B, C, T, H, W)"
    c = x.shape[1]
    if gamma.numel() != c or (bias is not None and bias.numel() != c):
        return f"gamma/bias do not hold one value per channel ({c})"
    return grad_reason(x, gamma, bias)


def channel_rms_norm_silu(
    x: torch.Tensor,
    gamma: torch.Tensor,
    bias: torch.Tensor | None = None,
    silu: bool = True,
    eps: float = 1e-12,
) -> torch.Tensor:
    """F.normalize(x, dim=1) * sqrt(C) * gamma + bias, then SiLU if `silu`.

    x: (B, C, H, W) or (B, C, T, H, W), channels-first, bfloat16, float16 or float32, any
    strides (a non-contiguous x is copied to contiguous first).
    gamma, bias: C elements each, in any shape such as (C,), (C, 1, 1) or (C, 1, 1, 1); cast
    to x's dtype and device like ComfyUI does; bias may be None.
    Returns a contiguous tensor of x's shape and dtype. The norm is taken over C at each
    position, with the sum of squares and the whole epilogue in float32 and one final
    rounding. Other inputs (dtypes, devices, shapes, autograd) use the eager reference.
    """
    reason = _why_not(x, gamma, bias)
    if reason is not None:
        log_fallback_once(OP, reason)
        return channel_rms_norm_silu_reference(x, gamma, bias, silu, eps)
    gamma = gamma.reshape(-1).to(x)
    bias = None if bias is None else bias.reshape(-1).to(x)
    return _channel_rms_norm_silu_op(x, gamma, bias, silu, eps)


class ChannelRMSNormSiLU(torch.nn.Module):
    """Drop-in for ComfyUI's channel-first `RMS_norm` (optionally followed by `nn.SiLU`).

    Holds the norm's own `gamma` and `bias` Parameters under the norm's names, so the patched
    tree names its weights as the original does (ComfyUI's ModelPatcher backs weights up and
    restores them by name, across object patches); they are cast to x's dtype and device on
    every call, as ComfyUI does.
    """

    def __init__(self, norm: torch.nn.Module, silu: bool):
        super().__init__()
        if not getattr(norm, "channel_first", False):
            raise ValueError(
                "ChannelRMSNormSiLU needs a channel-first RMS_norm (channel_first=True); "
                "leave channel-last norms as they are"
            )
        self.gamma, self.bias = norm.gamma, norm.bias
        self.silu = silu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x)
        return channel_rms_norm_silu(x, self.gamma.to(x), bias, self.silu)
