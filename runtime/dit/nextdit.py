"""What a Lumina-2 / NewBie-image checkpoint (ComfyUI's NextDiT) says about its model: the
constructor arguments read off the tensors' shapes, as ComfyUI's model detection reads them
for the stock files, and for narrow test models as well. Pure torch; never imports ComfyUI.

NewBie-image-Exp0.1 is Lumina-2's NextDiT (width 2304, 24 query and 8 key/value heads of 96)
with 36 blocks, Gemma-3-4B text features (2560) and a Jina CLIP v2 pooled vector (1024) that
joins the timestep embedding (`clip_text_pooled_proj`, `time_text_embed`).
"""

import re
from dataclasses import dataclass

import torch

from .config import NotQwenImageDiT

MARKERS = ("cap_embedder.1.weight", "layers.0.attention.qkv.weight")
PATCH = 2  # ComfyUI's detection sets it; the image embedder's input is patch² channels
# Z-Image's blocks take the timestep embedding without a SiLU in front: its Linear is index 0
Z_IMAGE = "layers.0.adaLN_modulation.0.weight"
ROPE_THETA = 10000.0  # Lumina-2's and NewBie's; older hosts' NextDiT hard-codes it
AXES_LENS = (300, 512, 512)  # as ComfyUI's detection sets it (NewBie's own are not used)


def is_nextdit(keys) -> bool:
    return all(m in keys for m in MARKERS)


@dataclass(frozen=True)
class NextDiTConfig:
    """ComfyUI's NextDiT constructor arguments (`image_model` lumina2), read from a checkpoint."""

    in_channels: int
    dim: int
    n_layers: int
    n_refiner_layers: int
    n_heads: int
    n_kv_heads: int
    mlp_hidden: int  # the MLP's width, as in the file
    multiple_of: int
    cap_feat_dim: int
    axes_dims: tuple[int, int, int]
    clip_text_dim: int | None = None  # NewBie's pooled CLIP vector; None for Lumina-2

    family = "NewBie / Lumina-2"
    host_model = "Lumina2"  # comfy.supported_models' class
    blocks = "layers"  # the DiT's attribute holding its main blocks

    @property
    def name(self) -> str:
        return "NewBie-image" if self.clip_text_dim else "Lumina-2"

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def variant(self) -> dict:
        """Arguments that only newer hosts' NextDiT takes, where the weights need them."""
        return {"clip_text_dim": self.clip_text_dim} if self.clip_text_dim else {}

    def unet_config(self, mlp_factor: int = 1) -> dict:
        """NextDiT's arguments on a host whose blocks give their MLP `mlp_factor` times the
        width before `ffn_dim_multiplier` (v0.33: 1; v0.3.64: 4)."""
        base = mlp_factor * self.dim
        multiplier = None if self.mlp_hidden == base else self.mlp_hidden / base
        if (
            multiplier is not None
            and hidden_size(base, multiplier, self.multiple_of) != self.mlp_hidden
        ):
            raise NotQwenImageDiT(
                f"this ComfyUI's NextDiT cannot make an MLP {self.mlp_hidden} wide"
            )
        return {
            "image_model": "lumina2", "patch_size": PATCH, "in_channels": self.in_channels,
            "dim": self.dim, "n_layers": self.n_layers, "n_refiner_layers": self.n_refiner_layers,
            "n_heads": self.n_heads, "n_kv_heads": self.n_kv_heads, "qk_norm": True,
            "ffn_dim_multiplier": multiplier, "multiple_of": self.multiple_of,
            "cap_feat_dim": self.cap_feat_dim, "axes_dims": list(self.axes_dims),
            "axes_lens": list(AXES_LENS), **self.variant(),
        }  # fmt: skip

    def summary(self) -> str:
        kv = f", {self.n_kv_heads} key/value heads" if self.n_kv_heads != self.n_heads else ""
        return (f"{self.name}, {self.n_layers} layers, width {self.dim} ({self.n_heads} heads "
                f"of {self.head_dim}{kv}), text {self.cap_feat_dim}")  # fmt: skip


def _count(sd, prefix: str) -> int:
    found = {int(m.group(1)) for k in sd if (m := re.match(rf"{prefix}\.(\d+)\.", k))}
    if found != set(range(len(found))):
        raise NotQwenImageDiT(f"{prefix} blocks are not numbered 0..N-1: {sorted(found)}")
    return len(found)


def hidden_size(dim: int, multiplier: float, multiple_of: int) -> int:
    """NextDiT's FeedForward width for these arguments."""
    hidden = int(multiplier * dim)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def read_config(sd: dict[str, torch.Tensor]) -> NextDiTConfig:
    """Width, heads (query and key/value), layers, text widths and the MLP width from the
    tensors' shapes. Raises NotQwenImageDiT for what the Optimized Loader does not build."""
    if Z_IMAGE in sd:
        raise NotQwenImageDiT(
            "a Z-Image DiT: the Optimized Loader builds Qwen-Image and NewBie / Lumina-2; load "
            "this one with ComfyUI's UNETLoader"
        )
    norm = "layers.0.attention.q_norm.weight"
    if norm not in sd:
        raise NotQwenImageDiT(f"a NextDiT without q/k norms (no {norm!r}): not Lumina-2 or NewBie")
    dim, cap_feat_dim = sd["cap_embedder.1.weight"].shape
    head_dim = sd[norm].shape[0]
    if dim % head_dim or head_dim % 6:
        raise NotQwenImageDiT(f"width {dim} and head size {head_dim} are not Lumina-2's layout")
    n_heads = dim // head_dim
    rows = sd["layers.0.attention.qkv.weight"].shape[0] // head_dim  # q, k and v heads
    n_kv_heads = (rows - n_heads) // 2
    hidden = sd["layers.0.feed_forward.w1.weight"].shape[0]
    if n_kv_heads < 1 or n_heads % n_kv_heads:
        raise NotQwenImageDiT(f"attention heads unreadable: {rows} in qkv, {n_heads} for queries")
    pooled = sd.get("clip_text_pooled_proj.0.weight")
    return NextDiTConfig(
        in_channels=sd["x_embedder.weight"].shape[1] // PATCH**2,
        dim=dim,
        n_layers=_count(sd, "layers"),
        n_refiner_layers=_count(sd, "noise_refiner"),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        mlp_hidden=hidden,
        multiple_of=256 if hidden % 256 == 0 else 1,
        cap_feat_dim=cap_feat_dim,
        axes_dims=(head_dim // 3,) * 3,
        clip_text_dim=None if pooled is None else pooled.shape[0],
    )
