"""fp8 Linear ops for ComfyUI's model: fp8 weights with a float32 per-tensor scale (ComfyUI's
scaled-fp8 layout), cast per call or run as fp8 GEMMs, LoRAs patched at the same scale."""

import contextlib
import contextvars

import comfy.float
import comfy.lora
import comfy.ops
import torch
import torch.nn.functional as F

from ...kernels.fp8_linear import (
    FP8,
    FP8_MAX,
    Unscaled,
    finished,
    fp8_gemv,
    fp8_linear,
    fp8_linear_reason,
    fp8_linear_unscaled,
    gelu_tanh,
    quantize_rows,
)

# Inputs with fewer rows (the timestep modulation: one row per sample) skip activation
# quantization: `fp8_gemv`, bf16 activations on the fp8 weight. Activation quantization there
# cost accuracy (H200, 60 layers: rel. error 6.5e-2 against 5.2e-2 with bf16 compute).
GEMV_ROWS = 16


# Set while a call runs on the safe path (`safe_compute`): fp8 GEMMs compute in bf16.
_safe = contextvars.ContextVar("qwen_turbo_safe_compute", default=False)


@contextlib.contextmanager
def safe_compute(on: bool = True):
    """Fp8FastLinear computes as Fp8Linear inside: the weights cast to the activations' dtype,
    no activation quantization (what the NaN guard runs a step again with); with `on` False,
    as it would outside."""
    token = _safe.set(on)
    try:
        yield
    finally:
        _safe.reset(token)


# Cleared inside `without_kept_blocks`.
_kept = contextvars.ContextVar("qwen_turbo_kept_blocks", default=True)


@contextlib.contextmanager
def without_kept_blocks():
    """The blocks the fidelity probe keeps in bf16 compute run fp8 GEMMs inside, as the others
    (Multi-GPU: its workers' models keep none, and every rank must compute alike)."""
    token = _kept.set(False)
    try:
        yield
    finally:
        _kept.reset(token)


def in_safe_compute() -> bool:
    return _safe.get()


def compute_mode() -> tuple[bool, bool]:
    """What the contexts above set for the call that runs now: (safe path, kept blocks)."""
    return _safe.get(), _kept.get()


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
    # the call by the block streamer (`streaming`) while this layer is offloaded; None otherwise.
    staged = None

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None):
        # weight and bias on the meta device: the state dict's tensors take their place
        # (`_load_from_state_dict`), so nothing is allocated for them first (846 layers)
        super().__init__(in_features, out_features, bias, "meta", dtype)
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

    def device_tensors(self, device) -> tuple[torch.Tensor, ...] | None:
        """The tensors a call on `device` reads (weight, bias and scale: the staged copies
        where the layer is offloaded), or None where a call would copy or patch a weight
        itself (a CUDA graph of the call could not replay it)."""
        if self.weight_function or self.bias_function:
            return None
        if "prev_comfy_cast_weights" in self.__dict__:  # offloaded: the streamer's copies
            if self.staged is None or self.staged[2] is not None:
                return None
            weight, bias = self.staged[:2]
        else:
            weight, bias = self.weight, self.bias
        tensors = (weight, self._scale(device)) + (() if bias is None else (bias,))
        return tensors if all(t.device == device for t in tensors) else None

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
    modulation inputs, the GELU fused into the activation quantization. The fused block's
    linears (`unscaled`, `linear_of_gelu`, `linears_of_one_input`) can leave their outputs'
    row scales and bias to the next kernel (`fp8_linear.Unscaled`)."""

    bf16_compute = False  # set in the blocks the fidelity probe keeps on the safe path

    def _scale_row(self, device) -> torch.Tensor:
        """scale_weight as the (1, N) float32 row _scaled_mm takes, made once per scale
        tensor and device instead of on every call."""
        scale = self._scale(device)
        if getattr(self, "_scale_row_of", None) is not scale:
            self._scale_row_value = scale.reshape(1, 1).expand(1, self.out_features).clone()
            self._scale_row_of = scale
        return self._scale_row_value

    def _fp8(self, x, gelu_input=False, x_fp8=None, unscaled=False):
        scale = self._scale_row(x.device)
        if self.weight_function:  # a LoRA on a layer left on the host: patched, requantized
            weight, bias = self._patched(x, torch.float32)
            weight = weight.div_(scale[:, :1]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
        else:
            weight, bias = self._weights(x, FP8, x.dtype)
        if _gemv_sized(x):  # the modulation linears
            return fp8_gemv(gelu_tanh(x) if gelu_input else x, weight, scale, bias)
        if unscaled:
            out = fp8_linear_unscaled(x, weight, scale[:, :1], bias, gelu_input, x_fp8)
            if out is not None:
                return out
        return fp8_linear(x, weight, scale, bias, gelu_input, x_fp8)

    def linears_of_one_input(self, x, linears, unscaled=()):
        """[linear(x) for linear in linears] (this one among them), x quantized to fp8 once
        for all of them (q, k and v of one stream); the outputs at the positions in
        `unscaled` may be `Unscaled`."""
        if _gemv_sized(x) or not all(
            isinstance(linear, Fp8FastLinear) and linear._lossy() and not linear.weight_function
            for linear in linears
        ):
            return [linear(x) for linear in linears]
        x_fp8 = quantize_rows(x.reshape(-1, x.shape[-1]))
        return [linear._fp8(x, x_fp8=x_fp8, unscaled=i in unscaled)
                for i, linear in enumerate(linears)]  # fmt: skip

    def _lossy(self) -> bool:
        """Whether this call runs fp8 GEMMs: not in a layer kept in bf16 (convert.in_blocks),
        nor in a block the fidelity probe keeps on the safe path, nor on the safe path."""
        kept = self.bf16_compute and _kept.get()
        return self.weight.dtype == FP8 and not kept and not _safe.get()

    def forward_comfy_cast_weights(self, input):
        if not self._lossy():
            return super().forward_comfy_cast_weights(input)
        return self._fp8(input)

    def unscaled(self, x) -> "torch.Tensor | Unscaled":
        """self(x), as an `Unscaled` where it runs an fp8 GEMM that can leave the row scales
        and the bias to the next kernel (not past a forward hook someone put on the layer)."""
        hooked = self._forward_hooks or self._forward_pre_hooks
        return self._fp8(x, unscaled=True) if self._lossy() and not hooked else self(x)

    def linear_of_gelu(self, x, unscaled=False):
        """self(gelu_tanh(x)), the GELU fused into the activation quantization. x may be an
        `Unscaled` (finished as it is quantized); with `unscaled` the result may be one."""
        raw = x.raw if isinstance(x, Unscaled) else x
        scale = self._scale_row(raw.device)
        if (
            not self._lossy()
            or _gemv_sized(raw)
            or fp8_linear_reason(raw, self.weight, scale, None) is not None
        ):
            return self(gelu_tanh(finished(x)))
        if isinstance(x, Unscaled):
            x_fp8 = quantize_rows(x, gelu=True)
            return self._fp8(x.raw, gelu_input=True, x_fp8=x_fp8, unscaled=unscaled)
        return self._fp8(x, gelu_input=True, unscaled=unscaled)


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
