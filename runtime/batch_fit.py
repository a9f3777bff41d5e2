"""How many pictures of one size a sampling run has room for on the GPU, by ComfyUI's own
activation estimate (the Optimized Loader's measured one for its models), for the CUDA Graph
Sampler's badge, its warning before a run and its out-of-memory message.

Checked against measured peaks (benchmarks/RESULTS.md, "Batches"): for the bundled turbo
workflow at 2512² the estimate is 2.5 GiB a picture against 1.65-2.13 GiB measured; on a 12 GiB
card (11 GiB free) this counts 4 pictures by arithmetic (10.1 GiB of room / 2.5), and batch 4
ran there in 7.6 GiB.
"""

import logging

import comfy.model_management as mm
import comfy.sampler_helpers as helpers

from . import host, log_once

log = logging.getLogger(__name__)
GiB = 2**30
# What stays on the GPU beside the activations with the DiT offloaded (ComfyUI's 128 MiB floor,
# the streamer's next block, the latents): 0.32 GiB at 12 GiB, batch 4 (the sampler's 7.61 GiB
# peak less its 7.29 GiB of activations).
WEIGHTS_FLOOR = GiB // 2


def per_picture(model, latent, positive, negative) -> int:
    """ComfyUI's estimate (sampler_helpers.estimate_memory, its minimum: one cond at a time) of
    what one picture of `latent`'s size needs in a model call beside the weights, reference
    latents (Edit) included. `model`: a ModelPatcher; the conds as ComfyUI's CONDITIONING."""
    conds = {"positive": helpers.convert_cond(positive),
             "negative": helpers.convert_cond(negative)}  # fmt: skip
    return helpers.estimate_memory(model, [1, *latent.shape[1:]], conds)[1]


def freeable(device) -> int:
    """The free memory on `device` and what the loaded models hold there (ComfyUI offloads
    them for room). A model whose patcher is gone (ComfyUI's entry for it not yet cleaned up:
    after an interrupt, a /free) holds nothing."""
    loaded = sum(m.model_loaded_memory() for m in mm.current_loaded_models
                 if m.device == device and m.model is not None)  # fmt: skip
    return mm.get_free_memory(device) + loaded


def room(device) -> int:
    """What a sampling run on `device` can have for activations: `freeable`, less ComfyUI's
    reserve and the weights that stay."""
    return freeable(device) - mm.extra_reserved_memory() - WEIGHTS_FLOOR


def check(model, latent, positive, negative) -> tuple[int | None, str | None]:
    """(the largest batch, the badge's note: 'batch 2 of up to 4 at 2512×2512'); where the
    batch is larger, the note is a warning, logged too. (None, None) where the host lacks the
    estimate."""
    why = host.missing("batch_fit")
    if why is not None:
        log_once(log, logging.INFO, f"Qwen Turbo: no batch estimate on this ComfyUI: {why}")
        return None, None
    each, free = per_picture(model, latent, positive, negative), room(model.load_device)
    n = max(0, int(free // each))
    b, (h, w) = latent.shape[0], (latent.shape[-2] * 8, latent.shape[-1] * 8)
    if b <= n:
        return n, f"batch {b} of up to {n} at {w}×{h}"
    advice = f"a batch of {n} or less fits" if n else "lower the size"
    msg = (
        f"batch {b} at {w}×{h} is more than the {n} that fit on this GPU by ComfyUI's estimate "
        f"({each / GiB:.2f} GiB a picture, {free / GiB:.1f} GiB of room): it may run out of "
        f"memory; {advice}"
    )
    log.warning("CUDA Graph Sampler: %s", msg)
    return n, msg
