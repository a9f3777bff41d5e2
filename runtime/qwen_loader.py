"""Loading the Qwen-Image DiT into ComfyUI: a plain MODEL (ModelPatcher), built from the config
read off the weights, with fp8 ops, attention and fused blocks attached through ModelPatcher.

This module imports ComfyUI; the math it uses is in `qwen_dit`, `attention` and `kernels/`.
"""

import logging
import weakref
from pathlib import Path

import comfy.ldm.qwen_image.model as qwen_model
import comfy.model_management as mm
import comfy.model_patcher
import comfy.ops
import comfy.supported_models
import comfy.utils
import folder_paths
import torch

from ..kernels.fp8_linear import (
    FP8,
    fp8_gemm_reason,
    fp8_gemv,
    fp8_linear,
    gelu_tanh,
    quantize_rows,
)
from . import host, log_once, qwen_dit
from .attention import attention_override

log = logging.getLogger(__name__)

FOLDER = "diffusion_models"
WEIGHT_DTYPES = ["auto", "bf16", "fp8_e4m3fn", "fp8_e4m3fn_fast"]
ATTENTION = ["auto", "sdpa", "flash", "fp8_cudnn"]
COMPILE = ["off", "regional"]
SUPPORTED = comfy.supported_models.QwenImage.supported_inference_dtypes
FUSED_KEY = "forward"  # object patch on each block's `forward`
# Inputs with fewer rows (the timestep modulation: one row per sample) skip activation
# quantization: `fp8_gemv`, bf16 activations on the fp8 weight. Activation quantization there
# cost accuracy (H200, 60 layers: rel. error 6.5e-2 against 5.2e-2 with bf16 compute).
GEMV_ROWS = 16


def model_names() -> list[str]:
    """UNETLoader's list, plus diffusers-layout folders (shown with a trailing '/')."""
    names = list(folder_paths.get_filename_list(FOLDER))
    for root in folder_paths.get_folder_paths(FOLDER):
        root = Path(root)
        if root.is_dir():
            dirs = sorted(p for p in root.iterdir() if p.is_dir())
            names += [p.name + "/" for p in dirs if qwen_dit.diffusers_folder(p)]
    return names


def resolve(name: str) -> Path:
    """The file or folder `name` (as listed by `model_names`), or FileNotFoundError saying
    where it should be."""
    roots = [Path(p) for p in folder_paths.get_folder_paths(FOLDER)]
    if name.endswith("/"):
        for root in roots:
            if qwen_dit.diffusers_folder(root / name.rstrip("/")):
                return root / name.rstrip("/")
    elif (path := folder_paths.get_full_path(FOLDER, name)) is not None:
        return Path(path)
    where = ", ".join(str(r) for r in roots) or "models/diffusion_models"
    raise FileNotFoundError(
        f"{name!r} was not found in {where}. Put the Qwen-Image DiT there: "
        "qwen_image_2512_bf16.safetensors or qwen_image_2512_fp8_e4m3fn.safetensors "
        "(https://huggingface.co/Comfy-Org/Qwen-Image_ComfyUI), or a diffusers folder with "
        "transformer/config.json and its safetensors shards."
    )


def read_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], qwen_dit.DiTConfig]:
    """The DiT state dict (ComfyUI key names) and its config, from a file or a diffusers folder."""
    rope_axes, metadata = None, None
    if path.is_dir():
        sd, config = qwen_dit.load_diffusers_folder(qwen_dit.diffusers_folder(path))
        rope_axes = config.get("axes_dims_rope")
    else:
        sd, metadata = comfy.utils.load_torch_file(str(path), return_metadata=True)
    sd = qwen_dit.from_mixed(qwen_dit.strip_prefix(sd), metadata)
    return sd, qwen_dit.read_config(sd, rope_axes)


def _gemv_sized(x: torch.Tensor) -> bool:
    """Whether x has fewer than GEMV_ROWS rows."""
    return x.numel() < GEMV_ROWS * x.shape[-1]


