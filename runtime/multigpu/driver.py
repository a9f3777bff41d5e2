"""Rank 0's DIFFUSION_MODEL wrapper (`Driver`): each call described for the workers, run
over the pool, or on rank 0 alone where the workers could not compute the same thing."""

import inspect
import logging
import uuid
import weakref
from dataclasses import dataclass, field

import torch

from .. import log_once
from ..graphs.policy import own
from . import wire
from .pool import GRACE_S, pool, shutdown
from .recipe import NotReplicable, attention_name, fused_blocks, recipe
from .split import Call, _strip, plan

log = logging.getLogger(__name__)

KEY = "qwen_turbo_multigpu"
MODES = ["auto", "cfg-parallel", "sequence-parallel", "both"]


@dataclass
class Stats:
    calls: dict = field(default_factory=dict)  # (groups, size) -> calls
    local: dict = field(default_factory=dict)  # reason -> calls on rank 0 alone


_tokens: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()
_recipes: "weakref.WeakKeyDictionary[torch.nn.Module, bytes]" = weakref.WeakKeyDictionary()


class Driver:
    """The DIFFUSION_MODEL wrapper of a Multi-GPU model. ModelPatcher deep-copies wrappers
    with its options on every clone; this one stays one object, so its clones share `stats`."""

    # its Python talks to the workers on every call: the CUDA Graph Sampler captures only
    # inside it (rank 0's share), never around it
    runs_python_per_call = True

    def __init__(self, base, devices, mode: str, backend: str):
        self.base = weakref.ref(base)
        self.devices, self.mode, self.backend = tuple(devices), mode, backend
        self.stats = Stats()

    def __deepcopy__(self, memo):
        return self

    def __call__(self, executor, *args, **kwargs):
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            # raised before any message, so the workers stay in step for the eager rerun
            raise RuntimeError("Multi-GPU model calls cannot be captured in a CUDA graph")
        try:
            call, patcher, dm, why = self.describe(executor, args, kwargs)
        except NotReplicable as e:
            return self._local(str(e), executor, args, kwargs)
        if call.groups * call.size == 1:
            return self._local(why, executor, args, kwargs)
        if why is not None:
            log_once(log, logging.INFO, f"Multi-GPU: {why}")
        key = (call.groups, call.size)
        self.stats.calls[key] = self.stats.calls.get(key, 0) + 1
        workers = pool(self.devices, self.backend)
        try:
            signature = (_tokens.setdefault(dm, uuid.uuid4().hex), patcher.patches_uuid)
            if workers.weights != signature:
                workers.load(_recipes[dm], signature, dm, patcher)
            return workers.run(call, executor)
        except BaseException as e:
            # a worker's failure (rank 0's collective fails first), or rank 0's own: either
            # way the workers are out of step and stop
            failed = workers.failure(GRACE_S)
            shutdown(kill=True)
            if failed is None or failed is e:
                raise
            raise failed from e

    def _local(self, why: str, executor, args, kwargs):
        self.stats.local[why] = self.stats.local.get(why, 0) + 1
        log_once(log, logging.INFO, f"Multi-GPU: running on {self.devices[0]} alone: {why}")
        return executor(*args, **kwargs)

    def describe(self, executor, args, kwargs):
        """(Call, current ModelPatcher, diffusion model, why not every rank takes part or
        None); NotReplicable when the workers could not compute this call as rank 0 does."""
        base, dm = self.base(), executor.class_obj
        patcher = getattr(base, "current_patcher", None)
        if patcher is None:
            raise NotReplicable("no ModelPatcher is running the model")
        bound = inspect.signature(dm._forward).bind(*args, **kwargs).arguments
        options = bound.get("transformer_options") or {}
        if bound.get("control") is not None:
            raise NotReplicable("ControlNet inputs")
        patches = [name for k in ("patches", "patches_replace")
                   for name, v in options.get(k, {}).items() if v]  # fmt: skip
        if patches:
            raise NotReplicable(f"model patches ({', '.join(map(str, patches))})")
        chain = [(k, f) for k, fns in options.get("wrappers", {}).get("diffusion_model", {})
                 .items() for f in fns]  # fmt: skip
        at = next((i for i, (_, f) in enumerate(chain) if f is self), len(chain))
        foreign = [k for k, f in chain[at + 1 :] if not own(f)]
        if foreign:
            raise NotReplicable(f"the {foreign[0]!r} diffusion_model wrapper")
        override = options.get("optimized_attention_override")
        attention = attention_name(override) if override is not None else None
        if override is not None and attention is None:
            raise NotReplicable(f"attention override {override!r}")
        fused = fused_blocks(patcher, dm)
        if dm not in _recipes:
            _recipes[dm] = recipe(base)
        tensors: list[torch.Tensor] = []
        spec = (_strip(tuple(args), tensors, options), _strip(dict(kwargs), tensors, options))
        try:
            wire.encode(spec)
        except TypeError as e:
            raise NotReplicable(f"a model argument that is not plain data ({e})") from None
        x = args[0]
        groups, size, why = plan(self.mode, len(self.devices), x.shape[0],
                                 self._why_not_sp(dm, bound))  # fmt: skip
        out = ((x.shape[0] // groups, *x.shape[1:]), x.dtype)
        blocks = len(dm.transformer_blocks)
        call = Call(spec, tensors, options, groups, size, attention, fused, blocks, out)
        return call, patcher, dm, why

    @staticmethod
    def _why_not_sp(dm, bound) -> str | None:
        if bound.get("attention_mask") is not None:
            return "a text attention mask"
        extra = bound.get("kwargs", {})
        method = extra.get("ref_latents_method", getattr(dm, "default_ref_method", "index"))
        if bound.get("ref_latents") is not None and method == "index_timestep_zero":
            return "reference latents at timestep zero (Edit-2511)"
        return None


def parallel(model, devices, mode: str = "auto", backend: str = "nccl"):
    """A clone of `model` (a ModelPatcher) whose diffusion-model calls run on `devices`
    (the first: this process's, where `model` runs), split by `mode`."""
    import comfy.patcher_extension as pe
    from comfy.ldm.qwen_image.model import QwenImageTransformer2DModel

    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {MODES}")
    dm = getattr(model.model, "diffusion_model", None)
    if not isinstance(dm, QwenImageTransformer2DModel):
        raise ValueError(f"Multi-GPU runs Qwen-Image DiTs; this MODEL holds {type(dm).__name__}")
    model = model.clone()
    model.remove_wrappers_with_key(pe.WrappersMP.DIFFUSION_MODEL, KEY)
    driver = Driver(model.model, devices, mode, backend)
    model.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, KEY, driver)
    return model


def driver_of(model) -> Driver | None:
    import comfy.patcher_extension as pe

    found = model.get_wrappers(pe.WrappersMP.DIFFUSION_MODEL, KEY)
    return found[0] if found else None


def cuda_devices(load_device: torch.device, gpus: int) -> tuple[list[str], str | None]:
    """The devices for `gpus` GPUs with `load_device` first, and a note: why fewer (or none:
    the model stays as it is) are used."""
    if gpus <= 1:
        return [], "1 GPU asked for: the model runs as it is"
    if load_device.type != "cuda":
        return [], f"the model runs on {load_device.type}, not CUDA: it runs as it is"
    count = torch.cuda.device_count()
    if count < 2:
        return [], f"{count} CUDA device present: the model runs as it is"
    first = load_device.index if load_device.index is not None else torch.cuda.current_device()
    others = [f"cuda:{i}" for i in range(count) if i != first][: gpus - 1]
    note = None if len(others) == gpus - 1 else f"{count} CUDA devices present, not {gpus}"
    return [f"cuda:{first}", *others], note
