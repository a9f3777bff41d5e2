"""What a worker rebuilds: the diffusion model from its recipe (class, `unet_config`, ops
classes), the pack's fused blocks, the attention override by name, and LoRA-patched weights
as a full load patches them. What it cannot rebuild raises NotReplicable: the call runs on
rank 0 alone."""

import functools
import inspect
import re

import torch

from ..dit.blocks import fused_block_forward, is_fused_forward
from ..graphs.policy import own
from . import wire


class NotReplicable(Exception):
    """Why a call runs on rank 0 alone: the workers could not compute the same thing."""


def attention_name(override) -> str | None:
    """The backend of an `attention.attention_override(name)` function (workers rebuild the
    pack's overrides by name); None for any other callable."""
    name = getattr(override, "backend", None)
    return name if own(override) and isinstance(name, str) else None


@functools.cache
def _op_names() -> frozenset[str]:
    import comfy.ops

    base = comfy.ops.disable_weight_init
    return frozenset(n for n in dir(base) if isinstance(getattr(base, n), type))


def recipe(base) -> dict:
    """What a worker builds `base.diffusion_model` from, as plain data (`wire`): the class,
    `unet_config` and, per op name (Linear, LayerNorm, ...), the ops class its modules use.
    Raises NotReplicable when one of them is not importable by name."""
    dm = base.diffusion_model
    ops: dict[str, type] = {}
    for m in dm.modules():
        if hasattr(m, "comfy_cast_weights"):
            name = next((c.__name__ for c in type(m).__mro__ if c.__name__ in _op_names()), None)
            if name is not None and ops.setdefault(name, type(m)) is not type(m):
                raise NotReplicable(f"two {name} classes in one model ({type(m).__qualname__})")
    r = {"cls": type(dm), "config": dict(base.model_config.unet_config), "ops": ops}
    try:
        wire.encode(r)
    except TypeError as e:
        raise NotReplicable(f"the model's classes cannot be rebuilt in a worker ({e})") from None
    return r


def build(r: dict) -> torch.nn.Module:
    """The diffusion model of a `recipe`, on the meta device (weights come by broadcast)."""
    ops = type("ops", (), dict(r["ops"]))
    return r["cls"](**r["config"], device="meta", operations=ops)


def fused_blocks(patcher, dm) -> bool:
    """Whether the pack's fused forward is on every block (False: on none). Raises
    NotReplicable for any other object patch inside the diffusion model."""
    fused = 0
    for key, obj in patcher.object_patches.items():
        if not key.startswith("diffusion_model."):
            continue
        block = re.fullmatch(r"diffusion_model\.transformer_blocks\.\d+\.forward", key)
        obj = inspect.unwrap(obj)  # the weight streamer's wrapper (workers load every weight)
        if block and is_fused_forward(obj):
            fused += 1
        elif not (block and inspect.ismethod(obj) and type(obj.__self__).forward is obj.__func__):
            raise NotReplicable(f"object patch on {key!r}")
    if fused not in (0, len(dm.transformer_blocks)):
        raise NotReplicable("the fused forward on some blocks only")
    return fused > 0


def set_fused(dm, on: bool) -> None:
    from comfy.ldm.qwen_image.model import optimized_attention_masked

    for block in dm.transformer_blocks:
        if on:
            block.forward = fused_block_forward(block, optimized_attention_masked)
        else:
            block.__dict__.pop("forward", None)


def patched_weight(patcher, key: str, device) -> torch.Tensor:
    """The weight at `key` as a full load patches it (LoRA in float32, rounded back to the
    storage dtype with ComfyUI's seed), for weights that `patcher` patches on the fly
    (lowvram, dynamic VRAM) instead of in place."""
    import comfy.float
    import comfy.lora
    import comfy.model_patcher as mp
    import comfy.utils

    weight, set_func, convert_func = mp.get_key_weight(patcher.model, key)
    temp = weight.to(device=device, dtype=torch.float32, copy=True)
    if convert_func is not None:
        temp = convert_func(temp, inplace=True)
    out = comfy.lora.calculate_weight(patcher.patches[key], temp, key)
    to_seed = getattr(comfy.utils, "string_to_seed", None) or mp.string_to_seed  # v0.3: there
    seed = to_seed(key)
    if set_func is None:
        return comfy.float.stochastic_rounding(out, weight.dtype, seed=seed)
    return set_func(out, seed=seed, return_weight=True)
