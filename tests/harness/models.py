"""Tiny random-weight models in ComfyUI's key format, made from a fixed seed and cached.

The architectures are ComfyUI's own modules, built on the meta device for their parameter
names and shapes; the weights come from a seeded generator. Files are cached outside the
repo, under $QWEN_TURBO_CACHE or ~/.cache/qwen-turbo/test-models, keyed by name.
"""

import contextlib
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from qwen_turbo.cli import bench
from qwen_turbo.cli.bench import random_state_dict

VERSION = 1  # bump when a recipe changes


def cache_dir() -> Path:
    root = Path(os.environ.get("QWEN_TURBO_CACHE", Path.home() / ".cache" / "qwen-turbo"))
    return root / "test-models"


def qwen_vae_module():
    """The Qwen-Image VAE: ComfyUI's Wan 2.1 VAE at full width (dim 96, z 16), on meta."""
    return bench.qwen_vae_module()


def sd_vae_module(z_channels: int = 4):
    """The SD1.5/SDXL AutoencoderKL at full width, as ComfyUI builds it from such a file.

    z_channels=16 gives the Flux/SD3 decoder width (with a 1x1 post-quant conv Flux lacks).
    """
    from comfy.ldm.models.autoencoder import AutoencoderKL

    ddconfig = {
        "double_z": True, "z_channels": z_channels, "resolution": 256, "in_channels": 3,
        "out_ch": 3, "ch": 128, "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2,
        "attn_resolutions": [], "dropout": 0.0,
    }  # fmt: skip
    with torch.device("meta"):
        return AutoencoderKL(ddconfig=ddconfig, embed_dim=z_channels)


# A narrow Qwen-Image DiT: 4 heads of 32 (width 128), text width 64, RoPE (4, 14, 14).
NARROW = bench.NARROW


def qwen_dit_module(num_layers: int = 1, **config):
    """Qwen-Image's MMDiT, by default at full width (3072, 24 heads, text 3584), few blocks."""
    import comfy.ops
    from comfy.ldm.qwen_image.model import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel(
        num_layers=num_layers, device="meta", operations=comfy.ops.disable_weight_init, **config
    )


def _cached(name: str, build, seed: int, dtype) -> Path:
    path = cache_dir() / f"{name}-v{VERSION}-s{seed}.safetensors"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        save_file(random_state_dict(build(), seed, dtype), str(tmp))
        tmp.replace(path)
    return path


def qwen_vae_file(seed: int = 0) -> Path:
    return _cached("qwen_image_vae_random", qwen_vae_module, seed, torch.bfloat16)


def qwen_dit_file(seed: int = 0, num_layers: int = 1) -> Path:
    return _cached(
        f"qwen_image_dit_{num_layers}layer_random",
        lambda: qwen_dit_module(num_layers),
        seed,
        torch.bfloat16,
    )


def qwen_dit_narrow_file(seed: int = 0, num_layers: int = 2) -> Path:
    return _cached(
        f"qwen_image_dit_narrow_{num_layers}layer_random",
        lambda: qwen_dit_module(num_layers, **NARROW),
        seed,
        torch.bfloat16,
    )


# NewBie-image-Exp0.1's NextDiT (ComfyUI's detection for width 2304, plus its pooled CLIP
# width), and a narrow one: 4 query and 2 key/value heads of 24, text 64, CLIP 32.
NEWBIE = dict(in_channels=16, dim=2304, n_heads=24, n_kv_heads=8, cap_feat_dim=2560,
              axes_dims=[32, 32, 32], ffn_dim_multiplier=4.0, clip_text_dim=1024)  # fmt: skip
NEWBIE_NARROW = dict(in_channels=16, dim=96, n_heads=4, n_kv_heads=2, cap_feat_dim=64,
                     axes_dims=[8, 8, 8], ffn_dim_multiplier=4.0, clip_text_dim=32)  # fmt: skip


def host_takes_newbie() -> bool:
    """Whether this ComfyUI's NextDiT takes NewBie's pooled CLIP vector (v0.33; not v0.3.64)."""
    import inspect

    from comfy.ldm.lumina.model import NextDiT

    return "clip_text_dim" in inspect.signature(NextDiT.__init__).parameters


