"""Nearest 2x upsample fused into the 3x3 convolution (padding 1) that follows it.

Output pixel (2i+a, 2j+b) of conv3x3(up2(x)) reads up2(x) rows 2i+a-1..2i+a+1, which are x rows
(i-1, i, i) for a=0 and (i, i, i+1) for a=1: each of the four output phases is a 2x2
convolution of x whose taps are sums of the 3x3 taps. All four phases run as one convolution
of x with 4*C_out filters of size 2x2 and padding 1, then interleave. The 4x upsampled tensor
never exists, each low-resolution texel is read once for all four phases, and the
multiply-adds drop from 36 to 16 per output pair (2.25x fewer).

The phase convolution runs through `F.conv2d` (cuDNN on GPU), so this op needs no Triton.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ._triton import custom_op, disabled, log_fallback_once

# Row (and column) combination of the 3x3 taps into 2x2 taps, for phase 0 and phase 1.
_COMBINE = torch.tensor([[[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]], [[1.0, 1.0, 0.0], [0.0, 0.0, 1.0]]])


def phase_weights(weight: torch.Tensor) -> torch.Tensor:
    """(C_out, C_in, 3, 3) -> (4*C_out, C_in, 2, 2), phase-major: index (2a+b)*C_out + o.

    Sums of at most four taps are formed in float32 (or wider), then rounded once.
    """
    acc = torch.promote_types(weight.dtype, torch.float32)
    r = _COMBINE.to(weight.device, acc)
    w = torch.einsum("auy,oiyx,bvx->abouiv", r, weight.to(acc), r)
    w = w.permute(0, 1, 2, 4, 3, 5)  # (a, b, o, i, u, v)
    return w.reshape(4 * weight.shape[0], weight.shape[1], 2, 2).to(weight.dtype)


def upsample_conv3x3_reference(x, weight, bias=None):
    """conv2d(interpolate(x, 2x nearest), weight, bias, padding=1), as the VAEs do it."""
    return F.conv2d(F.interpolate(x, scale_factor=2.0, mode="nearest"), weight, bias, padding=1)


def _upsample_conv3x3_phases(x, weight4, bias):
    b, _, h, w = x.shape
    c = weight4.shape[0] // 4
    y = F.conv2d(x, weight4, None, padding=1)  # (B, 4C, H+1, W+1)
    out = torch.empty((b, c, h, 2, w, 2), dtype=y.dtype, device=y.device)
    for a in (0, 1):
        for bb in (0, 1):
            k = 2 * a + bb
            out[:, :, :, a, :, bb] = y[:, k * c : (k + 1) * c, a : a + h, bb : bb + w]
    out = out.view(b, c, 2 * h, 2 * w)
    if bias is not None:
        out += bias.view(1, c, 1, 1)
    return out


@custom_op("qwen_turbo::upsample_conv3x3")
def _upsample_conv3x3_op(
    x: torch.Tensor, weight4: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return _upsample_conv3x3_phases(x, weight4, bias)


@_upsample_conv3x3_op.register_fake
def _(x, weight4, bias):
    b, _, h, w = x.shape
    return x.new_empty((b, weight4.shape[0] // 4, 2 * h, 2 * w))


def _unsupported(x, weight, bias) -> str | None:
    if disabled():
        return "disabled by QWEN_TURBO_DISABLE_KERNELS"
    if x.ndim != 4:
        return f"{x.ndim}-D input"
    if weight.shape[-2:] != (3, 3) or weight.shape[1] != x.shape[1]:
        return f"weight {tuple(weight.shape)} for input {tuple(x.shape)}"
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != x.dtype):
        return "mixed dtypes"
    return None


def upsample_conv3x3(x, weight, bias=None, weight4=None):
    """conv2d(nearest_2x(x), weight, bias, padding=1) without the upsampled tensor.

    x: (B, C_in, H, W); weight: (C_out, C_in, 3, 3); bias: (C_out,) or None; same dtype and
    device. weight4: `phase_weights(weight)`, if the caller has it. Returns
    (B, C_out, 2H, 2W), contiguous.
    """
    reason = _unsupported(x, weight, bias)
    if reason is not None:
        log_fallback_once("upsample_conv3x3", reason)
        return upsample_conv3x3_reference(x, weight, bias)
    if weight4 is None:
        weight4 = phase_weights(weight)
    return _upsample_conv3x3_op(x, weight4, bias)


class UpsampleConv3x3(torch.nn.Module):
    """Replaces `Sequential(Upsample(2x nearest), Conv2d(3x3, padding 1))` or a VAE `Upsample`.

    Holds the original conv (its parameters are shared, not copied) under its name in the
    replaced module ("1" in the Sequential, "conv" in an `Upsample`), so the patched tree names
    its weights as the original does (ComfyUI's ModelPatcher backs weights up and restores
    them by name, across object patches). The phase weights are built once per weight
    storage, device and dtype (and version, where the weight is not an inference tensor), not
    once per call: a tiled decode calls this once per tile.

    Takes the original module's extra arguments too (newer ComfyUI calls its `Upsample` as
    `upsample(x, conv_carry_in, conv_carry_out)`): the fused path runs for a 4-D x with every
    extra argument None; anything else goes to the original module unchanged.
    """

    def __init__(self, conv: torch.nn.Conv2d, fallback: Callable):
        super().__init__()
        named = getattr(fallback, "named_children", lambda: [])
        self.add_module(next((n for n, c in named() if c is conv), "conv"), conv)
        # plain references: the conv is named once, above; `fallback` is the original module,
        # for inputs this op does not take
        self.__dict__.update(_conv=conv, fallback=fallback)
        self.with_conv = True  # read by code that inspects a VAE `Upsample`
        self._phases = None  # (key, phase weights)

    def forward(self, x, *args, **kwargs):
        extra = (*args, *kwargs.values())
        if x.ndim != 4 or any(a is not None for a in extra):
            return self.fallback(x, *args, **kwargs)
        p = self._conv.weight
        w = p.to(x)
        b = None if self._conv.bias is None else self._conv.bias.to(x)
        # inference tensors carry no version counter; ComfyUI never patches VAE weights in place
        key = (p.data_ptr(), x.device, x.dtype, None if p.is_inference() else p._version)
        if self._phases is None or self._phases[0] != key:
            self._phases = (key, phase_weights(w))
        return upsample_conv3x3(x, w, b, self._phases[1])
