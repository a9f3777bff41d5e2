"""The CUDA Graph Sampler's run: KSampler with the graph runners on a clone of the model. After
an out-of-memory error it drops every graph and runs again as KSampler; after a run, the
graphs stay only where they leave ComfyUI the room it counts on. Each step's output is
checked for NaN and Inf (`guard`)."""

import logging
from contextlib import contextmanager

import comfy.model_management as mm
import comfy.patcher_extension as pe
import comfy.sampler_helpers

import nodes as comfy_nodes

from .. import batch_fit, host, log_once, memory
from ..dit import lockstep
from ..dit.loader import host_estimate
from . import blocks, guard
from .cache import count_run, trim_graphs
from .capture import CudaGraphs
from .runners import KEY, install

log = logging.getLogger(__name__)
CAPTURE_MODES = ["model forward", "whole CFG step", "off"]


def sample(model, capture, seed, steps, cfg, sampler_name, scheduler, positive, negative,
           latent_image, denoise=1.0):  # fmt: skip
    """The node's run: (latent, the batch-fit note, the graph status for the badge). `capture`
    is one of CAPTURE_MODES; off, on a model that runs on no CUDA device, or on a host that
    lacks an internal the runners rely on, it is KSampler. Either way each step's output is
    checked (`guard`)."""
    args = (seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image)
    missing = host.missing("cuda_graphs")
    cuda = model.load_device.type == "cuda"
    fit, note = (
        batch_fit.check(model, latent_image["samples"], positive, negative)
        if cuda else (None, None)
    )  # fmt: skip
    model, finite_guard = guard.guarded(model)
    block_status = count_blocks(model.model)
    if cuda and cfg != 1.0:  # cfg 1 runs no uncond
        model = model.clone()
        model.add_wrapper_with_key(pe.WrappersMP.PREPARE_SAMPLING, KEY, room_for_cond_batch)
    with named_errors(model, latent_image, fit):
        if capture != "off" and cuda and missing is None:
            whole_step = capture == "whole CFG step"
            latent, graphs = sample_within_memory(
                model, whole_step, CudaGraphs, *args, denoise=denoise
            )
        else:
            latent = comfy_nodes.common_ksampler(model, *args, denoise=denoise)[0]
            off = "capture off" if capture == "off" else f"runs on {model.load_device.type}"
            graphs = f"off ({missing or off})"
    if not guard.finite(latent["samples"]):  # not from a step's output: no safe path
        raise ValueError(
            "CUDA Graph Sampler: the sampled latent is not finite (NaN or Inf); the picture "
            "would be black. Try another sampler or scheduler, a lower cfg, or the Optimized "
            "Loader with weight_dtype bf16."
        )
    state = getattr(model.model, "qwen_turbo", None)  # the Optimized Loader's model
    notes = [graphs, *block_status(), finite_guard.note(), getattr(state, "fidelity", None)]
    return latent, note, "; ".join(filter(None, notes))


# ComfyUI runs the conds of a step as one batch where this many times the batch's estimate is
# free (samplers.calc_cond_batch); the margin covers the streamed block's weights.
COND_BATCH_FACTOR = 1.5
COND_BATCH_MARGIN = 256 * 2**20


def room_for_cond_batch(executor, model, noise_shape, conds, *args, **kwargs):
    """PREPARE_SAMPLING wrapper: a model loaded statically and left partly on the host copies
    those weights to the GPU at every call, and ComfyUI, with too little free for cond and
    uncond together, calls it once per cond. Where the conds could run as one batch (texts
    of one length: a zeroed negative, say), the load leaves that batch's room (at most half
    of what it would load): the weights then cross once a step. The load is sized by holding
    that room on the GPU while ComfyUI loads (`load_hold`, `memory.hold`), so no weight is
    loaded only to be copied back and pinned; what it still leaves short is freed after it.
    Models that load on demand (v0.33's dynamic VRAM) count their weights as free for the
    batch. Conds of two lengths run in lockstep on an Optimized Loader model that streams its
    weights (`lockstep`): the load leaves the second call's room."""
    dynamic = getattr(model, "is_dynamic", lambda: False)()
    estimate = None if dynamic else cond_batch(model, noise_shape, conds)
    if estimate:
        hold = load_hold(model, *estimate)
    else:  # conds of two lengths, the calls in lockstep where the weights stream
        hold = 0 if dynamic else lockstep.lockstep_room(model, noise_shape, conds)
    with memory.hold(model.load_device, hold):
        out = executor(model, noise_shape, conds, *args, **kwargs)
    loaded, size = model.loaded_size(), model.model_size()
    if estimate is None or not 0 < loaded < size:
        return out
    free = getattr(model, "get_free_memory", mm.get_free_memory)(model.load_device)
    short = int(COND_BATCH_FACTOR * estimate[0] + COND_BATCH_MARGIN - free)
    unload = 0 < short <= loaded // 2
    if unload:
        model.partially_unload(model.offload_device, short)
    if hold or unload:
        log_once(log, logging.INFO, "CUDA Graph Sampler: the weights stream from the host; "
                 "more of them stream so that cond and uncond run as one batch")  # fmt: skip
    return out


