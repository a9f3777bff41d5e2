"""fp8 linear with per-row activation scales: the `fp8_e4m3fn_fast` GEMM of the Optimized Loader.

Weights are float8_e4m3fn with one float32 scale per tensor (`scale_weight`, as in ComfyUI's
scaled-fp8 checkpoints: w = w_fp8 * scale_weight). Each activation row gets its own scale,
amax(row) / 448, so one large token cannot crush the resolution of the others (a per-tensor
activation scale, what ComfyUI's fp8_linear uses, does). Then

    out = torch._scaled_mm(x_fp8, w_fp8.t(), scale_a=(M, 1), scale_b=(1, N), bias) in x's dtype

`quantize_rows` computes the scales and the fp8 rows in one pass (Triton: one program per row
holding it in registers), optionally applying GELU-tanh first, so the MLP's second linear
takes the first one's raw output and the activation costs no extra pass.

`fp8_linear_unscaled` leaves the row scales and the bias to the output's consumer: the GEMM
then runs with one scale per operand (cuBLASLt's tensorwise kernels, 12-28% faster than its
row-scaled ones at the DiT's shapes on an H100; benchmarks/RESULTS.md 3.10) and returns an
`Unscaled`, which the next kernel (`quantize_rows`, `gated_residual`, `qk_norm_rope_into`)
finishes as it reads it.

`fp8_gemv` is the path for a few rows (the timestep modulation: one row per sample): the
activations stay in bf16 and the fp8 weight is read once, widened in registers, so it costs
one pass over the fp8 weight instead of a bf16 copy of it.
"""

import functools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ._triton import (
    HAS_TRITON,
    custom_op,
    fast_launch,
    grad_reason,
    log_fallback_once,
    tl,
    triton,
    unsupported,
)

OP = "fp8_linear"
OP_QUANT = "quantize_rows"
OP_GEMV = "fp8_gemv"
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# Smallest scale: an all-zero row quantizes to zeros instead of 0/0.
MIN_SCALE = 1e-12
# Widest row one program holds in registers (Qwen-Image's MLP: 12288).
MAX_K = 16384
# fp8_gemv's tile: output columns per program, and the K step.
GEMV_BLOCK_N, GEMV_BLOCK_K = 32, 256
IN_DTYPES = (torch.bfloat16, torch.float16)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class Unscaled(NamedTuple):
    """A linear's output before its per-row scales and bias: raw * row_scale + bias, in
    float32 (`value()` rounds it to raw's dtype)."""

    raw: torch.Tensor  # (..., N) in the activations' dtype
    row_scale: torch.Tensor  # (M, 1) float32, one per row of raw (M = raw.numel() // N)
    bias: torch.Tensor | None  # (N,) or None

    def value(self) -> torch.Tensor:
        y = self.raw.float() * self.row_scale.reshape(*self.raw.shape[:-1], 1)
        return (y if self.bias is None else y + self.bias.float()).to(self.raw.dtype)


def finished(y: "torch.Tensor | Unscaled") -> torch.Tensor:
    """y as a tensor: an `Unscaled`'s value, any tensor as it is."""
    return y.value() if isinstance(y, Unscaled) else y


