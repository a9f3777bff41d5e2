"""The Optimized Loader's ModelPatcher: weights uploaded through page-locked buffers, weights
from a file mapping put back there on unload, cached CUDA graphs dropped first when ComfyUI
asks for room; and the loader's record on the model (`LoaderState`)."""

import collections
import logging
from dataclasses import dataclass, field

import comfy.model_management as mm
import comfy.model_patcher
import comfy.utils
import torch

from .. import host, log_once, memory
from ..graphs.blocks import BlockGraphs
from . import streaming

log = logging.getLogger(__name__)


# room made beyond what a load asks to leave free, so that nothing allocated before ComfyUI
# checks it leaves it short (it would then unload a model that loads on demand whole)
ROOM_MARGIN = 64 << 20

# what ComfyUI's ModelPatcher keeps to restore a patched weight (its `backup` entries)
Backup = collections.namedtuple("Backup", ["weight", "inplace_update"])


def driver_free(device: torch.device) -> int:
    """Memory free on the driver (torch's cache not counted), as ComfyUI counts free memory
    where `device` is no CUDA device."""
    if device.type != "cuda":
        return mm.get_free_memory(device)
    return torch.cuda.mem_get_info(device)[0]


class HostCopies(dict):
    """Key: (a weight's host tensor in a file mapping, the data pointer of its GPU copy), for
    the weights on the GPU that have one. A deep copy of the model (ComfyUI's multi-GPU
    clones) starts with none: its weights are its own."""

    def __deepcopy__(self, memo):
        return type(self)()


@dataclass
class LoaderState:
    """What the Optimized Loader records on the model it builds (`model.qwen_turbo`), shared
    by every clone of its ModelPatcher."""

    weights: str  # the weight mode that runs: bf16, fp8_e4m3fn, fp8_e4m3fn_fast, auto
    blocks: str = "transformer_blocks"  # the DiT's attribute holding its main blocks
    notes: list[str] = field(default_factory=list)  # settings this host turned off, and why
    hosts: HostCopies = field(default_factory=HostCopies)
    # data pointers of the weights that are views of comfy-aimdo's file mapping (v0.33's
    # dynamic VRAM); empty otherwise
    mapped: set[int] = field(default_factory=set)
    # transformer blocks that compute on the safe path (the fidelity probe's `kept`), and the
    # probe's summary for the badge; None until it ran or was read from its cache
    safe_blocks: set[int] = field(default_factory=set)
    fidelity: str | None = None
    streamer: streaming.BlockStreamer | None = None  # where the fp8 layers stream
    block_graphs: BlockGraphs | None = None  # where the fused blocks replay graphs


