"""The fused transformer block: a `forward` for ComfyUI's QwenImageTransformerBlock that runs
the pack's kernels (LayerNorm-modulate, q/k RMSNorm + RoPE, GELU in the GEMM, gated
residuals). Pure torch; never imports ComfyUI.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ...kernels.fp8_linear import Unscaled, finished
from ...kernels.gated_residual import gated_residual, gated_residual_layernorm_modulate
from ...kernels.layernorm_modulate import layernorm_modulate
from ...kernels.linear_gelu import linear_gelu
from ...kernels.qk_norm_rope import qk_norm_rope_into

Attention = Callable[..., torch.Tensor]


def _plain_weights(linear, x: torch.Tensor) -> bool:
    """Whether `linear` would run as plain F.linear on x: ComfyUI ops cast or patch weights
    (comfy_cast_weights, weight_function: offloading, fp8, LoRA on the fly) otherwise."""
    return not (
        getattr(linear, "comfy_cast_weights", False)
        or getattr(linear, "weight_function", None)
        or getattr(linear, "bias_function", None)
        or linear.weight.dtype != x.dtype
        or linear.weight.device != x.device
    )


def mlp(ff, x: torch.Tensor):
    """ComfyUI's FeedForward (Linear, GELU-tanh, Linear) with the GELU fused: into the GEMM
    epilogue for plain weights, into the fp8 activation quantization for fp8 GEMMs. With fp8
    GEMMs the result may be an `fp8_linear.Unscaled` (`gated_residual` takes it); the hidden
    activation crosses between the two GEMMs unscaled too."""
    proj, out = ff.net[0].proj, ff.net[2]
    if hasattr(out, "linear_of_gelu"):
        h = proj.unscaled(x) if hasattr(proj, "unscaled") else proj(x)
        return out.linear_of_gelu(h, unscaled=True)
    if _plain_weights(proj, x):
        h = linear_gelu(x, proj.weight, proj.bias)
    else:
        h = F.gelu(proj(x), approximate="tanh")
    return out(h)


def project(x: torch.Tensor, linears, unscaled=()) -> list:
    """[linear(x) for linear in linears], through the ops' `linears_of_one_input` where they
    have it (fp8 GEMMs quantize x once for all of them); the outputs at the positions in
    `unscaled` may be `fp8_linear.Unscaled`."""
    shared = getattr(linears[0], "linears_of_one_input", None)
    if shared is None:
        return [linear(x) for linear in linears]
    return shared(x, linears, unscaled)


def unscaled(linear, x: torch.Tensor):
    """linear(x), an `fp8_linear.Unscaled` where the linear can leave it so."""
    return linear.unscaled(x) if hasattr(linear, "unscaled") else linear(x)


def joint_attention(
    attn, img: torch.Tensor, txt: torch.Tensor, freqs: torch.Tensor, attention: Attention,
    transformer_options: dict,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """ComfyUI's qwen_image `Attention.forward`: q/k RMSNorm + RoPE written straight into the
    joint (B, L_txt + L_img, H, Dh) buffers that attention reads as (B, H, L, Dh) views. The
    q and k projections and both outputs may be `fp8_linear.Unscaled` (their next kernels
    finish them); v is finished, as it is joined."""
    b, n_txt, n_img, heads = img.shape[0], txt.shape[1], img.shape[1], attn.heads
    n = n_txt + n_img
    q = img.new_empty(b, n, heads, attn.dim_head)
    k = torch.empty_like(q)
    streams = (
        (txt, slice(0, n_txt), (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj),
         (attn.norm_added_q, attn.norm_added_k)),
        (img, slice(n_txt, n), (attn.to_q, attn.to_k, attn.to_v), (attn.norm_q, attn.norm_k)),
    )  # fmt: skip
    vs = []
    for x, rows, linears, norms in streams:
        hq, hk, hv = project(x, linears, unscaled=(0, 1))
        for h, norm, out in ((hq, norms[0], q), (hk, norms[1], k)):
            h = h if isinstance(h, Unscaled) else h.unflatten(-1, (heads, -1))
            gain = norm_gain(norm, out.device)
            qk_norm_rope_into(h, gain, freqs[:, rows], out[:, rows], norm.eps)
        vs.append(hv)
    v = torch.cat(vs, dim=1).unflatten(-1, (heads, -1))
    out = attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), heads, None,
        skip_reshape=True, transformer_options=transformer_options,
    )  # fmt: skip
    return unscaled(attn.to_out[0], out[:, n_txt:]), unscaled(attn.to_add_out, out[:, :n_txt])


GAIN_NORMS = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")  # the attention's RMSNorms


def norm_gain(norm, device: torch.device) -> torch.Tensor:
    """An RMSNorm's gain on `device`: its weight where loaded, else `gain_copy`; with ComfyUI's
    per-call patches (`weight_function`: a LoRA on a norm left on the host), a new copy with
    them applied (they may write into the weight they are given)."""
    functions = getattr(norm, "weight_function", None)
    if functions:
        gain = norm.weight.to(device, copy=True)
        for f in functions:
            gain = f(gain)
        return gain
    return norm.weight if norm.weight.device == device else gain_copy(norm, device)


def gain_copy(norm, device: torch.device) -> torch.Tensor:
    """The gain of a norm left on the host by a partial load, on `device`: copied once and kept
    on the norm while its host tensor is the same, rather than crossing in every block call
    (a block graph replays it where it lies)."""
    weight = norm.weight
    hit = norm.__dict__.get("_gain")
    if hit is None or hit[0] is not weight or hit[1] != weight.data_ptr() or hit[2] != device:
        hit = (weight, weight.data_ptr(), device, weight.to(device, non_blocking=True))
        norm.__dict__["_gain"] = hit
    return hit[3]


def gain_tensors(norm, device: torch.device) -> tuple[torch.Tensor] | None:
    """What the fused block reads of `norm` on `device` (`graphs.blocks` reads): None where
    patches apply per call."""
    if getattr(norm, "weight_function", None):
        return None
    return (norm_gain(norm, device),)


def rope_table(freqs: torch.Tensor, n: int) -> torch.Tensor:
    """ComfyUI's RoPE table as (B or 1, L, 1, Dh/2, 2, 2), the layout the kernels take.

    v0.3.64 passes it so; newer hosts pass (B or 1, 1, L, Dh/2, 2, 2), made a view here."""
    return freqs if freqs.shape[1] == n else freqs.transpose(1, 2)


def why_host_block(mask, kwargs: dict, transformer_options: dict) -> str | None:
    """Why a block call needs the host's own forward, or None when the fused one computes it.

    The fused block handles text-to-image calls and reference latents (Qwen-Image-Edit),
    with the per-token modulation of Edit-2511's `timestep_zero_index`; a text mask,
    attention patches and any argument a newer host adds go to the host."""
    if mask is not None:
        return "a text attention mask"
    extra = sorted(k for k, v in kwargs.items() if v is not None)
    if extra:
        return f"block argument {extra[0]!r}"
    if transformer_options.get("patches", {}).get("attn1_patch"):
        return "attn1_patch model patches"
    return None


def by_segment(fn: Callable, split: int | None, tokens, mods):
    """fn(*tokens, *mods), with tokens (B, L, D) and mods (B, D); with `split` (Edit-2511's
    `timestep_zero_index`) the mods are (2B, D) and tokens from `split` on take their last B
    rows (the modulation of timestep 0), the others their first B: fn runs on each part and
    the parts are joined along L."""
    if split is None:
        return fn(*tokens, *mods)
    halves = [m.chunk(2) for m in mods]
    first = fn(*(t[:, :split] for t in tokens), *(h[0] for h in halves))
    rest = fn(*(t[:, split:] for t in tokens), *(h[1] for h in halves))
    if isinstance(first, tuple):
        return tuple(torch.cat(pair, dim=1) for pair in zip(first, rest, strict=True))
    return torch.cat((first, rest), dim=1)


def fused_block_forward(block, attention: Attention, on_host: Callable | None = None) -> Callable:
    """A `forward` for ComfyUI's QwenImageTransformerBlock with the fused kernels.

    Same signature and result as the block's own forward (within rounding: each fused op
    rounds once where ComfyUI rounds per op). `attention(q, k, v, heads, mask, skip_reshape=
    True, transformer_options=...)` takes (B, H, L, Dh) views and returns (B, L, H * Dh):
    ComfyUI's `optimized_attention_masked`, so attention overrides still apply. Calls it
    cannot compute (`why_host_block`) run the block's own forward; `on_host(reason)` is told.

    Reference latents (Qwen-Image-Edit) are image tokens after the generated ones. With
    `timestep_zero_index` (newer hosts, Edit-2511) temb holds 2B rows, the timestep's then
    timestep 0's: image tokens from that index on are modulated and gated by the latter, the
    text stream by the former, as the host's block does.
    """
    eps = block.img_norm1.eps

    def forward(
        hidden_states, encoder_hidden_states, encoder_hidden_states_mask=None, temb=None,
        image_rotary_emb=None, timestep_zero_index=None, transformer_options=None, **kwargs,
    ):  # fmt: skip
        transformer_options = {} if transformer_options is None else transformer_options
        why = why_host_block(encoder_hidden_states_mask, kwargs, transformer_options)
        if why is not None:
            if on_host is not None:
                on_host(why)
            if timestep_zero_index is not None:
                kwargs["timestep_zero_index"] = timestep_zero_index
            return type(block).forward(
                block, hidden_states, encoder_hidden_states, encoder_hidden_states_mask,
                temb=temb, image_rotary_emb=image_rotary_emb,
                transformer_options=transformer_options, **kwargs,
            )  # fmt: skip
        img, txt, split = hidden_states, encoder_hidden_states, timestep_zero_index
        freqs = rope_table(image_rotary_emb, img.shape[1] + txt.shape[1])
        # (B, 6D) each (2B with `split`): shift, scale, gate of the attention half, then of
        # the MLP half.
        i_shift1, i_scale1, i_gate1, i_shift2, i_scale2, i_gate2 = block.img_mod(temb).chunk(6, -1)
        txt_mod = block.txt_mod(temb if split is None else temb.chunk(2)[0])
        t_shift1, t_scale1, t_gate1, t_shift2, t_scale2, t_gate2 = txt_mod.chunk(6, -1)
        img_x = by_segment(
            lambda x, shift, scale: layernorm_modulate(x, shift, scale, eps),
            split, (img,), (i_shift1, i_scale1),
        )  # fmt: skip
        img_attn, txt_attn = joint_attention(
            block.attn, img_x, layernorm_modulate(txt, t_shift1, t_scale1, eps),
            freqs, attention, transformer_options,
        )  # fmt: skip
        img_attn = img_attn if split is None else finished(img_attn)  # by_segment splits it
        img, img_x = by_segment(
            lambda x, y, gate, shift, scale: gated_residual_layernorm_modulate(
                x, y, gate, shift, scale, eps
            ),
            split, (img, img_attn), (i_gate1, i_shift2, i_scale2),
        )  # fmt: skip
        txt, txt_x = gated_residual_layernorm_modulate(
            txt, txt_attn, t_gate1, t_shift2, t_scale2, eps
        )
        img_y = mlp(block.img_mlp, img_x)
        img_y = img_y if split is None else finished(img_y)  # by_segment splits tensors
        img = by_segment(gated_residual, split, (img, img_y), (i_gate2,))
        txt = gated_residual(txt, mlp(block.txt_mlp, txt_x), t_gate2)
        return txt, img

    forward.fused_block = True  # what Multi-GPU's workers rebuild (`is_fused_forward`)
    return forward


def is_fused_forward(obj) -> bool:
    """Whether `obj` is a forward made by `fused_block_forward`."""
    return getattr(obj, "fused_block", False) is True
