"""A DiT state dict between the layouts: newer ComfyUI's mixed-precision files to the
scaled-fp8 layout, bf16 to fp8 with per-tensor scales, and back; the weight mode a load runs.
Pure torch; never imports ComfyUI."""

import functools
import json
import logging
import math
from collections.abc import Callable

import torch

from ...kernels.fp8_linear import FP8, FP8_MAX, fp8_gemm_reason
from .config import NotQwenImageDiT

log = logging.getLogger(__name__)

# Prefixes a DiT may carry inside a whole checkpoint; stripped before reading the config.
PREFIXES = ("model.diffusion_model.", "diffusion_model.")
# fp8 weights keep their largest value this factor below 448 (room for LoRA deltas).
HEADROOM = 4


def strip_prefix(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The DiT's own keys: a known checkpoint prefix removed where most keys carry it."""
    for prefix in PREFIXES:
        if sum(k.startswith(prefix) for k in sd) > len(sd) // 2:
            return {k[len(prefix) :]: v for k, v in sd.items() if k.startswith(prefix)}
    return sd


def is_linear_weight(key: str, t: torch.Tensor) -> bool:
    """Every 2-D `.weight` of the Qwen-Image DiT belongs to a Linear."""
    return key.endswith(".weight") and t.ndim == 2


def in_blocks(key: str, blocks: str = "transformer_blocks") -> bool:
    """Whether `key` is inside one of the DiT's main blocks (its attribute `blocks`): 99.8%
    of Qwen-Image's weights, 90% of NewBie's. The rest (input and output projections, the
    timestep embedding that drives every block's modulation, NextDiT's refiner blocks) stay
    in bf16 in the fp8 modes, for accuracy."""
    return key.startswith(blocks + ".")


def _no_progress() -> None:
    pass


def to_scaled_fp8(
    sd: dict[str, torch.Tensor], quantize=in_blocks, step: Callable[[], None] = _no_progress,
    device: torch.device | None = None,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """Linear weights for which `quantize(key)` holds as float8_e4m3fn with a float32
    `scale_weight` each (w ~ w8 * scale); the others keep their dtype with a scale of 1.

    Weights in a wider dtype get scale amax / (448 / HEADROOM): the largest lands a factor
    HEADROOM below fp8's largest, so a LoRA patched in later (re-quantized with this scale)
    can grow weights that much before clamping; e4m3's relative precision is the same there.
    Weights already fp8 keep their file's scale, or 1 (ComfyUI's plain fp8 files). Other
    tensors are kept. This is the layout ComfyUI's scaled-fp8 ops load, patch and LoRA.
    `step` is called once per tensor (the loader's progress bar). With a CUDA `device` each
    weight is quantized there, one at a time (faster than the CPU: docs/PERFORMANCE.md,
    "NewBie-image"), the results left on the CPU; on the CPU where the device runs out of
    memory.
    """
    out = {}
    where = device if device is not None and device.type == "cuda" else None
    for k, t in sd.items():
        step()
        if k == "scaled_fp8":  # ComfyUI's marker key, not a tensor of the model
            continue
        out[k] = t
        if not is_linear_weight(k, t):
            continue
        scale_key = k[: -len("weight")] + "scale_weight"
        if t.dtype == FP8 or not quantize(k):
            out.setdefault(scale_key, sd.get(scale_key, torch.ones((), dtype=torch.float32)))
            continue
        if where is not None:
            try:
                out[k], out[scale_key] = (r.cpu() for r in _quantize(t.to(where)))
                continue
            except torch.OutOfMemoryError:
                log.info("fp8 conversion: out of GPU memory; the rest on the CPU")
                where = None
        out[k], out[scale_key] = _quantize(t)
    return out


def _quantize(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(t in fp8, its float32 scale): scale amax / (448 / HEADROOM)."""
    w = t.float()
    scale = (w.abs().amax() * HEADROOM / FP8_MAX).clamp_min(1e-12)
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def from_mixed(sd: dict[str, torch.Tensor], metadata: dict | None = None) -> dict:
    """A mixed-precision checkpoint (newer ComfyUI's `fp8mixed` files: per quantized layer a
    `comfy_quant` JSON entry or a line in the file's `_quantization_metadata`, `weight_scale`,
    optional `input_scale`) in the scaled-fp8 layout (`scale_weight`) the rest of this module
    reads; other checkpoints are returned as they are. Raises NotQwenImageDiT for
    quantization formats other than float8_e4m3fn."""
    layers = {
        k[: -len(".comfy_quant")]: json.loads(bytes(v.tolist()).decode())
        for k, v in sd.items() if k.endswith(".comfy_quant")
    }  # fmt: skip
    if metadata and "_quantization_metadata" in metadata:
        layers.update(json.loads(metadata["_quantization_metadata"]).get("layers", {}))
    if not layers:
        return sd
    for layer, conf in layers.items():
        fmt = conf.get("format")
        if fmt != "float8_e4m3fn":
            raise NotQwenImageDiT(
                f"{layer} is quantized as {fmt!r}; the Optimized Loader reads float8_e4m3fn "
                "checkpoints (load this one with ComfyUI's UNETLoader)"
            )
    out = {}
    for k, t in sd.items():
        if k.endswith((".comfy_quant", ".input_scale")):
            continue
        if k.endswith(".weight_scale"):
            k = k[: -len("weight_scale")] + "scale_weight"
        out[k] = t
    return out


def dequantize(
    sd: dict[str, torch.Tensor], dtype: torch.dtype, step: Callable[[], None] = _no_progress
) -> dict[str, torch.Tensor]:
    """fp8 weights (with any `scale_weight`) back to `dtype`; other floats cast to `dtype`;
    `step` called once per tensor."""
    out = {}
    for k, t in sd.items():
        step()
        if k == "scaled_fp8" or k.endswith(".scale_weight") or k.endswith(".scale_input"):
            continue
        if t.is_floating_point():
            scale = sd.get(k[: -len("weight")] + "scale_weight") if k.endswith(".weight") else None
            t = t.float() * scale.float() if scale is not None else t
            t = t.to(dtype)
        out[k] = t
    return out


def has_fp8_weights(sd: dict[str, torch.Tensor]) -> bool:
    return any(t.dtype == FP8 for k, t in sd.items() if is_linear_weight(k, t))


def count_params(sd: dict[str, torch.Tensor]) -> int:
    """The number of values in the state dict's tensors."""
    return sum(math.prod(t.shape) for t in sd.values())


def to_mode(sd: dict, mode: str, progress, blocks="transformer_blocks", device=None) -> dict:
    """`sd` as weight `mode` stores it: scaled fp8 in the fp8 modes (the main `blocks`'
    Linears, quantized on `device` where it is a GPU), else without fp8 weights (dequantized
    to bf16). `progress(n)` makes the step callback of a pass over n tensors."""
    if mode.startswith("fp8"):
        quantize = functools.partial(in_blocks, blocks=blocks)
        return to_scaled_fp8(sd, quantize, step=progress(len(sd)), device=device)
    if has_fp8_weights(sd):
        return dequantize(sd, torch.bfloat16, progress(len(sd)))
    return sd


def weight_mode(weight_dtype: str, sd: dict[str, torch.Tensor], device) -> str:
    """The weight mode that will run: 'auto' keeps fp8 files in fp8; fast needs fp8 GEMMs."""
    if weight_dtype == "auto" and has_fp8_weights(sd):
        weight_dtype = "fp8_e4m3fn"
    if weight_dtype == "fp8_e4m3fn_fast" and (reason := fp8_gemm_reason(device)):
        log.warning("fp8_e4m3fn_fast: %s; using fp8 storage with bf16 compute", reason)
        weight_dtype = "fp8_e4m3fn"
    return weight_dtype
