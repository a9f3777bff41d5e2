"""Capture a diffusion model's forward once per static shape as a CUDA graph; replay it.

`GraphRunner` is a ComfyUI DIFFUSION_MODEL wrapper (`fn(executor, *args, **kwargs)`). It keeps
no tensors itself, since ModelPatcher deep-copies wrappers with `model_options`: the captured
graphs live in a `GraphCache` per diffusion-model object, in a module-level registry.

A graph is keyed by every tensor argument's shape, dtype and device, the scalar arguments, and
a signature of the weights (their storage addresses), so a new shape, a LoRA that replaced
weights, or a reload leads to a new capture. Anything that cannot be captured (CPU tensors,
weights not all on the GPU, per-step model patches, nested tensor arguments such as ControlNet
inputs, a failed capture) runs eagerly, with the reason logged once.
"""

import logging
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)
SCALARS = (int, float, str, bool, type(None))


@dataclass
class Graph:
    replay: Callable[[], None]
    inputs: list[torch.Tensor]  # static buffers, refreshed before each replay
    output: torch.Tensor
    nbytes: int


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
            len(self.graphs) > self.max_graphs
            or sum(g.nbytes for g in self.graphs.values()) > self.max_bytes
        ):
            self.graphs.popitem(last=False)

    def drop_stale(self, weights: int) -> None:
        """Forget graphs captured against other weights."""
        for key in [k for k in self.graphs if k[-1] != weights]:
            del self.graphs[key]

    def clear(self) -> None:
        self.graphs.clear()
        self.failed.clear()


_caches: "weakref.WeakKeyDictionary[torch.nn.Module, GraphCache]" = weakref.WeakKeyDictionary()


def cache_for(model: torch.nn.Module) -> GraphCache:
    """The model's cache; its graphs may hold at most a quarter of the GPU's memory."""
    if model not in _caches:
        limit = float("inf")
        if torch.cuda.is_available():
            limit = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 4
        _caches[model] = GraphCache(max_bytes=limit)
    return _caches[model]


def free_graphs(model: torch.nn.Module) -> None:
    """Release a model's graphs and their memory pools (on unload)."""
    cache = _caches.pop(model, None)
    if cache is not None:
        cache.clear()


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
    def capture(run: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor, int]:
        device = torch.cuda.current_device()
        side = CudaGraphs._side.setdefault(device, torch.cuda.Stream(device))
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()  # warm-up: lazy init, cuBLAS/cuDNN workspaces and autotuning
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        before = torch.cuda.memory_reserved()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
        return graph.replay, out, torch.cuda.memory_reserved() - before


def _is_options(value) -> bool:
    """ComfyUI's transformer_options: it carries the wrapper list this runner came from."""
    return isinstance(value, dict) and "wrappers" in value


def _flatten(args, kwargs):
    """Tensor leaves and a hashable description of everything else; None if not capturable.

    transformer_options (positional or not) stays out of the key: it changes every step
    (sigmas) and the model reads nothing from it unless patches are set, which the runner
    refuses.
    """
    tensors, desc = [], []
    items = [(i, a) for i, a in enumerate(args)] + sorted(kwargs.items())
    for name, value in items:
        if name == "transformer_options" or _is_options(value):
            continue
        if isinstance(value, torch.Tensor):
            tensors.append((name, value))
            desc.append((name, tuple(value.shape), value.dtype, value.device))
        elif isinstance(value, SCALARS):
            desc.append((name, value))
        else:
            return None, f"argument {name!r} of type {type(value).__name__}"
    return tensors, tuple(desc)


def weights_signature(model: torch.nn.Module) -> int:
    return hash(tuple(t.data_ptr() for t in (*model.parameters(), *model.buffers())))


class GraphRunner:
    """DIFFUSION_MODEL wrapper: replays a captured graph when it can, else runs eagerly.

    `resident` tells whether the model's weights are all on the GPU (no lowvram/offload).
    """

    def __init__(self, resident: Callable[[], bool], backend=CudaGraphs):
        self.resident = resident
        self.backend = backend
        self.weights = None  # signature, computed at the first call of a run

    def _eager(self, cache: GraphCache, executor, reason: str, args, kwargs):
        cache.stats.eager += 1
        if reason not in cache.stats.reasons:
            log.info("CUDA Graph Sampler: running eagerly: %s", reason)
        cache.stats.reasons[reason] = cache.stats.reasons.get(reason, 0) + 1
        return executor(*args, **kwargs)

    def __call__(self, executor, *args, **kwargs):
        model = executor.class_obj
        cache = cache_for(model)
        options = next((a for a in (*args, *kwargs.values()) if _is_options(a)), {})
        tensors, desc = _flatten(args, kwargs)
        if tensors is None:
            return self._eager(cache, executor, desc, args, kwargs)
        why = self.backend.supports(tensors[0][1]) if tensors else "no tensor arguments"
        if why is None and not self.resident():
            why = "weights are not all on the GPU (lowvram or offloading)"
        if why is None and (options.get("patches") or options.get("patches_replace")):
            why = "model patches that run per step"
        if why is not None:
            return self._eager(cache, executor, why, args, kwargs)
        if self.weights is None:
            self.weights = weights_signature(model)
            cache.drop_stale(self.weights)
        key = (desc, self.weights)
        if key in cache.failed:
            return self._eager(cache, executor, "capture failed for this shape", args, kwargs)

        graph = cache.get(key)
        if graph is None:
            graph = self._capture(cache, key, executor, tensors, args, kwargs)
            if graph is None:
                return self._eager(cache, executor, "capture failed", args, kwargs)
        else:
            cache.stats.replayed += 1
        for buf, (_, t) in zip(graph.inputs, tensors, strict=True):
            buf.copy_(t)
        graph.replay()
        return graph.output.clone()

    def _capture(self, cache, key, executor, tensors, args, kwargs) -> Graph | None:
        inputs = [t.clone() for _, t in tensors]
        args, kwargs = list(args), dict(kwargs)
        for (name, _), buf in zip(tensors, inputs, strict=True):
            if isinstance(name, int):
                args[name] = buf
            else:
                kwargs[name] = buf
        try:
            replay, out, nbytes = self.backend.capture(lambda: executor(*args, **kwargs))
        except Exception as e:  # any capture failure: the run goes on eagerly
            cache.failed.add(key)
            log.warning("CUDA Graph Sampler: capture failed (%s: %s)", type(e).__name__, e)
            return None
        if not isinstance(out, torch.Tensor):
            cache.failed.add(key)
            return None
        graph = Graph(replay, inputs, out, nbytes)
        cache.put(key, graph)
        cache.stats.captured += 1
        return graph
