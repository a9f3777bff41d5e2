"""VAE Tiling's decode and encode: as ComfyUI's `VAE.decode` and `VAE.encode`, tile by tile."""

import contextlib

import comfy.model_management as mm
import torch

from .budget import run_tiled


def _output_dtype(vae) -> torch.dtype:
    out = getattr(vae, "vae_output_dtype", None)  # newer hosts: the intermediate dtype
    return out() if callable(out) else torch.float32


def _device_context(device):
    ctx = getattr(mm, "cuda_device_context", None)
    return ctx(device) if callable(ctx) else contextlib.nullcontext()


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
        out = run_tiled(vae, latent, "decode", tile_size, budget_gb, info)
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
        out = run_tiled(vae, vae.process_input(x), "encode", tile_size, budget_gb, info)
    if out is None:
        return vae.encode(pixels)
    # a contiguous copy, as the host's: a normal tensor also outside inference mode
    return out.to(
        device=vae.output_device,
        dtype=_output_dtype(vae),
        memory_format=torch.contiguous_format,
        copy=True,
    )
