"""The one owner of what the pack holds in VRAM beside ComfyUI's models.

ComfyUI's memory manager tracks the models it loads, not what the pack keeps beside them:
the captured CUDA graphs' memory pools (a cache per model, `graphs.cache.cache_for`, and the
block graphs of uncaptured calls, `graphs.blocks`), which ComfyUI counts as free (torch's
reserved, unused memory) but cannot drop, and the weight streamer's slabs (`dit.streaming`),
which it counts as used but cannot drop either. Each such holder registers here under its model,
and every feature that needs room goes through here: the Optimized Loader's patcher when
ComfyUI asks a model for room (`drop`), VAE Tiling before a decode (`held_bytes`,
`release_all`), the CUDA Graph Sampler after a run (`trim`), after an out-of-memory error
(`release_all`) and on unload (`release`). What the pack needs beside a model's weights is
held while ComfyUI loads it (`hold`), so that the load leaves that room; `room` is what a new
allocation can take.
"""

import weakref
from contextlib import contextmanager, suppress
from typing import Protocol

import torch


class Holder(Protocol):
    def held_bytes(self) -> int:
        """The VRAM it holds that ComfyUI counts as free."""

    def drop(self) -> None:
        """Free that VRAM (what it counts stays)."""

    def clear(self) -> None:
        """Free that VRAM and forget everything (the model is unloaded)."""


# model -> {kind: holder}: the graph runners' cache ("graphs"), the block graphs ("blocks"),
# the weight streamer's slabs ("stream")
_holders: "weakref.WeakKeyDictionary[torch.nn.Module, dict[str, Holder]]" = (
    weakref.WeakKeyDictionary()
)

# What the pack holds stays after a run only while it is at most this share of the memory
# left free beside it: this bounds what a later node's request to ComfyUI can be short by.
KEEP_SHARE = 0.25


def register(model: torch.nn.Module, holder: Holder, kind: str = "graphs") -> None:
    _holders.setdefault(model, {})[kind] = holder


def holder(model: torch.nn.Module, kind: str = "graphs") -> Holder | None:
    return _holders.get(model, {}).get(kind)


def _all() -> list[Holder]:
    return [h for kinds in list(_holders.values()) for h in kinds.values()]


def _of(model: torch.nn.Module) -> list[torch.nn.Module]:
    """A model and its diffusion model."""
    return [m for m in (model, getattr(model, "diffusion_model", None)) if m is not None]


def release(model: torch.nn.Module) -> None:
    """Free and forget what is held for a model, its diffusion model's included (on unload)."""
    for m in _of(model):
        for h in _holders.pop(m, {}).values():
            h.clear()


def drop(model: torch.nn.Module) -> int:
    """Free what is held for a model, its diffusion model's included; the bytes it held."""
    freed = 0
    for h in (h for m in _of(model) for h in _holders.get(m, {}).values()):
        freed += h.held_bytes()
        h.drop()
    return freed


def held_bytes() -> int:
    """What the pack holds in VRAM beside ComfyUI's models that ComfyUI counts as free."""
    return sum(h.held_bytes() for h in _all())


def trim(free: int) -> int:
    """Free everything held where together it is more than KEEP_SHARE of `free` (the memory
    free beside it); the bytes freed."""
    return release_all() if held_bytes() > KEEP_SHARE * free else 0


def release_all() -> int:
    """Free everything held, so its memory goes back to the allocator (before a node asks
    ComfyUI to unload or offload a model for room); the bytes it held."""
    freed = held_bytes()
    for h in _all():
        h.drop()
    if freed and torch.cuda.is_available():
        torch.cuda.empty_cache()
    return freed


def room(device: torch.device) -> float:
    """Bytes a copy can take on `device` without the allocator asking the driver for more
    than it has: free driver memory plus what the allocator holds unused."""
    if device.type != "cuda":
        return float("inf")
    free = torch.cuda.mem_get_info(device)[0]
    # one read of the allocator's counters: memory_reserved() and memory_allocated() each
    # flatten all of them (0.25 ms a call, twice per block)
    stats = torch.cuda.memory_stats_as_nested_dict(device)
    return (
        free
        + stats["reserved_bytes"]["all"]["current"]
        - stats["allocated_bytes"]["all"]["current"]
    )


HOLD_PIECE = 64 * 2**20  # `hold`'s allocations: after a run, free blocks are rarely larger


@contextmanager
def hold(device: torch.device, nbytes: int):
    """`nbytes` of `device`'s memory taken for the block, in pieces of at most HOLD_PIECE (the
    allocator's free blocks after a run are many and smaller), as many as are free: ComfyUI's
    free count leaves them out, and they are free again after it."""
    pieces = []
    with suppress(torch.OutOfMemoryError):
        while nbytes > 0:
            pieces.append(torch.empty(min(nbytes, HOLD_PIECE), dtype=torch.uint8, device=device))
            nbytes -= HOLD_PIECE
    try:
        yield
    finally:
        del pieces


# ComfyUI's model classes, by what a user knows them as
KNOWN_AS = (("TEModel", "the text encoder"), ("VAE", "the VAE"), ("QwenImage", "the DiT"))


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether `a` and `b` are one device ("cuda" is "cuda:0" where that is current)."""
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    current = torch.cuda.current_device() if a.type == "cuda" else 0
    return (a.index if a.index is not None else current) == (
        b.index if b.index is not None else current
    )


def on_the_gpu(device: torch.device) -> dict[str, float]:
    """What is on `device`, GiB: each model ComfyUI has loaded there (its VRAM as ComfyUI
    counts it), by what a user knows it as, and what the pack holds beside them."""
    import comfy.model_management as mm

    out: dict[str, float] = {}
    for loaded in mm.current_loaded_models:
        patcher = loaded.model
        if patcher is None or not same_device(loaded.device, device):
            continue
        name = type(patcher.model).__name__
        what = next((label for key, label in KNOWN_AS if key in name), name)
        out[what] = out.get(what, 0.0) + patcher.loaded_size() / 2**30
    if held := held_bytes():
        out["the pack's graphs"] = held / 2**30
    return {k: v for k, v in out.items() if v >= 0.05}