class _Fp8Gemm:
    """fp8 GEMMs with per-row activation scales for a ComfyUI fp8 Linear. The host's ops
    class says through `_fp8_ready(x)` whether it can take x (else its own forward runs), and
    through `_fp8_weight(x)` where the fp8 weight, its scale and the bias are."""

    def _scale_row(self, scale: torch.Tensor, device) -> torch.Tensor:
        """The per-tensor scale as the (1, N) float32 row _scaled_mm takes, made once per
        weight (a new Parameter after a LoRA patch or an unpatch) instead of per call."""
        key = (weakref.ref(self.weight), device)
        cached = getattr(self, "_scale_row_cache", None)
        if cached is None or cached[0][0]() is not self.weight or cached[0][1] != device:
            row = scale.to(device=device, dtype=torch.float32).reshape(1, 1)
            cached = (key, row.expand(1, self.out_features).clone())
            self._scale_row_cache = cached
        return cached[1]

    def _fp8(self, x, gelu_input=False, x_fp8=None):
        weight, scale, bias = self._fp8_weight(x)
        scale = self._scale_row(scale, x.device)
        if _gemv_sized(x):  # the modulation linears
            return fp8_gemv(gelu_tanh(x) if gelu_input else x, weight, scale, bias)
        return fp8_linear(x, weight, scale, bias, gelu_input, x_fp8)

    def linears_of_one_input(self, x, linears):
        """[linear(x) for linear in linears] (this one among them), x quantized to fp8 once
        for all of them (q, k and v of one stream)."""
        if _gemv_sized(x) or not all(
            isinstance(linear, _Fp8Gemm) and linear._fp8_ready(x) for linear in linears
        ):
            return [linear(x) for linear in linears]
        x_fp8 = quantize_rows(x.reshape(-1, x.shape[-1]))
        return [linear._fp8(x, x_fp8=x_fp8) for linear in linears]

    def linear_of_gelu(self, x):
        """self(gelu_tanh(x)), the GELU fused into the activation quantization."""
        if not self._fp8_ready(x):
            return self(gelu_tanh(x))
        return self._fp8(x, gelu_input=True)


def _scaled_fp8_ops(fast: bool):
    """ComfyUI v0.3's scaled-fp8 ops (fp8 storage with `scale_weight`, cast per layer, LoRA
    through convert/set_weight); with `fast`, fp8 GEMMs."""
    base = comfy.ops.scaled_fp8_ops(fp8_matrix_mult=False, scale_input=False, override_dtype=FP8)
    if not fast:
        return base

    class fp8_fast_ops(base):
        class Linear(_Fp8Gemm, base.Linear):
            def _fp8_ready(self, x):
                return self.weight.dtype == FP8  # else a layer kept in bf16 (in_blocks)

            def _fp8_weight(self, x):
                weight, bias = comfy.ops.cast_bias_weight(self, x, dtype=FP8, bias_dtype=x.dtype)
                return weight, self.scale_weight, bias

            def forward_comfy_cast_weights(self, input):
                if not self._fp8_ready(input):
                    return super().forward_comfy_cast_weights(input)
                return self._fp8(input)

    return fp8_fast_ops