def cond_batch(model, noise_shape, conds) -> tuple[int, int] | None:
    """ComfyUI's estimates for cond and uncond as one batch and for one cond, or None where it
    would not batch them (one cond; Qwen-Image batches no texts of different lengths)."""
    shapes = [cond_shape(c) for cs in conds.values() for c in cs]
    if len(shapes) < 2 or len(set(shapes)) != 1:
        return None
    return comfy.sampler_helpers.estimate_memory(model, noise_shape, conds)


def load_hold(model, batch: int, single: int) -> int:
    """Bytes to hold on the GPU while ComfyUI loads `model` so that the load leaves room for
    the cond batch (`batch`, ComfyUI's estimate): ComfyUI leaves free what one cond needs
    (`single`, with its reserve: `load_models_gpu`'s minimum) and loads what else there is (the
    memory of every model on the device) up to the model's size. 0 where it would load the
    whole model, or where the room would take more than half of what it loads."""
    left = max(mm.minimum_inference_memory(), single + mm.extra_reserved_memory())
    budget = batch_fit.freeable(model.load_device) - left
    hold = int(COND_BATCH_FACTOR * batch + COND_BATCH_MARGIN - left)
    log.debug("cond batch: %d MB to hold of the load's %d MB; the model is %d MB",
              hold / 2**20, budget / 2**20, model.model_size() / 2**20)  # fmt: skip
    if budget >= model.model_size() or not 0 < hold <= budget // 2:
        return 0
    return hold


def cond_shape(cond: dict) -> tuple:
    """The shapes of a cond's text and mask, which must match for ComfyUI to batch it with
    another (Qwen-Image's `c_crossattn` is a CONDRegular)."""
    return tuple(
        tuple(t.shape) if hasattr(t, "shape") else None
        for t in (cond.get("cross_attn"), cond.get("attention_mask"))
    )


@contextmanager
def named_errors(model, latent: dict, fit: int | None):
    """Errors of the block that a user can act on: an out-of-memory error (`out_of_memory`), a
    latent of another model (`wrong_channels`); others as they are."""
    try:
        yield
    except Exception as e:
        if host.is_oom(e):
            raise out_of_memory(model, latent, fit, e) from e
        if why := wrong_channels(model, latent["samples"]):
            raise ValueError(why) from e
        raise


def out_of_memory(model, latent: dict, fit: int | None, e: Exception) -> Exception:
    """The OOM error a user can act on: the size, the card's total, what was on the GPU
    (`memory.on_the_gpu`), ComfyUI's own estimate of what a step needs on top of the weights,
    the batch that fits (`fit`, as counted before the run), and the first thing to change.
    Still an OOM exception, so that ComfyUI's executor unloads the models as it does for any."""
    x = latent["samples"]
    h, w = x.shape[-2] * 8, x.shape[-1] * 8
    need = model.model.memory_required(x.shape) / 2**30
    total = mm.get_total_memory(model.load_device) / 2**30
    held = memory.on_the_gpu(model.load_device)
    others = sum(gib for what, gib in held.items() if what not in ("the DiT", "the pack's graphs"))
    fits = f" By that estimate {fit} pictures of this size fit." if fit is not None else ""
    if fit is not None and fit < x.shape[0]:
        first = f"a batch of {fit}"
    elif others >= 1:
        first = ("unload the other models (the queue's Unload models button) before the run, "
                 "or lower the size")  # fmt: skip
    else:
        first = "a lower size or batch, or ComfyUI started with --lowvram"
    listing = ", ".join(f"{what} {gib:.1f} GiB" for what, gib in held.items()) or "nothing"
    msg = (
        f"CUDA Graph Sampler ran out of memory at {w}×{h}, batch {x.shape[0]}, on this "
        f"{total:.1f} GiB GPU. On it: {listing}. ComfyUI estimates {need:.1f} GiB for a step "
        f"on top of the weights it keeps on the GPU.{fits} First try: {first}. Closing other "
        "programs using the GPU also helps. "
        f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    )
    return mm.OOM_EXCEPTION(msg)


