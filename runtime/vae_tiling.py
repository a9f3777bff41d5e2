"""Exact tiled VAE decoding and encoding under a memory budget.

A decoder or encoder is described as a list of ops:
- `Local`: maps a spatial crop to a crop `scale` times as large (1/2 for a downsampling op);
  an output pixel depends only on input pixels within `radius` (in input pixels).
- `Global`: needs the whole tensor (the mid-block attention). It runs untiled, at latent size.
- `Stats`: a GroupNorm's statistics over the whole tensor, accumulated tile by tile and read by
  the Local op that follows.

Runs of Local ops execute as chains. Each tile reads its input with a halo as wide as the
chain's receptive field and keeps only its interior, so tiles are stitched, never blended, and
the result equals an untiled run. Where a chain downsamples, tile borders and halos sit on
multiples of its downscale factor, so every crop sees the whole tensor's pixel grid. A chain
ends wherever its full output is small enough to keep; keeping it costs memory, recomputing
halos costs time.

The models are recognised by structure (ComfyUI's Wan 2.1 `Decoder3d`/`Encoder3d` and the
AutoencoderKL `Decoder`/`Encoder`): class names, attributes, layer types and `forward`
signatures, never ComfyUI's version, so this module does not import ComfyUI. What is not
recognised raises NotImplementedError naming it, and the caller runs the stock way.
"""

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction

import torch
import torch.nn.functional as F

from ..kernels.group_norm_silu import GroupNormSiLU
from ..kernels.group_norm_stats import (
    finalize_moments,
    group_moments,
    group_norm_apply,
    merge_moments,
)
from ..kernels.upsample_conv3x3 import UpsampleConv3x3
from .vae_patches import input_only_reason

log = logging.getLogger(__name__)

State = tuple[torch.Tensor, ...]
MIN_TILE = 8  # input pixels


@dataclass
class Local:
    fn: Callable[..., State]
    out_channels: int  # summed over the output state
    peak_channels: float  # working set, in channels at output resolution
    scale: int = 1
    radius: float = 0.0


@dataclass
class Global:
    fn: Callable[..., State]
    out_channels: int


@dataclass
class Stats:
    """GroupNorm statistics of state[index]; Local ops read them through `apply`."""

    norm: torch.nn.Module
    index: int = 0
    mean: torch.Tensor | None = None
    rstd: torch.Tensor | None = None

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        w = None if self.norm.weight is None else self.norm.weight.to(x.device)
        b = None if self.norm.bias is None else self.norm.bias.to(x.device)
        return group_norm_apply(x, self.mean, self.rstd, w, b)


# ---------------------------------------------------------------- model descriptions


def _call(module) -> Callable[..., State]:
    return lambda x: (module(x),)


def _require(condition: bool, what: str) -> None:
    if not condition:
        raise NotImplementedError(what)


def _callable(module, where: str) -> None:
    """The ops call `module(x)` where the host passes only arguments that are None or the
    defaults for one frame / a 2-D run; a forward that needs more is not recognised."""
    why = input_only_reason(module)
    _require(why is None, f"{where}: {why}")


def _conv(module, where: str, kind: type = torch.nn.Conv2d):
    _require(
        isinstance(module, kind),
        f"{where} is a {type(module).__name__}, not a {kind.__name__}",
    )
    return module


HALF = Fraction(1, 2)


def _wan_layer(layer, where: str, c: int) -> Local | Global:
    """A layer of a Wan `Encoder3d`/`Decoder3d` called without a feature cache; c: its input
    channels. For one frame a `Resample` skips its time conv."""
    kind = type(layer).__name__
    _callable(layer, f"{where} ({kind})")
    if kind == "ResidualBlock":
        c_in, c = layer.in_dim, layer.out_dim
        # x, norm, SiLU, the 3-frame padded copy of each causal conv input, conv output
        return Local(_call(layer), c, 2 * c_in + 6 * max(c_in, c), radius=2)
    if kind == "AttentionBlock":
        return Global(_call(layer), c)
    mode = getattr(layer, "mode", "")
    if kind == "Resample" and mode in ("upsample2d", "upsample3d"):
        c = layer.dim // 2
        return Local(_call(layer), c, 5 * c, scale=2, radius=0.5)
    if kind == "Resample" and mode in ("downsample2d", "downsample3d"):
        # zero-pad right and bottom, 3x3 conv of stride 2: the input, its padded copy, output
        conv = _conv(layer.resample[-1], f"{where}.resample[-1]")
        _require(conv.stride == (2, 2), f"{where} with stride {conv.stride}")
        return Local(_call(layer), layer.dim, 9 * layer.dim, scale=HALF, radius=1)
    raise NotImplementedError(f"{where} {kind} ({mode})")


