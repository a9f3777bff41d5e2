"""ComfyUI's AutoencoderKL (SD1.5, SDXL, SD3, Flux, Flux 2) as ops, with 2-D convolutions."""

from fractions import Fraction

import torch
import torch.nn.functional as F

from ...kernels.group_norm_silu import GroupNormSiLU
from ...kernels.upsample_conv3x3 import UpsampleConv3x3
from .ops import HALF, Global, Local, Stats, call, require, require_callable, require_conv


def _group_norm(m) -> torch.nn.Module:
    """A GroupNorm, or the fused replacement holding its weight, bias, num_groups and eps."""
    require(isinstance(m, torch.nn.GroupNorm | GroupNormSiLU), f"a {type(m).__name__} norm")
    return m


def _resnet_ops(block) -> list:
    """AutoencoderKL ResnetBlock: two GroupNorm boundaries, the skip carried in the state."""
    kind = type(block).__name__
    require(kind == "ResnetBlock", f"AutoencoderKL block {kind}")
    require(getattr(block, "temb_proj", None) is None, "ResnetBlock with a timestep input")
    c_in, c_out = block.in_channels, block.out_channels
    st1, st2 = Stats(_group_norm(block.norm1), 0), Stats(_group_norm(block.norm2), 1)
    conv1, conv2 = (
        require_conv(block.conv1, "ResnetBlock.conv1"),
        require_conv(block.conv2, "ResnetBlock.conv2"),
    )
    shortcut = None
    if c_in != c_out:
        shortcut = block.conv_shortcut if block.use_conv_shortcut else block.nin_shortcut
        require_conv(shortcut, "ResnetBlock shortcut")

    def first(x):
        return x, conv1(F.silu(st1.apply(x)))

    def second(x, h):
        h = conv2(block.dropout(F.silu(st2.apply(h))))
        if shortcut is not None:
            x = shortcut(x)
        return (x + h,)

    return [
        st1,
        Local(first, c_in + c_out, 5 * c_in + c_out, radius=1),
        st2,
        Local(second, c_out, c_in + 7 * c_out, radius=1),
    ]


def _blocks(level, where: str) -> list:
    """The ResnetBlocks of one AutoencoderKL level, each followed by its attention if any."""
    ops = []
    for i_block, block in enumerate(level.block):
        ops += _resnet_ops(block)
        if len(level.attn) > 0:
            require_callable(level.attn[i_block], f"{where}.attn")
            ops.append(Global(call(level.attn[i_block]), block.out_channels))
    return ops


def _mid(coder, c: int) -> list:
    mid = coder.mid
    require_callable(mid.attn_1, f"{type(coder).__name__}.mid.attn_1")
    return [*_resnet_ops(mid.block_1), Global(call(mid.attn_1), c), *_resnet_ops(mid.block_2)]


def _head(coder, c: int, tanh: bool = False) -> list:
    """norm_out, SiLU, conv_out (then tanh where the decoder has it)."""
    norm_out = Stats(_group_norm(coder.norm_out), 0)
    conv_out = require_conv(coder.conv_out, f"{type(coder).__name__}.conv_out")

    def head(x):
        y = conv_out(F.silu(norm_out.apply(x)))
        return (torch.tanh(y) if tanh else y,)

    return [norm_out, Local(head, conv_out.out_channels, 5 * c, radius=1)]


def _quant(vae, name: str) -> list:
    """The 1x1 `quant_conv` / `post_quant_conv` of AutoencoderKL (none in AutoencodingEngine)."""
    if type(vae).__name__ == "AutoencodingEngine":
        return []
    conv = getattr(vae, name)
    if isinstance(conv, torch.nn.Identity):
        return []
    require_conv(conv, name)
    return [Local(call(conv), conv.out_channels, 2 * conv.out_channels)]


def _latent_batch_norm(vae) -> Local:
    """Newer ComfyUI's latent batch norm (Flux 2's VAE), undone before `post_quant_conv`:
    z * sqrt(var + eps) + mean per channel, then channels (c, pi, pj) to 2x2 pixels."""
    bn, eps, ps = vae.bn, vae.bn_eps, tuple(vae.ps)
    require(ps[0] == ps[1], f"latent batch norm with patch {ps}")
    c = bn.running_mean.shape[0] // (ps[0] * ps[1])

    def fn(z):
        # as the host: the statistics cast to z's dtype, the arithmetic in z's dtype
        s = torch.sqrt(bn.running_var.view(1, -1, 1, 1).to(z) + eps)
        m = bn.running_mean.view(1, -1, 1, 1).to(z)
        return (F.pixel_shuffle(z * s + m, ps[0]),)

    return Local(fn, c, 3 * c, scale=ps[0])


