"""The Qwen-Image DiT: config read from the weights, diffusers-layout folders, fp8 weights with
per-tensor scales, and the fused transformer block. Pure torch; never imports ComfyUI.

Key names are ComfyUI's (`transformer_blocks.N.attn.to_q.weight`, ...), which are also the
diffusers names, so a diffusers `transformer/` folder loads without renaming.
"""

import json
import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..kernels.fp8_linear import FP8, FP8_MAX
from ..kernels.gated_residual import gated_residual, gated_residual_layernorm_modulate
from ..kernels.layernorm_modulate import layernorm_modulate
from ..kernels.linear_gelu import linear_gelu
from ..kernels.qk_norm_rope import qk_norm_rope_into

# Prefixes a DiT may carry inside a whole checkpoint; stripped before reading the config.
PREFIXES = ("model.diffusion_model.", "diffusion_model.")
REQUIRED = ("img_in.weight", "txt_in.weight", "txt_norm.weight", "proj_out.weight")
# Keys by which ComfyUI's model detection (v0.33) tells the variants apart. Edit-2511: its
# reference images' tokens get the modulation of timestep 0. Layered: a second timestep
# embedding, and references numbered downwards.
TIMESTEP_ZERO = "__index_timestep_zero__"
LAYERED = "time_text_embed.addition_t_embedding.weight"
VARIANT_DEFAULTS = {"default_ref_method": "index", "use_additional_t_cond": False}
# fp8 weights keep their largest value this factor below 448 (room for LoRA deltas).
HEADROOM = 4
PATCH = 2  # the model's process_img hard-codes 2x2 patches
# Other families, by a key only they have: to say what a wrong file is.
FAMILIES = (
    ("double_blocks.0.img_attn.qkv.weight", "a Flux DiT"),
    ("joint_blocks.0.context_block.attn.qkv.weight", "an SD3 MMDiT"),
    ("input_blocks.0.0.weight", "an SD/SDXL UNet"),
    ("cap_embedder.0.weight", "a Lumina-2 / NewBie DiT"),
    ("blocks.0.self_attn.q.weight", "a Wan video DiT"),
    ("decoder.conv_in.weight", "a VAE"),
    ("decoder.middle.0.residual.0.gamma", "a Wan / Qwen-Image VAE"),
    ("model.layers.0.self_attn.q_proj.weight", "a text encoder (Qwen2.5-VL / LLM)"),
    ("lora_unet_", "a LoRA"),
    (".lora_A.weight", "a LoRA"),
    (".lora_down.weight", "a LoRA"),
)


class NotQwenImageDiT(ValueError):
    """The checkpoint is not a Qwen-Image DiT; the message says what it looks like."""


@dataclass(frozen=True)
class DiTConfig:
    """QwenImageTransformer2DModel's constructor arguments, as read from a checkpoint."""

    in_channels: int
    out_channels: int
    num_layers: int
    attention_head_dim: int
    num_attention_heads: int
    joint_attention_dim: int
    axes_dims_rope: tuple[int, int, int]
    patch_size: int = PATCH
    # How the model places reference latents (Qwen-Image-Edit) when the conds do not say.
    default_ref_method: str = "index"
    use_additional_t_cond: bool = False

    @property
    def width(self) -> int:
        return self.attention_head_dim * self.num_attention_heads

    def variant(self) -> dict:
        """The settings that differ from Qwen-Image's (and Edit-2509's): arguments of newer
        hosts' model that older hosts' model does not take."""
        return {k: getattr(self, k) for k, d in VARIANT_DEFAULTS.items() if getattr(self, k) != d}

    def unet_config(self) -> dict:
        plain = {k: v for k, v in asdict(self).items() if k not in VARIANT_DEFAULTS}
        return {"image_model": "qwen_image", **plain, **self.variant()}


def describe(keys) -> str:
    """What a state dict with these keys looks like, for error messages."""
    keys = list(keys)
    for marker, family in FAMILIES:
        if any(marker in k for k in keys):
            return f"{family} ({len(keys)} tensors, e.g. {marker!r})"
    shown = ", ".join(repr(k) for k in keys[:3])
    return f"{len(keys)} tensors with no Qwen-Image DiT keys (first: {shown})"


