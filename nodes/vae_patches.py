"""Fused GroupNorm Patch and Texture Upsample: VAE clones whose decoder runs fused kernels."""

from comfy_api.latest import io

from ..runtime.vae import patches
from . import report


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
            out, extra["patched"] = patches.patched_vae(vae, patches.fused_norm_patches)
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
            out, extra["patched"] = patches.patched_vae(vae, patches.upsample_patches)
        return io.NodeOutput(out)
