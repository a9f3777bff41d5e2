"""The graph runners: three ComfyUI wrappers (`fn(executor, *args, **kwargs)`), outermost
first; the outermost one that may capture a call does, and the ones inside it pass through:
- `StepRunner` (PREDICT_NOISE): every model call of a step plus the CFG combination, so
  ComfyUI's per-step Python (batching conds, memory checks, CFG) leaves the loop too. Steps
  that depend on the step's data in Python (timestep ranges, masks, ControlNet, hooks, CFG
  functions) go on to the per-call graphs instead.
- `GraphRunner` (APPLY_MODEL): one model call, cond and uncond as the sampler batches them. It
  sits outside the diffusion model, so a torch.compile'd model (ComfyUI's compile wrapper swaps
  the module in at this level) is captured as compiled code rather than traced through.
- `ModelRunner` (DIFFUSION_MODEL, the innermost wrapper): the transformer's own math, after
  every other wrapper has run. Where another node's Python runs per call around the diffusion
  model (EasyCache decides there whether to skip a step), that Python still runs every call
  and only the transformer replays, so step caching and graphs add up.

Anything that cannot be captured (CPU tensors, weights not all on the GPU, nested arguments
such as ControlNet inputs, code that `policy` keeps out, a failed capture) runs eagerly, with
the reason logged once.
"""

import contextlib
import contextvars
import logging
from collections.abc import Callable

import comfy.patcher_extension as pe
import torch

from .. import memory
from .cache import Graph, GraphCache, cache_for, tensor_version
from .capture import CudaGraphs
from .inputs import cond_inputs, flatten, is_options, with_buffers, with_cond_buffers
from .policy import (
    PER_STEP_OPTIONS,
    STEP_CALLBACKS,
    foreign_code,
    foreign_object_patch,
    model_patches,
    own,
    region,
)

log = logging.getLogger(__name__)
KEY = "qwen_turbo_cuda_graphs"


def weights_signature(model: torch.nn.Module) -> int:
    return hash(tuple(t.data_ptr() for t in (*model.parameters(), *model.buffers())))


# Set while a runner has taken a call (captured or eager): the runners inside pass through.
_taken = contextvars.ContextVar("qwen_turbo_graph_taken", default=False)


@contextlib.contextmanager
def eager():
    """Every runner inside passes its calls through: no capture, no replay."""
    token = _taken.set(True)
    try:
        yield
    finally:
        _taken.reset(token)


def _taking(executor, *args, **kwargs):
    with eager():
        return executor(*args, **kwargs)


def innermost_free(options: dict) -> bool:
    """Whether the ModelRunner in `options`' wrappers may capture: no foreign code inside it."""
    chain = [f for fns in options.get("wrappers", {}).get("diffusion_model", {}).values()
             for f in fns]  # fmt: skip
    at = next((i for i, f in enumerate(chain) if isinstance(f, ModelRunner)), None)
    if at is None or chain[at].patched is not None:
        return False
    return foreign_code(options, ModelRunner.level, chain[at + 1 :]) is None


