"""Capture a model's forward, or a whole guided sampling step, once per static shape as a CUDA
graph; replay it.

Three ComfyUI wrappers (`fn(executor, *args, **kwargs)`), outermost first; the outermost one
that may capture a call does, and the ones inside it pass through:
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

None keeps tensors itself, since ModelPatcher deep-copies wrappers with `model_options`: the
graphs live in a `GraphCache` per model object, held in `memory` with what else the pack
keeps in VRAM.

A graph is keyed by every tensor input's shape, dtype and device, the scalar inputs, and a
signature of the weights (their storage addresses), so a new shape, a LoRA that replaced
weights, or a reload leads to a new capture. Anything that cannot be captured (CPU tensors,
weights not all on the GPU, nested arguments such as ControlNet inputs, a failed capture) runs
eagerly, with the reason logged once.

A replay skips the Python inside the captured region, so only code known to hold no per-step
Python state may sit there: the pack's own and `SAFE_WRAPPERS`. Any other wrapper at a level
inside the region, model patch, callable transformer option, object patch (other than
ComfyUI's model sampling, and a wrapped diffusion-model forward for the innermost runner) or,
for a whole step, CFG function or per-step callback keeps that region out of a graph
(`foreign_code`); the call goes on to the next runner inside, or runs eagerly.
"""

import contextvars
import inspect
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from . import memory

log = logging.getLogger(__name__)
SCALARS = (int, float, str, bool, type(None))
PACK = __name__.split(".")[0]
# ComfyUI's wrapper levels, outermost first, from a guided step (PREDICT_NOISE) inward.
STEP_LEVELS = ("predict_noise", "calc_cond_batch", "apply_model", "diffusion_model")
# Foreign wrapper keys that hold no per-step state: ComfyUI's torch.compile wrapper swaps the
# compiled modules in and back the same way on every call (tests prove the replay exact).
SAFE_WRAPPERS = ("torch.compile",)
# ModelPatcher callbacks that run inside a guided step (in calc_cond_batch).
STEP_CALLBACKS = ("on_prepare_state", "on_apply_hooks")


@dataclass
class Graph:
    replay: Callable[[], None]
    inputs: list[torch.Tensor]  # static buffers, refreshed before each replay
    output: torch.Tensor
    nbytes: int
    # Per input from another device (ComfyUI keeps text conds on the host): the tensor last
    # copied in and its version. Copying it again is a blocking host copy every step, so an
    # unchanged one is skipped; inference-mode tensors keep no version, and ComfyUI's nodes
    # never write to their inputs, so for those the same tensor object means the same values.
    copied: list = field(default_factory=list)

    def load(self, tensors: list[torch.Tensor]) -> None:
        """Refresh the input buffers from `tensors`."""
        for i, (buf, t) in enumerate(zip(self.inputs, tensors, strict=True)):
            if t.device != buf.device:
                stamp = (t, _version(t))
                last = self.copied[i]
                if last is not None and last[0] is t and last[1] == stamp[1]:
                    continue
                self.copied[i] = stamp
            buf.copy_(t)


def _version(t: torch.Tensor) -> int | None:
    """t's in-place-write counter; None for inference-mode tensors, which keep none."""
    try:
        return t._version
    except RuntimeError:
        return None


@dataclass
class Stats:
    captured: int = 0
    replayed: int = 0
    eager: int = 0
    reasons: dict[str, int] = field(default_factory=dict)


class GraphCache:
    """Captured graphs of one model, least recently used first out."""

    def __init__(self, max_graphs: int = 4, max_bytes: float = float("inf")):
        self.max_graphs, self.max_bytes = max_graphs, max_bytes
        self.graphs: OrderedDict[tuple, Graph] = OrderedDict()
        self.failed: set[tuple] = set()
        self.stats = Stats()

    def get(self, key):
        graph = self.graphs.get(key)
        if graph is not None:
            self.graphs.move_to_end(key)
        return graph

    def put(self, key, graph: Graph) -> None:
        self.graphs[key] = graph
        while len(self.graphs) > 1 and (
            len(self.graphs) > self.max_graphs or self.held_bytes() > self.max_bytes
        ):
            self.graphs.popitem(last=False)

    def drop_stale(self, weights: int) -> None:
        """Forget graphs captured against other weights."""
        for key in [k for k in self.graphs if k[-1] != weights]:
            del self.graphs[key]

    def held_bytes(self) -> int:
        """What the graphs' memory pools hold."""
        return sum(g.nbytes for g in self.graphs.values())

    def drop(self) -> None:
        """Drop the graphs, keeping the counters: the next call captures again."""
        self.graphs.clear()

    def clear(self) -> None:
        self.graphs.clear()
        self.failed.clear()


