"""ComfyUI's own Qwen-Image templates (package comfyui-workflow-templates-json, which ComfyUI
v0.33.0's requirements pin through comfyui-workflow-templates): their pipeline sits in a
subgraph, with v0.33's If/Else Switch. And their API graphs made to run on the tiny models."""

import importlib.util
from pathlib import Path

import pytest

from .workflows import scaled_for_cpu

TEMPLATES = ("image_qwen_image", "image_qwen_Image_2512", "image_qwen_image_edit_2511")
PACKAGE = "comfyui_workflow_templates_json"


def template(name: str) -> Path:
    """The template's file; skips where the package is not installed."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        pytest.skip(f"{PACKAGE} is not installed (pip install comfyui-workflow-templates-json)")
    path = Path(spec.origin).parent / "templates" / f"{name}.json"
    if not path.is_file():
        pytest.skip(f"this {PACKAGE} has no {path.name}")
    return path


def scaled_template(api: dict) -> dict:
    """`scaled_for_cpu` on a template's API graph: ids renumbered 1.. (the frontend's
    `238:226` ids; scaled_for_cpu seeds each prompt from its id), the Edit template's
    FluxKontextImageScale (to about 1024²) scaling to 64² instead."""
    ids = {old: str(i) for i, old in enumerate(api, start=1)}
    renumbered = {
        ids[old]: {"class_type": node["class_type"],
                   "inputs": {k: [ids[v[0]], v[1]] if isinstance(v, list) else v
                              for k, v in node["inputs"].items()}}
        for old, node in api.items()
    }  # fmt: skip
    out = scaled_for_cpu(renumbered)
    for node in out.values():
        if node["class_type"] == "FluxKontextImageScale":
            node["class_type"] = "ImageScale"
            node["inputs"] |= {"upscale_method": "area", "width": 64, "height": 64,
                               "crop": "disabled"}  # fmt: skip
    return out
