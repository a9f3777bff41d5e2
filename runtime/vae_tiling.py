"""Exact tiled VAE decoding under a memory budget.

A decoder is described as a list of ops:
- `Local`: maps a spatial crop to a crop `scale` times larger; an output pixel depends only on
  input pixels within `radius` (in input pixels).
- `Global`: needs the whole tensor (the mid-block attention). It runs untiled, at latent size.
- `Stats`: a GroupNorm's statistics over the whole tensor, accumulated tile by tile and read by
  the Local op that follows.

Runs of Local ops execute as chains. Each tile reads its input with a halo as wide as the
chain's receptive field and keeps only its interior, so tiles are stitched, never blended, and
the result equals an untiled decode. A chain ends wherever its full output is small enough to
keep; keeping it costs memory, recomputing halos costs time.

The decoders are recognised by structure (ComfyUI's Wan 2.1 `Decoder3d` and the AutoencoderKL
`Decoder`): class names, attributes, layer types and `forward` signatures, never ComfyUI's
version, so this module does not import ComfyUI. What is not recognised raises
NotImplementedError naming it, and the caller decodes the stock way.
"""

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

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


# ---------------------------------------------------------------- decoder descriptions


def _call(module) -> Callable[..., State]:
    return lambda x: (module(x),)


def _require(condition: bool, what: str) -> None:
    if not condition:
        raise NotImplementedError(what)


def _callable(module, where: str) -> None:
    """The ops call `module(x)` where the host passes only arguments that are None or the
    defaults for one frame / a 2-D decode; a forward that needs more is not recognised."""
    why = input_only_reason(module)
    _require(why is None, f"{where}: {why}")


def _conv(module, where: str, kind: type = torch.nn.Conv2d):
    _require(
        isinstance(module, kind),
        f"{where} is a {type(module).__name__}, not a {kind.__name__}",
    )
    return module


def _wan_ops(vae) -> list:
    """ComfyUI's Wan 2.1 / Qwen-Image VAE (`comfy.ldm.wan.vae.WanVAE`) for one frame.

    For T=1 every CausalConv3d sees zero temporal padding and `Resample` skips its time conv,
    so calling the modules without a feature cache matches `WanVAE.decode` (newer hosts run
    that uncached single frame through the conv's own truncated-weight path; the ops call the
    same modules, so they follow whichever the host has).
    """
    dec = vae.decoder
    z = _conv(vae.conv2, "WanVAE.conv2", torch.nn.Conv3d).out_channels
    c0 = _conv(dec.conv1, "Decoder3d.conv1", torch.nn.Conv3d).out_channels
    _callable(vae.conv2, "WanVAE.conv2")
    _callable(dec.conv1, "Decoder3d.conv1")
    ops = [
        Local(_call(vae.conv2), z, 2 * z),
        Local(_call(dec.conv1), c0, 4 * z + c0, radius=1),
    ]
    c = c0
    for i, layer in enumerate([*dec.middle, *dec.upsamples]):
        kind = type(layer).__name__
        _callable(layer, f"Wan decoder layer {i} ({kind})")
        if kind == "ResidualBlock":
            c_in, c = layer.in_dim, layer.out_dim
            # x, norm, SiLU, the 3-frame padded copy of each causal conv input, conv output
            ops.append(Local(_call(layer), c, 2 * c_in + 6 * max(c_in, c), radius=2))
        elif kind == "AttentionBlock":
            ops.append(Global(_call(layer), c))
        elif kind == "Resample" and layer.mode in ("upsample2d", "upsample3d"):
            c = layer.dim // 2
            ops.append(Local(_call(layer), c, 5 * c, scale=2, radius=0.5))
        else:
            raise NotImplementedError(f"Wan decoder layer {kind} ({getattr(layer, 'mode', '')})")
    head = dec.head
    _require(isinstance(head, torch.nn.Sequential), "Decoder3d.head is not a Sequential")
    out = _conv(head[-1], "Decoder3d.head[-1]", torch.nn.Conv3d).out_channels
    _callable(head[-1], "Decoder3d.head[-1]")
    ops.append(Local(_call(head), out, 6 * c, radius=1))
    return ops


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


