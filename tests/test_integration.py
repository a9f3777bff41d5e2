"""The pack inside a real ComfyUI server: it loads, and bundled-style workflows run."""

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from qwen_turbo.cli.workflow import ui_to_api
from tests.harness import models

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
    ui["nodes"][8]["widgets_values"] = [32]  # saved before the optional budget existed
    assert ui_to_api(ui, info)["9"]["inputs"] == {"tile_size": 32, "samples": ["6", 0],
                                                  "vae": ["7", 0]}  # fmt: skip
    ui["nodes"][8]["widgets_values"] = [32, 0.0, 1]
    with pytest.raises(ValueError, match="3 widget values, expected 2"):
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


def _loader_prompt() -> dict:
    """Optimized Loader next to UNETLoader (full width, one layer), and on the narrow DiT as a
    file, as a diffusers folder and with a LoRA; each sampled by the stock KSampler."""
    full = models.qwen_dit_file().name
    narrow = models.qwen_dit_narrow_file()
    prompt = {
        "1": ("QwenTurboLoader", {"unet_name": full, "weight_dtype": "auto", "attention": "sdpa",
                                  "fused_kernels": True, "compile": "off"}),
        "2": ("UNETLoader", {"unet_name": full, "weight_dtype": "default"}),
        "3": ("QwenTurboLoader", {"unet_name": narrow.name, "weight_dtype": "bf16",
                                  "attention": "auto", "fused_kernels": True, "compile": "off"}),
        "4": ("QwenTurboLoader", {"unet_name": narrow.stem + "/", "weight_dtype": "bf16",
                                  "attention": "auto", "fused_kernels": True, "compile": "off"}),
        "5": ("LoraLoaderModelOnly", {"model": ["3", 0], "strength_model": 1.0,
                                      "lora_name": models.narrow_lora_file().name}),
        "6": ("EmptySD3LatentImage", {"width": 64, "height": 48, "batch_size": 1}),
        "7": ("VAELoader", {"vae_name": models.qwen_vae_file().name}),
    }  # fmt: skip
    for width, cond in ((3584, "c_full"), (64, "c_narrow")):
        prompt[cond + "+"] = ("QwenTurboTestConditioning", {"seed": 1, "tokens": 8, "width": width})
        prompt[cond + "-"] = ("QwenTurboTestConditioning", {"seed": 2, "tokens": 8, "width": width})
    for model, cond in (("1", "c_full"), ("2", "c_full"), ("3", "c_narrow"), ("4", "c_narrow"),
                        ("5", "c_narrow")):  # fmt: skip
        prompt["k" + model] = ("KSampler", {
            "model": [model, 0], "seed": 3, "steps": 2, "cfg": 2.0, "sampler_name": "euler",
            "scheduler": "simple", "positive": [cond + "+", 0], "negative": [cond + "-", 0],
            "latent_image": ["6", 0], "denoise": 1.0})  # fmt: skip
        prompt["d" + model] = ("VAEDecode", {"samples": ["k" + model, 0], "vae": ["7", 0]})
        prompt["s" + model] = ("SaveImage", {"images": ["d" + model, 0], "filename_prefix": model})
    return {k: {"class_type": c, "inputs": i} for k, (c, i) in prompt.items()}


def test_optimized_loader_workflow(comfy_server):
    info = comfy_server.get("/object_info")["QwenTurboLoader"]
    assert info["display_name"] == "Optimized Loader" and info["output"] == ["MODEL"]
    names = info["input"]["required"]["unet_name"][1]["options"]
    assert models.qwen_dit_narrow_file().stem + "/" in names  # the diffusers folder is listed
    entry = comfy_server.run(_loader_prompt())
    pixels = {m: _pixels(comfy_server.images(entry, "s" + m)[0]) for m in "12345"}
    assert pixels["2"].std() > 5 and pixels["3"].std() > 5
    assert np.abs(pixels["1"] - pixels["2"]).max() <= 2  # ours vs UNETLoader: same picture
    assert np.array_equal(pixels["3"], pixels["4"])  # the folder holds the file's weights
    assert np.abs(pixels["5"] - pixels["3"]).mean() > 2  # the LoRA took effect


def test_nodes_report_stats_to_the_frontend(comfy_server):
    """Each pack node sends qwen_turbo.node_stats (what the badge shows) to the prompt's
    client over the websocket: seconds, and the sampler's graph status."""
    import asyncio

    import aiohttp

    info = comfy_server.get("/object_info")
    apis = [ui_to_api(json.loads((WORKFLOWS / name).read_text()), info)
            for name in ("tiny_qwen_vae.json", "tiny_qwen_sampler.json")]  # fmt: skip
    apis[0]["6"]["inputs"]["seed"] += 1  # not cached from the other tests
    apis[1]["7"]["inputs"]["seed"] += 1

    async def listen():
        url = comfy_server.url.replace("http", "ws") + "/ws?clientId=qwen-turbo-tests"
        stats = {}
        async with aiohttp.ClientSession() as session, session.ws_connect(url) as ws:
            loop = asyncio.get_running_loop()
            run = loop.run_in_executor(None, lambda: [comfy_server.run(a) for a in apis])
            while not run.done():
                try:
                    msg = await ws.receive_json(timeout=1)
                except asyncio.TimeoutError:
                    continue
                if msg["type"] == "qwen_turbo.node_stats":
                    stats.setdefault(msg["data"]["node"], []).append(msg["data"])
            await run
        return stats

    stats = asyncio.run(listen())
    assert {"9", "12", "13", "14"} <= set(stats), stats  # VAE Tiling x2, the two patches
    assert [s["patched"] > 0 for s in stats["12"] + stats["13"]] == [True, True]
    (sampler,) = stats["7"]  # the CUDA Graph Sampler of the second workflow
    assert sampler["graphs"] == "off (runs on cpu)" and sampler["seconds"] > 0
    assert all(s["peak_vram_gib"] is None for runs in stats.values() for s in runs)
