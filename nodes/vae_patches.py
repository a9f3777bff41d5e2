"""Fused GroupNorm Patch and Texture Upsample: VAE clones whose decoder runs fused kernels."""

import copy
import logging

from comfy_api.latest import io

from ..kernels import warmup
from ..runtime import log_once, vae_patches
from . import report

log = logging.getLogger(__name__)


# what a VAE's structure can raise when it is not one this pack knows
UNRECOGNISED = (AttributeError, TypeError, ValueError, IndexError, KeyError)


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
    """A copy of `vae` with a cloned patcher carrying `find`'s object patches.

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
    if patches:
        warmup.start(vae.device)  # compiles the kernels before the first decode
    out = copy.copy(vae)
    out.patcher = vae.patcher.clone()
    for path, module in patches.items():
        out.patcher.add_object_patch(path, module)
    return out, len(patches)


class FusedNormPatch(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="QwenTurboFusedNormPatch",
            display_name="Fused GroupNorm Patch",
            category="QwenTurbo",
            description=(
                "Returns a VAE whose norms and the SiLU after them run as one fused kernel "
                "(SD, SDXL, SD3, Flux, Qwen-Image and Wan VAEs): faster decodes and encodes."
            ),
            inputs=[
                io.Vae.Input(
                    "vae",
                    tooltip="The VAE to patch; a clone is returned, the input is unchanged. "
                    "Without a CUDA GPU or Triton the clone runs as the original.",
                )
            ],
            outputs=[io.Vae.Output()],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, vae) -> io.NodeOutput:
        with report.measured(cls) as extra:
            out, extra["patched"] = patched_vae(vae, vae_patches.fused_norm_patches)
        return io.NodeOutput(out)


class TextureUpsample(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="QwenTurboTextureUpsample",
            display_name="Texture Upsample",
            category="QwenTurbo",
            description=(
                "Returns a VAE whose decoder runs each upsample and the convolution after it "
                "as one: faster, with less memory, the same picture within rounding."
            ),
            inputs=[
                io.Vae.Input(
                    "vae",
                    tooltip="The VAE to patch; a clone is returned, the input is unchanged.",
                )
            ],
            outputs=[io.Vae.Output()],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, vae) -> io.NodeOutput:
        with report.measured(cls) as extra:
            out, extra["patched"] = patched_vae(vae, vae_patches.upsample_patches)
        return io.NodeOutput(out)
