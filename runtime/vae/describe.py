"""Which VAE family a ComfyUI first-stage model is, and its decoder's or encoder's op list.

The models are recognised by structure (ComfyUI's Wan 2.1 `Decoder3d`/`Encoder3d` and the
AutoencoderKL `Decoder`/`Encoder`): class names, attributes, layer types and `forward`
signatures, never ComfyUI's version, so this package's descriptions do not import ComfyUI.
What is not recognised raises NotImplementedError naming it, and the caller runs the stock way.
"""

import math

import torch

from . import autoencoder_kl, wan
from .ops import Local

WAN_MODULE = "wan.vae"  # comfy.ldm.wan.vae (not vae2_2: Wan 2.2's layers differ)
KL_MODULE = "diffusionmodules.model"
KL_MODELS = ("AutoencoderKL", "AutoencodingEngineLegacy", "AutoencodingEngine")


def _ops(first_stage_model, x: torch.Tensor, part: str, as_wan: tuple, as_kl: tuple) -> list:
    """The ops of `first_stage_model`'s `part` ("decoder" or "encoder"); as_wan: (the Wan class,
    the WanVAE 1x1 conv beside it, its ops); as_kl: (the AutoencoderKL class, its ops)."""
    m = first_stage_model
    coder = getattr(m, part, None)
    kind = type(coder).__name__
    what = "latents" if part == "decoder" else "images"
    try:
        if (
            type(m).__name__ == "WanVAE"
            and type(m).__module__.endswith(WAN_MODULE)
            and kind == as_wan[0]
            and hasattr(m, as_wan[1])
        ):
            if x.ndim != 5 or x.shape[2] != 1:
                raise NotImplementedError(f"Wan {what} with T != 1 (shape {tuple(x.shape)})")
            return as_wan[2](m)
        if kind == as_kl[0] and type(coder).__module__.endswith(KL_MODULE):
            if type(m).__name__ not in KL_MODELS:
                raise NotImplementedError(f"the first-stage model {type(m).__name__}")
            if x.ndim != 4:
                raise NotImplementedError(f"{what} of {x.ndim} dimensions for a 2-D VAE")
            return as_kl[1](m)
    except (AttributeError, IndexError, TypeError) as e:  # a layout this module does not know
        raise NotImplementedError(f"the {kind} layout ({type(e).__name__}: {e})") from e
    raise NotImplementedError(f"the VAE {type(m).__name__} with {part} {kind}")


def decoder_ops(first_stage_model, latent: torch.Tensor) -> list:
    """The op list for decoding `latent` with a ComfyUI first-stage model.

    Raises NotImplementedError naming what is not supported, so callers can fall back.
    """
    as_wan = ("Decoder3d", "conv2", wan.decoder_ops)
    return _ops(
        first_stage_model, latent, "decoder", as_wan, ("Decoder", autoencoder_kl.decoder_ops)
    )


def encoder_ops(first_stage_model, pixels: torch.Tensor) -> list:
    """The op list for encoding `pixels` (B, C, [T,] H, W), processed as the host's
    `VAE.encode` hands them to the model, into the latent `first_stage_model.encode` returns.

    Raises NotImplementedError naming what is not supported, so callers can fall back.
    """
    as_wan = ("Encoder3d", "conv1", wan.encoder_ops)
    as_kl = ("Encoder", autoencoder_kl.encoder_ops)
    ops = _ops(first_stage_model, pixels, "encoder", as_wan, as_kl)
    down = math.prod(op.scale for op in ops if isinstance(op, Local)).denominator
    h, w = pixels.shape[-2:]
    if h % down or w % down:
        raise NotImplementedError(f"a {h}x{w} image (not a multiple of {down})")
    return ops
