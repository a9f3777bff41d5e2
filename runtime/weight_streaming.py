"""Weights left on the host, streamed: while transformer block i computes, the offloaded weights
of block i + 1 cross to the GPU on a copy stream. Pure torch; never imports ComfyUI.

ComfyUI's partial load ("lowvram") leaves the modules that do not fit on the offload device and
marks them (`prev_comfy_cast_weights`); its ops then copy each weight when its layer runs, on
the compute stream, so the GPU waits for every copy. Here a layer that can take a copy made
ahead (`staged`, the pack's fp8 Linear) gets it from a copy stream that runs one block ahead.
Copies overlap compute only from page-locked memory: weights the host pinned (ComfyUI v0.33
pins what it offloads, up to its limit) are used as they are; others (v0.3.64, or past v0.33's
limit) get a pinned copy, kept while the layer stays offloaded.

Where the next block's copy would not fit in free memory, or runs out of it, that block's
layers take ComfyUI's own per-layer copies: slower, never a failure.
"""

import copy
import logging
from collections.abc import Callable

import torch

from . import log_once

log = logging.getLogger(__name__)


def room(device: torch.device) -> float:
    """Bytes a copy can take on `device` without the allocator asking the driver for more
    than it has: free driver memory plus what the allocator holds unused."""
    if device.type != "cuda":
        return float("inf")
    free = torch.cuda.mem_get_info(device)[0]
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def to_device(obj, device: torch.device):
    """`obj` with its tensors copied to `device`, non-blocking: tensors in tuples and lists,
    and in objects holding `weights` (ComfyUI's LoRA weight adapters)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if type(obj) in (tuple, list):
        return type(obj)(to_device(v, device) for v in obj)
    if hasattr(obj, "weights"):
        moved = copy.copy(obj)
        moved.weights = to_device(obj.weights, device)
        return moved
    return obj


def lora_patches(layer, device: torch.device) -> list | None:
    """The layer's lowvram LoRA patches (`weight_function` entries holding `key` and
    `patches`, as ComfyUI's LowVramPatch does) on `device`, in order; None where it has
    none. ComfyUI leaves them on the host, so each call would copy them on the compute
    stream."""
    if not layer.weight_function:
        return None
    return [
        to_device(p.patches[p.key], device) if hasattr(p, "key") and hasattr(p, "patches")
        else None
        for p in layer.weight_function
    ]  # fmt: skip


def offloaded(module: torch.nn.Module) -> bool:
    """Whether ComfyUI's partial load left this module's weights on the offload device."""
    return hasattr(module, "prev_comfy_cast_weights")


def _tensors(obj):
    """The tensors in what `to_device` returns."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif type(obj) in (tuple, list):
        for v in obj:
            yield from _tensors(v)
    elif hasattr(obj, "weights"):
        yield from _tensors(obj.weights)