def cache_for(model: torch.nn.Module) -> GraphCache:
    """The model's cache, held in `memory`; its graphs may hold at most a quarter of the GPU's
    memory."""
    cache = memory.holder(model)
    if not isinstance(cache, GraphCache):
        limit = float("inf")
        if torch.cuda.is_available():
            limit = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 4
        cache = GraphCache(max_bytes=limit)
        memory.register(model, cache)
    return cache


class CudaGraphs:
    """The real backend: torch.cuda.CUDAGraph with a warm-up on a side stream.

    The side stream is made once per device: cuBLAS keeps a workspace (32 MiB on Hopper) for
    every stream it has seen, so a new stream per capture would leak one per capture.
    """

    _side: dict[int, torch.cuda.Stream] = {}

    @staticmethod
    def supports(x: torch.Tensor) -> str | None:
        if not x.is_cuda:
            return f"tensors on {x.device.type}"
        if torch.cuda.is_current_stream_capturing():
            return "already inside a capture"
        return None

    @staticmethod
    def capture(
        run: Callable[[], torch.Tensor], mode: str = "global"
    ) -> tuple[Callable[[], None], torch.Tensor, int, torch.Tensor]:
        """(replay, the graph's output, the bytes its pool took, the warm-up's output).
        The warm-up (lazy init, cuBLAS/cuDNN workspaces and autotuning) computes the call
        eagerly, so its output serves the capturing call: no replay of the same step.
        `mode`: CUDA's capture error mode; "relaxed" lets the captured Python query free
        memory (ComfyUI's cond batching does, every step)."""
        device = torch.cuda.current_device()
        side = CudaGraphs._side.setdefault(device, torch.cuda.Stream(device))
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            first = run()
        torch.cuda.current_stream().wait_stream(side)
        if isinstance(first, torch.Tensor):
            first.record_stream(torch.cuda.current_stream())
        torch.cuda.synchronize()
        before = torch.cuda.memory_reserved()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode=mode):
            out = run()
        nbytes = pool_bytes(graph.pool())
        if nbytes is None:
            nbytes = torch.cuda.memory_reserved() - before
        return graph.replay, out, nbytes, first


def pool_bytes(pool) -> int | None:
    """What the segments of a graph's memory pool hold; None where the allocator lists none
    (cudaMallocAsync). The growth of reserved memory over a capture is no measure: where
    memory is short, the allocator frees cached blocks to make the pool."""
    try:
        segments = torch.cuda.memory_snapshot()
    except RuntimeError:
        return None
    return sum(
        s["total_size"] for s in segments if tuple(s.get("segment_pool_id", ())) == tuple(pool)
    )


def _is_options(value) -> bool:
    """ComfyUI's transformer_options: it carries the wrapper list this runner came from."""
    return isinstance(value, dict) and "wrappers" in value


def _flatten(args, kwargs):
    """Tensor leaves with their paths ((name,) or, inside a list such as Edit's reference
    latents, (name, index)) and a hashable description of everything else; (None, reason) if
    not capturable.

    transformer_options (positional or not) stays out of the key: it changes every step
    (sigmas) and the model reads nothing from it unless patches are set, which the runner
    refuses.
    """
    tensors, desc = [], []
    items = [(i, a) for i, a in enumerate(args)] + sorted(kwargs.items())
    for name, value in items:
        if name == "transformer_options" or _is_options(value):
            continue
        listed = isinstance(value, (list, tuple))
        for j, v in enumerate(value if listed else [value]):
            path = (name, j) if listed else (name,)
            if isinstance(v, torch.Tensor):
                tensors.append((path, v))
                desc.append((path, tuple(v.shape), v.dtype, v.device))
            elif isinstance(v, SCALARS) and not listed:
                desc.append((path, v))
            else:
                return None, f"argument {name!r} of type {type(v).__name__}"
        if listed:
            desc.append((name, type(value).__name__, len(value)))
    return tensors, tuple(desc)


