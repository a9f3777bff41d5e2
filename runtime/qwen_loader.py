"""Loading the Qwen-Image DiT into ComfyUI: a plain MODEL (ModelPatcher), built from the config
read off the weights, with fp8 ops, attention and fused blocks attached through ModelPatcher.

This module imports ComfyUI; the math it uses is in `qwen_dit`, `attention` and `kernels/`.
"""

import collections
import contextlib
import inspect
import logging
from pathlib import Path

import comfy.cli_args
import comfy.float
import comfy.ldm.qwen_image.model as qwen_model
import comfy.lora
import comfy.model_management as mm
import comfy.model_patcher
import comfy.ops
import comfy.supported_models
import comfy.utils
import folder_paths
import torch
import torch.nn.functional as F
from safetensors import SafetensorError

from ..kernels import warmup
from ..kernels.fp8_linear import (
    FP8,
    FP8_MAX,
    fp8_gemm_reason,
    fp8_gemv,
    fp8_linear,
    gelu_tanh,
    quantize_rows,
)
from . import host, log_once, memory, qwen_dit, weight_streaming
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
# ComfyUI's estimate of what a Qwen-Image call needs beside the weights (BaseModel.
# memory_required, memory_usage_factor 1.8) is about twice what the bundled workflows' settings
# take (fp8_e4m3fn_fast, fused blocks, fp8_cudnn): per 2512² picture 1.65 GiB resident and
# 1.8-2.1 GiB with the DiT streamed on a 12 GiB card, batches 1-4 (benchmarks/RESULTS.md,
# "Batches"), against its 3.46 (2.50 printed with 1.3, scaled to 1.8). ComfyUI keeps that much
# free and offloads weights for it;
# 1.3 (2.5 GiB) keeps more of the DiT on the GPU on small cards. fp8 storage with bf16 GEMMs and
# fp8_cudnn's sdpa fallback (GPUs before Hopper) hold the same token-sized tensors, plus one
# layer's weight in bf16 at a time. Other settings keep ComfyUI's estimate.
ACTIVATIONS_FACTOR = 1.3


@contextlib.contextmanager
def host_estimate(model):
    """ComfyUI's own activation estimate for `model` (a ModelPatcher) inside: for a run again
    after running out of memory with the measured one."""
    base = model.model
    measured = base.memory_usage_factor
    base.memory_usage_factor = base.model_config.memory_usage_factor
    try:
        yield
    finally:
        base.memory_usage_factor = measured


# The variants by their reference method (qwen_dit.read_config), for messages.
VARIANTS = {"index_timestep_zero": "Qwen-Image-Edit-2511", "negative_index": "Qwen-Image-Layered"}


class HostLacks(ValueError):
    """The weights need a model setting this ComfyUI's Qwen-Image model does not take."""


class Unreadable(ValueError):
    """A checkpoint file that cannot be read: truncated, corrupt, or not safetensors."""


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
    try:
        if path.is_dir():
            sd, config = qwen_dit.load_diffusers_folder(qwen_dit.diffusers_folder(path))
            rope_axes = config.get("axes_dims_rope")
        else:
            sd, metadata = comfy.utils.load_torch_file(str(path), return_metadata=True)
    except (FileNotFoundError, PermissionError):
        raise
    except (SafetensorError, OSError, ValueError, KeyError) as e:  # KeyError: index sans weight_map
        what = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise Unreadable(
            f"cannot read {path} ({what}): truncated, corrupt or not safetensors. Download it "
            "again and check its size."
        ) from e
    sd = qwen_dit.from_mixed(qwen_dit.strip_prefix(sd), metadata)
    return sd, qwen_dit.read_config(sd, rope_axes)


def _gemv_sized(x: torch.Tensor) -> bool:
    """Whether x has fewer than GEMV_ROWS rows."""
    return x.numel() < GEMV_ROWS * x.shape[-1]


