"""CUDA Graph Sampler: KSampler whose steps (or model calls) replay captured CUDA graphs."""

import logging

import comfy.model_management as mm
import comfy.patcher_extension as pe
import comfy.samplers
from comfy_api.latest import io

import nodes as comfy_nodes

from ..runtime import batch_fit, cuda_graphs, host, log_once, memory
from ..runtime.dit.loader import host_estimate
from . import report

log = logging.getLogger(__name__)
KEY = "qwen_turbo_cuda_graphs"
CAPTURE_MODES = ["model forward", "whole CFG step", "off"]


def _free_on_unload(patcher, unpatch_all):
    if unpatch_all:  # the weights leave the GPU: the graphs point at them
        memory.release(patcher.model)


def with_cuda_graphs(model, backend=cuda_graphs.CudaGraphs, whole_step=False):
    """A clone of `model` whose model calls go through a GraphRunner, and the diffusion model
    inside every other wrapper through a ModelRunner; with `whole_step`, whose guided steps
    go through a StepRunner."""
    model = model.clone()
    base = model.model

    def resident():
        return not getattr(base, "model_lowvram", False)

    patched = cuda_graphs.foreign_object_patch(model.object_patches)
    calls = cuda_graphs.GraphRunner(resident, backend, patched)
    model.add_wrapper_with_key(pe.WrappersMP.APPLY_MODEL, KEY, calls)
    # added last, so it is the innermost DIFFUSION_MODEL wrapper; another node's wrapper
    # around the diffusion model's forward (an object patch on it) runs outside it
    inside = cuda_graphs.foreign_object_patch(model.object_patches, ("diffusion_model.forward",))
    transformer = cuda_graphs.ModelRunner(resident, backend, inside)
    model.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, KEY, transformer)
    if whole_step:
        step = cuda_graphs.StepRunner(resident, backend, patched)
        model.add_wrapper_with_key(pe.WrappersMP.PREDICT_NOISE, KEY, step)
    model.add_callback_with_key(pe.CallbacksMP.ON_DETACH, KEY, _free_on_unload)
    return model


def capture_off(model, capture: str) -> str:
    return "capture off" if capture == "off" else f"runs on {model.load_device.type}"


def graph_status(before: cuda_graphs.Stats, after: cuda_graphs.Stats) -> str:
    """This run's share of the cache's counters and its fallback reasons:
    'captured 1, replayed 3; running eagerly: ...'."""
    parts = [f"{name} {n}" for name in ("captured", "replayed", "eager")
             if (n := getattr(after, name) - getattr(before, name))]  # fmt: skip
    reasons = [r for r, n in after.reasons.items() if n > before.reasons.get(r, 0)]
    return "; ".join(filter(None, [", ".join(parts), *reasons]))


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


def sample_with_graphs(model, whole_step, backend, *args, **kwargs):
    """common_ksampler(model, *args, **kwargs) through the graph runners: its latent and this
    run's graph status for the badge."""
    skipped = []
    why = cuda_graphs.model_patches(model.model_options.get("transformer_options", {}))
    if why is not None:  # every call eager: no runners, no per-call checks
        log_once(log, logging.INFO, f"CUDA Graph Sampler: ran as KSampler: {why}")
        model = model.clone()
        add_skip_report(model, skipped)
        latent = comfy_nodes.common_ksampler(model, *args, **kwargs)[0]
        return latent, "; ".join([f"ran as KSampler: {why}", *skipped])
    before = cuda_graphs.run_stats(model.model)
    model = with_cuda_graphs(model, backend, whole_step)  # one clone: each copies the options
    add_skip_report(model, skipped)
    latent = comfy_nodes.common_ksampler(model, *args, **kwargs)[0]
    status = graph_status(before, cuda_graphs.run_stats(model.model))
    return latent, "; ".join(filter(None, [status, trim_graphs(model.load_device), *skipped]))


def free_beside_graphs(device, held: int) -> int:
    """What ComfyUI counts as free, less the graph pools it counts in that."""
    return mm.get_free_memory(device) - held


def trim_graphs(device) -> str | None:
    """After a run: drop the cached graphs where they would crowd the free memory that later
    nodes ask ComfyUI for (cuda_graphs.trim); what was dropped, for the badge."""
    held = memory.held_bytes()
    dropped = memory.trim(free_beside_graphs(device, held)) if held else 0
    if not dropped:
        return None
    log_once(log, logging.INFO, "CUDA Graph Sampler: cached graphs dropped after a run, to "
             "leave ComfyUI the free memory it counts on; the next run captures again")  # fmt: skip
    return f"graphs dropped after the run for room ({dropped / 2**30:.2f} GiB)"


def sample_within_memory(model, whole_step, backend, *args, **kwargs):
    """sample_with_graphs; where it runs out of memory, every cached graph is dropped and the
    run goes again as KSampler, which needs no graph memory, with ComfyUI's own activation
    estimate (the Optimized Loader's measured one is smaller)."""
    try:
        return sample_with_graphs(model, whole_step, backend, *args, **kwargs)
    except Exception as e:
        if not host.is_oom(e):
            raise
    # outside the handler, so the failed run's frames (activations, graph inputs) are freed
    freed = memory.release_all() / 2**30
    mm.soft_empty_cache()
    note = f"out of memory with graphs ({freed:.2f} GiB dropped); ran as KSampler"
    log.warning("CUDA Graph Sampler: %s", note)
    with host_estimate(model):
        return comfy_nodes.common_ksampler(model, *args, **kwargs)[0], f"off ({note})"


