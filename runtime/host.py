"""The ComfyUI internals the pack reaches into, checked when the pack loads.

Each feature lists the host modules, attributes and signatures it relies on. Where one is
missing (a newer ComfyUI moved it), `check` names it, the feature is turned off with a logged
reason and a note on the node's badge, and the rest of the pack keeps working.
"""

import importlib
import inspect
import logging
import sys
from collections.abc import Callable

from . import log_once

log = logging.getLogger(__name__)


def _resolve(module: str, path: str):
    obj = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def attr(module: str, path: str) -> Callable[[], str | None]:
    """A check that `module.path` exists."""

    def check():
        try:
            _resolve(module, path)
        except (ImportError, AttributeError):
            return f"{module}.{path} is missing"
        return None

    check.internal = (module, path)
    return check


def params(module: str, path: str, *names: str) -> Callable[[], str | None]:
    """A check that the callable `module.path` takes the parameters `names`."""

    def check():
        try:
            fn = _resolve(module, path)
            taken = inspect.signature(fn).parameters
        except (ImportError, AttributeError, TypeError, ValueError):
            return f"{module}.{path} is missing"
        absent = [n for n in names if n not in taken]
        return f"{module}.{path} takes no {absent[0]!r}" if absent else None

    check.internal = (module, path)
    return check


QWEN = "comfy.ldm.qwen_image.model"
LUMINA = "comfy.ldm.lumina.model"
BLOCK_ARGS = (
    "hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "temb",
    "image_rotary_emb", "transformer_options",
)  # fmt: skip

# feature -> the internals it needs
FEATURES: dict[str, list[Callable[[], str | None]]] = {
    "fused_blocks": [
        params(QWEN, "QwenImageTransformerBlock.forward", *BLOCK_ARGS),
        attr(QWEN, "optimized_attention_masked"),
        attr(QWEN, "QwenImageTransformerBlock._modulate"),
    ],
    "fused_nextdit_blocks": [
        params(
            LUMINA,
            "JointTransformerBlock.forward",
            "x",
            "x_mask",
            "freqs_cis",
            "adaln_input",
            "transformer_options",
        ),  # fmt: skip
        params(LUMINA, "JointAttention.forward", "x", "x_mask", "freqs_cis", "transformer_options"),
        attr(LUMINA, "FeedForward._forward_silu_gating"),  # SwiGLU: w2(silu(w1 x) * w3 x)
    ],
    "fp8_weights": [  # what dit.fp8.Fp8Linear calls
        attr("comfy.ops", "cast_bias_weight"),
        attr("comfy.float", "stochastic_rounding"),
        attr("comfy.lora", "calculate_weight"),
    ],
    "attention_override": [
        params("comfy.ldm.modules.attention", "wrap_attn", "func"),
    ],
    "regional_compile": [
        attr("comfy_api.torch_helpers", "set_torch_compile_wrapper"),
    ],
    "cuda_graphs": [
        attr("comfy.patcher_extension", "WrappersMP.APPLY_MODEL"),
        attr("comfy.patcher_extension", "WrappersMP.PREDICT_NOISE"),
        params("comfy.samplers", "CFGGuider.predict_noise", "x", "timestep", "model_options"),
    ],
    "finite_guard": [
        attr("comfy.patcher_extension", "WrappersMP.PREDICT_NOISE"),
    ],
    "lockstep": [
        attr("comfy.patcher_extension", "WrappersMP.CALC_COND_BATCH"),
        attr("comfy.samplers", "get_area_and_mult"),
        attr("comfy.samplers", "can_concat_cond"),
    ],
    "batch_fit": [
        params("comfy.sampler_helpers", "estimate_memory", "model", "noise_shape", "conds"),
        attr("comfy.sampler_helpers", "convert_cond"),
        attr("comfy.model_management", "extra_reserved_memory"),
        attr("comfy.model_management", "current_loaded_models"),
    ],
}

_missing: dict[str, str] | None = None


def check() -> dict[str, str]:
    """{feature: why it is off} for the running host; logs each once per call."""
    out = {}
    for feature, checks in FEATURES.items():
        reasons = [r for c in checks if (r := c())]
        if reasons:
            out[feature] = reasons[0]
            log.warning("Qwen Turbo: %s is off on this ComfyUI: %s", feature, reasons[0])
    return out


def missing(feature: str) -> str | None:
    """Why `feature` is off on this host (checked once, at the first call), or None."""
    global _missing
    if _missing is None:
        _missing = check()
    return _missing.get(feature)


def reset() -> None:
    """Check again at the next `missing` call (tests that remove an internal)."""
    global _missing
    _missing = None