class Fp8Linear(comfy.ops.manual_cast.Linear):
    """A Linear holding an fp8 weight with a float32 per-tensor `scale_weight` (ComfyUI v0.3's
    scaled-fp8 layout), the same on every host: cast to the compute dtype per call, LoRAs
    patched through convert_weight/set_weight (dequantize, add, requantize at the same scale).

    Tensors load as they are in the state dict, so layers kept in bf16 stay bf16. Newer
    hosts' own quantized tensors are not used: under inference_mode (every node runs in it)
    the host's ModelPatcher fails to move or restore them ("Cannot set version_counter for
    inference tensor"), as a test shows.
    """

    # (weight, bias, LoRA patches or None) as stored, copied to the compute device ahead of
    # the call by weight_streaming while this layer is offloaded; None otherwise.
    staged = None

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None):
        super().__init__(in_features, out_features, bias, device, dtype)
        self.scale_weight = torch.nn.Parameter(torch.ones((), device=device), requires_grad=False)

    def _load_from_state_dict(
        self, sd, prefix, local_metadata, strict, missing, unexpected, errors
    ):
        for name in ("weight", "bias", "scale_weight"):
            if (t := sd.pop(prefix + name, None)) is not None:
                setattr(self, name, torch.nn.Parameter(t, requires_grad=False))
            elif name != "scale_weight" and getattr(self, name) is not None:
                missing.append(prefix + name)

    def _scale(self, device) -> torch.Tensor:
        """scale_weight in float32 on `device`, copied once per scale tensor and device
        rather than from the host on every call."""
        key = (self.scale_weight.data_ptr(), device)
        if getattr(self, "_scale_key", None) != key:
            # detached: `to` may return the Parameter itself, which would register here
            self._scale_value = self.scale_weight.detach().to(device=device, dtype=torch.float32)
            self._scale_key = key
        return self._scale_value

    def _patched(self, x, dtype=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Weight (in `dtype`, x's by default) and bias (x's dtype) on x's device with
        ComfyUI's lowvram LoRA patches (`weight_function`, set on layers left on the host)
        applied to the dequantized weight in float32, as a loaded model's are, on every host
        (v0.33's cast_bias_weight runs them on the fp8 or the unscaled weight: a failed or a
        wrong LoRA)."""
        # fp8 bytes cross to the GPU, then widen there (a cast in the copy runs on the CPU)
        weight, bias, staged = self.staged or (self.weight, self.bias, None)
        weight = self.convert_weight(weight.to(x.device).float())
        for n, patch in enumerate(self.weight_function):
            key, patches = getattr(patch, "key", None), getattr(patch, "patches", None)
            if key is None or patches is None:  # not a LoRA patch: it takes the weight itself
                weight = patch(weight)
            else:
                patches = staged[n] if staged else patches[key]
                weight = comfy.lora.calculate_weight(patches, weight, key)
        bias = None if bias is None else bias.to(x.device, x.dtype)
        for patch in self.bias_function if bias is not None else ():
            bias = patch(bias)
        return weight.to(dtype or x.dtype), bias

    def _weights(self, x, dtype, bias_dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Weight (unscaled) and bias on x's device: the staged copies, else ComfyUI's cast
        (which also runs any patch functions)."""
        if self.staged is None or self.weight_function or self.bias_function:
            return comfy.ops.cast_bias_weight(self, x, dtype=dtype, bias_dtype=bias_dtype)
        weight, bias, _ = self.staged
        return weight.to(dtype), None if bias is None else bias.to(bias_dtype)

    def forward_comfy_cast_weights(self, input):
        if self.weight.dtype != FP8:
            if self.staged is None:
                return super().forward_comfy_cast_weights(input)
            return F.linear(input, *self._weights(input, input.dtype, input.dtype))
        if self.weight_function:
            return F.linear(input, *self._patched(input))
        weight, bias = self._weights(input, input.dtype, input.dtype)
        scale = self._scale(weight.device).to(weight.dtype)
        if weight.numel() < input.numel():
            return F.linear(input, weight * scale, bias)
        return F.linear(input * scale, weight, bias)

    def convert_weight(self, weight, inplace=False, **kwargs):
        if self.weight.dtype != FP8:
            return weight
        scale = self._scale(weight.device).to(weight.dtype)
        return weight.mul_(scale) if inplace else weight * scale

    def set_weight(self, weight, inplace_update=False, seed=None, return_weight=False, **kwargs):
        if self.weight.dtype == FP8:
            scale = self.scale_weight.to(device=weight.device, dtype=weight.dtype)
            weight = comfy.float.stochastic_rounding(weight / scale, FP8, seed=seed)
        else:
            weight = weight.to(self.weight.dtype)
        if return_weight:
            return weight
        if inplace_update:
            self.weight.data.copy_(weight)
        else:
            self.weight = torch.nn.Parameter(weight, requires_grad=False)


class Fp8FastLinear(Fp8Linear):
    """Fp8Linear with fp8 GEMMs: per-row activation scales, `fp8_gemv` for the few-row
    modulation inputs, the GELU fused into the activation quantization."""

    def _scale_row(self, device) -> torch.Tensor:
        """scale_weight as the (1, N) float32 row _scaled_mm takes, made once per scale
        tensor and device instead of on every call."""
        scale = self._scale(device)
        if getattr(self, "_scale_row_of", None) is not scale:
            self._scale_row_value = scale.reshape(1, 1).expand(1, self.out_features).clone()
            self._scale_row_of = scale
        return self._scale_row_value

    def _fp8(self, x, gelu_input=False, x_fp8=None):
        scale = self._scale_row(x.device)
        if self.weight_function:  # a LoRA on a layer left on the host: patched, requantized
            weight, bias = self._patched(x, torch.float32)
            weight = weight.div_(scale[:, :1]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
        else:
            weight, bias = self._weights(x, FP8, x.dtype)
        if _gemv_sized(x):  # the modulation linears
            return fp8_gemv(gelu_tanh(x) if gelu_input else x, weight, scale, bias)
        return fp8_linear(x, weight, scale, bias, gelu_input, x_fp8)

    def linears_of_one_input(self, x, linears):
        """[linear(x) for linear in linears] (this one among them), x quantized to fp8 once
        for all of them (q, k and v of one stream)."""
        if _gemv_sized(x) or not all(
            isinstance(linear, Fp8FastLinear)
            and linear.weight.dtype == FP8
            and not linear.weight_function
            for linear in linears
        ):
            return [linear(x) for linear in linears]
        x_fp8 = quantize_rows(x.reshape(-1, x.shape[-1]))
        return [linear._fp8(x, x_fp8=x_fp8) for linear in linears]

    def forward_comfy_cast_weights(self, input):
        if self.weight.dtype != FP8:  # a layer kept in bf16 (qwen_dit.in_blocks)
            return super().forward_comfy_cast_weights(input)
        return self._fp8(input)

    def linear_of_gelu(self, x):
        """self(gelu_tanh(x)), the GELU fused into the activation quantization."""
        if self.weight.dtype != FP8:
            return self(gelu_tanh(x))
        return self._fp8(x, gelu_input=True)


def fp8_ops(fast: bool):
    """ComfyUI's manual-cast ops with the pack's fp8 Linear."""

    class ops(comfy.ops.manual_cast):
        Linear = Fp8FastLinear if fast else Fp8Linear

    return ops


def fp8_parts(linear) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(fp8 weight, float32 scale) of a Linear holding an fp8 weight, else None."""
    if linear.weight.dtype != FP8:
        return None
    return linear.weight, linear.scale_weight


def _storage(weight_dtype: str, sd, load_device) -> str:
    """The weight mode that will run: 'auto' keeps fp8 files in fp8; fast needs fp8 GEMMs."""
    if weight_dtype == "auto" and qwen_dit.has_fp8_weights(sd):
        weight_dtype = "fp8_e4m3fn"
    if weight_dtype == "fp8_e4m3fn_fast" and (reason := fp8_gemm_reason(load_device)):
        log.warning("fp8_e4m3fn_fast: %s; using fp8 storage with bf16 compute", reason)
        weight_dtype = "fp8_e4m3fn"
    return weight_dtype


def check_host(config: qwen_dit.DiTConfig) -> None:
    """Raise HostLacks where this host's model cannot take the variant's settings: an older
    ComfyUI runs Edit-2511's weights with Edit-2509's reference method, silently wrong."""
    takes = inspect.signature(qwen_model.QwenImageTransformer2DModel.__init__).parameters
    for key, value in config.variant().items():
        if key not in takes:
            what = VARIANTS.get(config.default_ref_method, "this checkpoint")
            raise HostLacks(
                f"{what} needs {key}={value!r}, which this ComfyUI's Qwen-Image model does not "
                "take (its reference images would get the wrong positions or modulation); "
                "update ComfyUI"
            )


# what ComfyUI's ModelPatcher keeps to restore a patched weight (its `backup` entries)
Backup = collections.namedtuple("Dimension", ["weight", "inplace_update"])


class HostCopies(dict):
    """Key: (a weight's host tensor in a file mapping, the data pointer of its GPU copy), for
    the weights on the GPU that have one (`model.qwen_turbo_hosts`). A deep copy of the model
    (ComfyUI's multi-GPU clones) starts with none: its weights are its own."""

    def __deepcopy__(self, memo):
        return type(self)()


class Patcher(comfy.model_patcher.ModelPatcher):
    """ComfyUI's ModelPatcher for the Optimized Loader's model.

    A load to the GPU copies the weights through a page-locked buffer (weight_streaming.
    Uploader): ComfyUI's `.to()` of a weight in a file mapping, on both hosts, is a pageable
    copy at a third of the speed. The rest of the load is ComfyUI's. A weight so copied out of
    a file mapping, without patches, keeps its place in the mapping (`HostCopies`): unloading
    it takes no copy back from the GPU, which for the whole DiT (ComfyUI unloads it whenever
    a LoRA is switched on) is 19 GiB.

    With v0.33's dynamic VRAM the fp8 layers hold views of comfy-aimdo's file mapping
    (`model.qwen_turbo_mapped`: their data pointers), which the driver cannot page-lock:
    ComfyUI's pinning of an offloaded weight would fail ("Pin error.") and synchronize. A
    weight ComfyUI pins is copied out of the mapping first, so only offloaded weights are
    copied: copying all 19 GiB at load cost the loader 5-6 s on an H100.
    """

    def load(self, device_to=None, *args, **kwargs):
        self.qwen_turbo_uploader = None
        if (
            device_to is not None
            and torch.device(device_to).type == "cuda"
            and not getattr(comfy.cli_args.args, "disable_pinned_memory", False)
        ):
            self.qwen_turbo_uploader = weight_streaming.Uploader.for_tensors(
                self.model.parameters()
            )
        if self.qwen_turbo_uploader is not None:
            self.qwen_turbo_backed = weight_streaming.file_backed(self.model.parameters())
        try:
            return super().load(device_to, *args, **kwargs)
        finally:
            if self.qwen_turbo_uploader is not None:
                self.qwen_turbo_uploader.close()
            self.qwen_turbo_uploader = None

    def patch_weight_to_device(self, key, device_to=None, *args, **kwargs):
        """ComfyUI's, from a copy the uploader made where `load` has one: the weight's own
        data where the key has no patches (what the module's `.to()` that follows would
        have done), else the patches' input, the host weight kept as the backup."""
        uploader = getattr(self, "qwen_turbo_uploader", None)
        plain = not (args or any(kwargs.values()) or self.weight_inplace_update)
        weight = comfy.utils.get_attr(self.model, key) if uploader and device_to and plain else None
        if weight is not None and uploader.takes(weight):
            if key not in self.patches:
                host = weight.data
                weight.data = uploader.to(weight, device_to)
                if host.data_ptr() in self.qwen_turbo_backed:
                    self.model.qwen_turbo_hosts[key] = (host, weight.data_ptr())
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
        hosts = getattr(self.model, "qwen_turbo_hosts", None)
        to_host = device_to is not None and torch.device(device_to).type == "cpu"
        if hosts and unpatch_weights and to_host:
            for key, (host, ptr) in hosts.items():
                weight = comfy.utils.get_attr(self.model, key)
                if weight.data_ptr() == ptr and key not in self.backup:
                    weight.data = host
            hosts.clear()
        return super().unpatch_model(device_to, unpatch_weights)

    def partially_unload(self, device_to, memory_to_free=0, *args, **kwargs):
        """ComfyUI's, after this model's cached CUDA graphs are dropped: ComfyUI asks a model
        for room this way, the graphs point at weights about to move, and ComfyUI cannot see
        them. What their release adds to ComfyUI's free count (it already counts their
        pools' unused memory) is taken off what the weights must free."""
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

    def pin_weight_to_device(self, key):
        mapped = getattr(self.model, "qwen_turbo_mapped", None)
        weight = comfy.utils.get_attr(self.model, key) if mapped else None
        if weight is not None and weight.data_ptr() in mapped:
            mapped.discard(weight.data_ptr())
            comfy.utils.set_attr_param(self.model, key, weight.detach().clone())
        super().pin_weight_to_device(key)


def _progress(n: int):
    """A step callback for the loader's pass over n tensors on the CPU (a 38 GiB bf16 file to
    fp8 takes a while): ComfyUI's progress bar, updated each percent, and its interrupt."""
    bar, done, every = comfy.utils.ProgressBar(n), 0, max(1, -(-n // 100))  # ceil(n / 100)

    def step():
        nonlocal done
        done += 1
        if done % every == 0 or done == n:
            mm.throw_exception_if_processing_interrupted()
            bar.update_absolute(done, n)

    return step


def build(sd, config: qwen_dit.DiTConfig, weight_dtype: str = "auto"):
    """A ModelPatcher holding ComfyUI's QwenImage model of `config` with the weights of `sd`.
    Raises HostLacks where this host cannot run the variant."""
    check_host(config)
    load_device = mm.get_torch_device()
    offload_device = mm.unet_offload_device()
    model_config = comfy.supported_models.QwenImage(config.unet_config())
    mode = _storage(weight_dtype, sd, load_device)
    unet_dtype = torch.bfloat16
    if mode.startswith("fp8"):
        # fp8 Linear weights with scales; the rest (biases, norm gains, the layers outside
        # the blocks) in bf16.
        sd = qwen_dit.to_scaled_fp8(sd, step=_progress(len(sd)))
        model_config.custom_operations = fp8_ops(fast=mode == "fp8_e4m3fn_fast")
    else:
        if qwen_dit.has_fp8_weights(sd):
            sd = qwen_dit.dequantize(sd, torch.bfloat16, _progress(len(sd)))
        if mode == "auto":  # ComfyUI's own choice for the device (float32 on CPU)
            params = qwen_dit.count_params(sd)
            unet_dtype = mm.unet_dtype(model_params=params, supported_dtypes=SUPPORTED)
    manual_cast = mm.unet_manual_cast(unet_dtype, load_device, SUPPORTED)
    model_config.set_inference_dtype(unet_dtype, manual_cast)
    model = model_config.get_model(sd, "")
    model = model.to(offload_device)
    # with dynamic VRAM the state dict's tensors are views of comfy-aimdo's file mapping
    mapped = getattr(getattr(comfy, "memory_management", None), "aimdo_enabled", False)
    views = {t.data_ptr() for t in sd.values() if t.device.type == "cpu"} - {0} if mapped else set()
    model.load_model_weights(sd, "")
    if mapped:
        model.qwen_turbo_mapped = {p.data_ptr() for p in model.parameters()} & views
        log_once(log, logging.INFO, "Optimized Loader: ComfyUI's dynamic VRAM is on; this "
                 "model loads through ComfyUI's standard partial loading, whose offloaded "
                 "weights the pack streams (its fp8 layers are not comfy-aimdo's)")  # fmt: skip
    model.qwen_turbo_hosts = HostCopies()
    patcher = Patcher(model, load_device, offload_device)
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


def stream_offloaded_weights(patcher) -> weight_streaming.BlockStreamer:
    """Object patches: each block's forward (fused or not) copies the next block's offloaded
    fp8 weights ahead (weight_streaming), where ComfyUI's partial load leaves some on the
    host."""
    blocks = patcher.model.diffusion_model.transformer_blocks
    streamer = weight_streaming.BlockStreamer(blocks)
    for i, block in enumerate(blocks):
        key = f"diffusion_model.transformer_blocks.{i}.{FUSED_KEY}"
        inner = patcher.object_patches.get(key, block.forward)
        patcher.add_object_patch(key, streamer.forward(i, inner))
    return streamer


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
    warmup.start(mm.get_torch_device())  # compiles the kernels while the weights load
    sd, config = read_checkpoint(resolve(name))
    notes: list[str] = []
    if weight_dtype.startswith("fp8") and not _host_allows("fp8_weights", weight_dtype, notes):
        weight_dtype = "bf16"
    patcher = build(sd, config, weight_dtype)
    log.info(
        "Optimized Loader: %s, %d layers, width %d (%d heads of %d), text %d, weights %s%s",
        name, config.num_layers, config.width, config.num_attention_heads,
        config.attention_head_dim, config.joint_attention_dim, patcher.qwen_turbo_weights,
        f", {VARIANTS[config.default_ref_method]}" if config.variant() else "",
    )  # fmt: skip
    fused = fused_kernels and _host_allows("fused_blocks", "fused_kernels", notes)
    if fused:
        add_fused_blocks(patcher)
    if patcher.qwen_turbo_weights.startswith("fp8"):
        stream_offloaded_weights(patcher)
    if attention != "auto" and _host_allows("attention_override", f"{attention} attention", notes):
        set_attention(patcher, attention)
        if fused and attention == "fp8_cudnn" and patcher.qwen_turbo_weights.startswith("fp8"):
            patcher.model.memory_usage_factor = ACTIVATIONS_FACTOR  # as measured
    if compile == "regional" and _host_allows("regional_compile", "regional compile", notes):
        compile_blocks(patcher)
    patcher.qwen_turbo_notes = notes
    return patcher