def _mixed_fp8_ops(fast: bool, compute_dtype: torch.dtype):
    """Newer ComfyUI's mixed-precision ops: fp8 weights as its quantized tensors (the
    layout of `fp8mixed` checkpoints; LoRAs requantize them), bf16 compute; with `fast`, the
    pack's fp8 GEMMs on the quantized weights."""
    base = comfy.ops.mixed_precision_ops({"mixed_ops": True}, compute_dtype, full_precision_mm=True)

    class Linear(base.Linear):
        def _apply(self, fn, recurse=True):
            # Under inference_mode (every node runs in it) the host re-wraps a moved quantized
            # weight in a Parameter, which fails for an inference tensor; outside it, the
            # host clones inference tensors first.
            with torch.inference_mode(False):
                return super()._apply(fn, recurse)

    class FastLinear(_Fp8Gemm, Linear):
        def _fp8_ready(self, x):
            """Resident fp8 weights with nothing patched on the fly; else ComfyUI's own
            forward (its offloading, its dequantized matmul)."""
            qdata = getattr(self.weight, "_qdata", None)
            return not (
                qdata is None or qdata.dtype != FP8 or qdata.device != x.device
                or self.weight_function or self.bias_function
                or getattr(self, "comfy_force_cast_weights", False)
            )  # fmt: skip

        def _fp8_weight(self, x):
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return self.weight._qdata, self.weight._params.scale, bias

        def forward(self, input, *args, **kwargs):
            if not self._fp8_ready(input):
                return super().forward(input, *args, **kwargs)
            return self._fp8(input)

    class ops(base):
        pass

    ops.Linear = FastLinear if fast else Linear
    return ops


def mixed_host() -> bool:
    """Whether the host loads fp8 weights through mixed-precision ops (newer than v0.3)."""
    return hasattr(comfy.ops, "mixed_precision_ops")


def fp8_ops(fast: bool, compute_dtype: torch.dtype = torch.bfloat16):
    """The host's fp8 ops, with the pack's fp8 GEMMs where `fast`."""
    return _mixed_fp8_ops(fast, compute_dtype) if mixed_host() else _scaled_fp8_ops(fast)


def fp8_state_dict(sd: dict[str, torch.Tensor], quantize=qwen_dit.in_blocks) -> dict:
    """`sd` with its Linear weights in the host's fp8 layout (`qwen_dit.to_scaled_fp8`)."""
    sd = qwen_dit.to_scaled_fp8(sd, quantize)
    return qwen_dit.to_mixed_fp8(sd) if mixed_host() else sd


def fp8_parts(linear) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(fp8 weight, float32 scale) of a Linear holding fp8 weights on either host, else None."""
    w = linear.weight
    if getattr(w, "_qdata", None) is not None and w._qdata.dtype == FP8:
        return w._qdata, w._params.scale
    if w.dtype == FP8:
        return w, linear.scale_weight
    return None


def _storage(weight_dtype: str, sd, load_device) -> str:
    """The weight mode that will run: 'auto' keeps fp8 files in fp8; fast needs fp8 GEMMs."""
    if weight_dtype == "auto" and qwen_dit.has_fp8_weights(sd):
        weight_dtype = "fp8_e4m3fn"
    if weight_dtype == "fp8_e4m3fn_fast" and (reason := fp8_gemm_reason(load_device)):
        log.warning("fp8_e4m3fn_fast: %s; using fp8 storage with bf16 compute", reason)
        weight_dtype = "fp8_e4m3fn"
    return weight_dtype


def build(sd, config: qwen_dit.DiTConfig, weight_dtype: str = "auto"):
    """A ModelPatcher holding ComfyUI's QwenImage model of `config` with the weights of `sd`."""
    load_device = mm.get_torch_device()
    offload_device = mm.unet_offload_device()
    model_config = comfy.supported_models.QwenImage(config.unet_config())
    mode = _storage(weight_dtype, sd, load_device)
    fast = mode == "fp8_e4m3fn_fast"
    mixed = mode.startswith("fp8") and mixed_host()
    if mode.startswith("fp8"):
        sd = fp8_state_dict(sd)
        # v0.3 builds the model in fp8; mixed-precision ops build it in bf16 and hold the
        # fp8 weights as quantized tensors.
        unet_dtype = torch.bfloat16 if mixed else FP8
    else:
        if qwen_dit.has_fp8_weights(sd):
            sd = qwen_dit.dequantize(sd, torch.bfloat16)
        unet_dtype = torch.bfloat16
        if mode == "auto":  # ComfyUI's own choice for the device (float32 on CPU)
            params = qwen_dit.count_params(sd)
            unet_dtype = mm.unet_dtype(model_params=params, supported_dtypes=SUPPORTED)
    manual_cast = mm.unet_manual_cast(unet_dtype, load_device, SUPPORTED)
    if mode.startswith("fp8"):
        model_config.custom_operations = fp8_ops(fast, manual_cast or unet_dtype)
    model_config.set_inference_dtype(unet_dtype, manual_cast)
    model = model_config.get_model(sd, "")
    model = model.to(offload_device)
    # v0.3 builds every parameter in fp8 here, biases and norm gains too (1.1 rounds to
    # 1.125). Everything but the fp8 weights and their scales is put back in bf16 after the
    # load (which empties `sd`).
    kept = {}
    if mode.startswith("fp8") and not mixed:
        kept = {
            k: t for k, t in sd.items()
            if t.is_floating_point() and t.dtype != FP8 and not k.endswith("scale_weight")
        }  # fmt: skip
    model.load_model_weights(sd, "")
    for k, t in kept.items():
        comfy.utils.set_attr_param(model.diffusion_model, k, t.to(torch.bfloat16))
    patcher = comfy.model_patcher.ModelPatcher(model, load_device, offload_device)
    patcher.qwen_turbo_weights = mode
    return patcher


