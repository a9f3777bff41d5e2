"""VAE Tiling: an exact tiled decode, and encode, that stay inside a VRAM budget."""

import contextlib
import logging

import comfy.model_management as mm
import comfy.utils
import torch
from comfy_api.latest import io

from ..runtime import host, log_once, memory, vae_tiling
from . import report

log = logging.getLogger(__name__)
GiB = 1024**3


# what a model whose modules are called in a way this pack does not know raises mid-run
INTERFACE_ERRORS = (AttributeError, TypeError, NotImplementedError)


def _warn_once(msg: str) -> None:
    log_once(log, logging.WARNING, msg)


def _free_memory(vae, device) -> int:
    """Free memory as the host's own decode counts it (newer hosts add what dynamic VRAM
    offloading can give back, through the patcher)."""
    free = getattr(vae.patcher, "get_free_memory", None)
    return free(device) if callable(free) else mm.get_free_memory(device)


# What the automatic budget asks ComfyUI to make room for; the decode then uses all that
# ComfyUI counts free. On a 24 GiB card a larger request has ComfyUI offload part of the DiT,
# which the next run loads again (docs/PERFORMANCE.md, memory). Smaller runs ask for what
# stock would.
AUTO_REQUEST = 1 * GiB


def _request(vae, x, budget: int, estimate: str = "memory_used_decode") -> int:
    """The VRAM to ask ComfyUI's memory manager for: the budget, else AUTO_REQUEST or stock's
    own estimate (`vae.memory_used_decode` or `memory_used_encode` of x) where that is
    smaller."""
    if budget:
        return budget
    fn = getattr(vae, estimate, None)
    stock = fn(x.shape, vae.vae_dtype) if callable(fn) else AUTO_REQUEST
    return int(min(stock, AUTO_REQUEST))


def _make_room(vae, memory_required: int) -> None:
    """Load the VAE through ComfyUI, which first unloads or offloads other models (a DiT
    partly, where that suffices) until `memory_required` and its own reserve are free. The
    CUDA Graph Sampler's cached graphs go first: ComfyUI cannot see or reclaim them."""
    if _free_memory(vae, vae.device) < memory_required + mm.extra_reserved_memory():
        freed = memory.release_all()
        if freed:
            log.info("VAE Tiling: freed %.2f GiB of cached CUDA graphs for room", freed / GiB)
    mm.load_models_gpu(
        [vae.patcher], memory_required=memory_required, force_full_load=vae.disable_offload
    )


def _within_card(budget: int, device) -> int:
    """A set budget, at most the device's memory: more would have ComfyUI unload every model
    and still run out."""
    total = mm.get_total_memory(device)
    if budget > total:
        _warn_once(f"VAE Tiling: vram_budget_gb {budget / GiB:.1f} is more than this device's "
                   f"{total / GiB:.1f} GiB; using {total / GiB:.1f}")  # fmt: skip
        return int(total)
    return budget


def _auto_budget(vae, device, request: int) -> int:
    """What ComfyUI counts as free, less its own reserve and the cached graphs' pools (which
    it counts as free); at least what was asked for."""
    free = _free_memory(vae, device) - memory.held_bytes()
    return int(max(request, free - mm.extra_reserved_memory()))


def _output_dtype(vae) -> torch.dtype:
    out = getattr(vae, "vae_output_dtype", None)  # newer hosts: the intermediate dtype
    return out() if callable(out) else torch.float32


def _device_context(device):
    ctx = getattr(mm, "cuda_device_context", None)
    return ctx(device) if callable(ctx) else contextlib.nullcontext()


def _wrong_channels(vae, latent) -> str | None:
    """After a failed decode: where the latent's channels are not the VAE's, what to do."""
    want = getattr(vae, "latent_channels", None)
    if want in (None, latent.shape[1]):
        return None
    return (
        f"VAE Tiling: the latent has {latent.shape[1]} channels, and this VAE takes {want}. "
        "Decode it with the VAE of the model that made it."
    )


def _fall_back(info: dict, reason: str, what: str) -> None:
    info["fallback"] = reason
    _warn_once(f"VAE Tiling: {reason}; using ComfyUI's VAE {what} instead")