def _wan_chain(first, layers, head, where: str) -> list:
    """conv1, the layers, head (RMS norm, SiLU, causal conv) of a Wan encoder or decoder."""
    c0 = _conv(first, f"{where}.conv1", torch.nn.Conv3d).out_channels
    _callable(first, f"{where}.conv1")
    # the input, its 3-frame padded copy, the output
    ops = [Local(_call(first), c0, 4 * first.in_channels + c0, radius=1)]
    c = c0
    for i, layer in enumerate(layers):
        ops.append(_wan_layer(layer, f"{where} layer {i}", c))
        c = ops[-1].out_channels
    _require(isinstance(head, torch.nn.Sequential), f"{where}.head is not a Sequential")
    out = _conv(head[-1], f"{where}.head[-1]", torch.nn.Conv3d).out_channels
    _callable(head[-1], f"{where}.head[-1]")
    ops.append(Local(_call(head), out, 6 * c, radius=1))
    return ops


def _wan_ops(vae) -> list:
    """ComfyUI's Wan 2.1 / Qwen-Image VAE (`comfy.ldm.wan.vae.WanVAE`) decoder for one frame.

    For T=1 every CausalConv3d sees zero temporal padding and `Resample` skips its time conv,
    so calling the modules without a feature cache matches `WanVAE.decode` (newer hosts run
    that uncached single frame through the conv's own truncated-weight path; the ops call the
    same modules, so they follow whichever the host has).
    """
    dec = vae.decoder
    z = _conv(vae.conv2, "WanVAE.conv2", torch.nn.Conv3d).out_channels
    _callable(vae.conv2, "WanVAE.conv2")
    ops = _wan_chain(dec.conv1, [*dec.middle, *dec.upsamples], dec.head, "Decoder3d")
    return [Local(_call(vae.conv2), z, 2 * z), *ops]


