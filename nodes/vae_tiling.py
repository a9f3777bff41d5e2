"""VAE Tiling: an exact tiled decode that stays inside a VRAM budget."""

import logging

import comfy.model_management as mm
import comfy.utils
import torch
from comfy_api.latest import io

from ..runtime import log_once, vae_tiling
from . import report

log = logging.getLogger(__name__)
GiB = 1024**3


def _warn_once(msg: str) -> None:
    log_once(log, logging.WARNING, msg)


def _auto_budget(device) -> int:
    free = mm.get_free_memory(device)
    return int(max(GiB // 4, free - max(GiB // 2, free // 10)))


def decode(vae, latent: torch.Tensor, tile_size: int = 0, budget_gb: float = 0.0) -> torch.Tensor:
    """Decode like `VAE.decode`, tile by tile; returns images (B, [T,] H, W, C) in 0..1."""
    vae.throw_exception_if_invalid()
    if getattr(vae, "latent_dim", 2) == 3 and latent.ndim == 4:
        latent = latent.unsqueeze(2)
    budget = int(budget_gb * GiB)
    # load first: the op list must hold the modules of this VAE's (possibly patched) tree
    mm.load_models_gpu([vae.patcher], memory_required=budget, force_full_load=vae.disable_offload)
    try:
        ops = vae_tiling.decoder_ops(vae.first_stage_model, latent)
    except NotImplementedError as e:
        _warn_once(f"VAE Tiling: {e} is not supported; using ComfyUI's VAE decode instead")
        return vae.decode(latent)

    device = vae.device
    budget = budget or _auto_budget(device)
    x = latent.to(device=device, dtype=vae.vae_dtype)
    out = None
    for attempt in range(3):
        plan = vae_tiling.plan_decode(ops, tuple(x.shape), vae.vae_dtype, budget, tile_size)
        pbar = comfy.utils.ProgressBar(plan.total)

        def progress(done, total, pbar=pbar):
            mm.throw_exception_if_processing_interrupted()
            pbar.update_absolute(done, total)

        try:
            out = vae_tiling.execute(plan, x, device, progress)
            break
        except mm.OOM_EXCEPTION:
            out = None  # retry outside the handler, so the failed tiles can be freed
        mm.soft_empty_cache()
        if attempt == 2:
            raise RuntimeError(
                f"VAE Tiling ran out of memory even with a budget of {budget / GiB:.2f} GiB. "
                "Free VRAM (unload other models) or set a smaller tile_size."
            )
        budget //= 4
        tile_size = tile_size // 2
        _warn_once(f"VAE Tiling: out of memory; retrying with a {budget / GiB:.2f} GiB budget")
    out = vae.process_output(out.to(vae.output_device).float())
    return out.movedim(1, -1)


class VAEDecodeTiled(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="QwenTurboVAEDecodeTiled",
            display_name="VAE Tiling",
            category="QwenTurbo",
            description=(
                "Decodes a latent tile by tile within a VRAM budget. Each tile is computed with "
                "a halo as wide as the decoder's receptive field and the global attention runs "
                "once, so the picture equals an untiled decode: no seams, no blending."
            ),
            inputs=[
                io.Latent.Input("samples", tooltip="The latent to decode."),
                io.Vae.Input(
                    "vae",
                    tooltip="Qwen-Image/Wan 2.1 or AutoencoderKL (SD1.5, SDXL, SD3, Flux) VAEs "
                    "are tiled exactly; others use ComfyUI's decode.",
                ),
                io.Int.Input(
                    "tile_size",
                    default=0,
                    min=0,
                    max=16384,
                    step=8,
                    optional=True,
                    tooltip="Tile side in pixels; 0 picks the largest tile that fits the budget. "
                    "Smaller tiles need less memory but recompute more halo, so they are slower.",
                ),
                io.Float.Input(
                    "vram_budget_gb",
                    default=0.0,
                    min=0.0,
                    max=1024.0,
                    step=0.25,
                    optional=True,
                    tooltip="VRAM the decode may use on top of the VAE weights; 0 = free memory "
                    "minus a margin. A smaller budget means smaller tiles and a slower decode.",
                ),
            ],
            outputs=[io.Image.Output()],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, samples, vae, tile_size=0, vram_budget_gb=0.0) -> io.NodeOutput:
        with report.measured(cls):
            images = decode(vae, samples["samples"], tile_size, vram_budget_gb)
        if images.ndim == 5:  # combine batches, as VAEDecode does
            images = images.reshape(-1, *images.shape[-3:])
        return io.NodeOutput(images)
