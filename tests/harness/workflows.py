"""The bundled workflows, and their API graphs scaled down to run on the tiny models on CPU."""

from pathlib import Path

import numpy as np
from PIL import Image

from . import models
from .pack import ROOT

WORKFLOWS = sorted((ROOT / "workflows").glob("*.json"))
INPUT_IMAGE = "qwen_turbo_test_input.png"  # LoadImage's picture on the tiny models
# Full-size side -> CPU side (latent 8x smaller; both multiples of 16).
SCALED = {2512: 64, 1328: 32, 2048: 64, 1536: 48, 1024: 32}
# NewBie's text features: Gemma-3-4B's width, and Jina CLIP v2's pooled vector
NEWBIE_TEXT = {"width": 2560, "pooled": 1024}


def is_newbie(api: dict) -> bool:
    return any(n["inputs"].get("type") == "newbie" for n in api.values())


def scaled_for_cpu(api: dict) -> dict:
    """The graph on the tiny models: CLIP nodes -> test conditioning (Qwen-Image-Edit's text
    encoder: test conditioning with the VAE-encoded picture as reference latent, as the node
    encodes it), files -> tiny files, sizes per SCALED, 2 steps."""
    files = {
        "unet_name": models.qwen_dit_file().name,
        "vae_name": models.qwen_vae_file().name,
        "lora_name": models.full_lora_file().name,
        "image": INPUT_IMAGE,
    }
    newbie = is_newbie(api)
    if newbie:  # full width: ComfyUI's UNETLoader reads NewBie's stock config only
        files |= {
            "unet_name": models.newbie_dit_file().name,
            "vae_name": models.flux_vae_file().name,
        }
    encoded = NEWBIE_TEXT if newbie else {"width": 3584}
    edit_2511 = models.qwen_dit_variant_file("edit_2511").name
    out = {}
    for node_id, node in api.items():
        kind, inputs = node["class_type"], dict(node["inputs"])
        if kind in ("CLIPLoader", "DualCLIPLoader"):
            continue
        if kind in ("CLIPTextEncode", "TextEncodeQwenImageEditPlus"):
            seed = int(node_id)  # different seeds and lengths for the two prompts
            cond = {"seed": seed, "tokens": 8 + seed, **encoded}
            images = [inputs[k] for k in ("image1", "image2", "image3") if k in inputs]
            text = f"{node_id}.text" if images else node_id
            out[text] = {"class_type": "QwenTurboTestConditioning", "inputs": cond}
            for i, image in enumerate(images):  # a chain of ReferenceLatent; its end: node_id
                encode = {"pixels": image, "vae": inputs["vae"]}
                out[f"{node_id}.vae{i}"] = {"class_type": "VAEEncode", "inputs": encode}
                ref = node_id if i == len(images) - 1 else f"{node_id}.ref{i}"
                refs = {"conditioning": [text, 0], "latent": [f"{node_id}.vae{i}", 0]}
                out[ref], text = {"class_type": "ReferenceLatent", "inputs": refs}, ref
            continue
        for name in inputs:
            if name in files and isinstance(inputs[name], str):  # not a link
                inputs[name] = edit_2511 if "edit_2511" in inputs[name] else files[name]
            elif name in ("width", "height"):
                inputs[name] = SCALED[inputs[name]]
            elif name == "steps":
                inputs[name] = 2
        out[node_id] = {"class_type": kind, "inputs": inputs}
    return out


def put_input_image(folder: Path) -> None:
    """INPUT_IMAGE in ComfyUI's input `folder`: a gradient with seeded noise."""
    folder.mkdir(exist_ok=True)
    ramp = np.linspace(0, 255, 96)
    pixels = np.stack([*np.meshgrid(ramp, ramp[::-1]), np.full((96, 96), 128.0)], axis=-1)
    pixels += np.random.default_rng(0).normal(0, 20, pixels.shape)
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(folder / INPUT_IMAGE)


def link_edit_2511(models_dir: Path) -> None:
    """The tiny Qwen-Image-Edit-2511 DiT among the models' diffusion_models."""
    edit_2511 = models.qwen_dit_variant_file("edit_2511")
    (models_dir / "diffusion_models" / edit_2511.name).unlink(missing_ok=True)
    (models_dir / "diffusion_models" / edit_2511.name).symlink_to(edit_2511)