def _wan_encoder_ops(vae) -> list:
    """The Wan VAE's encoder for one frame, then `conv1` and the mean half of its channels, as
    `WanVAE.encode` (the first frame's feature cache is empty: the same as none)."""
    enc = vae.encoder
    ops = _wan_chain(enc.conv1, [*enc.downsamples, *enc.middle], enc.head, "Encoder3d")
    conv = _conv(vae.conv1, "WanVAE.conv1", torch.nn.Conv3d)
    _callable(conv, "WanVAE.conv1")
    c = conv.out_channels

    def mean(x):
        return (conv(x).chunk(2, dim=1)[0],)

    return [*ops, Local(mean, c // 2, 3 * c)]


def _group_norm(m) -> torch.nn.Module:
    """A GroupNorm, or the fused replacement holding its weight, bias, num_groups and eps."""
    _require(isinstance(m, torch.nn.GroupNorm | GroupNormSiLU), f"a {type(m).__name__} norm")
    return m


def _resnet_ops(block) -> list:
    """AutoencoderKL ResnetBlock: two GroupNorm boundaries, the skip carried in the state."""
    kind = type(block).__name__
    _require(kind == "ResnetBlock", f"AutoencoderKL block {kind}")
    _require(getattr(block, "temb_proj", None) is None, "ResnetBlock with a timestep input")
    c_in, c_out = block.in_channels, block.out_channels
    st1, st2 = Stats(_group_norm(block.norm1), 0), Stats(_group_norm(block.norm2), 1)
    conv1, conv2 = _conv(block.conv1, "ResnetBlock.conv1"), _conv(block.conv2, "ResnetBlock.conv2")
    shortcut = None
    if c_in != c_out:
        shortcut = block.conv_shortcut if block.use_conv_shortcut else block.nin_shortcut
        _conv(shortcut, "ResnetBlock shortcut")

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


def _kl_blocks(level, where: str) -> list:
    """The ResnetBlocks of one AutoencoderKL level, each followed by its attention if any."""
    ops = []
    for i_block, block in enumerate(level.block):
        ops += _resnet_ops(block)
        if len(level.attn) > 0:
            _callable(level.attn[i_block], f"{where}.attn")
            ops.append(Global(_call(level.attn[i_block]), block.out_channels))
    return ops


def _kl_mid(coder, c: int) -> list:
    mid = coder.mid
    _callable(mid.attn_1, f"{type(coder).__name__}.mid.attn_1")
    return [*_resnet_ops(mid.block_1), Global(_call(mid.attn_1), c), *_resnet_ops(mid.block_2)]


def _kl_head(coder, c: int, tanh: bool = False) -> list:
    """norm_out, SiLU, conv_out (then tanh where the decoder has it)."""
    norm_out = Stats(_group_norm(coder.norm_out), 0)
    conv_out = _conv(coder.conv_out, f"{type(coder).__name__}.conv_out")

    def head(x):
        y = conv_out(F.silu(norm_out.apply(x)))
        return (torch.tanh(y) if tanh else y,)

    return [norm_out, Local(head, conv_out.out_channels, 5 * c, radius=1)]


def _kl_quant(vae, name: str) -> list:
    """The 1x1 `quant_conv` / `post_quant_conv` of AutoencoderKL (none in AutoencodingEngine)."""
    if type(vae).__name__ == "AutoencodingEngine":
        return []
    conv = getattr(vae, name)
    if isinstance(conv, torch.nn.Identity):
        return []
    _conv(conv, name)
    return [Local(_call(conv), conv.out_channels, 2 * conv.out_channels)]


def _latent_batch_norm(vae) -> Local:
    """Newer ComfyUI's latent batch norm (Flux 2's VAE), undone before `post_quant_conv`:
    z * sqrt(var + eps) + mean per channel, then channels (c, pi, pj) to 2x2 pixels."""
    bn, eps, ps = vae.bn, vae.bn_eps, tuple(vae.ps)
    _require(ps[0] == ps[1], f"latent batch norm with patch {ps}")
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
    _require(ps[0] == ps[1], f"latent batch norm with patch {ps}")
    c = bn.running_mean.shape[0]

    def fn(z):
        z = F.pixel_unshuffle(z, ps[0])
        return (F.batch_norm(z, bn.running_mean.to(z), bn.running_var.to(z), eps=eps),)

    return Local(fn, c, 3 * c, scale=Fraction(1, ps[0]))


def _autoencoder_kl_ops(vae) -> list:
    """ComfyUI's AutoencoderKL decoder (SD1.5, SDXL, SD3, Flux, Flux 2), 2-D convolutions.

    Older hosts' `give_pre_end` (no head) is not tiled; newer hosts split video decodes into
    carried chunks (CarriedConv3d), which the 2-D layer checks below turn away.
    """
    dec = vae.decoder
    _require(not getattr(dec, "give_pre_end", False), "decoders with give_pre_end")
    _require(not getattr(dec, "carried", False), "decoders with carried 3-D convolutions")
    ops = []
    if getattr(vae, "bn", None) is not None and type(vae).__name__ != "AutoencodingEngine":
        ops.append(_latent_batch_norm(vae))
    ops += _kl_quant(vae, "post_quant_conv")
    conv_in = _conv(dec.conv_in, "Decoder.conv_in")
    c = conv_in.out_channels
    ops += [Local(_call(conv_in), c, 2 * c, radius=1), *_kl_mid(dec, c)]
    for i_level in reversed(range(dec.num_resolutions)):
        up = dec.up[i_level]
        _require(len(up.block) == dec.num_res_blocks + 1, f"Decoder.up[{i_level}] block count")
        ops += _kl_blocks(up, f"Decoder.up[{i_level}]")
        c = up.block[-1].out_channels
        if i_level != 0:
            sample = up.upsample
            where = f"Decoder.up[{i_level}].upsample"
            orig = sample.fallback if isinstance(sample, UpsampleConv3x3) else sample
            sf = getattr(orig, "scale_factor", None)
            _require(sf in (2, 2.0), f"{where} with scale factor {sf}")
            _callable(sample, where)
            if sample.with_conv:
                conv = getattr(sample, "conv", None)  # a fused replacement keeps it as .conv
                _conv(conv, f"{where}.conv")
            r = 0.5 if sample.with_conv else 0.0
            ops.append(Local(_call(sample), c, 3 * c, scale=2, radius=r))
    return ops + _kl_head(dec, c, tanh=getattr(dec, "tanh_out", False))


def _autoencoder_kl_encoder_ops(vae) -> list:
    """ComfyUI's AutoencoderKL encoder with 2-D convolutions, then `quant_conv`, the
    regularizer (the Gaussian's mean; run whole, as the host runs it) and, on newer hosts,
    Flux 2's latent batch norm."""
    enc = vae.encoder
    conv_in = _conv(enc.conv_in, "Encoder.conv_in")
    c = conv_in.out_channels
    ops = [Local(_call(conv_in), c, 2 * c, radius=1)]
    for i_level in range(enc.num_resolutions):
        down = enc.down[i_level]
        _require(len(down.block) == enc.num_res_blocks, f"Encoder.down[{i_level}] block count")
        ops += _kl_blocks(down, f"Encoder.down[{i_level}]")
        c = down.block[-1].out_channels
        if i_level != enc.num_resolutions - 1:
            sample = down.downsample
            where = f"Encoder.down[{i_level}].downsample"
            _callable(sample, where)
            if sample.with_conv:  # zero-pad right and bottom, 3x3 conv of stride 2
                conv = _conv(sample.conv, f"{where}.conv")
                _require(conv.stride == (2, 2), f"{where}.conv with stride {conv.stride}")
            r = 1 if sample.with_conv else 0  # else a 2x2 average
            ops.append(Local(_call(sample), c, 9 * c, scale=HALF, radius=r))
    ops += [*_kl_mid(enc, c), *_kl_head(enc, c), *_kl_quant(vae, "quant_conv")]
    regularize = vae.regularization  # its output has at most as many channels as its input
    ops.append(Global(lambda z: (regularize(z)[0],), ops[-1].out_channels))
    if getattr(vae, "bn", None) is not None and type(vae).__name__ != "AutoencodingEngine":
        ops.append(_latent_batch_norm_encode(vae))
    return ops


WAN_MODULE = "wan.vae"  # comfy.ldm.wan.vae (not vae2_2: Wan 2.2's layers differ)
KL_MODULE = "diffusionmodules.model"
KL_MODELS = ("AutoencoderKL", "AutoencodingEngineLegacy", "AutoencodingEngine")


def _ops(first_stage_model, x: torch.Tensor, part: str, wan: tuple, kl: tuple) -> list:
    """The ops of `first_stage_model`'s `part` ("decoder" or "encoder"); wan: (the Wan class,
    the WanVAE 1x1 conv beside it, its ops); kl: (the AutoencoderKL class, its ops)."""
    m = first_stage_model
    coder = getattr(m, part, None)
    kind = type(coder).__name__
    what = "latents" if part == "decoder" else "images"
    try:
        if (
            type(m).__name__ == "WanVAE"
            and type(m).__module__.endswith(WAN_MODULE)
            and kind == wan[0]
            and hasattr(m, wan[1])
        ):
            if x.ndim != 5 or x.shape[2] != 1:
                raise NotImplementedError(f"Wan {what} with T != 1 (shape {tuple(x.shape)})")
            return wan[2](m)
        if kind == kl[0] and type(coder).__module__.endswith(KL_MODULE):
            if type(m).__name__ not in KL_MODELS:
                raise NotImplementedError(f"the first-stage model {type(m).__name__}")
            if x.ndim != 4:
                raise NotImplementedError(f"{what} of {x.ndim} dimensions for a 2-D VAE")
            return kl[1](m)
    except (AttributeError, IndexError, TypeError) as e:  # a layout this module does not know
        raise NotImplementedError(f"the {kind} layout ({type(e).__name__}: {e})") from e
    raise NotImplementedError(f"the VAE {type(m).__name__} with {part} {kind}")


def decoder_ops(first_stage_model, latent: torch.Tensor) -> list:
    """The op list for decoding `latent` with a ComfyUI first-stage model.

    Raises NotImplementedError naming what is not supported, so callers can fall back.
    """
    wan, kl = ("Decoder3d", "conv2", _wan_ops), ("Decoder", _autoencoder_kl_ops)
    return _ops(first_stage_model, latent, "decoder", wan, kl)


def encoder_ops(first_stage_model, pixels: torch.Tensor) -> list:
    """The op list for encoding `pixels` (B, C, [T,] H, W), processed as the host's
    `VAE.encode` hands them to the model, into the latent `first_stage_model.encode` returns.

    Raises NotImplementedError naming what is not supported, so callers can fall back.
    """
    wan = ("Encoder3d", "conv1", _wan_encoder_ops)
    ops = _ops(first_stage_model, pixels, "encoder", wan, ("Encoder", _autoencoder_kl_encoder_ops))
    down = math.prod(op.scale for op in ops if isinstance(op, Local)).denominator
    h, w = pixels.shape[-2:]
    if h % down or w % down:
        raise NotImplementedError(f"a {h}x{w} image (not a multiple of {down})")
    return ops


# ---------------------------------------------------------------- planning


@dataclass
class Chain:
    ops: list
    scale: Fraction  # output size / input size
    halo: int
    tiles: list[tuple[int, int, int, int]]  # (y0, y1, x0, x1) in input pixels
    store_on_device: bool


@dataclass
class Plan:
    steps: list = field(default_factory=list)  # Chain | Global | (Stats, rows)

    @property
    def total(self) -> int:
        return sum(len(s.tiles) if isinstance(s, Chain) else 1 for s in self.steps)

    @property
    def max_tiles(self) -> int:
        return max((len(s.tiles) for s in self.steps if isinstance(s, Chain)), default=1)


def _grid(h: int, w: int, th: int, tw: int, step: int) -> list[tuple[int, int, int, int]]:
    """Tiles of about th x tw covering h x w, their borders on multiples of `step`."""
    ny, nx = math.ceil(h / th), math.ceil(w / tw)
    ys = [round(i * (h // step) / ny) * step for i in range(ny)] + [h]
    xs = [round(i * (w // step) / nx) * step for i in range(nx)] + [w]
    return [(ys[i], ys[i + 1], xs[j], xs[j + 1]) for i in range(ny) for j in range(nx)]


def _chain_geometry(ops: list) -> tuple[Fraction, int, int]:
    """(scale, halo, step): tile borders and the halo sit on multiples of `step`, the chain's
    downscale factor, so every downsampling op sees the same pixel grid as untiled."""
    scale, radius, step = Fraction(1), 0.0, 1
    for op in ops:
        radius += op.radius / scale
        scale *= op.scale
        step = math.lcm(step, scale.denominator)
    return scale, step * math.ceil(radius / step - 1e-9), step


def _tile_bytes(ops, c_in, th, tw, halo, per_px) -> float:
    """Working set of one tile of a chain: its input crop, the largest op, its output."""
    pix = (th + 2 * halo) * (tw + 2 * halo)
    c, worst, scale = c_in, 0.0, 1.0
    for op in ops:
        scale *= op.scale
        worst = max(worst, op.peak_channels * pix * scale * scale)
        c = op.out_channels
    return per_px * (c_in * pix + worst + c * th * tw * scale * scale)


def plan_tiles(
    ops: list,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    budget: int,
    tile_px: int = 0,
) -> Plan:
    """Split `ops` into chains and tiles so that the working set stays within `budget` bytes.

    shape: the input's shape (B, C, [T,] H, W). tile_px: tile side in pixels at each chain's
    larger end (image pixels for a decoder's last chain and an encoder's first), 0 = the
    largest tile that fits.
    """
    batch = shape[0] * (shape[2] if len(shape) == 5 else 1)
    per_px = batch * torch.finfo(dtype).bits // 8
    keep_limit = budget / 4  # a chain may end where its output is this small
    c, h, w = shape[1], shape[-2], shape[-1]
    out = Plan()
    run: list[Local] = []
    resident = True  # whether the current state is on the device

    def flush():
        nonlocal c, h, w, resident
        if not run:
            return
        scale, halo, step = _chain_geometry(run)
        c_out = run[-1].out_channels
        in_bytes = per_px * c * h * w if resident else 0
        out_bytes = per_px * c_out * h * w * float(scale) ** 2
        on_device = in_bytes + out_bytes <= 0.6 * budget
        held = in_bytes + (out_bytes if on_device else 0)

        def fits(th, tw, halo=halo):
            return _tile_bytes(run, c, th, tw, halo, per_px) + held <= budget

        def side(t, n):  # a tile side: on the grid's step, within the tensor
            return min(step * max(1, math.ceil(t / step)), n)

        if tile_px:
            t = math.ceil(tile_px / max(scale, 1))
            th, tw = side(t, h), side(t, w)
        elif fits(h, w, 0):
            th, tw = h, w
        else:
            # the largest tile that fits: squares, or full-width strips where a tensor on the
            # host is read or written, so each strip is one contiguous copy

            def tile(t):
                return side(t, h), (side(t, w) if resident and on_device else w)

            lo, hi = MIN_TILE, max(h, w)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if fits(*tile(mid)) else (lo, mid - 1)
            th, tw = tile(lo)
        out.steps.append(Chain(list(run), scale, halo, _grid(h, w, th, tw, step), on_device))
        c, h, w = c_out, int(h * scale), int(w * scale)
        resident = on_device
        run.clear()

    for op in ops:
        if isinstance(op, Local):
            run.append(op)
            # end the chain where its output is cheap to keep
            scale = float(_chain_geometry(run)[0])
            if per_px * op.out_channels * h * w * scale * scale <= keep_limit:
                flush()
        else:
            flush()
            if isinstance(op, Stats):
                rows = max(1, int(keep_limit // max(1, 4 * per_px * c * w)))
                out.steps.append((op, rows))
            else:
                out.steps.append(op)
                c, resident = op.out_channels, True
    flush()
    return out


# ---------------------------------------------------------------- execution


def _host_buffer(like: torch.Tensor, h: int, w: int, device) -> torch.Tensor:
    """A host tensor of shape (*lead, h, w) stored rows first, so that full-width row strips
    are contiguous (one DMA each, pinned when the device is a GPU)."""
    pin = torch.device(device).type == "cuda"
    buf = torch.empty(h, *like.shape[:-2], w, dtype=like.dtype, pin_memory=pin)
    return buf.movedim(0, -2)


def _rows(t: torch.Tensor, a0: int, a1: int, b0: int, b1: int, device) -> torch.Tensor:
    """t[..., a0:a1, b0:b1] on `device`; a strip of a host buffer moves as one block."""
    if t.device.type == "cpu" and b0 == 0 and b1 == t.shape[-1]:
        strip = t.movedim(-2, 0)[a0:a1]
        if strip.is_contiguous():
            return strip.to(device).movedim(0, -2)
    return t[..., a0:a1, b0:b1].to(device)


def _write(dst: torch.Tensor, src: torch.Tensor, y0: int, y1: int, x0: int, x1: int) -> None:
    if dst.device.type == "cpu" and x0 == 0 and x1 == dst.shape[-1]:
        strip = dst.movedim(-2, 0)[y0:y1]
        if strip.is_contiguous():
            strip.copy_(src.movedim(-2, 0))
            return
    dst[..., y0:y1, x0:x1] = src


def _run_chain(chain: Chain, x: State, device, tick) -> State:
    h, w = x[0].shape[-2:]
    halo = chain.halo

    def at(n: int) -> int:  # input pixels to output pixels (exact: tiles sit on the grid)
        return int(n * chain.scale)

    out = None
    for y0, y1, x0, x1 in chain.tiles:
        a0, a1 = max(0, y0 - halo), min(h, y1 + halo)
        b0, b1 = max(0, x0 - halo), min(w, x1 + halo)
        crop = tuple(_rows(t, a0, a1, b0, b1, device) for t in x)
        for op in chain.ops:
            crop = op.fn(*crop)
        ya, xa = at(y0 - a0), at(x0 - b0)
        inner = [t[..., ya : ya + at(y1 - y0), xa : xa + at(x1 - x0)] for t in crop]
        if out is None:
            if chain.store_on_device and len(chain.tiles) == 1:
                out = tuple(inner)
            elif chain.store_on_device:
                out = tuple(
                    torch.empty(*t.shape[:-2], at(h), at(w), dtype=t.dtype, device=device)
                    for t in inner
                )
            else:
                out = tuple(_host_buffer(t, at(h), at(w), device) for t in inner)
        if out[0] is not inner[0]:
            for o, t in zip(out, inner, strict=True):
                _write(o, t, at(y0), at(y1), at(x0), at(x1))
        del crop, inner
        tick()
    return out


def _run_stats(op: Stats, rows: int, x: State, device) -> None:
    t = x[op.index]
    acc = None
    for r0 in range(0, t.shape[-2], rows):
        m = group_moments(_rows(t, r0, r0 + rows, 0, t.shape[-1], device), op.norm.num_groups)
        acc = m if acc is None else merge_moments(acc, m)
    op.mean, op.rstd = finalize_moments(acc, op.norm.eps)


def execute(plan: Plan, x: torch.Tensor, device, progress=None) -> torch.Tensor:
    """Run a plan on `x` (already in the VAE's dtype): a latent for a decoder's ops, pixels
    for an encoder's. Returns the last op's output.

    progress: optional callable(done, total), called after each tile; it may raise to stop.
    """
    total, done = plan.total, 0

    def tick():
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total)

    state: State = (x,)
    with torch.inference_mode():
        for step in plan.steps:
            if isinstance(step, Chain):
                state = _run_chain(step, state, device, tick)
            elif isinstance(step, Global):
                state = step.fn(*(t.to(device) for t in state))
                tick()
            else:
                _run_stats(*step, state, device)
                tick()
    return state[0]