def _latent_batch_norm_encode(vae) -> Local:
    """The encode side of `_latent_batch_norm`: 2x2 pixels to channels, then the batch norm
    with the running statistics, as `AutoencodingEngineLegacy.encode`."""
    bn, eps, ps = vae.bn, vae.bn_eps, tuple(vae.ps)
    require(ps[0] == ps[1], f"latent batch norm with patch {ps}")
    c = bn.running_mean.shape[0]

    def fn(z):
        z = F.pixel_unshuffle(z, ps[0])
        return (F.batch_norm(z, bn.running_mean.to(z), bn.running_var.to(z), eps=eps),)

    return Local(fn, c, 3 * c, scale=Fraction(1, ps[0]))


def decoder_ops(vae) -> list:
    """ComfyUI's AutoencoderKL decoder (SD1.5, SDXL, SD3, Flux, Flux 2), 2-D convolutions.

    Older hosts' `give_pre_end` (no head) is not tiled; newer hosts split video decodes into
    carried chunks (CarriedConv3d), which the 2-D layer checks below turn away.
    """
    dec = vae.decoder
    require(not getattr(dec, "give_pre_end", False), "decoders with give_pre_end")
    require(not getattr(dec, "carried", False), "decoders with carried 3-D convolutions")
    ops = []
    if getattr(vae, "bn", None) is not None and type(vae).__name__ != "AutoencodingEngine":
        ops.append(_latent_batch_norm(vae))
    ops += _quant(vae, "post_quant_conv")
    conv_in = require_conv(dec.conv_in, "Decoder.conv_in")
    c = conv_in.out_channels
    ops += [Local(call(conv_in), c, 2 * c, radius=1), *_mid(dec, c)]
    for i_level in reversed(range(dec.num_resolutions)):
        up = dec.up[i_level]
        require(len(up.block) == dec.num_res_blocks + 1, f"Decoder.up[{i_level}] block count")
        ops += _blocks(up, f"Decoder.up[{i_level}]")
        c = up.block[-1].out_channels
        if i_level != 0:
            sample = up.upsample
            where = f"Decoder.up[{i_level}].upsample"
            orig = sample.fallback if isinstance(sample, UpsampleConv3x3) else sample
            sf = getattr(orig, "scale_factor", None)
            require(sf in (2, 2.0), f"{where} with scale factor {sf}")
            require_callable(sample, where)
            if sample.with_conv:
                conv = getattr(sample, "conv", None)  # a fused replacement keeps it as .conv
                require_conv(conv, f"{where}.conv")
            r = 0.5 if sample.with_conv else 0.0
            ops.append(Local(call(sample), c, 3 * c, scale=2, radius=r))
    return ops + _head(dec, c, tanh=getattr(dec, "tanh_out", False))


def encoder_ops(vae) -> list:
    """ComfyUI's AutoencoderKL encoder with 2-D convolutions, then `quant_conv`, the
    regularizer (the Gaussian's mean; run whole, as the host runs it) and, on newer hosts,
    Flux 2's latent batch norm."""
    enc = vae.encoder
    conv_in = require_conv(enc.conv_in, "Encoder.conv_in")
    c = conv_in.out_channels
    ops = [Local(call(conv_in), c, 2 * c, radius=1)]
    for i_level in range(enc.num_resolutions):
        down = enc.down[i_level]
        require(len(down.block) == enc.num_res_blocks, f"Encoder.down[{i_level}] block count")
        ops += _blocks(down, f"Encoder.down[{i_level}]")
        c = down.block[-1].out_channels
        if i_level != enc.num_resolutions - 1:
            sample = down.downsample
            where = f"Encoder.down[{i_level}].downsample"
            require_callable(sample, where)
            if sample.with_conv:  # zero-pad right and bottom, 3x3 conv of stride 2
                conv = require_conv(sample.conv, f"{where}.conv")
                require(conv.stride == (2, 2), f"{where}.conv with stride {conv.stride}")
            r = 1 if sample.with_conv else 0  # else a 2x2 average
            ops.append(Local(call(sample), c, 9 * c, scale=HALF, radius=r))
    ops += [*_mid(enc, c), *_head(enc, c), *_quant(vae, "quant_conv")]
    regularize = vae.regularization  # its output has at most as many channels as its input
    ops.append(Global(lambda z: (regularize(z)[0],), ops[-1].out_channels))
    if getattr(vae, "bn", None) is not None and type(vae).__name__ != "AutoencodingEngine":
        ops.append(_latent_batch_norm_encode(vae))
    return ops
