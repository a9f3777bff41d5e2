"""Attention backends for ComfyUI's `optimized_attention_override` (transformer_options).

ComfyUI's SDPA path sets its own backend priority inside `comfy.ops`, so choosing a backend
means calling `F.scaled_dot_product_attention` here under our priority. "fp8" runs the
fastest fp8 attention the GPU has (FlashAttention-3's where it is installed on Hopper, else
cuDNN's; see `kernels.attention_fp8`), "fp8_cudnn" cuDNN's (Hopper+, `nvidia-cudnn-frontend`),
each where it can, else SDPA. The call signature is ComfyUI's attention functions'
(comfy/ldm/modules/attention.py).
"""

import functools

import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ...kernels.attention_fp8 import attention_fp8, kernel_name, register_amax_group

BACKENDS = {
    # cuDNN first: 571 TFLOP/s at L = 24,905 on an H200, against 360 for flash.
    "sdpa": [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
             SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
    "flash": [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
              SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
}  # fmt: skip
# Exact attention whose first call builds nothing: torch's cuDNN bf16 attention builds a graph
# at a process's first call (0.83 s on an H100), and torch 2.11 puts cuDNN first on Hopper at
# its first backend choice whatever priority was asked, so cuDNN is left out, not put last.
UNBUILT = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def comfy_signature(core):
    """An attention function with ComfyUI's signature around `core(q, k, v, mask)`, which
    takes and returns (B, H, L, D) tensors."""

    def attention(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                  skip_output_reshape=False, **kwargs):  # fmt: skip
        if skip_reshape:
            b, dim_head = q.shape[0], q.shape[-1]
        else:
            b, dim_head = q.shape[0], q.shape[-1] // heads
            q, k, v = (t.view(b, -1, heads, dim_head).transpose(1, 2) for t in (q, k, v))
        if mask is not None:
            mask = mask.unsqueeze(0) if mask.ndim == 2 else mask
            mask = mask.unsqueeze(1) if mask.ndim == 3 else mask
        out = core(q, k, v, mask)
        if skip_output_reshape:
            return out
        return out.transpose(1, 2).reshape(b, -1, heads * dim_head)

    return attention


def sdpa(backends: list[SDPBackend]):
    """SDPA with `backends` in priority order (the first that supports the inputs runs)."""

    def core(q, k, v, mask):
        with sdpa_kernel(backends, set_priority=True):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return core


def quantized(kernel):
    """`kernel(q, k, v)`; masked calls (which it does not take) go to SDPA, cuDNN first."""

    masked = sdpa(BACKENDS["sdpa"])

    def core(q, k, v, mask):
        return kernel(q, k, v) if mask is None else masked(q, k, v, mask)

    return core


QUANTIZED = {name: functools.partial(attention_fp8, kernel=kernel)
             for name, kernel in (("fp8", "auto"), ("fp8_cudnn", "cudnn"))}  # fmt: skip
OVERRIDE = "optimized_attention_override"  # ComfyUI's transformer option for an attention


def attention_override(name: str, amax_group=None, safe_blocks: set[int] = frozenset(),
                       unindexed_exact: bool = False):  # fmt: skip
    """A `transformer_options["optimized_attention_override"]` running backend `name`; a
    quantized one with the scales of all ranks of the process group `amax_group` (see
    `attention_fp8`). Transformer blocks in `safe_blocks` (read at each call) take ComfyUI's
    attention; with `unindexed_exact`, so do calls outside the indexed blocks (NextDiT's
    refiner blocks, which the fidelity probe does not measure)."""
    if name in QUANTIZED:
        group = register_amax_group(amax_group) if amax_group is not None else ""
        core = quantized(functools.partial(QUANTIZED[name], amax_group=group))
    else:
        core = sdpa(BACKENDS[name])
    override = _override(core, safe_blocks, unindexed_exact)
    override.backend = name  # what a Multi-GPU worker rebuilds it from
    override.collective = amax_group is not None and name in QUANTIZED
    return override


def kernel_note(name: str, device, head_dim: int) -> str | None:
    """Which kernel the quantized attention `name` runs on `device`, for the badge; None for
    the others and off CUDA."""
    if name not in QUANTIZED or device.type != "cuda":
        return None
    return f"{name} attention: {kernel_name(device, head_dim, QUANTIZED[name].keywords['kernel'])}"


def unbuilt_override():
    """An override running exact SDPA on the `UNBUILT` backends: the fidelity probe's
    reference."""
    return _override(sdpa(UNBUILT))


def _override(core, safe_blocks: set[int] = frozenset(), unindexed_exact: bool = False):
    """`core` with ComfyUI's signature as an attention override; ComfyUI's own attention for
    the transformer blocks in `safe_blocks`, and with `unindexed_exact` for calls that name no
    block."""
    attention = comfy_signature(core)

    def override(func, *args, **kwargs):
        index = kwargs.get("transformer_options", {}).get("block_index")
        if (index is None and unindexed_exact) or (safe_blocks and index in safe_blocks):
            return func(*args, **kwargs)
        kwargs.pop("_inside_attn_wrapper", None)
        kwargs.pop("transformer_options", None)
        return attention(*args, **kwargs)

    return override
