"""What a Qwen-Image DiT checkpoint says about its model: the constructor arguments read off
the tensors' shapes, the variant by its marker keys, and what a wrong file looks like. Pure
torch; never imports ComfyUI.

Key names are ComfyUI's (`transformer_blocks.N.attn.to_q.weight`, ...), which are also the
diffusers names, so a diffusers `transformer/` folder loads without renaming.
"""

import re
from dataclasses import asdict, dataclass

import torch

REQUIRED = ("img_in.weight", "txt_in.weight", "txt_norm.weight", "proj_out.weight")
# Keys by which ComfyUI's model detection (v0.33) tells the variants apart. Edit-2511: its
# reference images' tokens get the modulation of timestep 0. Layered: a second timestep
# embedding, and references numbered downwards.
TIMESTEP_ZERO = "__index_timestep_zero__"
LAYERED = "time_text_embed.addition_t_embedding.weight"
VARIANT_DEFAULTS = {"default_ref_method": "index", "use_additional_t_cond": False}
PATCH = 2  # the model's process_img hard-codes 2x2 patches
# Other families, by a key only they have: to say what a wrong file is.
FAMILIES = (
    ("double_blocks.0.img_attn.qkv.weight", "a Flux DiT"),
    ("joint_blocks.0.context_block.attn.qkv.weight", "an SD3 MMDiT"),
    ("input_blocks.0.0.weight", "an SD/SDXL UNet"),
    ("layers.0.adaLN_modulation.0.weight", "a Z-Image DiT"),
    ("blocks.0.self_attn.q.weight", "a Wan video DiT"),
    ("decoder.conv_in.weight", "a VAE"),
    ("decoder.middle.0.residual.0.gamma", "a Wan / Qwen-Image VAE"),
    ("model.layers.0.self_attn.q_proj.weight", "a text encoder (Qwen2.5-VL / LLM)"),
    ("lora_unet_", "a LoRA"),
    (".lora_A.weight", "a LoRA"),
    (".lora_down.weight", "a LoRA"),
)


class NotQwenImageDiT(ValueError):
    """The checkpoint is no DiT the Optimized Loader builds; the message says what it is."""


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

    family = "Qwen-Image"
    host_model = "QwenImage"  # comfy.supported_models' class
    blocks = "transformer_blocks"  # the DiT's attribute holding its blocks

    @property
    def width(self) -> int:
        return self.attention_head_dim * self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim

    @property
    def name(self) -> str:
        return "Qwen-Image"

    def summary(self) -> str:
        return (f"{self.num_layers} layers, width {self.width} ({self.num_attention_heads} "
                f"heads of {self.head_dim}), text {self.joint_attention_dim}")  # fmt: skip

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
    return f"{len(keys)} tensors with no Qwen-Image or NewBie DiT keys (first: {shown})"


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
            f"not a Qwen-Image or NewBie / Lumina-2 DiT: no {(missing or [norm_q])[0]!r}; "
            f"found {describe(sd)}"
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
