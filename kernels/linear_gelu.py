"""Linear followed by GELU-tanh, with the activation in the GEMM's epilogue: the MLP's first half.

ComfyUI (comfy/ldm/qwen_image/model.py, FeedForward) runs `F.gelu(proj(x), approximate="tanh")`:
a GEMM writing the (L, 4D) hidden activation, then a pass that reads and rewrites it (at
2512^2, 606 MB each way per stream and block). cuBLASLt's GELU_BIAS epilogue applies bias and
GELU-tanh to the float32 accumulator before the one store; PyTorch exposes it as
`torch._addmm_activation(bias, x, w.t(), use_gelu=True)`. Only the CUDA path uses it: on CPU
that call applies the erf GELU, not tanh. No Triton involved.
"""

import torch
import torch.nn.functional as F

from ._triton import disabled, grad_reason, log_fallback_once

OP = "linear_gelu"


def linear_gelu_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """F.gelu(F.linear(x, weight, bias), approximate="tanh"), ComfyUI's ops (two roundings)."""
    return F.gelu(F.linear(x, weight, bias), approximate="tanh")


def _why_not(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    if disabled():
        return "disabled by QWEN_TURBO_DISABLE_KERNELS"
    if not x.is_cuda:
        return f"tensors on {x.device.type} are not supported"
    if bias is None:
        return "no bias (the epilogue is GELU_BIAS)"
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype:
        return f"dtypes x {x.dtype}, weight {weight.dtype} are not one of bfloat16/float16"
    if bias.dtype != x.dtype or bias.device != x.device or weight.device != x.device:
        return "bias or weight differ from x in dtype or device"
    return grad_reason(x, weight, bias)


def linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """gelu_tanh(x @ weight.T + bias), the activation applied before the one rounding.

    x: (..., K) bfloat16 or float16 on CUDA; weight: (N, K) and bias: (N,) in x's dtype and
    device. Returns (..., N) in x's dtype. Anything else uses the eager reference.
    """
    reason = _why_not(x, weight, bias)
    if reason is not None:
        log_fallback_once(OP, reason)
        return linear_gelu_reference(x, weight, bias)
    x2 = x.reshape(-1, x.shape[-1])
    out = torch._addmm_activation(bias, x2, weight.t(), use_gelu=True)
    return out.reshape(*x.shape[:-1], weight.shape[0])
