"""VAE Tiling: an exact tiled decode, and encode, that stay inside a VRAM budget."""

from comfy_api.latest import io

from ..runtime.vae import tiled
from . import report


def _tiling_inputs(what: str) -> list:
    """tile_size and vram_budget_gb, for the decode or the encode."""
    return [
        io.Int.Input(
            "tile_size",
            default=0,
            min=0,
            max=16384,
            step=8,
            optional=True,
            tooltip="Tile side in pixels; 0: the largest that fits the budget. Smaller "
            "tiles need less memory and are slower.",
        ),
        io.Float.Input(
            "vram_budget_gb",
            default=0.0,
            min=0.0,
            max=1024.0,
            step=0.25,
            optional=True,
            tooltip=f"VRAM the {what} may use beside the VAE; ComfyUI offloads other models "
            "to make room. 0: automatic, all that ComfyUI counts free after a small request. "
            "A smaller budget is slower.",
        ),
    ]


class VAEDecodeTiled(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="QwenTurboVAEDecodeTiled",
            display_name="VAE Tiling",
            category="QwenTurbo",
            description=(
                "Decodes a latent tile by tile within a VRAM budget, with no seams: the "
                "picture equals an untiled decode."
            ),
            inputs=[
                io.Latent.Input("samples", tooltip="The latent to decode."),
                io.Vae.Input(
                    "vae",
                    tooltip="Qwen-Image/Wan 2.1 or AutoencoderKL (SD1.5, SDXL, SD3, Flux) VAEs "
                    "are tiled exactly; others use ComfyUI's decode.",
                ),
                *_tiling_inputs("decode"),
            ],
            outputs=[io.Image.Output()],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, samples, vae, tile_size=0, vram_budget_gb=0.0) -> io.NodeOutput:
        with report.measured(cls) as extra:
            images = tiled.decode(vae, samples["samples"], tile_size, vram_budget_gb, info=extra)
        if images.ndim == 5:  # combine batches, as VAEDecode does
            images = images.reshape(-1, *images.shape[-3:])
        return io.NodeOutput(images)


class VAEEncodeTiled(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="QwenTurboVAEEncodeTiled",
            display_name="VAE Tiling Encode",
            category="QwenTurbo",
            description=(
                "Encodes images tile by tile within a VRAM budget, with no seams: the latent "
                "equals an untiled encode."
            ),
            inputs=[
                io.Image.Input(
                    "pixels",
                    tooltip="The images to encode; cropped to a multiple of 8 as VAEEncode does.",
                ),
                io.Vae.Input(
                    "vae",
                    tooltip="Qwen-Image/Wan 2.1 or AutoencoderKL (SD1.5, SDXL, SD3, Flux) VAEs "
                    "are tiled exactly; others use ComfyUI's encode.",
                ),
                *_tiling_inputs("encode"),
            ],
            outputs=[io.Latent.Output()],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, pixels, vae, tile_size=0, vram_budget_gb=0.0) -> io.NodeOutput:
        with report.measured(cls) as extra:
            samples = tiled.encode(vae, pixels, tile_size, vram_budget_gb, info=extra)
        return io.NodeOutput({"samples": samples})