def out_of_memory(model, latent: dict, fit: int | None, e: Exception) -> Exception:
    """The OOM error a user can act on: the size, ComfyUI's own estimate of what a step needs
    on top of the weights, what the card has, the batch that fits (`fit`, as counted before
    the run), and what to change. Still an OOM exception, so that ComfyUI's executor unloads
    the models as it does for any."""
    x = latent["samples"]
    h, w = x.shape[-2] * 8, x.shape[-1] * 8
    need = model.model.memory_required(x.shape) / 2**30
    total = mm.get_total_memory(model.load_device) / 2**30
    fits = f" By that estimate {fit} pictures of this size fit." if fit is not None else ""
    msg = (
        f"CUDA Graph Sampler ran out of memory at {w}×{h}, batch {x.shape[0]}: ComfyUI "
        f"estimates {need:.1f} GiB for a step on top of the weights it keeps on the GPU, and "
        f"this GPU has {total:.1f} GiB.{fits} Lower the size or batch, close other programs using "
        "the GPU, or start ComfyUI with --lowvram (or a smaller --reserve-vram). "
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


class CUDAGraphSampler(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="QwenTurboCUDAGraphSampler",
            display_name="CUDA Graph Sampler",
            category="QwenTurbo",
            description=(
                "KSampler with its steps replayed as CUDA graphs: the same inputs and result, "
                "less CPU overhead. Helps most at small sizes."
            ),
            inputs=[
                io.Model.Input("model", tooltip="The model used for denoising the input latent."),
                io.Int.Input(
                    "seed", default=0, min=0, max=0xFFFFFFFFFFFFFFFF, control_after_generate=True,
                    tooltip="The random seed used for creating the noise.",
                ),
                io.Int.Input(
                    "steps", default=20, min=1, max=10000,
                    tooltip="The number of steps used in the denoising process.",
                ),
                io.Float.Input(
                    "cfg", default=8.0, min=0.0, max=100.0, step=0.1, round=0.01,
                    tooltip="Classifier-free guidance scale, as in KSampler.",
                ),
                io.Combo.Input(
                    "sampler_name", options=comfy.samplers.KSampler.SAMPLERS,
                    tooltip="The sampling algorithm, as in KSampler.",
                ),
                io.Combo.Input(
                    "scheduler", options=comfy.samplers.KSampler.SCHEDULERS,
                    tooltip="How the noise is removed over the steps, as in KSampler.",
                ),
                io.Conditioning.Input("positive", tooltip="What to include in the image."),
                io.Conditioning.Input("negative", tooltip="What to exclude from the image."),
                io.Latent.Input("latent_image", tooltip="The latent image to denoise."),
                io.Float.Input(
                    "denoise", default=1.0, min=0.0, max=1.0, step=0.01,
                    tooltip="The amount of denoising applied; below 1 for img2img and hires "
                    "second passes.",
                ),
                io.Combo.Input(
                    "capture", options=CAPTURE_MODES, default=CAPTURE_MODES[1], optional=True,
                    tooltip="whole CFG step: one graph per step; model forward: one per model "
                    "call; off: KSampler. A capture costs one extra forward and some VRAM; what "
                    "cannot be captured runs as KSampler, and the badge says why.",
                ),
            ],
            outputs=[io.Latent.Output(tooltip="The denoised latent.")],
            hidden=[io.Hidden.unique_id],
        )  # fmt: skip

    @classmethod
    def execute(
        cls, model, seed, steps, cfg, sampler_name, scheduler, positive, negative,
        latent_image, denoise=1.0, capture=CAPTURE_MODES[1],
    ) -> io.NodeOutput:  # fmt: skip
        args = (seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image)
        missing = host.missing("cuda_graphs")  # a host internal the runners rely on
        cuda = model.load_device.type == "cuda"
        with report.measured(cls) as extra:
            fit, extra["note"] = (
                batch_fit.check(model, latent_image["samples"], positive, negative)
                if cuda else (None, None)
            )  # fmt: skip
            try:
                if capture != "off" and cuda and missing is None:
                    whole_step = capture == "whole CFG step"
                    latent, extra["graphs"] = sample_within_memory(
                        model, whole_step, cuda_graphs.CudaGraphs, *args, denoise=denoise
                    )
                else:
                    latent = comfy_nodes.common_ksampler(model, *args, denoise=denoise)[0]
                    extra["graphs"] = f"off ({missing or capture_off(model, capture)})"
            except Exception as e:
                if host.is_oom(e):
                    raise out_of_memory(model, latent_image, fit, e) from e
                if why := wrong_channels(model, latent_image["samples"]):
                    raise ValueError(why) from e
                raise
        return io.NodeOutput(latent)
