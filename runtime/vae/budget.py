"""The VRAM a tiled run may use: the request to ComfyUI, making room, and the retries after
running out of memory."""

import logging

import comfy.model_management as mm
import comfy.utils
import torch

from .. import host, log_once, memory
from . import describe, executor, planner

log = logging.getLogger(__name__)
GiB = 1024**3

# What the automatic budget asks ComfyUI to make room for; the run then uses all that
# ComfyUI counts free. On a 24 GiB card a larger request has ComfyUI offload part of the DiT,
# which the next run loads again (docs/PERFORMANCE.md, memory). Smaller runs ask for what
# stock would.
AUTO_REQUEST = 1 * GiB

# what a model whose modules are called in a way this pack does not know raises mid-run
INTERFACE_ERRORS = (AttributeError, TypeError, NotImplementedError)


def _warn_once(msg: str) -> None:
    log_once(log, logging.WARNING, msg)


def _free_memory(vae, device) -> int:
    """Free memory as the host's own decode counts it (newer hosts add what dynamic VRAM
    offloading can give back, through the patcher)."""
    free = getattr(vae.patcher, "get_free_memory", None)
    return free(device) if callable(free) else mm.get_free_memory(device)


def request(vae, x, budget: int, estimate: str = "memory_used_decode") -> int:
    """The VRAM to ask ComfyUI's memory manager for: the budget, else AUTO_REQUEST or stock's
    own estimate (`vae.memory_used_decode` or `memory_used_encode` of x) where that is
    smaller."""
    if budget:
        return budget
    fn = getattr(vae, estimate, None)
    stock = fn(x.shape, vae.vae_dtype) if callable(fn) else AUTO_REQUEST
    return int(min(stock, AUTO_REQUEST))


def make_room(vae, memory_required: int) -> None:
    """Load the VAE through ComfyUI, which first unloads or offloads other models (a DiT
    partly, where that suffices) until `memory_required` and its own reserve are free. What
    the pack holds (the CUDA Graph Sampler's cached graphs) goes first: ComfyUI cannot see or
    reclaim it."""
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


def _auto_budget(vae, device, asked: int) -> int:
    """What ComfyUI counts as free, less its own reserve and what the pack holds (which it
    counts as free); at least what was asked for."""
    free = _free_memory(vae, device) - memory.held_bytes()
    return int(max(asked, free - mm.extra_reserved_memory()))


def _wrong_channels(vae, latent) -> str | None:
    """Where the latent's channels are not the VAE's, what to do."""
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


def run_tiled(vae, x, what: str, tile_size, budget_gb, info) -> torch.Tensor | None:
    """The decoder's (what="decode") or encoder's ("encode") output for x, run tile by tile,
    on the VAE's device; None where the model is not one VAE Tiling knows (the reason is in
    info["fallback"]).

    Out of memory, it retries twice with a quarter of the budget and half the tile size.
    """
    ops_of = describe.decoder_ops if what == "decode" else describe.encoder_ops
    budget = _within_card(int(budget_gb * GiB), vae.device)
    asked = request(vae, x, budget, f"memory_used_{what}")
    # named should the run fail with an error other than running out of memory
    wrong_channels = _wrong_channels(vae, x) if what == "decode" else None
    # load first: the op list must hold the modules of this VAE's (possibly patched) tree
    make_room(vae, asked)
    try:
        ops = ops_of(vae.first_stage_model, x)
    except NotImplementedError as e:
        _fall_back(info, f"{e} is not supported", what)
        return None

    device = vae.device
    budget = budget or _auto_budget(vae, device, asked)
    x = x.to(device=device, dtype=vae.vae_dtype)
    for attempt in range(3):
        plan = planner.plan_tiles(ops, tuple(x.shape), vae.vae_dtype, budget, tile_size)
        pbar = comfy.utils.ProgressBar(plan.total)

        def progress(done, total, pbar=pbar):
            mm.throw_exception_if_processing_interrupted()
            pbar.update_absolute(done, total)

        try:
            return executor.execute(plan, x, device, progress)
        except INTERFACE_ERRORS as e:  # a module called differently on this ComfyUI
            reason = f"the {what}r does not run tile by tile ({type(e).__name__}: {e})"
            _fall_back(info, reason, what)
            return None
        except Exception as e:
            if not host.is_oom(e):
                if wrong_channels:
                    raise ValueError(wrong_channels) from e
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
        make_room(vae, budget)  # something grew since: ComfyUI frees what it can again
        _warn_once(f"VAE Tiling: out of memory; retrying with a {budget / GiB:.2f} GiB budget")
    return None  # not reached