class GraphRunner:
    """APPLY_MODEL wrapper: replays a captured graph when it can; where foreign code inside
    the call keeps it out of a graph but not the transformer itself, hands the call to the
    ModelRunner inside; else runs it eagerly.

    `resident` tells whether the model's weights are all on the GPU (no lowvram/offload);
    `patched`, why the model's object patches keep graphs off (`foreign_object_patch`).
    """

    # another thread's unsafe call (comfy-aimdo evicting a text encoder's pages, a kernel
    # warm-up loading a module) cannot invalidate the capture
    capture_mode = "thread_local"
    level = "apply_model"

    def __init__(self, resident: Callable[[], bool], backend=CudaGraphs, patched=None):
        self.resident = resident
        self.backend = backend
        self.patched = patched
        self.weights = None  # signature, computed at the first call of a run

    def _note(self, cache: GraphCache, reason: str) -> None:
        if reason not in cache.stats.reasons:
            log.info("CUDA Graph Sampler: %s", reason)
        cache.stats.reasons[reason] = cache.stats.reasons.get(reason, 0) + 1

    def _eager(self, cache: GraphCache, executor, reason: str, args, kwargs):
        cache.stats.eager += 1
        self._note(cache, f"running eagerly: {reason}")
        return _taking(executor, *args, **kwargs)

    def _why_not(self, x: torch.Tensor, executor, options: dict) -> tuple[str | None, bool]:
        """Why this call cannot be captured here, and whether a runner inside still may."""
        why = self.backend.supports(x)
        if why is None and not self.resident():
            why = "weights are not all on the GPU (lowvram or offloading)"
        if why is not None:
            return why, False
        # the wrappers this one runs inside its own level
        why = self.patched or foreign_code(
            options, self.level, executor.wrappers[executor.idx + 1 :]
        )
        return why, why is not None and self.level != ModelRunner.level and innermost_free(options)

    def __call__(self, executor, *args, **kwargs):
        if _taken.get():
            return executor(*args, **kwargs)
        model = executor.class_obj
        cache = cache_for(model)
        options = next((a for a in (*args, *kwargs.values()) if is_options(a)), {})
        tensors, desc = flatten(args, kwargs)
        if tensors is None:
            return self._eager(cache, executor, desc, args, kwargs)
        if not tensors:
            return self._eager(cache, executor, "no tensor arguments", args, kwargs)
        why, inner = self._why_not(tensors[0][1], executor, options)
        if inner:
            self._note(cache, f"model call captured inside its wrappers: {why}")
            return executor(*args, **kwargs)
        if why is not None:
            return self._eager(cache, executor, why, args, kwargs)

        def run(buffers):
            args_, kwargs_ = with_buffers(args, kwargs, tensors, buffers)
            return _taking(executor, *args_, **kwargs_)

        key = (desc, region(options, self.level))
        out = self._replay(cache, model, key, [t for _, t in tensors], run)
        if out is None:
            return self._eager(cache, executor, "capture failed for this shape", args, kwargs)
        return out

    def _replay(self, cache, model, desc, tensors, run) -> torch.Tensor | None:
        """Replay the graph for `desc` with `tensors` as its inputs, capturing `run(buffers)`
        first if it is new; None when it cannot be captured."""
        if self.weights is None:
            self.weights = weights_signature(model)
            cache.drop_stale(self.weights)
        key = (self.level, desc, self.weights)
        if key in cache.failed:
            return None
        graph = cache.get(key)
        if graph is None:
            return self._capture(cache, key, tensors, run)
        cache.stats.replayed += 1
        graph.load(tensors)
        graph.replay()
        return graph.output.clone()

    def _capture(self, cache, key, tensors, run) -> torch.Tensor | None:
        """Capture `run` for `key`; the output of this call (the capture's warm-up), or None
        when it cannot be captured."""
        # Buffers live on the latent's device: ComfyUI keeps the text conds on the CPU and
        # copies them in every call, which a capture cannot record.
        inputs = [t.to(tensors[0].device, copy=True) for t in tensors]
        try:
            replay, out, nbytes, first = self.backend.capture(
                lambda: run(inputs), self.capture_mode
            )
        except Exception as e:  # any capture failure: the run goes on eagerly
            cache.failed.add(key)
            log.warning("CUDA Graph Sampler: capture failed (%s: %s)", type(e).__name__, e)
            return None
        if not isinstance(out, torch.Tensor):
            cache.failed.add(key)
            return None
        pairs = zip(tensors, inputs, strict=True)
        copied = [(t, tensor_version(t)) if t.device != b.device else None for t, b in pairs]
        cache.put(key, Graph(replay, inputs, out, nbytes, copied))
        cache.stats.captured += 1
        return first