class BlockStreamer:
    """Copies ahead the offloaded weights of a model's blocks, run in order.

    `blocks[i]`'s layers with a `staged` attribute are the ones streamed; `forward(i, inner)`
    is block i's forward with the copies around it. A copy made ahead is kept only until the
    block it is for has run, so nothing stays on the GPU between model calls.
    """

    def __init__(self, blocks):
        self.layers = [[m for m in b.modules() if hasattr(m, "staged")] for b in blocks]
        self.mirror = True  # pinned copies of pageable weights; off once pinning fails
        self.ahead: dict[int, tuple[torch.cuda.Event | None, list]] = {}
        self.streams: dict[torch.device, torch.cuda.Stream] = {}
        self.copies = 0  # blocks staged, for tests and the log
        self.no_room = 0  # blocks left to ComfyUI's copies for want of memory

    def _source(self, layer, name: str) -> torch.Tensor | None:
        """The layer's tensor `name`, page-locked where this host leaves it pageable."""
        t = getattr(layer, name)
        if t is None or not self.mirror or t.device.type != "cpu" or t.is_pinned():
            return t
        cached = getattr(layer, "_pinned", {}).get(name)
        if cached is not None and cached[0] is t:
            return cached[1]
        try:
            pinned = t.pin_memory()
        except RuntimeError as e:  # out of page-locked memory: copy from pageable
            log_once(log, logging.WARNING, f"weight streaming: host memory not pinned ({e})")
            self.mirror = False
            return t
        layer._pinned = {**getattr(layer, "_pinned", {}), name: (t, pinned)}
        return pinned

    def _stage(self, i: int, device: torch.device) -> list:
        """(layer, its weight, (weight, bias, LoRA patches) on `device`) for block i's
        offloaded layers, copied on the current stream; [] where they do not fit."""
        layers = [m for m in self.layers[i] if offloaded(m)]
        if not layers:
            return []
        sources = [(m, self._source(m, "weight"), self._source(m, "bias")) for m in layers]
        if sum(t.nbytes for _, w, b in sources for t in (w, b) if t is not None) > room(device):
            return self._left_to_comfyui()
        try:
            return [
                (m, m.weight, (w.to(device, non_blocking=True),
                               None if b is None else b.to(device, non_blocking=True),
                               lora_patches(m, device)))
                for m, w, b in sources
            ]  # fmt: skip
        except torch.OutOfMemoryError:
            return self._left_to_comfyui()

    def _left_to_comfyui(self) -> list:
        self.no_room += 1
        log_once(log, logging.INFO, "weight streaming: no room for a block's copies; "
                 "ComfyUI copies those layers itself")  # fmt: skip
        return []

    def _prefetch(self, i: int, device: torch.device) -> None:
        """Start block i's copies on the copy stream."""
        if device.type != "cuda":
            self.ahead[i] = (None, self._stage(i, device))
            return
        stream = self.streams.get(device)
        if stream is None:
            stream = self.streams[device] = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            staged = self._stage(i, device)
            event = torch.cuda.Event()
            event.record(stream)
        self.ahead[i] = (event, staged)

    def _take(self, i: int, device: torch.device) -> list:
        """Block i's staged weights, made ready for the current stream."""
        if i not in self.ahead:
            return self._stage(i, device)
        event, staged = self.ahead.pop(i)
        if event is not None:
            current = torch.cuda.current_stream(device)
            current.wait_event(event)
            for *_, tensors in staged:  # made on the copy stream, freed after use on this one
                for t in _tensors(tensors):
                    t.record_stream(current)
        return staged

    def forward(self, i: int, inner: Callable) -> Callable:
        """Block i's forward (`inner`, the hidden states first) with its offloaded weights
        staged, and block i + 1's copied meanwhile."""

        def forward(hidden_states, *args, **kwargs):
            if i == 0:
                self.ahead.clear()  # left by a call that did not run every block
            streamed = False
            for m in self.layers[i]:
                if offloaded(m):
                    streamed = True
                else:  # loaded: a pinned copy from before goes
                    m.__dict__.pop("_pinned", None)
            if not streamed:
                return inner(hidden_states, *args, **kwargs)
            device = hidden_states.device
            # a layer reloaded since its copy was made takes ComfyUI's copy
            staged = [s for s in self._take(i, device) if s[0].weight is s[1]]
            if i + 1 < len(self.layers):
                self._prefetch(i + 1, device)
            if staged and not self.copies:
                log_once(log, logging.INFO, "weight streaming: offloaded weights copied ahead")
            self.copies += bool(staged)
            try:
                for m, _, tensors in staged:
                    m.staged = tensors
                return inner(hidden_states, *args, **kwargs)
            except BaseException:
                self.ahead.clear()  # an interrupted call leaves no copies behind
                raise
            finally:
                for m, *_ in staged:
                    m.staged = None

        forward.__wrapped__ = inner  # for inspect.unwrap: what this block runs
        return forward