def _with_buffers(args, kwargs, tensors, buffers):
    """`args` and `kwargs` with the tensors at `tensors`' paths replaced by `buffers`."""
    args, kwargs = list(args), dict(kwargs)
    for ((name, *j), _), buf in zip(tensors, buffers, strict=True):
        where = args if isinstance(name, int) else kwargs
        if j:
            items = list(where[name])
            items[j[0]] = buf
            where[name] = type(where[name])(items)
        else:
            where[name] = buf
    return args, kwargs


def region(options: dict, level: str) -> tuple:
    """The wrappers at `level` and the levels inside it, by key and name: part of a graph's
    key, so that a graph captured without a wrapper (or with another) is never replayed for a
    model clone that has it."""
    wrappers = options.get("wrappers", {})
    return tuple((lvl, key, getattr(fn, "__qualname__", type(fn).__qualname__))
                 for lvl in STEP_LEVELS[STEP_LEVELS.index(level) :]
                 for key, fns in wrappers.get(lvl, {}).items() for fn in fns)  # fmt: skip


def own(obj) -> bool:
    """Whether `obj` (a function, a method or a callable object) is this pack's code."""
    module = getattr(obj, "__module__", None) or type(obj).__module__
    return module.split(".")[0] == PACK


def model_patches(options: dict) -> str | None:
    """Why the model patches in transformer `options` (a ControlNet's block patches, say) keep
    every call out of a graph: they run Python inside the transformer, at every level."""
    patches = [*options.get("patches", {}), *options.get("patches_replace", {})]
    return f"model patches ({', '.join(patches)}) run Python per step" if patches else None


def foreign_code(options: dict, level: str, inner: list) -> str | None:
    """Why Python that a replay would skip runs inside a graph captured at `level`: a wrapper
    among `inner` (those inside the runner's own at `level`) or at a level below it, a model
    patch or a callable transformer option, none of them the pack's; None if there is none.
    `options`: the transformer_options of the call."""
    wrappers = options.get("wrappers", {})
    for lvl in STEP_LEVELS[STEP_LEVELS.index(level) :]:
        for key, fns in wrappers.get(lvl, {}).items():
            for fn in fns:
                inside = lvl != level or any(fn is f for f in inner)
                foreign = not own(fn) or getattr(fn, "runs_python_per_call", False)
                if inside and key not in SAFE_WRAPPERS and foreign:
                    return f"{key!r} {lvl} wrapper runs Python per step"
    why = model_patches(options)
    if why is not None:
        return why
    for key, value in options.items():
        if key not in ("wrappers", "callbacks") and callable(value) and not own(value):
            return f"transformer option {key!r} runs Python per step"
        if getattr(value, "collective", False):  # its peers run eagerly: never in a graph
            return f"transformer option {key!r} talks to other processes"
    return None


def comfy_model_sampling(obj) -> bool:
    """Whether every method of `obj`'s class is ComfyUI's own model sampling (tensor math on
    the step's sigma, in comfy.model_sampling). The ModelSampling* nodes patch in a subclass
    with no methods of its own, defined in a module that ComfyUI's node loader names after
    the file's path, so the module of the class itself says nothing."""
    for cls in type(obj).__mro__:
        if cls.__module__ == "comfy.model_sampling" or cls.__module__.split(".")[0] in (
            "torch", "builtins",
        ):  # fmt: skip
            continue
        kinds = (staticmethod, classmethod, property)
        if any(inspect.isfunction(v) or isinstance(v, kinds) for v in vars(cls).values()):
            return False
    return True


def foreign_object_patch(object_patches: dict, outside: tuple[str, ...] = ()) -> str | None:
    """Why a ModelPatcher's object patches run Python a replay would skip: one that is neither
    the pack's nor ComfyUI's own model sampling, nor on a key in `outside` (what wraps the
    captured region from outside)."""
    for key, obj in object_patches.items():
        comfy_sampling = key == "model_sampling" and comfy_model_sampling(obj)
        if not (comfy_sampling or key in outside or own(obj)):
            return f"object patch on {key!r} runs Python per step"
    return None


