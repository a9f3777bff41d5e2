"""ComfyUI's Wan 2.1 / Qwen-Image VAE (`comfy.ldm.wan.vae.WanVAE`) as ops, for one frame."""

import torch

from .ops import HALF, Global, Local, call, require, require_callable, require_conv


def _layer(layer, where: str, c: int) -> Local | Global:
    """A layer of a Wan `Encoder3d`/`Decoder3d` called without a feature cache; c: its input
    channels. For one frame a `Resample` skips its time conv."""
    kind = type(layer).__name__
    require_callable(layer, f"{where} ({kind})")
    if kind == "ResidualBlock":
        c_in, c = layer.in_dim, layer.out_dim
        # x, norm, SiLU, the 3-frame padded copy of each causal conv input, conv output
        return Local(call(layer), c, 2 * c_in + 6 * max(c_in, c), radius=2)
    if kind == "AttentionBlock":
        return Global(call(layer), c)
    mode = getattr(layer, "mode", "")
    if kind == "Resample" and mode in ("upsample2d", "upsample3d"):
        c = layer.dim // 2
        return Local(call(layer), c, 5 * c, scale=2, radius=0.5)
    if kind == "Resample" and mode in ("downsample2d", "downsample3d"):
        # zero-pad right and bottom, 3x3 conv of stride 2: the input, its padded copy, output
        conv = require_conv(layer.resample[-1], f"{where}.resample[-1]")
        require(conv.stride == (2, 2), f"{where} with stride {conv.stride}")
        return Local(call(layer), layer.dim, 9 * layer.dim, scale=HALF, radius=1)
    raise NotImplementedError(f"{where} {kind} ({mode})")


def _chain(first, layers, head, where: str) -> list:
    """conv1, the layers, head (RMS norm, SiLU, causal conv) of a Wan encoder or decoder."""
    c0 = require_conv(first, f"{where}.conv1", torch.nn.Conv3d).out_channels
    require_callable(first, f"{where}.conv1")
    # the input, its 3-frame padded copy, the output
    ops = [Local(call(first), c0, 4 * first.in_channels + c0, radius=1)]
    c = c0
    for i, layer in enumerate(layers):
        ops.append(_layer(layer, f"{where} layer {i}", c))
        c = ops[-1].out_channels
    require(isinstance(head, torch.nn.Sequential), f"{where}.head is not a Sequential")
    out = require_conv(head[-1], f"{where}.head[-1]", torch.nn.Conv3d).out_channels
    require_callable(head[-1], f"{where}.head[-1]")
    ops.append(Local(call(head), out, 6 * c, radius=1))
    return ops


def decoder_ops(vae) -> list:
    """ComfyUI's Wan 2.1 / Qwen-Image VAE (`comfy.ldm.wan.vae.WanVAE`) decoder for one frame.

    For T=1 every CausalConv3d sees zero temporal padding and `Resample` skips its time conv,
    so calling the modules without a feature cache matches `WanVAE.decode` (newer hosts run
    that uncached single frame through the conv's own truncated-weight path; the ops call the
    same modules, so they follow whichever the host has).
    """
    dec = vae.decoder
    z = require_conv(vae.conv2, "WanVAE.conv2", torch.nn.Conv3d).out_channels
    require_callable(vae.conv2, "WanVAE.conv2")
    ops = _chain(dec.conv1, [*dec.middle, *dec.upsamples], dec.head, "Decoder3d")
    return [Local(call(vae.conv2), z, 2 * z), *ops]


def encoder_ops(vae) -> list:
    """The Wan VAE's encoder for one frame, then `conv1` and the mean half of its channels, as
    `WanVAE.encode` (the first frame's feature cache is empty: the same as none)."""
    enc = vae.encoder
    ops = _chain(enc.conv1, [*enc.downsamples, *enc.middle], enc.head, "Encoder3d")
    conv = require_conv(vae.conv1, "WanVAE.conv1", torch.nn.Conv3d)
    require_callable(conv, "WanVAE.conv1")
    c = conv.out_channels

    def mean(x):
        return (conv(x).chunk(2, dim=1)[0],)

    return [*ops, Local(mean, c // 2, 3 * c)]
