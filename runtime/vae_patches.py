"""Which VAE submodules the fused kernels replace, as object patches for ModelPatcher.

Each function walks a VAE's original module tree and returns ({dotted name: replacement},
[(dotted name, why it was left alone)]). `backups` is the patcher's object-patch backup dict,
so the walk sees the original modules even while a patched clone is loaded.
"""

from collections.abc import Iterator

import torch.nn.functional as F
from torch import nn

from ..kernels.channel_rms_norm_silu import ChannelRMSNormSiLU
from ..kernels.group_norm_silu import GroupNormSiLU
from ..kernels.upsample_conv3x3 import UpsampleConv3x3

Patches = tuple[dict[str, nn.Module], list[tuple[str, str]]]


def _walk(module: nn.Module, backups: dict, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    for name, child in module.named_children():
        path = prefix + name
        child = backups.get(path, child)
        yield path, child
        yield from _walk(child, backups, path + ".")


def _children(module: nn.Module, path: str, backups: dict) -> list[tuple[str, nn.Module]]:
    return [(f"{path}.{n}", backups.get(f"{path}.{n}", c)) for n, c in module.named_children()]


def _is_rms_norm(m) -> bool:
    return type(m).__name__ == "RMS_norm" and hasattr(m, "gamma")


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
        if kind == "Resample" and getattr(m, "mode", "").startswith("upsample"):
            seq = backups.get(f"{path}.resample", m.resample)
            why = _is_upsample_conv(seq[0], seq[1]) if len(seq) == 2 else "unexpected layers"
            target, conv, original = f"{path}.resample", seq[1] if len(seq) == 2 else None, seq
        elif kind == "Upsample" and getattr(m, "with_conv", False):
            conv = m.conv
            why = None if m.scale_factor in (2, 2.0) else f"scale factor {m.scale_factor}"
            why = why or _is_upsample_conv(nn.Upsample(scale_factor=2.0), conv)
            target, original = path, m
        else:
            continue
        if why is None:
            patches[target] = UpsampleConv3x3(conv, original)
        else:
            skipped.append((path, why))
    return patches, skipped


class SingleFrameCausalConv:
    """A `forward` for a Wan `CausalConv3d` that runs one uncached frame as a 2D convolution.

    With one frame and zero causal padding in front, only the last temporal slice of the
    kernel touches data: conv2d with it gives the same result without the zero-padded copy
    of the input or the 3x wasted multiply-adds. Other inputs take the original forward.
    It patches the module's `forward` attribute rather than the module, because the Wan code
    dispatches on `isinstance(layer, CausalConv3d)`.
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


def causal_conv_patches(model: nn.Module, backups: dict | None = None) -> Patches:
    """Every Wan `CausalConv3d`'s forward, to run single frames as 2D convolutions."""
    backups = backups or {}
    patches = {
        f"{path}.forward": SingleFrameCausalConv(m)
        for path, m in _walk(model, backups)
        if type(m).__name__ == "CausalConv3d" and hasattr(m, "_padding")
    }
    return patches, []


def fused_norm_patches(model: nn.Module, backups: dict | None = None) -> Patches:
    """What Fused GroupNorm Patch applies: fused norms and single-frame causal convs."""
    norms, skipped = norm_patches(model, backups)
    convs, _ = causal_conv_patches(model, backups)
    return {**norms, **convs}, skipped