class StepRunner(GraphRunner):
    """PREDICT_NOISE wrapper: one graph for the whole guided step, from the latent and sigma
    to the CFG result. Steps it cannot take go on to the per-call GraphRunner."""

    capture_mode = "relaxed"
    level = "predict_noise"

    def __call__(self, executor, x, timestep, model_options, seed=None):
        if _taken.get():
            return executor(x, timestep, model_options, seed)
        guider = executor.class_obj
        model = guider.inner_model
        cache = cache_for(model)
        why = self._why_not(x, executor, model_options.get("transformer_options", {}))[0]
        found = [k for k in PER_STEP_OPTIONS if model_options.get(k)]
        if why is None and found:
            why = f"{found[0]} set"
        callbacks = guider.model_patcher.callbacks
        found = [(t, k) for t in STEP_CALLBACKS for k, fns in callbacks.get(t, {}).items()
                 if any(not own(f) for f in fns)]  # fmt: skip
        if why is None and found:
            why = "{1!r} {0} callback runs Python per step".format(*found[0])
        conds, desc = cond_inputs(guider.conds)
        if why is None and conds is None:
            why = desc
        if why is None and not isinstance(timestep, torch.Tensor):
            why = f"timestep of type {type(timestep).__name__}"
        if why is not None:
            self._note(cache, f"whole step not captured: {why}")
            return executor(x, timestep, model_options, seed)

        original = guider.conds

        def run(buffers):
            guider.conds = with_cond_buffers(original, dict(zip(paths, buffers[2:], strict=True)))
            try:
                return _taking(executor, buffers[0], buffers[1], model_options, seed)
            finally:
                guider.conds = original

        paths = [p for p, _ in conds]
        tensors = [x, timestep] + [t for _, t in conds]
        shapes = [(tuple(t.shape), t.dtype, t.device) for t in tensors[:2]]
        options = model_options.get("transformer_options", {})
        key = ("step", guider.cfg, *shapes, desc, region(options, self.level))
        out = self._replay(cache, model, key, tensors, run)
        if out is None:
            self._note(cache, "whole step not captured: capture failed for this shape")
            return executor(x, timestep, model_options, seed)
        return out


class ModelRunner(GraphRunner):
    """DIFFUSION_MODEL wrapper, the innermost: the transformer's math alone, for calls that the
    runners outside leave to it (another node's Python around the diffusion model). A
    torch.compile'd model is traced through this level, so it passes through there."""

    level = "diffusion_model"

    def __call__(self, executor, *args, **kwargs):
        if torch.compiler.is_compiling():
            return executor(*args, **kwargs)
        return super().__call__(executor, *args, **kwargs)


def install(patcher, backend=CudaGraphs, whole_step=False) -> str | None:
    """Put the runners on `patcher` (a clone its caller owns): a GraphRunner on its model calls,
    a ModelRunner on the diffusion model inside every other wrapper and, with `whole_step`, a
    StepRunner on its guided steps. Where model patches keep every call out of a graph, none:
    the reason."""
    why = model_patches(patcher.model_options.get("transformer_options", {}))
    if why is not None:
        return why
    base = patcher.model

    def resident():
        return not getattr(base, "model_lowvram", False)

    patched = foreign_object_patch(patcher.object_patches)
    calls = GraphRunner(resident, backend, patched)
    patcher.add_wrapper_with_key(pe.WrappersMP.APPLY_MODEL, KEY, calls)
    # added last, so it is the innermost DIFFUSION_MODEL wrapper; another node's wrapper
    # around the diffusion model's forward (an object patch on it) runs outside it
    inside = foreign_object_patch(patcher.object_patches, ("diffusion_model.forward",))
    transformer = ModelRunner(resident, backend, inside)
    patcher.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, KEY, transformer)
    if whole_step:
        step = StepRunner(resident, backend, patched)
        patcher.add_wrapper_with_key(pe.WrappersMP.PREDICT_NOISE, KEY, step)
    patcher.add_callback_with_key(pe.CallbacksMP.ON_DETACH, KEY, free_on_unload)
    return None


def free_on_unload(patcher, unpatch_all):
    """ON_DETACH callback: where the weights leave the GPU, the graphs that point at them go."""
    if unpatch_all:
        memory.release(patcher.model)