def quantize_rows_reference(
    x: torch.Tensor,
    gelu: bool = False,
    row_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: (M, K) float. Returns (x_fp8 (M, K) float8_e4m3fn, scale (M, 1) float32) with
    x ~= x_fp8 * scale; with `gelu`, of gelu_tanh(x) (in float32, from x as given). With
    `row_scale` ((M, 1) float32) and `bias` ((K,)), of x * row_scale + bias (an `Unscaled`'s
    value, not rounded), then the GELU."""
    x = x.float()
    if row_scale is not None:
        x = x * row_scale
    if bias is not None:
        x = x + bias.float()
    if gelu:
        x = gelu_tanh(x)
    scale = (x.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(MIN_SCALE)
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_weight: torch.Tensor,
    bias: torch.Tensor | None,
    gelu_input: bool = False,
) -> torch.Tensor:
    """ComfyUI's scaled-fp8 compute: F.linear(x, weight.to(x.dtype) * scale_weight, bias), in
    x's dtype (bf16 activations, fp8 only as storage); with `gelu_input`, of gelu_tanh(x).

    x: (..., K); weight: (N, K) float8_e4m3fn (or any float); scale_weight: float32, one
    value, or one per output row as (1, N) or (N, 1); bias: (N,) or None. This is also the
    path for GPUs without fp8 GEMMs.
    """
    if gelu_input:
        x = gelu_tanh(x)
    w = weight.to(x.dtype) * scale_weight.to(device=x.device, dtype=x.dtype).reshape(-1, 1)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


if HAS_TRITON:

    @fast_launch
    @triton.jit
    def _quantize_rows_kernel(
        x_ptr, rs_ptr, b_ptr, q_ptr, s_ptr, K, sx_m, sq_m, GELU: tl.constexpr,
        ROW_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """One program: one row of x (unit stride along K) to fp8 plus its float32 scale;
        with ROW_SCALE and HAS_BIAS, of x * rs[row] + b (an `Unscaled`) first."""
        row = tl.program_id(0).to(tl.int64)  # int64: M * K passes 2^31 at 2512^2 (3e8 x 12288)
        offs = tl.arange(0, BLOCK_K)
        mask = offs < K
        x = tl.load(x_ptr + row * sx_m + offs, mask=mask, other=0.0).to(tl.float32)
        if ROW_SCALE:
            x = x * tl.load(rs_ptr + row)
        if HAS_BIAS:
            x += tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if GELU:
            # gelu_tanh(x) = 0.5 x (1 + tanh(u)) = x * sigmoid(2u), u = sqrt(2/pi)(x + 0.044715 x^3)
            u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
            x = x * tl.sigmoid(2.0 * u)
        scale = tl.maximum(tl.max(tl.abs(x), axis=0) / 448.0, 1e-12)
        q = tl.clamp(x / scale, -448.0, 448.0)
        tl.store(q_ptr + row * sq_m + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + row, scale)

    @custom_op("qwen_turbo::quantize_rows")
    def _quantize_rows_op(
        x: torch.Tensor, gelu: bool, row_scale: torch.Tensor | None, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        m, k = x.shape
        q = torch.empty((m, k), dtype=FP8, device=x.device)
        s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
        if m:
            block_k = triton.next_power_of_2(k)
            _quantize_rows_kernel[(m,)](
                x, s if row_scale is None else row_scale, x if bias is None else bias, q, s, k,
                x.stride(0), q.stride(0), GELU=gelu, ROW_SCALE=row_scale is not None,
                HAS_BIAS=bias is not None, BLOCK_K=block_k,
                num_warps=16 if block_k >= 8192 else 8,
            )  # fmt: skip
        return q, s

    @_quantize_rows_op.register_fake
    def _(x, gelu, row_scale, bias):
        m, k = x.shape
        return x.new_empty((m, k), dtype=FP8), x.new_empty((m, 1), dtype=torch.float32)

    @fast_launch
    @triton.jit
    def _gemv_kernel(
        x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, K, sx_m, sw_n, so_m,
        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, K_STEPS: tl.constexpr, INTERPRET: tl.constexpr,
    ):  # fmt: skip
        """out[m, n] = scale[n] * sum_k x[m, k] w[n, k] + bias[n]: fp8 w widened to x's dtype
        (exact), products exact in the tensor cores, float32 sums. One program: BLOCK_N
        outputs of BLOCK_M rows."""
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for i in range(K_STEPS):  # a constexpr count: the interpreter cannot loop to a K
            offs_k = i * BLOCK_K + tl.arange(0, BLOCK_K)
            x = tl.load(
                x_ptr + offs_m[:, None] * sx_m + offs_k[None, :],
                mask=(offs_m[:, None] < M) & (offs_k[None, :] < K),
                other=0.0,
            )
            w = tl.load(
                w_ptr + offs_n[None, :] * sw_n + offs_k[:, None],
                mask=(offs_n[None, :] < N) & (offs_k[:, None] < K),
                other=0.0,
            )
            if INTERPRET:  # its dot mishandles bfloat16; float32 is exact here too
                acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc)
            else:
                acc = tl.dot(x, w.to(x.dtype), acc)
        out = acc * tl.load(s_ptr + offs_n, mask=offs_n < N, other=0.0)[None, :]
        if HAS_BIAS:
            out += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        tl.store(out_ptr + offs_m[:, None] * so_m + offs_n[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=mask)  # fmt: skip

    @custom_op("qwen_turbo::fp8_gemv")
    def _fp8_gemv_op(
        x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        m, k = x.shape
        n = weight.shape[0]
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
        if m:
            grid = (triton.cdiv(n, GEMV_BLOCK_N), triton.cdiv(m, 16))
            _gemv_kernel[grid](
                x, weight, scale, bias if bias is not None else scale, out, m, n, k,
                x.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
                BLOCK_M=16, BLOCK_N=GEMV_BLOCK_N, BLOCK_K=GEMV_BLOCK_K,
                K_STEPS=triton.cdiv(k, GEMV_BLOCK_K), INTERPRET=not x.is_cuda, num_warps=4,
                num_stages=4,
            )  # fmt: skip
        return out

    @_fp8_gemv_op.register_fake
    def _(x, weight, scale, bias):
        return x.new_empty((x.shape[0], weight.shape[0]))


def quantize_rows(
    x: "torch.Tensor | Unscaled", gelu: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row fp8 quantization of x: (M, K) bfloat16/float16/float32 with unit stride along K,
    or an `Unscaled` of M rows (finished in float32 as it is read, not rounded first).

    Returns (x_fp8 (M, K) float8_e4m3fn, scale (M, 1) float32), x ~= x_fp8 * scale, the scale
    amax(row) / 448 (at least 1e-12). With `gelu`, of gelu_tanh(x) computed in float32.
    Uses the eager reference without Triton, off CUDA, for K > MAX_K or under autograd.
    """
    row_scale = bias = None
    if isinstance(x, Unscaled):
        x, row_scale, bias = x.raw.reshape(-1, x.raw.shape[-1]), x.row_scale, x.bias
    reason = unsupported(x)
    if reason is None and x.dtype not in (*IN_DTYPES, torch.float32):
        reason = f"dtype {x.dtype} is not supported"
    if reason is None and x.ndim != 2:
        reason = f"x has shape {tuple(x.shape)}, not (M, K)"
    if reason is None and x.shape[1] > MAX_K:
        reason = f"K = {x.shape[1]} is wider than the kernel's row ({MAX_K})"
    if reason is None and bias is not None and (bias.device != x.device or bias.stride(0) != 1):
        reason = "the bias is not a unit-stride vector on x's device"
    reason = reason or grad_reason(x, bias)
    if reason is not None:
        log_fallback_once(OP_QUANT, reason)
        return quantize_rows_reference(x, gelu, row_scale, bias)
    return _quantize_rows_op(x if x.stride(1) == 1 else x.contiguous(), gelu, row_scale, bias)


@functools.cache  # a device's answer does not change; asked at every fp8 GEMM
def fp8_gemm_reason(device: torch.device) -> str | None:
    """Why this device cannot run fp8 GEMMs (torch._scaled_mm with row-wise scales), or None."""
    if device.type != "cuda":
        return f"fp8 GEMMs need a CUDA GPU, not {device.type}"
    if not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no torch._scaled_mm"
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        return f"compute capability {cap[0]}.{cap[1]} has no fp8 tensor cores (needs 8.9+)"
    return None


def fp8_linear_reason(x, weight, scale_weight, bias) -> str | None:
    """Why `fp8_linear` would not run an fp8 GEMM for these arguments, or None."""
    reason = fp8_gemm_reason(x.device)
    if reason is not None:
        return reason
    if x.dtype not in IN_DTYPES:
        return f"activation dtype {x.dtype} is not bfloat16 or float16"
    if weight.dtype != FP8:
        return f"weight dtype {weight.dtype} is not float8_e4m3fn"
    n, k = weight.shape
    if k % 16 or n % 16:
        return f"weight shape ({n}, {k}) is not a multiple of 16"
    if scale_weight.numel() != 1 and scale_weight.shape != (1, n):
        return "scale_weight is not one value per tensor or a (1, N) row"
    if scale_weight.shape == (1, n) and not (
        scale_weight.dtype == torch.float32
        and scale_weight.device == x.device
        and scale_weight.is_contiguous()
    ):
        return "the (1, N) scale_weight row is not contiguous float32 on x's device"
    return grad_reason(x, weight, bias)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    gelu_input: bool = False,
    x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """F.linear(x, weight * scale_weight, bias) as an fp8 GEMM with per-row activation scales.

    x: (..., K) bfloat16 or float16 (the output dtype); weight: (N, K) float8_e4m3fn on x's
    device, N and K multiples of 16; scale_weight: one float32 value, or the same as a
    contiguous float32 (1, N) row on x's device (`scale_b` of `torch._scaled_mm`: callers that
    run often keep it, saving a copy per call); bias: (N,) or None.
    With `gelu_input`, computes the linear of gelu_tanh(x) (the activation fused into the
    quantization). `x_fp8`, if given, is `quantize_rows` of x flattened to (M, K) (with the
    same `gelu_input`), so that linears of one input quantize it once. Off an fp8-capable GPU
    (or for other dtypes/shapes, or under autograd) it uses `fp8_linear_reference`: bf16
    compute on the dequantized weight.
    """
    reason = fp8_linear_reason(x, weight, scale_weight, bias)
    if reason is not None:
        log_fallback_once(OP, reason)
        return fp8_linear_reference(x, weight, scale_weight, bias, gelu_input)
    n, k = weight.shape
    lead = x.shape[:-1]
    if x_fp8 is None:
        x_fp8 = quantize_rows(x.reshape(math.prod(lead), k), gelu_input)
    xq, scale_a = x_fp8
    scale_b = scale_weight
    if scale_b.shape != (1, n):
        scale_b = scale_b.to(device=x.device, dtype=torch.float32).reshape(1, 1).expand(1, n)
    out = torch._scaled_mm(
        xq, weight.t(), scale_a=scale_a, scale_b=scale_b.contiguous(),
        bias=None if bias is None else bias.to(x.dtype), out_dtype=x.dtype,
    )  # fmt: skip
    return out.reshape(*lead, n)


_ones: dict[torch.device, torch.Tensor] = {}  # scale_a of the tensorwise GEMM, per device


def fp8_linear_unscaled(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    gelu_input: bool = False,
    x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> Unscaled | None:
    """`fp8_linear`'s output as an `Unscaled`: the GEMM of the fp8 rows and the weight times
    its one scale (tensorwise), the row scales and the bias left to the consumer. Arguments as
    `fp8_linear`'s, with one scale_weight value; None where `fp8_linear` would not run an fp8
    GEMM or scale_weight has a value per column (the caller runs `fp8_linear`)."""
    if scale_weight.numel() != 1 or fp8_linear_reason(x, weight, scale_weight, bias) is not None:
        return None
    if (one := _ones.get(x.device)) is None:
        if torch.cuda.is_current_stream_capturing():  # made in a graph, it would hold no value
            return None
        one = _ones[x.device] = torch.ones((), dtype=torch.float32, device=x.device)
    n, k = weight.shape
    lead = x.shape[:-1]
    if x_fp8 is None:
        x_fp8 = quantize_rows(x.reshape(math.prod(lead), k), gelu_input)
    xq, row_scale = x_fp8
    scale_b = scale_weight.to(device=x.device, dtype=torch.float32).reshape(())
    raw = torch._scaled_mm(xq, weight.t(), scale_a=one, scale_b=scale_b, out_dtype=x.dtype)
    return Unscaled(raw.reshape(*lead, n), row_scale, None if bias is None else bias.to(x.dtype))


def _gemv_device_reason(device: torch.device) -> str | None:
    """Why fp8_gemv's kernel cannot run on this device, or None."""
    if device.type == "cuda" and (cap := torch.cuda.get_device_capability(device)) < (8, 9):
        return f"compute capability {cap[0]}.{cap[1]}: Triton has no float8_e4m3fn below 8.9"
    return None


def _gemv_why_not(x, weight, scale_weight, bias) -> str | None:
    reason = unsupported(x) or _gemv_device_reason(x.device)
    if reason is not None:
        return reason
    if x.dtype not in IN_DTYPES:
        return f"activation dtype {x.dtype} is not bfloat16 or float16"
    if weight.dtype != FP8 or weight.ndim != 2 or weight.stride(1) != 1:
        return f"weight {weight.dtype} {tuple(weight.shape)} is not row-major float8_e4m3fn"
    n = weight.shape[0]
    if scale_weight.numel() != 1 and scale_weight.shape != (1, n):
        return "scale_weight is not one value per tensor or a (1, N) row"
    if bias is not None and bias.shape != (n,):
        return f"bias shape {tuple(bias.shape)} is not ({n},)"
    return grad_reason(x, weight, bias)


def fp8_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """F.linear(x, weight * scale_weight, bias) for a few rows of x, without an fp8 copy of x
    or a bf16 copy of the weight: the weight is read once, in fp8, and widened in registers.

    x: (..., K) bfloat16 or float16 (the output dtype); weight: (N, K) float8_e4m3fn, unit
    stride along K, on x's device; scale_weight: one float32 value or a (1, N) row; bias:
    (N,) or None. Exact products and float32 sums, so it is closer to float32 math than the
    reference (`fp8_linear_reference`: the weight rounded to bf16 first), which it uses for
    other inputs, without Triton, or under autograd. Any row count works; it is meant for a
    few (the loader sends it inputs of fewer than 16 rows).
    """
    reason = _gemv_why_not(x, weight, scale_weight, bias)
    if reason is not None:
        log_fallback_once(OP_GEMV, reason)
        return fp8_linear_reference(x, weight, scale_weight, bias)
    n, k = weight.shape
    lead = x.shape[:-1]
    scale = scale_weight.to(device=x.device, dtype=torch.float32).reshape(-1).expand(n)
    x2 = x.reshape(math.prod(lead), k)
    out = _fp8_gemv_op(x2 if x2.stride(1) == 1 else x2.contiguous(), weight, scale.contiguous(),
                       None if bias is None else bias.to(x.dtype))  # fmt: skip
    return out.reshape(*lead, n)