def _host_block(reason: str) -> None:
    log_once(log, logging.INFO, f"Optimized Loader: fused block not used for {reason}")


def add_fused_blocks(patcher) -> None:
    """Object patches: each transformer block's forward runs the fused kernels."""
    for i, block in enumerate(patcher.model.diffusion_model.transformer_blocks):
        forward = qwen_dit.fused_block_forward(
            block, qwen_model.optimized_attention_masked, _host_block
        )
        patcher.add_object_patch(f"diffusion_model.transformer_blocks.{i}.{FUSED_KEY}", forward)


def set_attention(patcher, attention: str) -> None:
    if attention != "auto":
        options = patcher.model_options.setdefault("transformer_options", {})
        options["optimized_attention_override"] = attention_override(attention)


def compile_blocks(patcher) -> None:
    """Regional torch.compile: each block compiled on its own (one graph, reused by all)."""
    from comfy_api.torch_helpers import set_torch_compile_wrapper

    n = len(patcher.model.diffusion_model.transformer_blocks)
    keys = [f"diffusion_model.transformer_blocks.{i}" for i in range(n)]
    set_torch_compile_wrapper(patcher, backend="inductor", keys=keys)


def _host_allows(feature: str, setting: str, notes: list[str]) -> bool:
    """Whether this host has what `feature` needs; else a logged note that `setting` is off."""
    why = host.missing(feature)
    if why is not None:
        notes.append(f"{setting} off: {why}")
        log_once(log, logging.WARNING, f"Optimized Loader: {notes[-1]}")
    return why is None


def load(name: str, weight_dtype="auto", attention="auto", fused_kernels=True, compile="off"):
    """The Optimized Loader: a MODEL that every stock node accepts. Settings this host cannot
    run are turned off; `patcher.qwen_turbo_notes` says which and why."""
    sd, config = read_checkpoint(resolve(name))
    notes: list[str] = []
    if weight_dtype.startswith("fp8") and not _host_allows("fp8_weights", weight_dtype, notes):
        weight_dtype = "bf16"
    patcher = build(sd, config, weight_dtype)
    log.info(
        "Optimized Loader: %s, %d layers, width %d (%d heads of %d), text %d, weights %s",
        name, config.num_layers, config.width, config.num_attention_heads,
        config.attention_head_dim, config.joint_attention_dim, patcher.qwen_turbo_weights,
    )  # fmt: skip
    if fused_kernels and _host_allows("fused_blocks", "fused_kernels", notes):
        add_fused_blocks(patcher)
    if attention != "auto" and _host_allows("attention_override", f"{attention} attention", notes):
        set_attention(patcher, attention)
    if compile == "regional" and _host_allows("regional_compile", "regional compile", notes):
        compile_blocks(patcher)
    patcher.qwen_turbo_notes = notes
    return patcher