def newbie_dit_module(n_layers: int = 1, clip_text_dim=None, **config):
    """ComfyUI's NextDiT with NewBie's layout (`config`: NEWBIE by default), few blocks, on
    meta. Where the host's NextDiT lacks the pooled CLIP input, its layers are added by hand
    with the shapes newer hosts give them (a NewBie file for an older host to refuse)."""
    import comfy.ops
    from comfy.ldm.lumina.model import NextDiT

    from qwen_turbo.runtime.dit.loader import nextdit_mlp_factor

    config = {"qk_norm": True, "n_refiner_layers": 2, **(config or NEWBIE), "n_layers": n_layers}
    config["ffn_dim_multiplier"] /= nextdit_mlp_factor()  # the same file on every host
    clip = config.pop("clip_text_dim", None) if clip_text_dim is None else clip_text_dim
    takes = host_takes_newbie()
    with bench.weights_at_construction():
        m = NextDiT(device="meta", operations=comfy.ops.disable_weight_init,
                    **config, **({"clip_text_dim": clip} if clip and takes else {}))  # fmt: skip
        if hasattr(m, "norm_final"):  # v0.3.64's, unused: the same keys on every host
            del m.norm_final
        if clip and not takes:
            t = min(config["dim"], 1024)
            m.clip_text_pooled_proj = torch.nn.Sequential(
                torch.nn.RMSNorm(clip, device="meta"), torch.nn.Linear(clip, clip, device="meta")
            )
            m.time_text_embed = torch.nn.Sequential(
                torch.nn.SiLU(), torch.nn.Linear(t + clip, t, device="meta")
            )
    return m


def newbie_dit_file(seed: int = 0, n_layers: int = 1, narrow: bool = False, clip=True) -> Path:
    """A random NewBie DiT file (full width unless `narrow`); `clip=False`: Lumina-2's."""
    config = dict(NEWBIE_NARROW if narrow else NEWBIE)
    if not clip:
        config.pop("clip_text_dim")
    kind = ("newbie" if clip else "lumina2") + ("_narrow" if narrow else "")
    return _cached(
        f"{kind}_dit_{n_layers}layer_random",
        lambda: newbie_dit_module(n_layers, clip_text_dim=config.pop("clip_text_dim", 0), **config),
        seed,
        torch.bfloat16,
    )


def flux_vae_file(seed: int = 0) -> Path:
    """The Flux VAE (NewBie's, 16 latent channels) at full width, random."""
    return _cached("flux_vae_random", lambda: sd_vae_module(16), seed, torch.bfloat16)


def load_narrow_dit():
    """The narrow DiT as a plain ModelPatcher, as UNETLoader's (ComfyUI's loader reads
    full-width configs only; the pack's builder, without its kernels)."""
    from qwen_turbo.runtime.dit import files, loader

    return loader.build(*files.read_checkpoint(qwen_dit_narrow_file()))


def diffusers_folder(file: Path, root: Path, shards: int = 2) -> Path:
    """`file` re-published in the diffusers layout under root/<name>/transformer: config.json
    (the narrow config), the tensors split over `shards` safetensors files, and the index."""
    sd = load_file(str(file))
    folder = root / file.stem / "transformer"
    folder.mkdir(parents=True, exist_ok=True)
    keys = sorted(sd)
    weight_map = {}
    for i in range(shards):
        name = f"diffusion_pytorch_model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = keys[i::shards]
        save_file({k: sd[k] for k in part}, str(folder / name))
        weight_map.update(dict.fromkeys(part, name))
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    config = {"_class_name": "QwenImageTransformer2DModel", "patch_size": 2, "in_channels": 64,
              "out_channels": 16, "num_layers": len({k.split(".")[1] for k in keys
                                                     if k.startswith("transformer_blocks.")}),
              **NARROW, "axes_dims_rope": list(NARROW["axes_dims_rope"])}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    return folder.parent


