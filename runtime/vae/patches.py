"""Which VAE submodules the fused kernels replace, as object patches for ModelPatcher.

Each function walks a VAE's original module tree and returns ({dotted name: replacement},
[(dotted name, why it was left alone)]). `backups` is the patcher's object-patch backup dict,
so the walk sees the original modules even while a patched clone is loaded.

The host's modules are recognised by class name, attributes and `forward` signatures, never
by ComfyUI's version: a module whose layout or call is not the one a replacement reproduces
is left alone, with the reason in the skipped list. `patched_vae` returns a clone of a VAE
whose patcher carries one function's patches.
"""

import copy
import inspect
import logging
from collections.abc import Iterator

import torch.nn.functional as F
from torch import nn

from ...kernels import warmup
from ...kernels.channel_rms_norm_silu import ChannelRMSNormSiLU
from ...kernels.group_norm_silu import GroupNormSiLU
from ...kernels.upsample_conv3x3 import UpsampleConv3x3
from .. import log_once

log = logging.getLogger(__name__)

Patches = tuple[dict[str, nn.Module], list[tuple[str, str]]]


def _walk(module: nn.Module, backups: dict, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    for name, child in module.named_children():
        path = prefix + name
        child = backups.get(path, child)
        yield path, child
        yield from _walk(child, backups, path + ".")


def _children(module: nn.Module, path: str, backups: dict) -> list[tuple[str, nn.Module]]:
    return [(f"{path}.{n}", backups.get(f"{path}.{n}", c)) for n, c in module.named_children()]


def _params(fn) -> list[inspect.Parameter] | None:
    """The parameters of `fn` after its input (self excluded for a bound method), or None
    where no signature can be read or `fn` takes no positional input."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if not params or params[0].kind not in (*positional, inspect.Parameter.VAR_POSITIONAL):
        return None
    return params[1:] if params[0].kind in positional else params


def _named(params: list[inspect.Parameter]) -> list[inspect.Parameter]:
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [p for p in params if p.kind not in variadic]


def input_only_reason(module) -> str | None:
    """Why `module(x)` cannot be called with the input alone, or None where it can."""
    params = _params(module.forward)
    if params is None:
        return f"{type(module).__name__}.forward has no readable signature"
    required = [p.name for p in _named(params) if p.default is inspect.Parameter.empty]
    return f"{type(module).__name__}.forward needs {required[0]!r}" if required else None


def _plain_forward_reason(module) -> str | None:
    """Why a replacement taking only x cannot stand in for `module`: it takes more."""
    params = _params(module.forward)
    if params is None:
        return f"{type(module).__name__}.forward has no readable signature"
    named = _named(params)
    return f"{type(module).__name__}.forward takes {named[0].name!r}" if named else None


def _none_defaults_reason(module) -> str | None:
    """Why a replacement that runs its fast path when every extra argument is None, and passes
    anything else to the original, would differ from `module`: an extra parameter whose default
    is not None (or that has none), whose omission the host may rely on."""
    params = _params(module.forward)
    if params is None:
        return f"{type(module).__name__}.forward has no readable signature"
    odd = [p.name for p in _named(params) if p.default is not None]
    return (
        f"{type(module).__name__}.forward takes {odd[0]!r} not defaulting to None" if odd else None
    )


def _is_rms_norm(m) -> bool:
    return type(m).__name__ == "RMS_norm" and hasattr(m, "gamma")


def _norm_reason(m: nn.Module) -> str | None:
    why = _plain_forward_reason(m)
    if why is None and _is_rms_norm(m):
        c = m.gamma.shape[0]
        if abs(getattr(m, "scale", 0.0) - c**0.5) > 1e-6 * c**0.5:
            why = f"RMS_norm scale {getattr(m, 'scale', None)} is not sqrt({c})"
    return why


def _norm(m: nn.Module, silu: bool) -> nn.Module:
    if isinstance(m, nn.GroupNorm):
        return GroupNormSiLU(m, silu)
    return ChannelRMSNormSiLU(m, silu)


def norm_patches(model: nn.Module, backups: dict | None = None) -> Patches:
    """Every GroupNorm (AutoencoderKL) and RMS_norm (Wan/Qwen), with the SiLU after it fused."""
    backups = backups or {}
    norms: dict[str, nn.Module] = {}
    silu_of: dict[str, str] = {}  # norm path -> path of the SiLU module it absorbs
    for path, m in _walk(model, backups):
        if isinstance(m, nn.GroupNorm) or _is_rms_norm(m):
            norms[path] = m
        elif isinstance(m, nn.Sequential):  # Wan: RMS_norm, SiLU, conv, ...
            kids = _children(m, path, backups)
            for (p1, a), (p2, b) in zip(kids, kids[1:], strict=False):
                if _is_rms_norm(a) and isinstance(b, nn.SiLU):
                    silu_of[p1] = p2
        elif (
            type(m).__name__ == "ResnetBlock"
            and not hasattr(m, "temb_proj")
            and isinstance(getattr(m, "swish", None), nn.SiLU)
        ):  # AutoencoderKL: norm1 -> swish -> conv1 -> norm2 -> swish -> dropout -> conv2
            silu_of[f"{path}.norm1"] = silu_of[f"{path}.norm2"] = f"{path}.swish"
    patches, skipped = {}, []
    for path, m in norms.items():
        why = _norm_reason(m)
        if why is not None:
            skipped.append((path, why))
            continue
        try:
            patches[path] = _norm(m, silu=path in silu_of)
        except ValueError as e:
            skipped.append((path, str(e)))
            continue
        if path in silu_of:
            patches[silu_of[path]] = nn.Identity()
    return patches, skipped


def _is_upsample_conv(up, conv) -> str | None:
    if type(up).__name__ != "Upsample" or not isinstance(conv, nn.Conv2d):
        return "not an upsample followed by a conv"
    if getattr(up, "mode", "nearest") not in ("nearest", "nearest-exact"):
        return f"{up.mode} upsampling"
    sf = up.scale_factor
    if (sf if isinstance(sf, (tuple, list)) else (sf, sf)) not in ((2, 2), (2.0, 2.0)):
        return f"scale factor {sf}"
    if conv.kernel_size != (3, 3) or conv.padding != (1, 1) or conv.stride != (1, 1):
        return f"conv {conv.kernel_size} padding {conv.padding} stride {conv.stride}"
    if conv.dilation != (1, 1) or conv.groups != 1 or conv.padding_mode != "zeros":
        return "dilated, grouped or non-zero-padded conv"
    return None


def upsample_patches(model: nn.Module, backups: dict | None = None) -> Patches:
    """Each nearest-2x upsample + 3x3 conv: Wan `Resample.resample` and AutoencoderKL `Upsample`."""
    backups = backups or {}
    patches, skipped = {}, []
    for path, m in _walk(model, backups):
        kind = type(m).__name__
        if kind == "Resample" and str(getattr(m, "mode", "")).startswith("upsample"):
            # Wan: `self.resample(x)` on (B*T, C, H, W); only the Sequential is replaced
            seq = backups.get(f"{path}.resample", getattr(m, "resample", None))
            ok = isinstance(seq, nn.Sequential) and len(seq) == 2
            why = _is_upsample_conv(seq[0], seq[1]) if ok else "unexpected layers"
            target, conv, original = f"{path}.resample", seq[1] if ok else None, seq
        elif kind == "Upsample" and getattr(m, "with_conv", False):
            # AutoencoderKL: newer hosts call it as upsample(x, conv_carry_in, conv_carry_out);
            # the replacement passes any argument that is not None to the original module
            conv = getattr(m, "conv", None)
            sf = getattr(m, "scale_factor", None)
            why = None if sf in (2, 2.0) else f"scale factor {sf}"
            why = why or _none_defaults_reason(m)
            why = why or _is_upsample_conv(nn.Upsample(scale_factor=2.0), conv)
            target, original = path, m
        else:
            continue
        if why is None:
            patches[target] = UpsampleConv3x3(conv, original)
        else:
            skipped.append((path, why))
    return patches, skipped


HOST_SINGLE_FRAME = (
    "this ComfyUI already runs single-frame causal convs as 2D convs (Conv3d autopad)"
)


def _old_causal_layout(conv) -> bool:
    """Whether `conv` pads itself from a 6-tuple `_padding` (ComfyUI v0.3's CausalConv3d)."""
    pad = getattr(conv, "_padding", None)
    return isinstance(pad, tuple) and len(pad) == 6 and all(isinstance(p, int) for p in pad)


def _host_single_frame(conv) -> bool:
    """Whether the host's CausalConv3d has its own single-frame path: newer ComfyUI keeps the
    causal padding as an int and runs uncached single frames through its Conv3d op with
    autopad="causal_zero" (the last temporal kernel slice), the same 2D convolution this
    patch would run."""
    conv_forward = getattr(conv, "_conv_forward", None)
    params = _params(conv_forward) if conv_forward is not None else None
    pad = getattr(conv, "_padding", None)
    return isinstance(pad, int) and params is not None and any(p.name == "autopad" for p in params)


class SingleFrameCausalConv:
    """A `forward` for a Wan `CausalConv3d` that runs one uncached frame as a 2D convolution.

    With one frame and zero causal padding in front, only the last temporal slice of the
    kernel touches data: conv2d with it gives the same result without the zero-padded copy
    of the input or the 3x wasted multiply-adds. Other inputs take the original forward.
    It patches the module's `forward` attribute rather than the module, because the Wan code
    dispatches on `isinstance(layer, CausalConv3d)`. For ComfyUI v0.3's layout only (a
    6-tuple `_padding`); `causal_conv_patches` checks that before building one.
    """

    def __init__(self, conv: nn.Module):
        self.conv = conv
        pw0, pw1, ph0, ph1, pt0, pt1 = conv._padding
        kt = conv.kernel_size[0]
        self.ok = (
            pt0 == kt - 1 and pt1 == 0 and pw0 == pw1 and ph0 == ph1
            and conv.stride[0] == 1 and conv.dilation == (1, 1, 1) and conv.groups == 1
        )  # fmt: skip
        self.padding = (ph0, pw0)

    def __call__(self, x, cache_x=None, cache_list=None, cache_idx=None):
        conv = self.conv
        if cache_list is not None:  # as CausalConv3d: take and clear the cache slot
            cache_x = cache_list[cache_idx]
            cache_list[cache_idx] = None
        if cache_x is not None or x.shape[2] != 1 or not self.ok:
            return type(conv).forward(conv, x, cache_x=cache_x)
        w = conv.weight[:, :, -1].to(x)
        b = None if conv.bias is None else conv.bias.to(x)
        return F.conv2d(x[:, :, 0], w, b, conv.stride[1:], self.padding).unsqueeze(2)


_CAUSAL_ARGS = ("cache_x", "cache_list", "cache_idx")


def _causal_conv_reason(conv) -> str | None:
    """Why `conv`'s forward is left alone, or None where SingleFrameCausalConv replaces it."""
    if _host_single_frame(conv):
        return HOST_SINGLE_FRAME
    if not _old_causal_layout(conv):
        return f"unrecognised causal padding {getattr(conv, '_padding', None)!r}"
    params = _params(type(conv).forward.__get__(conv))
    names = None if params is None else [p.name for p in _named(params)]
    if names != list(_CAUSAL_ARGS):
        return f"CausalConv3d.forward takes {names}, not x, {', '.join(_CAUSAL_ARGS)}"
    return None


def causal_conv_patches(model: nn.Module, backups: dict | None = None) -> Patches:
    """Every Wan `CausalConv3d`'s forward, to run single frames as 2D convolutions.

    Left alone (with the reason) where the host does that itself or lays the conv out in a
    way this patch does not know.
    """
    backups = backups or {}
    patches, skipped = {}, []
    for path, m in _walk(model, backups):
        if type(m).__name__ != "CausalConv3d":
            continue
        why = _causal_conv_reason(m)
        if why is None:
            patches[f"{path}.forward"] = SingleFrameCausalConv(m)
        else:
            skipped.append((path, why))
    return patches, skipped


def fused_norm_patches(model: nn.Module, backups: dict | None = None) -> Patches:
    """What Fused GroupNorm Patch applies: fused norms and single-frame causal convs."""
    norms, skipped = norm_patches(model, backups)
    convs, conv_skipped = causal_conv_patches(model, backups)
    return {**norms, **convs}, skipped + conv_skipped


# what a VAE's structure can raise when it is not one this pack knows
UNRECOGNISED = (AttributeError, TypeError, ValueError, IndexError, KeyError)


def warmed(patches: dict) -> set[str] | None:
    """The kernel modules whose recorded launches a patched VAE starts compiling: the Qwen-Image
    VAE's (Wan 2.1's) the whole manifest (recorded from the Qwen workflows: their DiT's kernels
    then compile while the text encoder runs), another VAE its own kernels'."""
    package = warmup.__name__.rsplit(".", 1)[0]  # the pack's kernels
    kinds = {t.__module__.rsplit(".", 1)[-1] for t in map(type, patches.values())
             if t.__module__.startswith(package + ".")}  # fmt: skip
    return None if "channel_rms_norm_silu" in kinds else kinds


def _log_skipped(skipped: list[tuple[str, str]]) -> None:
    """One line per reason (once per process), naming the first few modules it applies to."""
    by_reason: dict[str, list[str]] = {}
    for path, why in skipped:
        by_reason.setdefault(why, []).append(path)
    for why, paths in by_reason.items():
        names = ", ".join(paths[:3]) + (", ..." if len(paths) > 3 else "")
        what = (
            f"{names} as it is"
            if len(paths) == 1
            else f"{len(paths)} modules ({names}) as they are"
        )
        log_once(log, logging.INFO, f"Qwen Turbo: left {what}: {why}")


def patched_vae(vae, find):
    """A copy of `vae` with a cloned patcher carrying `find`'s object patches, and their count.

    The input VAE and its patcher are left untouched; the patches apply while the clone is
    loaded and are undone when it unloads. Modules `find` does not recognise stay as they
    are, with the reason logged once; a VAE it cannot read at all is returned unpatched.
    """
    vae.throw_exception_if_invalid()
    try:
        patches, skipped = find(vae.first_stage_model, vae.patcher.object_patches_backup)
    except UNRECOGNISED as e:
        log_once(
            log,
            logging.WARNING,
            f"Qwen Turbo: {find.__name__} does not recognise the VAE "
            f"{type(vae.first_stage_model).__name__} ({type(e).__name__}: {e}); "
            "it is returned unpatched",
        )
        patches, skipped = {}, []
    _log_skipped(skipped)
    if patches:  # compiles kernels before the first decode
        warmup.start(vae.device, warmed(patches))
    out = copy.copy(vae)
    out.patcher = vae.patcher.clone()
    for path, module in patches.items():
        out.patcher.add_object_patch(path, module)
    return out, len(patches)