class Patcher(comfy.model_patcher.ModelPatcher):
    """ComfyUI's ModelPatcher for the Optimized Loader's model.

    A load to the GPU copies the weights through a page-locked buffer (streaming.
    Uploader): ComfyUI's `.to()` of a weight in a file mapping, on both hosts, is a pageable
    copy at a third of the speed. The rest of the load is ComfyUI's. A weight so copied out of
    a file mapping, without patches, keeps its place in the mapping (`HostCopies`): unloading
    it takes no copy back from the GPU, which for the whole DiT (ComfyUI unloads it whenever
    a LoRA is switched on) is 19 GiB.

    With v0.33's dynamic VRAM the fp8 layers hold views of comfy-aimdo's file mapping
    (`LoaderState.mapped`: their data pointers), which the driver cannot page-lock:
    ComfyUI's pinning of an offloaded weight would fail ("Pin error.") and synchronize. A
    weight ComfyUI pins is copied out of the mapping first, so only offloaded weights are
    copied: copying all 19 GiB at load cost the loader 5-6 s on an H100.
    """

    # during a load to the GPU: its uploader, and the data pointers of the weights in a file
    # mapping (`streaming.file_backed`)
    _uploader: streaming.Uploader | None = None
    _backed = frozenset()
    _unloading = False  # inside partially_unload
    _to_pin: list[str] | None = None  # during a load: the keys of mapped weights it offloads

    def load(self, device_to=None, *args, **kwargs):
        self._uploader = None
        if (
            device_to is not None
            and torch.device(device_to).type == "cuda"
            and not host.pinning_disabled()
        ):
            self._uploader = streaming.Uploader.for_tensors(self.model.parameters())
        if self._uploader is not None:
            self._backed = streaming.file_backed(self.model.parameters())
        self._to_pin = []
        try:
            out = super().load(device_to, *args, **kwargs)
            self._pin_copies(self._to_pin)
        finally:
            if self._uploader is not None:
                self._uploader.close()
            self._uploader = self._to_pin = None
        mapped = [view for view, _ in self.model.qwen_turbo.hosts.values()]
        mapped += [b.weight for b in self.backup.values() if b.weight.data_ptr() in self._backed]
        self._page_out(mapped)
        return out

    def _page_out(self, tensors) -> None:
        """Views of a file mapping whose data is elsewhere now: their file cache goes where
        RAM is short (`streaming.page_out`)."""
        asked = streaming.page_out(tensors, self.model_size())
        if asked:
            log_once(log, logging.INFO, "Optimized Loader: host RAM is short; the file "
                     "cache of weights on the GPU or copied goes back to the OS")  # fmt: skip

    def model_size(self):
        """ComfyUI's; asked what a load will page-lock (`host.pin_request`), what is neither
        on the GPU nor page-locked already: ComfyUI pins only weights a load leaves offloaded,
        and for the whole size of a model already on the card it would evict other models'
        page-locked weights (a text encoder's). Asked the room for its first load beside
        models that load on demand only (`host.room_request`), see `_room_beside_on_demand`."""
        size = super().model_size()
        request = host.room_request("model_memory")  # the room for a first load
        if request is not None and not self._beside(on_demand=False):
            return -self._room_beside_on_demand(*request)
        if not host.pin_request():
            return size
        weights = (comfy.utils.get_attr(self.model, k) for k in self.pinned)
        pinned = sum(w.nbytes for w in weights if w.device.type == "cpu")
        return max(0, size - self.loaded_size() - pinned)

    def loaded_size(self):
        """ComfyUI's. Where ComfyUI makes room for models that load their weights on demand (a
        text encoder or a VAE under dynamic VRAM), its `model_unload` unloads a model whole
        when it asks for more than the model holds, and the next sampling would load the whole
        DiT again (10 s at 12 GiB): asked there (`host.unload_request`), it holds at least
        that much, so that it is asked to free part of it (`partially_unload`). Where ComfyUI
        sums the room to make for this model's next load (`host.room_request`) beside such
        models only, the model makes that room itself (`_room_beside_on_demand`)."""
        size = super().loaded_size()
        asked = host.unload_request()
        if asked is not None:
            return max(size, asked + 1)
        request = host.room_request("model_offloaded_memory")
        if request is not None and not self._beside(on_demand=False):
            return self.model_size() + self._room_beside_on_demand(*request)
        return size

    def _room_beside_on_demand(self, extra: int, minimum: int) -> int:
        """For the size of what it loads ComfyUI would unload the models beside it that load
        on demand whole, a text encoder's page-locked weights with it (2 s to page-lock again
        at the next prompt): it unloads whole a model asked for more than its VRAM, and any
        asked once theirs is freed. The room the load needs (`minimum`, and a margin for
        what is allocated before ComfyUI checks it) is made of their VRAM first (their
        page-locked weights stay), then of this model's own weights, as its load would. The
        bytes returned, reported as the size it would load less nothing, make ComfyUI's
        request (that size × 1.1 + `extra`) nothing; the load then takes their VRAM
        (`partially_load`). ComfyUI's load keeps its offload buffer out of what it is given, so
        the room covers the buffer where that exceeds the margin: made smaller, each load
        would count that much less of the weights as loaded, leaving them on the GPU (54 MB
        a run at 1328², 12 GiB); larger, each would unload weights only to load them again."""
        buffer = getattr(self.model, "model_offload_buffer_memory", 0)
        short = minimum + max(ROOM_MARGIN, buffer) - mm.get_free_memory(self.load_device)
        if short > 0:
            short -= self._on_demand_vram(short)
        if short > 0 and super().loaded_size() > 0:
            self.partially_unload(self.offload_device, short)
        return int(extra / 1.1) + 1

    def _beside(self, on_demand: bool) -> list:
        """The models ComfyUI has loaded on this model's device, other than its clones, that
        load their weights on demand (or statically)."""
        models = (loaded.model for loaded in mm.current_loaded_models
                  if loaded.device == self.load_device)  # fmt: skip
        return [m for m in models if m is not None and not self.is_clone(m)
                and getattr(m, "is_dynamic", lambda: False)() == on_demand]  # fmt: skip

    def _on_demand_vram(self, wanted: int) -> int:
        """Up to `wanted` bytes of the VRAM of models on this model's device that load their
        weights on demand, freed (their page-locked weights stay: they load again from
        there); what was freed."""
        freed = 0
        for other in self._beside(on_demand=True):
            held = other.loaded_size()
            if freed < wanted and held > 0:
                freed += other.partially_unload(other.offload_device, min(held, wanted - freed))
        return freed

    def partially_load(self, device_to, extra_memory=0, *args, **kwargs):
        """ComfyUI's, at every sampling, after the models beside it that load their weights
        on demand gave back their VRAM (their page-locked weights stay; their next use loads
        them again from there), as ComfyUI unloads them whole for a statically loaded model:
        where their pages held the card, comfy-aimdo evicted them inside this model's run,
        from within torch's allocations, which invalidated its graph captures. Beside such
        models only, what they gave back is taken for weights this load would leave
        offloaded, up to the whole model."""
        freed = self._on_demand_vram(sum(m.loaded_size() for m in self._beside(on_demand=True)))
        short = self.model_size() - self.loaded_size() - extra_memory
        if short > 0 and not self._beside(on_demand=False):
            extra_memory += min(freed, short)
        return super().partially_load(device_to, extra_memory, *args, **kwargs)

    def patch_weight_to_device(self, key, device_to=None, *args, **kwargs):
        """ComfyUI's, from a copy the uploader made where `load` has one: the weight's own
        data where the key has no patches (what the module's `.to()` that follows would
        have done), else the patches' input, the host weight kept as the backup."""
        uploader = self._uploader
        plain = not (args or any(kwargs.values()) or self.weight_inplace_update)
        weight = comfy.utils.get_attr(self.model, key) if uploader and device_to and plain else None
        if weight is not None and uploader.takes(weight):
            if key not in self.patches:
                view = weight.data
                weight.data = uploader.to(weight, device_to)
                if view.data_ptr() in self._backed:
                    self.model.qwen_turbo.hosts[key] = (view, weight.data_ptr())
            elif key not in self.backup:
                self.backup[key] = Backup(weight, False)
                comfy.utils.set_attr_param(self.model, key, uploader.to(weight, device_to))
        return super().patch_weight_to_device(key, device_to, *args, **kwargs)

    def unpatch_model(self, device_to=None, unpatch_weights=True):
        """ComfyUI's. A weight the load copied out of a file mapping goes back to its place
        there instead of being copied back from the GPU, while its GPU copy is still the
        weight's tensor. A weight without patches keeps the file's values: ComfyUI writes
        weights in place only where it patches them (those are never kept), and no version
        counter could tell otherwise (the executor's tensors are inference tensors, and
        ComfyUI writes through `.data`)."""
        hosts = self.model.qwen_turbo.hosts
        to_host = device_to is not None and torch.device(device_to).type == "cpu"
        if hosts and unpatch_weights and to_host:
            for key, (view, ptr) in hosts.items():
                weight = comfy.utils.get_attr(self.model, key)
                if weight.data_ptr() == ptr and key not in self.backup:
                    weight.data = view
            hosts.clear()
        return super().unpatch_model(device_to, unpatch_weights)

    def partially_unload(self, device_to, memory_to_free=0, *args, **kwargs):
        """ComfyUI's, after this model's cached CUDA graphs are dropped: ComfyUI asks a model
        for room this way, the graphs point at weights about to move, and ComfyUI cannot see
        them. What their release adds to ComfyUI's free count (it already counts their
        pools' unused memory) is taken off what the weights must free. Weights that go back
        to their file mapping stay there unpinned (`pin_weight_to_device`). For models that
        load their weights on demand, only what they compute in is freed (`host.dynamic_need`)."""
        self._unloading = True
        try:
            return self._partially_unload(device_to, memory_to_free, *args, **kwargs)
        finally:
            self._unloading = False

    def _partially_unload(self, device_to, memory_to_free=0, *args, **kwargs):
        need = host.dynamic_need()
        if need is not None:
            # models loading on demand (a text encoder, a VAE under dynamic VRAM) stream
            # their weights, as ComfyUI lets them do beside each other: this model frees
            # only what they compute and cast in, and keeps its weights and graphs where that
            # is free on the driver (comfy-aimdo allocates there, not from torch's cache)
            mm.soft_empty_cache()
            short = max(0, need - driver_free(self.load_device))
            if short < memory_to_free:
                log_once(log, logging.INFO, "Optimized Loader: a model that loads its weights "
                         "on demand got the room it computes in; this model's weights stay on "
                         "the GPU")  # fmt: skip
                freed = self._make_room(device_to, short, *args, **kwargs) if short else 0
                mm.soft_empty_cache()  # back to the driver, where comfy-aimdo allocates
                return memory_to_free if freed >= short else freed
        return self._make_room(device_to, memory_to_free, *args, **kwargs)

    def _make_room(self, device_to, memory_to_free, *args, **kwargs):
        before = mm.get_free_memory(self.load_device)
        if not memory.drop(self.model):
            return super().partially_unload(device_to, memory_to_free, *args, **kwargs)
        mm.soft_empty_cache()
        gained = max(0, mm.get_free_memory(self.load_device) - before)
        log_once(log, logging.INFO, "Optimized Loader: ComfyUI asked the model for room; its "
                 "cached CUDA graphs went first, before any weight")  # fmt: skip
        if gained >= memory_to_free:
            return gained
        return gained + super().partially_unload(
            device_to, memory_to_free - gained, *args, **kwargs
        )

    def __del__(self):
        """ComfyUI's. A clone shares its parent's page-locked weights (ComfyUI's `pinned` set)
        and leaves them to it: ComfyUI's unpins them all whenever any clone is dropped, which
        each sampling does with its clones, and the weights it streams would then be
        page-locked again by the next."""
        parent = getattr(self, "parent", None)
        if parent is not None and getattr(parent, "pinned", None) is getattr(self, "pinned", 0):
            self.detach(unpatch_all=False)
            return
        super().__del__()

    def pin_weight_to_device(self, key):
        """ComfyUI's. A weight in comfy-aimdo's file mapping is pinned as a copy (the driver
        cannot page-lock the mapping) where a load leaves it offloaded, after the load's
        other work (`_pin_copies`); where ComfyUI makes room for another model (a text
        encoder on a new prompt) it stays in the mapping, unpinned: a copy would hold it twice
        in RAM, and the model's next load takes it to the GPU through the uploader's
        page-locked buffers."""
        mapped = self.model.qwen_turbo.mapped
        weight = comfy.utils.get_attr(self.model, key) if mapped else None
        if weight is not None and weight.data_ptr() in mapped:
            if self._unloading or host.pinning_disabled():  # a copy would not be pinned
                return
            if self._to_pin is not None:
                self._to_pin.append(key)
                return
            self._pin_copies([key])
            return
        super().pin_weight_to_device(key)

    def _pin_copies(self, keys: list[str]) -> None:
        """Mapped weights `keys` copied out of the mapping, on a few threads ahead of this
        one (`streaming.copies_ahead`: torch's copy takes every core and waits for the
        slowest, 2.3 GB/s beside the kernel warm-up), and pinned by ComfyUI."""
        if not keys:
            return
        weights = [comfy.utils.get_attr(self.model, key) for key in keys]
        for key, weight, copy in zip(keys, weights, streaming.copies_ahead(weights), strict=True):
            self.model.qwen_turbo.mapped.discard(weight.data_ptr())
            comfy.utils.set_attr_param(self.model, key, copy)
            super().pin_weight_to_device(key)
        self._page_out(weights)