def load_vae(path: Path):
    """A ComfyUI VAE object from a cached file, as VAELoader builds it."""
    import comfy.sd

    return comfy.sd.VAE(sd=load_file(str(path)))


def sd_vae(seed: int = 0):
    import comfy.sd

    return comfy.sd.VAE(sd=random_state_dict(sd_vae_module(), seed))


def sd_vae_with_latent_batch_norm():
    """ComfyUI's VAE for a random 4-channel AutoencoderKL carrying Flux 2's latent batch-norm
    statistics (`bn.*`); hosts without that norm load it without them."""
    import comfy.sd

    sd = random_state_dict(sd_vae_module(4), seed=3)
    g = torch.Generator().manual_seed(4)
    sd["bn.running_mean"] = torch.randn(16, generator=g)
    sd["bn.running_var"] = torch.rand(16, generator=g) + 0.5
    sd["bn.num_batches_tracked"] = torch.tensor(10)
    return comfy.sd.VAE(sd=sd)


def narrow_lora_file(seed: int = 0) -> Path:
    return _lora_file("qwen_image_narrow_lora_random", qwen_dit_module(2, **NARROW), seed)


def full_lora_file(seed: int = 0) -> Path:
    """A LoRA for the full-width one-layer DiT (stands in for the Lightning LoRA)."""
    return _lora_file("qwen_image_lora_random", qwen_dit_module(1), seed)


def _lora_file(name: str, module, seed: int, rank: int = 4) -> Path:
    """A LoRA (lora_up/lora_down, ComfyUI's generic key names) on the DiT's image MLPs and q
    projections, strong enough to change the output visibly."""
    path = cache_dir() / f"{name}-v{VERSION}-s{seed}.safetensors"
    if not path.exists():
        g = torch.Generator().manual_seed(seed)
        sd = {}
        for weight, p in module.state_dict().items():
            if weight.endswith(("img_mlp.net.2.weight", "attn.to_q.weight")):
                key = "diffusion_model." + weight[: -len(".weight")]
                sd[key + ".lora_up.weight"] = torch.randn(p.shape[0], rank, generator=g) * 0.3
                sd[key + ".lora_down.weight"] = torch.randn(rank, p.shape[1], generator=g) * 0.3
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        save_file({k: v.to(torch.bfloat16) for k, v in sd.items()}, str(tmp))
        tmp.replace(path)
    return path


