"""The fused NextDiT block (Lumina-2, NewBie-image): a `forward` for ComfyUI's
JointTransformerBlock whose norms, modulation and gated residuals run as the pack's kernels
(`kernels.rms_norm_gate`: one pass for each half's pre-norm, one for the residual with the
next half's pre-norm), and whose MLP quantizes its input once for both of its first GEMMs
(fp8). The attention is ComfyUI's own module (on v0.33 its q/k RMSNorm and RoPE are one
kernel already). Pure torch; never imports ComfyUI.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ...kernels.rms_norm_gate import (
    gated_rms_residual,
    gated_rms_residual_rms_norm_modulate,
    rms_norm_modulate,
)
from .blocks import norm_gain, project

# the block's RMSNorms: where a partial load leaves them on the host, or a LoRA patches them,
# `blocks.norm_gain` gives their gain on the device
NORMS = ("attention_norm1", "attention_norm2", "ffn_norm1", "ffn_norm2")


def why_host_block(block, x: torch.Tensor, x_mask, timestep_zero_index, options: dict):
    """Why a call needs the block's own forward, or None when the fused one computes it."""
    if not getattr(block, "modulation", False):
        return "a block without modulation"
    if block.attention_norm1.eps is None:
        return "RMSNorms without eps"
    if x.dtype == torch.float16:  # ComfyUI clamps fp16 activations between the ops
        return "fp16 activations"
    if x_mask is not None:
        return "an attention mask"
    if timestep_zero_index is not None:
        return "reference images (timestep_zero_index)"
    if options.get("patches", {}).get("attn1_patch"):
        return "attn1_patch model patches"
    return None


def swiglu(ff, x: torch.Tensor) -> torch.Tensor:
    """ComfyUI's FeedForward, w2(silu(w1 x) * w3 x), with x quantized once for w1 and w3
    where they are fp8 GEMMs; the same ops otherwise."""
    a, b = project(x, [ff.w1, ff.w3])
    return ff.w2(F.silu(a) * b)


def fused_block_forward(block, on_host: Callable | None = None) -> Callable:
    """A `forward` for ComfyUI's JointTransformerBlock with the fused kernels: the block's own
    result within rounding (each fused op rounds once where ComfyUI rounds per op). Calls it
    does not compute (`why_host_block`) run the block's own forward; `on_host(reason)` is
    told."""

    def forward(x, x_mask, freqs_cis, adaln_input=None, transformer_options=None, **kwargs):
        options = {} if transformer_options is None else transformer_options
        zero_index = kwargs.get("timestep_zero_index")
        why = why_host_block(block, x, x_mask, zero_index, options)
        extra = sorted(k for k, v in kwargs.items() if v is not None)
        if why is None and extra:  # an argument a newer host adds
            why = f"block argument {extra[0]!r}"
        if why is not None:
            if on_host is not None:
                on_host(why)
            return type(block).forward(
                block, x, x_mask, freqs_cis, adaln_input, transformer_options=options, **kwargs
            )
        gains = [norm_gain(getattr(block, n), x.device) for n in NORMS]
        eps = block.attention_norm1.eps
        scale_msa, gate_msa, scale_mlp, gate_mlp = block.adaLN_modulation(adaln_input).chunk(4, 1)
        h = rms_norm_modulate(x, gains[0], scale_msa, eps)
        y = block.attention(h, x_mask, freqs_cis, transformer_options=options)
        x, h = gated_rms_residual_rms_norm_modulate(
            x, y, gains[1], gate_msa, gains[2], scale_mlp, eps
        )
        return gated_rms_residual(x, swiglu(block.feed_forward, h), gains[3], gate_mlp, eps)

    forward.fused_block = True
    return forward