def _run_tiled(vae, x, what: str, tile_size, budget_gb, info) -> torch.Tensor | None:
    """The decoder's (what="decode") or encoder's ("encode") output for x, run tile by tile,
    on the VAE's device; None where the model is not one VAE Tiling knows (the reason is in
    info["fallback"])."""
    describe = vae_tiling.decoder_ops if what == "decode" else vae_tiling.encoder_ops
    budget = _within_card(int(budget_gb * GiB), vae.device)
    request = _request(vae, x, budget, f"memory_used_{what}")
    # load first: the op list must hold the modules of this VAE's (possibly patched) tree
    _make_room(vae, request)
    try:
        ops = describe(vae.first_stage_model, x)
    except NotImplementedError as e:
        _fall_back(info, f"{e} is not supported", what)
        return None

    device = vae.device
    budget = budget or _auto_budget(vae, device, request)
    x = x.to(device=device, dtype=vae.vae_dtype)
    for attempt in range(3):
        plan = vae_tiling.plan_tiles(ops, tuple(x.shape), vae.vae_dtype, budget, tile_size)
        pbar = comfy.utils.ProgressBar(plan.total)

        def progress(done, total, pbar=pbar):
            mm.throw_exception_if_processing_interrupted()
            pbar.update_absolute(done, total)

        try:
            return vae_tiling.execute(plan, x, device, progress)
        except INTERFACE_ERRORS as e:  # a module called differently on this ComfyUI
            reason = f"the {what}r does not run tile by tile ({type(e).__name__}: {e})"
            _fall_back(info, reason, what)
            return None
        except Exception as e:
            if not host.is_oom(e):
                if what == "decode" and (why := _wrong_channels(vae, x)):
                    raise ValueError(why) from e
                raise
        # retry outside the handler, so the failed tiles can be freed
        mm.soft_empty_cache()
        if attempt == 2:  # still an OOM error: ComfyUI's executor unloads the models for it
            raise mm.OOM_EXCEPTION(
                f"VAE Tiling ran out of memory even with a budget of {budget / GiB:.2f} GiB. "
                "Free VRAM (unload other models) or set a smaller tile_size."
            )
        budget //= 4
        tile_size = tile_size // 2
        # ComfyUI counted the graphs' pools as free: they go first, whatever its count says
        memory.release_all()
        _make_room(vae, budget)  # something grew since: ComfyUI frees what it can again
        _warn_once(f"VAE Tiling: out of memory; retrying with a {budget / GiB:.2f} GiB budget")
    return None  # not reached


def decode(
    vae,
    latent: torch.Tensor,
    tile_size: int = 0,
    budget_gb: float = 0.0,
    info: dict | None = None,
) -> torch.Tensor:
    """Decode like `VAE.decode`, tile by tile; returns images (B, [T,] H, W, C) in 0..1.

    A decoder VAE Tiling does not recognise is decoded by `VAE.decode`, with the reason
    logged once and stored in info["fallback"] (info: optional dict, filled in).
    """
    vae.throw_exception_if_invalid()
    info = {} if info is None else info
    if getattr(latent, "is_nested", False):  # as VAEDecode takes nested latents
        latent = latent.unbind()[0]
    if getattr(vae, "latent_dim", 2) == 3 and latent.ndim == 4:
        latent = latent.unsqueeze(2)
    with _device_context(vae.device):
        out = _run_tiled(vae, latent, "decode", tile_size, budget_gb, info)
    if out is None:
        return vae.decode(latent)
    # a copy made here is a normal tensor, which process_output may change in place (newer
    # hosts do) also outside inference mode
    out = out.to(device=vae.output_device, dtype=_output_dtype(vae), copy=True)
    return vae.process_output(out).movedim(1, -1)


def encode(
    vae,
    pixels: torch.Tensor,
    tile_size: int = 0,
    budget_gb: float = 0.0,
    info: dict | None = None,
) -> torch.Tensor:
    """Encode images (B, H, W, C) in 0..1 like ComfyUI's VAEEncode, tile by tile; returns the
    latent `VAE.encode` returns, in its shape, dtype and device.

    An encoder VAE Tiling does not recognise runs through `VAE.encode`, with the reason
    logged once and stored in info["fallback"] (info: optional dict, filled in).
    """
    vae.throw_exception_if_invalid()
    info = {} if info is None else info
    if not hasattr(vae, "pad_channel_value"):  # older hosts: VAEEncode keeps three channels
        pixels = pixels[..., :3]
    pixels = vae.vae_encode_crop_pixels(pixels)  # newer hosts also fit the channels here
    # as VAE.encode: channels first; a 3-D VAE takes the images as frames of one video
    x = pixels.movedim(-1, 1)
    if vae.latent_dim == 3 and x.ndim < 5:
        x = x.unsqueeze(2) if vae.not_video else x.movedim(1, 0).unsqueeze(0)
    with _device_context(vae.device):
        out = _run_tiled(vae, vae.process_input(x), "encode", tile_size, budget_gb, info)
    if out is None:
        return vae.encode(pixels)
    # a contiguous copy, as the host's: a normal tensor also outside inference mode
    return out.to(
        device=vae.output_device,
        dtype=_output_dtype(vae),
        memory_format=torch.contiguous_format,
        copy=True,
    )


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
            images = decode(vae, samples["samples"], tile_size, vram_budget_gb, info=extra)
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
            samples = encode(vae, pixels, tile_size, vram_budget_gb, info=extra)
        return io.NodeOutput({"samples": samples})