def to_fp8mixed(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A scaled-fp8 state dict (`convert.to_scaled_fp8`) as newer ComfyUI's `fp8mixed`
    checkpoints store it: fp8 weights with `weight_scale` and a `comfy_quant` JSON entry."""
    conf = list(json.dumps({"format": "float8_e4m3fn"}).encode())
    out = {}
    for k, t in sd.items():
        if not k.endswith(".scale_weight"):
            out[k] = t
        elif sd[k[: -len("scale_weight")] + "weight"].dtype == torch.float8_e4m3fn:
            layer = k[: -len(".scale_weight")]
            out[layer + ".weight_scale"] = t.float()
            out[layer + ".comfy_quant"] = torch.tensor(conf, dtype=torch.uint8)
    return out


def qwen_dit_fp8mixed_file(seed: int = 0) -> Path:
    """The full-width one-layer DiT as an `fp8mixed` checkpoint (fp8 weights in the blocks)."""
    from qwen_turbo.runtime.dit import convert

    path = cache_dir() / f"qwen_image_dit_1layer_fp8mixed-v{VERSION}-s{seed}.safetensors"
    if not path.exists():
        sd = to_fp8mixed(convert.to_scaled_fp8(load_file(str(qwen_dit_file(seed)))))
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        save_file(sd, str(tmp))
        tmp.replace(path)
    return path


def qwen_dit_variant_file(variant: str, seed: int = 0, fp8mixed: bool = False) -> Path:
    """The full-width one-layer DiT with a variant's marker keys, as ComfyUI's model detection
    reads them: "edit_2511" (`__index_timestep_zero__`: reference tokens modulated at
    timestep 0) or "layered" (a random second timestep embedding). `fp8mixed`: stored as
    Comfy-Org ships Edit-2511 (`qwen_image_edit_2511_fp8mixed.safetensors`)."""
    from qwen_turbo.runtime.dit import config, convert

    kind = "_fp8mixed" if fp8mixed else ""
    path = cache_dir() / f"qwen_image_dit_1layer_{variant}{kind}-v{VERSION}-s{seed}.safetensors"
    if not path.exists():
        sd = load_file(str(qwen_dit_file(seed)))
        if variant == "edit_2511":
            sd[config.TIMESTEP_ZERO] = torch.tensor([])
        elif variant == "layered":
            width = sd["img_in.weight"].shape[0]
            g = torch.Generator().manual_seed(seed + 1)
            sd[config.LAYERED] = (torch.randn(2, width, generator=g) * 0.5).to(torch.bfloat16)
        else:
            raise ValueError(f"unknown variant {variant!r}")
        if fp8mixed:
            sd = to_fp8mixed(convert.to_scaled_fp8(sd))
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        save_file(sd, str(tmp))
        tmp.replace(path)
    return path


def host_runs_edit_2511() -> bool:
    """Whether this ComfyUI's Qwen-Image model takes Edit-2511's and Layered's settings
    (`default_ref_method`: v0.33, not v0.3.64)."""
    import inspect

    from comfy.ldm.qwen_image.model import QwenImageTransformer2DModel

    return "default_ref_method" in inspect.signature(QwenImageTransformer2DModel).parameters


def reference_latents(sizes, seed: int = 0, channels: int = 16) -> list[torch.Tensor]:
    """Random Qwen-Image latents (1, C, 1, H, W), one per (H, W): Edit's reference images."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, channels, 1, h, w, generator=g) for h, w in sizes]


def host_rope(freqs: torch.Tensor) -> torch.Tensor:
    """A (B, L, 1, Dh/2, 2, 2) RoPE table (ComfyUI v0.3's layout) in the layout the host's Qwen
    block takes: newer hosts apply it to (B, H, L, Dh) and take (B, 1, L, Dh/2, 2, 2)."""
    import comfy.ldm.qwen_image.model as qm

    return freqs.transpose(1, 2) if hasattr(qm, "apply_rope1") else freqs


def models_tree(root: Path) -> Path:
    """A ComfyUI models/ folder: the tiny DiTs (Qwen-Image's full width, narrow, the narrow
    one as a diffusers folder; NewBie's full width), the VAEs (Qwen-Image's, Flux's) and the
    LoRAs."""
    diffusers_folder(qwen_dit_narrow_file(), root / "diffusion_models")
    for sub, files in {
        "diffusion_models": [qwen_dit_file(), qwen_dit_narrow_file(), newbie_dit_file()],
        "vae": [qwen_vae_file(), flux_vae_file()],
        "loras": [narrow_lora_file(), full_lora_file()],
    }.items():
        d = root / sub
        d.mkdir(parents=True, exist_ok=True)
        for f in files:
            link = d / f.name
            if not link.exists():
                link.symlink_to(f)
    return root


@contextlib.contextmanager
def nan_in_block(patcher, index: int):
    """Transformer block `index` of `patcher`'s diffusion model gives NaN hidden states, off the
    NaN guard's safe path only (as an fp8 overflow would)."""
    from qwen_turbo.runtime.dit import fp8

    def hook(module, args, out):
        if fp8.in_safe_compute():
            return out
        encoder, hidden = out
        return encoder, torch.full_like(hidden, float("nan"))

    block = patcher.model.diffusion_model.transformer_blocks[index]
    handle = block.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def with_outliers(sd: dict, blocks, scale: float = 100.0, channels: int = 4) -> dict:
    """`sd` with outlier channels in the attention of `blocks`, as trained weights have: the
    first `channels` gains of each q and k RMSNorm (image and text) times `scale`, so those
    channels of q and k run `scale` times the median."""
    out = dict(sd)
    for b in blocks:
        for name in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
            key = f"transformer_blocks.{b}.attn.{name}.weight"
            key = next(k for k in sd if k.endswith(key))
            gain = sd[key].clone()
            gain[:channels] *= scale
            out[key] = gain
    return out