def strip_prefix(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The DiT's own keys: a known checkpoint prefix removed where most keys carry it."""
    for prefix in PREFIXES:
        if sum(k.startswith(prefix) for k in sd) > len(sd) // 2:
            return {k[len(prefix) :]: v for k, v in sd.items() if k.startswith(prefix)}
    return sd


def default_rope_axes(head_dim: int) -> tuple[int, int, int]:
    """Qwen-Image's (16, 56, 56) split of a 128-wide head, scaled to `head_dim` (even parts)."""
    frame = max(2, 2 * round(head_dim / 16))
    side = (head_dim - frame) // 2
    return (head_dim - 2 * side, side, side)


def read_config(sd: dict[str, torch.Tensor], rope_axes=None) -> DiTConfig:
    """Width, heads, layers, text width and channels from the tensors' shapes; the Edit-2511
    and Layered variants by their marker keys, as ComfyUI's model detection reads them.

    `rope_axes` (from a diffusers config.json) must sum to the head size; without it the
    stock split is scaled to the head size. Raises NotQwenImageDiT naming what was found.
    """
    missing = [k for k in REQUIRED if k not in sd]
    norm_q = "transformer_blocks.0.attn.norm_q.weight"
    if missing or norm_q not in sd:
        raise NotQwenImageDiT(
            f"not a Qwen-Image DiT: no {(missing or [norm_q])[0]!r}; found {describe(sd)}"
        )
    width, in_channels = sd["img_in.weight"].shape
    head_dim = sd[norm_q].shape[0]
    blocks = {int(m.group(1)) for k in sd if (m := re.match(r"transformer_blocks\.(\d+)\.", k))}
    if blocks != set(range(len(blocks))):
        raise NotQwenImageDiT(f"transformer_blocks are not numbered 0..N-1: {sorted(blocks)}")
    if width % head_dim:
        raise NotQwenImageDiT(f"width {width} is not a multiple of the head size {head_dim}")
    axes = tuple(rope_axes) if rope_axes else default_rope_axes(head_dim)
    if len(axes) != 3 or sum(axes) != head_dim or any(a % 2 for a in axes):
        raise NotQwenImageDiT(f"RoPE axes {axes} do not split the head size {head_dim}")
    return DiTConfig(
        in_channels=in_channels,
        out_channels=sd["proj_out.weight"].shape[0] // PATCH**2,
        num_layers=len(blocks),
        attention_head_dim=head_dim,
        num_attention_heads=width // head_dim,
        joint_attention_dim=sd["txt_in.weight"].shape[1],
        axes_dims_rope=axes,
        default_ref_method="negative_index" if LAYERED in sd
        else "index_timestep_zero" if TIMESTEP_ZERO in sd else "index",
        use_additional_t_cond=LAYERED in sd,
    )  # fmt: skip


def diffusers_folder(path: Path) -> Path | None:
    """The diffusers transformer folder at `path` (itself or its `transformer/`), or None."""
    for folder in (path / "transformer", path):
        if (folder / "config.json").is_file():
            return folder
    return None


def load_diffusers_folder(folder: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """(state dict, config.json) of a diffusers transformer folder: sharded safetensors with an
    index (`*.safetensors.index.json`), or one safetensors file. Edit-2511's `zero_cond_t`
    becomes the marker key ComfyUI's files carry (TIMESTEP_ZERO)."""
    from diffusers import QwenImageTransformer2DModel
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    def read(file: Path, how):
        try:
            return how(file)
        except (SafetensorError, ValueError, KeyError, OSError) as e:
            raise ValueError(f"{file.name}: {e}") from e

    config = QwenImageTransformer2DModel.load_config(str(folder))
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if indexes:
        index = read(indexes[0], lambda f: json.loads(f.read_text())["weight_map"])
        shards = sorted(set(index.values()))
    else:
        shards = sorted(p.name for p in folder.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{folder} has config.json but no .safetensors weights")
    sd = {}
    for shard in shards:
        if not (folder / shard).is_file():
            raise FileNotFoundError(f"{folder / shard} is listed in the index but missing")
        sd.update(read(folder / shard, lambda f: load_file(str(f))))
    if config.get("zero_cond_t"):
        sd[TIMESTEP_ZERO] = torch.tensor([])
    return sd, config


def is_linear_weight(key: str, t: torch.Tensor) -> bool:
    """Every 2-D `.weight` of the Qwen-Image DiT belongs to a Linear."""
    return key.endswith(".weight") and t.ndim == 2


def in_blocks(key: str) -> bool:
    """Whether `key` is inside a transformer block: 99.8% of the weights. The rest (input and
    output projections, the timestep embedding that drives every block's modulation) stay in
    bf16 in the fp8 modes, for accuracy."""
    return key.startswith("transformer_blocks.")


def _no_progress() -> None:
    pass


def to_scaled_fp8(
    sd: dict[str, torch.Tensor], quantize=in_blocks, step: Callable[[], None] = _no_progress
) -> dict[str, torch.Tensor]:
    """Linear weights for which `quantize(key)` holds as float8_e4m3fn with a float32
    `scale_weight` each (w ~ w8 * scale); the others keep their dtype with a scale of 1.

    Weights in a wider dtype get scale amax / (448 / HEADROOM): the largest lands a factor
    HEADROOM below fp8's largest, so a LoRA patched in later (re-quantized with this scale)
    can grow weights that much before clamping; e4m3's relative precision is the same there.
    Weights already fp8 keep their file's scale, or 1 (ComfyUI's plain fp8 files). Other
    tensors are kept. This is the layout ComfyUI's scaled-fp8 ops load, patch and LoRA.
    `step` is called once per tensor (the loader's progress bar).
    """
    out = {}
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
        w = t.float()
        scale = (w.abs().amax() * HEADROOM / FP8_MAX).clamp_min(1e-12)
        out[k] = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        out[scale_key] = scale
    return out


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


# --- the fused block ---------------------------------------------------------------------

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


def mlp(ff, x: torch.Tensor) -> torch.Tensor:
    """ComfyUI's FeedForward (Linear, GELU-tanh, Linear) with the GELU fused: into the GEMM
    epilogue for plain weights, into the fp8 activation quantization for fp8 GEMMs."""
    proj, out = ff.net[0].proj, ff.net[2]
    if hasattr(out, "linear_of_gelu"):
        return out.linear_of_gelu(proj(x))
    if _plain_weights(proj, x):
        h = linear_gelu(x, proj.weight, proj.bias)
    else:
        h = F.gelu(proj(x), approximate="tanh")
    return out(h)


def project(x: torch.Tensor, linears) -> list[torch.Tensor]:
    """[linear(x) for linear in linears], through the ops' `linears_of_one_input` where they
    have it (fp8 GEMMs quantize x once for all of them)."""
    shared = getattr(linears[0], "linears_of_one_input", None)
    return shared(x, linears) if shared is not None else [linear(x) for linear in linears]


def joint_attention(
    attn, img: torch.Tensor, txt: torch.Tensor, freqs: torch.Tensor, attention: Attention,
    transformer_options: dict,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """ComfyUI's qwen_image `Attention.forward`: q/k RMSNorm + RoPE written straight into the
    joint (B, L_txt + L_img, H, Dh) buffers that attention reads as (B, H, L, Dh) views."""
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
        hq, hk, hv = project(x, linears)
        for h, norm, out in ((hq, norms[0], q), (hk, norms[1], k)):
            h = h.unflatten(-1, (heads, -1))
            gain = norm.weight.to(out.device)  # left on the host by a partial load
            qk_norm_rope_into(h, gain, freqs[:, rows], out[:, rows], norm.eps)
        vs.append(hv)
    v = torch.cat(vs, dim=1).unflatten(-1, (heads, -1))
    out = attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), heads, None,
        skip_reshape=True, transformer_options=transformer_options,
    )  # fmt: skip
    return attn.to_out[0](out[:, n_txt:]), attn.to_add_out(out[:, :n_txt])


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
        img, img_x = by_segment(
            lambda x, y, gate, shift, scale: gated_residual_layernorm_modulate(
                x, y, gate, shift, scale, eps
            ),
            split, (img, img_attn), (i_gate1, i_shift2, i_scale2),
        )  # fmt: skip
        txt, txt_x = gated_residual_layernorm_modulate(
            txt, txt_attn, t_gate1, t_shift2, t_scale2, eps
        )
        img = by_segment(gated_residual, split, (img, mlp(block.img_mlp, img_x)), (i_gate2,))
        txt = gated_residual(txt, mlp(block.txt_mlp, txt_x), t_gate2)
        return txt, img

    forward.fused_block = True  # what Multi-GPU's workers rebuild (`is_fused_forward`)
    return forward


def is_fused_forward(obj) -> bool:
    """Whether `obj` is a forward made by `fused_block_forward`."""
    return getattr(obj, "fused_block", False) is True


def count_params(sd: dict[str, torch.Tensor]) -> int:
    return sum(math.prod(t.shape) for t in sd.values())
