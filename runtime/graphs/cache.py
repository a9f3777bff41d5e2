"""The captured graphs of a model, least recently used first out; the runners' counters; and,
after a run, whether the graphs may stay beside the free memory ComfyUI counts on.

A graph is keyed by every tensor input's shape, dtype and device, the scalar inputs, and a
signature of the weights (their storage addresses), so a new shape, a LoRA that replaced
weights, or a reload leads to a new capture. The runners keep no tensors themselves, since
ModelPatcher deep-copies wrappers with `model_options`: the graphs live in a `GraphCache` per
model object, held in `runtime.memory` with what else the pack keeps in VRAM.
"""

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import comfy.model_management as mm
import torch

from .. import log_once, memory

log = logging.getLogger(__name__)


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
                stamp = (t, tensor_version(t))
                last = self.copied[i]
                if last is not None and last[0] is t and last[1] == stamp[1]:
                    continue
                self.copied[i] = stamp
            buf.copy_(t)


def tensor_version(t: torch.Tensor) -> int | None:
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
    memory (as ComfyUI counts it: its total)."""
    cache = memory.holder(model)
    if not isinstance(cache, GraphCache):
        limit = float("inf")
        if torch.cuda.is_available():
            limit = mm.get_total_memory(mm.get_torch_device()) / 4
        cache = GraphCache(max_bytes=limit)
        memory.register(model, cache)
    return cache


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


def graph_status(before: Stats, after: Stats) -> str:
    """This run's share of the cache's counters and its fallback reasons:
    'captured 1, replayed 3; running eagerly: ...'."""
    parts = [f"{name} {n}" for name in ("captured", "replayed", "eager")
             if (n := getattr(after, name) - getattr(before, name))]  # fmt: skip
    reasons = [r for r, n in after.reasons.items() if n > before.reasons.get(r, 0)]
    return "; ".join(filter(None, [", ".join(parts), *reasons]))


def count_run(model: torch.nn.Module) -> Callable[[], str]:
    """Start counting a run of `model`'s runners: the function returned words, after the run,
    its graph_status."""
    before = run_stats(model)
    return lambda: graph_status(before, run_stats(model))


def free_beside_graphs(device, held: int) -> int:
    """What ComfyUI counts as free, less the graph pools it counts in that."""
    return mm.get_free_memory(device) - held


def trim_graphs(device) -> str | None:
    """After a run: drop the cached graphs where they would crowd the free memory that later
    nodes ask ComfyUI for (memory.trim); what was dropped, for the badge."""
    held = memory.held_bytes()
    dropped = memory.trim(free_beside_graphs(device, held)) if held else 0
    if not dropped:
        return None
    log_once(log, logging.INFO, "CUDA Graph Sampler: cached graphs dropped after a run, to "
             "leave ComfyUI the free memory it counts on; the next run captures again")  # fmt: skip
    return f"graphs dropped after the run for room ({dropped / 2**30:.2f} GiB)"