def _autoencoder_kl_ops(vae) -> list:
    """ComfyUI's AutoencoderKL decoder (SD1.5, SDXL, SD3, Flux, Flux 2), 2-D convolutions.

    Older hosts' `give_pre_end` (no head) is not tiled; newer hosts split video decodes into
    carried chunks (CarriedConv3d), which the 2-D layer checks below turn away.
    """
    dec = vae.decoder
    _require(not getattr(dec, "give_pre_end", False), "decoders with give_pre_end")
    _require(not getattr(dec, "carried", False), "decoders with carried 3-D convolutions")
    ops = []
    if type(vae).__name__ != "AutoencodingEngine":  # AutoencoderKL / ...Legacy
        if getattr(vae, "bn", None) is not None:
            ops.append(_latent_batch_norm(vae))
        pqc = vae.post_quant_conv
        if isinstance(pqc, torch.nn.Conv2d):
            ops.append(Local(_call(pqc), pqc.out_channels, 2 * pqc.out_channels))
        else:
            _require(isinstance(pqc, torch.nn.Identity), f"post_quant_conv {type(pqc).__name__}")
    conv_in = _conv(dec.conv_in, "Decoder.conv_in")
    c = conv_in.out_channels
    ops.append(Local(_call(conv_in), c, 2 * c, radius=1))
    _callable(dec.mid.attn_1, "Decoder.mid.attn_1")
    ops += [*_resnet_ops(dec.mid.block_1), Global(_call(dec.mid.attn_1), c)]
    ops += _resnet_ops(dec.mid.block_2)
    for i_level in reversed(range(dec.num_resolutions)):
        up = dec.up[i_level]
        _require(len(up.block) == dec.num_res_blocks + 1, f"Decoder.up[{i_level}] block count")
        for i_block, block in enumerate(up.block):
            ops += _resnet_ops(block)
            c = block.out_channels
            if len(up.attn) > 0:
                _callable(up.attn[i_block], f"Decoder.up[{i_level}].attn")
                ops.append(Global(_call(up.attn[i_block]), c))
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
    norm_out = Stats(_group_norm(dec.norm_out), 0)
    conv_out = _conv(dec.conv_out, "Decoder.conv_out")
    tanh = getattr(dec, "tanh_out", False)

    def head(x):
        y = conv_out(F.silu(norm_out.apply(x)))
        return (torch.tanh(y) if tanh else y,)

    ops += [norm_out, Local(head, conv_out.out_channels, 5 * c, radius=1)]
    return ops


WAN_MODULE = "wan.vae"  # comfy.ldm.wan.vae (not vae2_2: Wan 2.2's decoder differs)
KL_MODULE = "diffusionmodules.model"
KL_MODELS = ("AutoencoderKL", "AutoencodingEngineLegacy", "AutoencodingEngine")


def decoder_ops(first_stage_model, latent: torch.Tensor) -> list:
    """The op list for decoding `latent` with a ComfyUI first-stage model.

    Raises NotImplementedError naming what is not supported, so callers can fall back.
    """
    m = first_stage_model
    dec = getattr(m, "decoder", None)
    kind = type(dec).__name__
    try:
        if (
            type(m).__name__ == "WanVAE"
            and type(m).__module__.endswith(WAN_MODULE)
            and kind == "Decoder3d"
            and hasattr(m, "conv2")
        ):
            if latent.ndim != 5 or latent.shape[2] != 1:
                raise NotImplementedError(f"Wan latents with T != 1 (shape {tuple(latent.shape)})")
            return _wan_ops(m)
        if kind == "Decoder" and type(dec).__module__.endswith(KL_MODULE):
            if type(m).__name__ not in KL_MODELS:
                raise NotImplementedError(f"the first-stage model {type(m).__name__}")
            if latent.ndim != 4:
                raise NotImplementedError(f"a {latent.ndim}-D latent for a 2-D VAE")
            return _autoencoder_kl_ops(m)
    except (AttributeError, IndexError, TypeError) as e:  # a layout this module does not know
        raise NotImplementedError(f"the {kind} layout ({type(e).__name__}: {e})") from e
    raise NotImplementedError(f"the VAE {type(m).__name__} with decoder {kind}")


# ---------------------------------------------------------------- planning


@dataclass
class Chain:
    ops: list
    scale: int
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


def _grid(h: int, w: int, th: int, tw: int) -> list[tuple[int, int, int, int]]:
    ny, nx = math.ceil(h / th), math.ceil(w / tw)
    ys = [round(i * h / ny) for i in range(ny + 1)]
    xs = [round(i * w / nx) for i in range(nx + 1)]
    return [(ys[i], ys[i + 1], xs[j], xs[j + 1]) for i in range(ny) for j in range(nx)]


def _chain_geometry(ops: list) -> tuple[int, int]:
    scale, radius = 1, 0.0
    for op in ops:
        radius += op.radius / scale
        scale *= op.scale
    return scale, math.ceil(radius - 1e-9)