def wrong_channels(model, samples) -> str | None:
    """After a failed run: where the latent's channels are not the model's (a latent another
    model's VAE made), what to do. ComfyUI resizes an all-zero latent itself."""
    want = getattr(getattr(model.model, "latent_format", None), "latent_channels", None)
    nested = getattr(samples, "is_nested", False)
    if nested or want in (None, samples.shape[1]) or not samples.any():
        return None
    return (
        f"CUDA Graph Sampler: latent_image has {samples.shape[1]} channels, and this model "
        f"takes {want}. Encode the picture with this model's VAE, or start from an empty latent."
    )


def sample_within_memory(model, whole_step, backend, *args, **kwargs):
    """sample_with_graphs; where it runs out of memory, every cached graph is dropped and the
    run goes again as KSampler, which needs no graph memory, with ComfyUI's own activation
    estimate (the Optimized Loader's measured one is smaller)."""
    try:
        return sample_with_graphs(model, whole_step, backend, *args, **kwargs)
    except Exception as e:
        if not host.is_oom(e):
            raise
        error = str(e).splitlines()[0] if str(e) else type(e).__name__
    # outside the handler, so the failed run's frames (activations, graph inputs) are freed
    freed = memory.release_all() / 2**30
    mm.soft_empty_cache()
    note = f"out of memory with graphs ({freed:.2f} GiB dropped); ran as KSampler"
    log.warning("CUDA Graph Sampler: %s (%s)", note, error)
    with host_estimate(model), blocks.off():
        return comfy_nodes.common_ksampler(model, *args, **kwargs)[0], f"off ({note})"


def sample_with_graphs(model, whole_step, backend, *args, **kwargs):
    """common_ksampler(model, *args, **kwargs) through the graph runners: its latent and this
    run's graph status for the badge."""
    skipped = []
    run = model.clone()  # one clone: each step below adds to its options
    add_skip_report(run, skipped)
    why = install(run, backend, whole_step)
    if why is not None:  # every call eager: no runners, no per-call checks
        log_once(log, logging.INFO, f"CUDA Graph Sampler: ran as KSampler: {why}")
        latent = comfy_nodes.common_ksampler(run, *args, **kwargs)[0]
        return latent, "; ".join([f"ran as KSampler: {why}", *skipped])
    status = count_run(run.model)
    latent = comfy_nodes.common_ksampler(run, *args, **kwargs)[0]
    return latent, "; ".join(filter(None, [status(), trim_graphs(run.load_device), *skipped]))


def count_blocks(model):
    """Start counting a run of the Optimized Loader's block graphs (`blocks`) on `model`: the
    function returned gives, after the run, its replays and the reasons blocks ran eagerly
    ('blocks replayed 120', 'blocks eager: model patch ...'); nothing for another model."""
    graphs = getattr(getattr(model, "qwen_turbo", None), "block_graphs", None)
    if graphs is None:
        return list
    replays, refused = graphs.replays, dict(graphs.refused)

    def status() -> list[str]:
        n = graphs.replays - replays
        reasons = [f"blocks eager: {r}" for r, k in graphs.refused.items() if k > refused.get(r, 0)]
        return [f"blocks replayed {n}"] * bool(n) + reasons

    return status


def with_cuda_graphs(model, backend=CudaGraphs, whole_step=False):
    """A clone of `model` with the graph runners on (`install`)."""
    model = model.clone()
    install(model, backend, whole_step)
    return model


def add_skip_report(model, skipped: list) -> None:
    """Make `model` (a clone of the node's input) append to `skipped`, after sampling, what a
    step-caching node (EasyCache, LazyCache: their holder in transformer_options) skipped:
    'EasyCache skipped 3 of 20 steps'. Its OUTER_SAMPLE wrapper sits inside theirs, where
    their per-run copy is."""

    def report(executor, *args, **kwargs):
        try:
            return executor(*args, **kwargs)
        finally:
            holder = executor.class_obj.model_options["transformer_options"].get("easycache")
            if hasattr(holder, "total_steps_skipped"):
                name = type(holder).__name__.removesuffix("Holder")
                steps = len(args[3]) - 1  # the sigmas
                skipped.append(f"{name} skipped {holder.total_steps_skipped} of {steps} steps")

    model.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, KEY, report)
