"""Reading a DiT checkpoint: a safetensors file or a diffusers folder in ComfyUI's
diffusion_models folders, with errors that name the fix for missing or damaged files."""

import json
from pathlib import Path

import comfy.utils
import folder_paths
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from . import nextdit
from .config import TIMESTEP_ZERO, DiTConfig, read_config
from .convert import from_mixed, strip_prefix

FOLDER = "diffusion_models"


class Unreadable(ValueError):
    """A checkpoint file that cannot be read: truncated, corrupt, or not safetensors."""


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


def model_names() -> list[str]:
    """UNETLoader's list, plus diffusers-layout folders (shown with a trailing '/')."""
    names = list(folder_paths.get_filename_list(FOLDER))
    for root in folder_paths.get_folder_paths(FOLDER):
        root = Path(root)
        if root.is_dir():
            dirs = sorted(p for p in root.iterdir() if p.is_dir())
            names += [p.name + "/" for p in dirs if diffusers_folder(p)]
    return names


def resolve(name: str) -> Path:
    """The file or folder `name` (as listed by `model_names`), or FileNotFoundError saying
    where it should be."""
    roots = [Path(p) for p in folder_paths.get_folder_paths(FOLDER)]
    if name.endswith("/"):
        for root in roots:
            if diffusers_folder(root / name.rstrip("/")):
                return root / name.rstrip("/")
    elif (path := folder_paths.get_full_path(FOLDER, name)) is not None:
        return Path(path)
    where = ", ".join(str(r) for r in roots) or "models/diffusion_models"
    raise FileNotFoundError(
        f"{name!r} was not found in {where}. Put the Qwen-Image DiT there: "
        "qwen_image_2512_bf16.safetensors or qwen_image_2512_fp8_e4m3fn.safetensors "
        "(https://huggingface.co/Comfy-Org/Qwen-Image_ComfyUI), or a diffusers folder with "
        "transformer/config.json and its safetensors shards; or NewBie-image's "
        "NewBie-Image-Exp0.1-bf16.safetensors (https://huggingface.co/Comfy-Org/NewBie-image-Exp0.1_repackaged)."
    )


def read_checkpoint(path: Path) -> tuple[dict, DiTConfig | nextdit.NextDiTConfig]:
    """The DiT state dict (ComfyUI key names) and its config (Qwen-Image's, or NewBie's and
    Lumina-2's NextDiT), from a file or a diffusers folder (Qwen-Image)."""
    rope_axes, metadata = None, None
    try:
        if path.is_dir():
            sd, config = load_diffusers_folder(diffusers_folder(path))
            rope_axes = config.get("axes_dims_rope")
        else:
            sd, metadata = comfy.utils.load_torch_file(str(path), return_metadata=True)
    except (FileNotFoundError, PermissionError):
        raise
    except (SafetensorError, OSError, ValueError, KeyError) as e:  # KeyError: index sans weight_map
        what = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise Unreadable(
            f"cannot read {path} ({what}): truncated, corrupt or not safetensors. Download it "
            "again and check its size."
        ) from e
    sd = from_mixed(strip_prefix(sd), metadata)
    return sd, nextdit.read_config(sd) if nextdit.is_nextdit(sd) else read_config(sd, rope_axes)