def weights_signature(model: torch.nn.Module) -> int:
    return hash(tuple(t.data_ptr() for t in (*model.parameters(), *model.buffers())))


# Set while a runner has taken a call (captured or eager): the runners inside pass through.
_taken = contextvars.ContextVar("qwen_turbo_graph_taken", default=False)


def _taking(executor, *args, **kwargs):
    token = _taken.set(True)
    try:
        return executor(*args, **kwargs)
    finally:
        _taken.reset(token)


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

    capture_mode = "global"
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
        options = next((a for a in (*args, *kwargs.values()) if _is_options(a)), {})
        tensors, desc = _flatten(args, kwargs)
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
            args_, kwargs_ = _with_buffers(args, kwargs, tensors, buffers)
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
        copied = [(t, _version(t)) if t.device != b.device else None for t, b in pairs]
        cache.put(key, Graph(replay, inputs, out, nbytes, copied))
        cache.stats.captured += 1
        return first


# Keys of a cond (after ComfyUI's process_conds) whose effect depends on the step's data or
# runs extra Python per step; a step with any of them is not captured whole.
PER_STEP_CONDS = ("timestep_start", "timestep_end", "mask", "control", "hooks", "gligen", "default")
# model_options entries that run Python around the model calls of a step.
PER_STEP_OPTIONS = (
    "sampler_cfg_function", "sampler_pre_cfg_function", "sampler_post_cfg_function",
    "sampler_calc_cond_batch_function", "model_function_wrapper", "context_handler",
)  # fmt: skip


def cond_inputs(conds: dict) -> tuple[list | None, tuple | str]:
    """The tensors a guided step reads from a guider's processed conds, with their paths, and
    a hashable description of the rest; (None, reason) when the step cannot be captured."""
    tensors, desc = [], []
    for name in sorted(conds):
        for i, c in enumerate(conds[name] or ()):
            found = [k for k in PER_STEP_CONDS if k in c]
            if found:
                return None, f"conditioning with {found[0]!r}"
            desc.append((name, i, tuple(c.get("area", ())), c.get("strength", 1.0)))
            for k in sorted(c["model_conds"]):
                value = c["model_conds"][k].cond
                for j, v in enumerate(value if isinstance(value, list) else [value]):
                    if isinstance(v, torch.Tensor):
                        tensors.append(((name, i, k, j), v))
                        desc.append((k, j, tuple(v.shape), v.dtype, v.device))
                    elif isinstance(v, SCALARS):
                        desc.append((k, j, v))
                    else:
                        return None, f"conditioning {k!r} of type {type(v).__name__}"
    return tensors, tuple(desc)


def with_cond_buffers(conds: dict, buffers: dict) -> dict:
    """A copy of `conds` whose tensors at the paths in `buffers` are replaced by them."""
    out = {}
    for name, items in conds.items():
        if items is None:
            out[name] = None
            continue
        out[name] = []
        for i, c in enumerate(items):
            model_conds = {}
            for k, cond in c["model_conds"].items():
                if isinstance(cond.cond, list):
                    value = [buffers.get((name, i, k, j), v) for j, v in enumerate(cond.cond)]
                else:
                    value = buffers.get((name, i, k, 0), cond.cond)
                model_conds[k] = cond._copy_with(value)
            out[name].append({**c, "model_conds": model_conds})
    return out


class StepRunner(GraphRunner):
    """PREDICT_NOISE wrapper: one graph for the whole guided step, from the latent and sigma
    to the CFG result. Steps it cannot take go on to the per-call GraphRunner."""

    capture_mode = "relaxed"
    level = "predict_noise"

    def __call__(self, executor, x, timestep, model_options, seed=None):
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


def run_stats(model: torch.nn.Module) -> Stats:
    """The counters and reasons of a model's runners, its diffusion model's included."""
    total = Stats()
    for m in (model, getattr(model, "diffusion_model", None)):
        cache = memory.holder(m) if m is not None else None
        if isinstance(cache, GraphCache):
            s = cache.stats
            total.captured += s.captured
            total.replayed += s.replayed
            total.eager += s.eager
            for reason, n in s.reasons.items():
                total.reasons[reason] = total.reasons.get(reason, 0) + n
    return total