def _tile_bytes(ops, c_in, th, tw, halo, per_px) -> float:
    """Working set of one tile of a chain: its input crop, the largest op, its output."""
    pix = (th + 2 * halo) * (tw + 2 * halo)
    c, worst, scale = c_in, 0.0, 1
    for op in ops:
        scale *= op.scale
        worst = max(worst, op.peak_channels * pix * scale * scale)
        c = op.out_channels
    return per_px * (c_in * pix + worst + c * th * tw * scale * scale)


def plan_decode(
    ops: list,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    budget: int,
    tile_px: int = 0,
) -> Plan:
    """Split `ops` into chains and tiles so that the working set stays within `budget` bytes.

    shape: the latent's shape (B, C, [T,] H, W). tile_px: tile side in pixels at each chain's
    output resolution (image pixels for the last chain), 0 = the largest tile that fits.
    """
    batch = shape[0] * (shape[2] if len(shape) == 5 else 1)
    per_px = batch * torch.finfo(dtype).bits // 8
    keep_limit = budget / 4  # a chain may end where its output is this small
    c, h, w = shape[1], shape[-2], shape[-1]
    plan = Plan()
    run: list[Local] = []
    resident = True  # whether the current state is on the device

    def flush():
        nonlocal c, h, w, resident
        if not run:
            return
        scale, halo = _chain_geometry(run)
        c_out = run[-1].out_channels
        in_bytes = per_px * c * h * w if resident else 0
        out_bytes = per_px * c_out * h * w * scale * scale
        on_device = in_bytes + out_bytes <= 0.6 * budget
        held = in_bytes + (out_bytes if on_device else 0)

        def fits(th, tw, halo=halo):
            return _tile_bytes(run, c, th, tw, halo, per_px) + held <= budget

        if tile_px:
            t = max(1, math.ceil(tile_px / scale))
            th, tw = min(t, h), min(t, w)
        elif fits(h, w, 0):
            th, tw = h, w
        else:
            # the largest tile that fits: squares, or full-width strips where a tensor on the
            # host is read or written, so each strip is one contiguous copy

            def tile(t):
                return min(t, h), (min(t, w) if resident and on_device else w)

            lo, hi = MIN_TILE, max(h, w)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if fits(*tile(mid)) else (lo, mid - 1)
            th, tw = tile(lo)
        plan.steps.append(Chain(list(run), scale, halo, _grid(h, w, th, tw), on_device))
        c, h, w = c_out, h * scale, w * scale
        resident = on_device
        run.clear()

    for op in ops:
        if isinstance(op, Local):
            run.append(op)
            # end the chain where its output is cheap to keep
            if per_px * op.out_channels * h * w * _chain_geometry(run)[0] ** 2 <= keep_limit:
                flush()
        else:
            flush()
            if isinstance(op, Stats):
                rows = max(1, int(keep_limit // max(1, 4 * per_px * c * w)))
                plan.steps.append((op, rows))
            else:
                plan.steps.append(op)
                c, resident = op.out_channels, True
    flush()
    return plan


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
    s, halo = chain.scale, chain.halo
    out = None
    for y0, y1, x0, x1 in chain.tiles:
        a0, a1 = max(0, y0 - halo), min(h, y1 + halo)
        b0, b1 = max(0, x0 - halo), min(w, x1 + halo)
        crop = tuple(_rows(t, a0, a1, b0, b1, device) for t in x)
        for op in chain.ops:
            crop = op.fn(*crop)
        ya, xa = (y0 - a0) * s, (x0 - b0) * s
        inner = [t[..., ya : ya + (y1 - y0) * s, xa : xa + (x1 - x0) * s] for t in crop]
        if out is None:
            if chain.store_on_device and len(chain.tiles) == 1:
                out = tuple(inner)
            elif chain.store_on_device:
                out = tuple(
                    torch.empty(*t.shape[:-2], h * s, w * s, dtype=t.dtype, device=device)
                    for t in inner
                )
            else:
                out = tuple(_host_buffer(t, h * s, w * s, device) for t in inner)
        if out[0] is not inner[0]:
            for o, t in zip(out, inner, strict=True):
                _write(o, t, y0 * s, y1 * s, x0 * s, x1 * s)
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


def execute(plan: Plan, latent: torch.Tensor, device, progress=None) -> torch.Tensor:
    """Run a plan on `latent` (already in the VAE's dtype). Returns the decoder's output.

    progress: optional callable(done, total), called after each tile; it may raise to stop.
    """
    total, done = plan.total, 0

    def tick():
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total)

    x: State = (latent,)
    with torch.inference_mode():
        for step in plan.steps:
            if isinstance(step, Chain):
                x = _run_chain(step, x, device, tick)
            elif isinstance(step, Global):
                x = step.fn(*(t.to(device) for t in x))
                tick()
            else:
                _run_stats(*step, x, device)
                tick()
    return x[0]
