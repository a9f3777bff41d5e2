"""The pack inside a real ComfyUI server: it loads, and bundled-style workflows run."""

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.harness.workflow import ui_to_api

WORKFLOWS = Path(__file__).parent / "workflows"


def test_pack_loads_without_errors(comfy_server):
    log = comfy_server.log_text()
    assert "IMPORT FAILED" not in log, log[-3000:]
    info = comfy_server.get("/object_info")
    for node_id, name in [
        ("QwenTurboFusedNormPatch", "Fused GroupNorm Patch"),
        ("QwenTurboTextureUpsample", "Texture Upsample"),
    ]:
        assert info[node_id]["display_name"] == name
        assert info[node_id]["output"] == ["VAE"]
    info = info["QwenTurboVAEDecodeTiled"]
    assert info["display_name"] == "VAE Tiling"
    assert list(info["input"]["required"]) == ["samples", "vae"]
    assert list(info["input"]["optional"]) == ["tile_size", "vram_budget_gb"]
    assert info["output"] == ["IMAGE"]
    assert any("qwen_turbo" in e for e in comfy_server.get("/extensions"))


def test_ui_to_api_checks_the_graph(comfy_server):
    info = comfy_server.get("/object_info")
    ui = json.loads((WORKFLOWS / "tiny_qwen_vae.json").read_text())
    api = ui_to_api(ui, info)
    assert api["6"]["inputs"]["steps"] == 2 and api["6"]["inputs"]["model"] == ["2", 0]
    assert api["9"]["inputs"] == {"tile_size": 32, "vram_budget_gb": 0.0, "samples": ["6", 0],
                                  "vae": ["7", 0]}  # fmt: skip
    ui["nodes"][8]["widgets_values"] = [32]
    with pytest.raises(ValueError, match="1 widget values, expected 2"):
        ui_to_api(ui, info)
    ui["nodes"][8]["type"] = "NoSuchNode"
    with pytest.raises(ValueError, match="unknown node type 'NoSuchNode'"):
        ui_to_api(ui, info)


def _pixels(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"), dtype=np.int16)


def test_vae_workflow_matches_stock_decode(comfy_server):
    """Tiny Qwen DiT -> KSampler -> stock VAEDecode, VAE Tiling (32-px tiles), and VAE Tiling
    on a VAE through Fused GroupNorm Patch and Texture Upsample."""
    ui = json.loads((WORKFLOWS / "tiny_qwen_vae.json").read_text())
    entry = comfy_server.run(ui_to_api(ui, comfy_server.get("/object_info")))
    (stock,) = comfy_server.images(entry, "10")
    ref = _pixels(stock)
    assert ref.shape == (56, 80, 3)
    assert ref.std() > 5, "the decoded image is flat; the comparison would prove nothing"
    for node_id in ("11", "15"):
        (path,) = comfy_server.images(entry, node_id)
        assert np.abs(_pixels(path) - ref).max() <= 2  # 2/255


def test_cuda_graph_sampler_workflow_equals_ksampler(comfy_server):
    """Same inputs through KSampler and CUDA Graph Sampler (cond and uncond of different
    lengths, dpmpp_2m/karras): on CPU the two must give the same picture."""
    ui = json.loads((WORKFLOWS / "tiny_qwen_sampler.json").read_text())
    info = comfy_server.get("/object_info")["QwenTurboCUDAGraphSampler"]
    assert info["display_name"] == "CUDA Graph Sampler"
    entry = comfy_server.run(ui_to_api(ui, comfy_server.get("/object_info")))
    (ref,) = comfy_server.images(entry, "11")
    (out,) = comfy_server.images(entry, "12")
    a = _pixels(ref)
    assert a.std() > 5 and np.array_equal(a, _pixels(out))