def dynamic_need() -> int | None:
    """Where ComfyUI makes room for models that all load their weights on demand (v0.33's
    dynamic VRAM: `free_memory(for_dynamic=True)` inside `load_models_gpu`), what they need
    free on the driver beside their weights, bytes: what they compute in (its
    `minimum_memory_required`), and the largest weight one of them casts at once (comfy-aimdo
    grows its cast buffer to it with cudaMalloc: a text encoder's 1 GiB embedding, which
    failed as "VRAM grow failed" where only the compute was freed). None elsewhere, and where
    another node wraps either function. Read from the callers' frames: ComfyUI tells a model
    only how much to free."""
    import comfy.model_management as mm

    free_memory = getattr(getattr(mm, "free_memory", None), "__code__", None)
    load = getattr(getattr(mm, "load_models_gpu", None), "__code__", None)
    if free_memory is None or load is None or "for_dynamic" not in free_memory.co_varnames:
        return None  # a host without dynamic VRAM, or another node's wrapper
    if "minimum_memory_required" not in load.co_varnames:
        log_once(log, logging.WARNING, "Qwen Turbo: this ComfyUI's load_models_gpu keeps no "
                 "minimum_memory_required; models loading on demand take the room ComfyUI "
                 "asks for")  # fmt: skip
        return None
    for_dynamic, frame = None, sys._getframe(1)
    while frame is not None:
        if frame.f_code is free_memory:
            for_dynamic = frame.f_locals.get("for_dynamic")
        elif frame.f_code is load:
            need = frame.f_locals.get("minimum_memory_required")
            if for_dynamic is not True or need is None:
                return None
            return int(need) + largest_cast(frame.f_locals.get("models") or [])
        frame = frame.f_back
    return None


def largest_cast(models) -> int:
    """The bytes of the largest weight of `models` (ModelPatchers) in their compute dtype."""
    largest = 0
    for model in models:
        dtype = model.model_dtype() if hasattr(model, "model_dtype") else None
        for p in model.model.parameters():
            largest = max(largest, p.numel() * (dtype or p.dtype).itemsize)
    return largest


def _called_through(*codes):
    """The frame of the last of `codes` where the method that asks (the caller of the reader
    that calls this) was called through them in turn, innermost first; None otherwise."""
    try:
        frame = sys._getframe(3)  # the caller of the method that asks
    except ValueError:  # a shallower stack
        return None
    for code in codes:
        if code is None or frame is None or frame.f_code is not code:
            return None
        last, frame = frame, frame.f_back
    return last


def unload_request() -> int | None:
    """What ComfyUI's `LoadedModel.model_unload` asks a model to free while it makes room for
    models that all load their weights on demand (`dynamic_need` not None), read by the
    model's `loaded_size` that it asks first; None elsewhere and where another node wraps
    either function."""
    import comfy.model_management as mm

    unload = getattr(getattr(mm.LoadedModel, "model_unload", None), "__code__", None)
    if unload is None or "memory_to_free" not in unload.co_varnames:
        return None
    caller = _called_through(unload)
    asked = caller.f_locals.get("memory_to_free") if caller is not None else None
    return int(asked) if asked is not None and dynamic_need() is not None else None


def room_request(via: str) -> tuple[int, int] | None:
    """Where ComfyUI's `load_models_gpu` (v0.33) sums the room to make for a model it loads
    (`total_memory_required`: its offloaded size, or its whole size where it is not on the
    card yet, freed on top of `extra_mem` by unloading whatever is loaded beside it, models
    that load on demand too), what it then wants free: (`extra_mem`,
    `minimum_memory_required`), bytes. Read from the callers' frames: the model's method that
    asks <- `LoadedModel.<via>` (`model_offloaded_memory` or `model_memory`) <-
    `model_memory_required` <- there; None elsewhere, on hosts that load no model on demand
    and where another node wraps any of them."""
    import comfy.model_management as mm

    load = getattr(getattr(mm, "load_models_gpu", None), "__code__", None)
    free_memory = getattr(getattr(mm, "free_memory", None), "__code__", None)
    chain = [getattr(getattr(mm.LoadedModel, name, None), "__code__", None)
             for name in (via, "model_memory_required")]  # fmt: skip
    if load is None or "total_memory_required" not in load.co_varnames:
        return None
    if free_memory is None or "for_dynamic" not in free_memory.co_varnames:
        return None
    caller = _called_through(*chain, load)
    if caller is None:
        return None
    extra, minimum = (caller.f_locals.get(k) for k in ("extra_mem", "minimum_memory_required"))
    return None if extra is None or minimum is None else (int(extra), int(minimum))


def pinning_disabled() -> bool:
    """Whether ComfyUI runs with --disable-pinned-memory (v0.33; earlier hosts lack it): the
    pack then page-locks no host memory either."""
    import comfy.cli_args

    return bool(getattr(comfy.cli_args.args, "disable_pinned_memory", False))


def pin_request() -> bool:
    """Whether ComfyUI's `load_models_gpu` is summing what the models it loads will page-lock
    (v0.33: `total_pins_required`, each statically loaded model's whole size, whether it pins
    anything or not; the sum makes room by evicting other models' pins, a text encoder's).
    Read from the callers' frames, `model_size` <- `LoadedModel.model_memory` <- there; False
    on other hosts and where another node wraps either."""
    import comfy.model_management as mm

    load = getattr(getattr(mm, "load_models_gpu", None), "__code__", None)
    memory = getattr(getattr(mm.LoadedModel, "model_memory", None), "__code__", None)
    if load is None or memory is None or "total_pins_required" not in load.co_varnames:
        return False
    frame = _called_through(memory, load)
    # the pins' sum precedes the loads, whose RAM log line also asks (with `vram_used` set)
    return frame is not None and "vram_used" not in frame.f_locals


def is_oom(e: BaseException) -> bool:
    """Whether `e` is running out of GPU memory, as ComfyUI's executor judges it: newer hosts'
    `is_oom` also counts out-of-memory AcceleratorErrors."""
    import comfy.model_management as mm

    judge = getattr(mm, "is_oom", None)
    return judge(e) if callable(judge) else isinstance(e, mm.OOM_EXCEPTION)
