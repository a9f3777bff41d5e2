"""benchmarks/card_workflow.py on CPU: the stock and pack API graphs it makes from every bundled
workflow pass ComfyUI's validation at full size; an Edit workflow runs end to end on the tiny
models through the executor with the benchmark's Recorder and run_once, stock and pack; the
test Edit conditioning hands the VAE the pixels TextEncodeQwenImageEditPlus hands it."""

import asyncio
import importlib.util
import sys

import execution
import folder_paths
import numpy as np
import pytest
import torch
from comfy_extras.nodes_qwen import TextEncodeQwenImageEditPlus
from PIL import Image
from safetensors.torch import load_file

import nodes
from qwen_turbo.cli import headless
from qwen_turbo.cli.stock import PATCHES
from qwen_turbo.nodes import NODES
from tests import testing_nodes
from tests.harness import models
from tests.harness.comfyui import ROOT
from tests.harness.workflows import WORKFLOWS


def _load(name: str):
    """A benchmark script as module `name` (soak imports card_workflow by that name)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


card = _load("card_workflow")
soak = _load("soak")
session = _load("session")


@pytest.fixture
def comfy(tmp_path, monkeypatch):
    """The executor's node table with the pack and test nodes; model folders whose files carry
    the bundled workflows' names (links to the tiny models); input and output in tmp_path."""
    asyncio.run(nodes.init_extra_nodes(init_custom_nodes=False, init_api_nodes=False))
    for cls in [*NODES, testing_nodes.TestConditioning, testing_nodes.TestEditConditioning]:
        monkeypatch.setitem(nodes.NODE_CLASS_MAPPINGS, cls.define_schema().node_id, cls)
    tiny = {"vae": models.qwen_vae_file(), "loras": models.full_lora_file()}
    for path in WORKFLOWS:
        for node in card.prompts(path)["pack"].values():
            for key, name in node["inputs"].items():
                kind = {"unet_name": "diffusion_models", "vae_name": "vae", "lora_name": "loras"}
                if key not in kind:
                    continue
                link = tmp_path / "models" / kind[key] / name
                link.parent.mkdir(parents=True, exist_ok=True)
                if not link.exists():
                    dit = (models.qwen_dit_variant_file("edit_2511") if "2511" in name
                           else models.qwen_dit_file())  # fmt: skip
                    link.symlink_to(tiny.get(kind[key], dit))
        card.write_pictures(tmp_path / "input", card.prompts(path)["pack"])
    for kind in ("diffusion_models", "vae", "loras"):
        paths = ([str(tmp_path / "models" / kind)], {".safetensors"})
        monkeypatch.setitem(folder_paths.folder_names_and_paths, kind, paths)
    monkeypatch.setattr(folder_paths, "filename_list_cache", {})
    monkeypatch.setattr(folder_paths, "input_directory", str(tmp_path / "input"))
    monkeypatch.setattr(folder_paths, "output_directory", str(tmp_path / "output"))
    return tmp_path


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_graphs_validate_at_full_size(comfy, path):
    variants = card.prompts(path)
    for variant, api in variants.items():
        valid, error, outputs, node_errors = asyncio.run(
            execution.validate_prompt("card", api, None)
        )
        assert valid and not node_errors, (variant, error, node_errors)
        save = "SaveImage" if variant.startswith("stock") else "QwenTurboSaveImage"
        assert [api[k]["class_type"] for k in outputs] == [save]
        batch, channels, frames, height, width = card.latent_shape(api)
        assert (batch, channels, frames) == (1, 16, 1) and height * width >= 128**2, path.stem
    kinds = {v: {n["class_type"] for n in api.values()} for v, api in variants.items()}
    assert not kinds["stock"] & {"QwenTurboLoader", "QwenTurboCUDAGraphSampler",
                                 "QwenTurboVAEDecodeTiled", "QwenTurboVAEEncodeTiled",
                                 "QwenTurboSaveImage", *PATCHES}  # fmt: skip
    assert "TextEncodeQwenImageEditPlus" not in kinds["pack"] | kinds["stock"]
    assert not {"CLIPLoader", "CLIPTextEncode"} & (kinds["pack"] | kinds["stock"])
    if "edit" in path.stem:
        assert {"QwenTurboVAEEncodeTiled", "QwenTurboTestEditConditioning"} <= kinds["pack"]
        assert {"VAEEncode", "LoadImage", "QwenTurboTestEditConditioning"} <= kinds["stock"]
    assert kinds["stock+fp8_fast"] == kinds["stock"]
    dtypes = {n["inputs"]["weight_dtype"] for n in variants["stock+fp8_fast"].values()
              if n["class_type"] == "UNETLoader"}  # fmt: skip
    assert dtypes == {"fp8_e4m3fn_fast"}
    mixed = kinds["pack+VAEDecode"]
    assert "VAEDecode" in mixed and "QwenTurboVAEDecodeTiled" not in mixed
    assert mixed - {"VAEDecode"} == kinds["pack"] - {"QwenTurboVAEDecodeTiled"}


def test_soak_cycles_sizes_batches_and_the_lora(comfy):
    """soak.py's 20 runs: every size with the LoRA on and off, batches 1 and 2, run 2 and run
    20 the same case; each graph, the LoRA bypassed or not, passes ComfyUI's validation."""
    cases = [soak.case(run, batch_2512=1) for run in range(1, 21)]
    assert cases[1] == cases[19]
    for size in soak.SIZES:
        assert {lora for w, h, _, lora in cases if (w, h) == size} == {True, False}
    assert {b for w, _, b, _ in cases if w != 2512} == {1, 2}
    assert {b for w, _, b, _ in cases if w == 2512} == {1}
    assert {soak.case(r, batch_2512=2)[2] for r in range(1, 21)} == {1, 2}
    api = card.prompts(ROOT / "workflows" / f"{soak.WORKFLOW}.json")["pack"]
    for width, height, batch, lora in cases[: soak.CYCLE]:
        run = soak.variant(api, width, height, batch, lora)
        valid, error, _, node_errors = asyncio.run(execution.validate_prompt("soak", run, None))
        assert valid and not node_errors, (width, lora, error, node_errors)
        kinds = [n["class_type"] for n in run.values()]
        assert kinds.count("LoraLoaderModelOnly") == lora
        (latent,) = [n["inputs"] for n in run.values() if n["class_type"] == "EmptySD3LatentImage"]
        assert (latent["width"], latent["height"], latent["batch_size"]) == (width, height, batch)
    assert api == card.prompts(ROOT / "workflows" / f"{soak.WORKFLOW}.json")["pack"]


@pytest.mark.slow
def test_session_runs_every_action_through_one_executor(comfy, monkeypatch):
    """session.py's session on the tiny models (sizes 16-32², 2 steps, test conditioning), the
    pack's graphs: the turbo workflow, then the 1328² one and back; every action
    done: new seeds, prompts of three lengths, sizes ending at the workflow's own, the LoRA
    changed, removed and back, ComfyUI's /free then a run, an interrupt at the second step
    that stops the run without an error, then a run that completes."""
    monkeypatch.setattr(session, "SIZES", [(16, 16), (32, 16), (32, 32)])
    args = type("Args", (), {"text_encoder": "test", "steps": 2})()
    for variant in ("pack",):
        workflows = {}
        for name in ("qwen_image_2512_turbo_2512px", "qwen_image_2512_t2i_1328px"):
            api = session.session_graph(args, name, variant)
            card.set_latent(api, 1, 32)
            for node in api.values():
                if node["class_type"] == "QwenTurboTestConditioning":
                    node["inputs"]["tokens"] = 8
            workflows[name] = api
        planned = session.actions(workflows)
        names = [a for a, _ in planned]
        assert names[:5] == ["first run, new install", "new seed", "new prompt (5 words)",
                             "new prompt (24 words)", "new prompt (68 words)"]  # fmt: skip
        assert names[5:8] == ["new size 16x16", "new size 32x16", "new size 32x32"]
        assert names[8:11] == ["LoRA strength 0.6", "LoRA removed", "LoRA back"]
        kinds = {a: [n["class_type"] for n in g.values()] for a, g in planned}
        assert "LoraLoaderModelOnly" not in kinds["LoRA removed"]
        assert "LoraLoaderModelOnly" in kinds["LoRA back"]
        from qwen_turbo.nodes import report

        send = report.send
        rows = list(session.run_session(workflows))
        assert report.send is send  # the badges' sender given back
        assert [r["action"] for r in rows] == names
        assert all(r["done"] for r in rows), [(r["action"], r["error"]) for r in rows]
        interrupted = rows[names.index("interrupt")]
        assert not interrupted["ok"] and interrupted["error"] is None  # stopped, cleanly
        assert rows[names.index("after interrupt")]["ok"]
        assert "QwenTurboLoader" in rows[names.index("free")]["nodes"]  # loaded again
        assert "QwenTurboLoader" not in rows[names.index("after interrupt")]["nodes"]
        steps = {r["action"]: r["nodes"] for r in rows}
        assert "QwenTurboTestConditioning" in steps["new prompt (5 words)"]
        assert "QwenTurboTestConditioning" not in steps["new seed"]
    table = session.table([{**r, "variant": "pack", "card_gib": 24} for r in rows], True)
    assert table[0] == "| card | action | stock | pack | pack / stock |"
    assert len(table) == 2 + len(rows)


def test_edit_workflow_runs_stock_and_pack(comfy):
    """qwen_image_edit_2509_2512px at 32² (references at 32², 1 step, 8 + 4 tokens): both
    variants finish, the encodes run as nodes, a second run (a new seed) reruns only the
    sampler and what follows it, and a third (a new prompt) the conditioning as well."""
    variants = card.prompts(ROOT / "workflows" / "qwen_image_edit_2509_2512px.json")
    for variant in ("stock", "pack"):
        api = variants[variant]
        for node in api.values():
            kind, i = node["class_type"], node["inputs"]
            i.update({"width": 32, "height": 32} if kind == "ImageScale" else {})
            if kind == "QwenTurboTestEditConditioning":
                i.update(tokens=8, vision_tokens=4, reference_side=32)
            i.update({"steps": 1} if "steps" in i else {})
        server = card.Recorder()
        executor = headless._executor(execution, server)
        first = card.run_once(executor, server, api, 1, 0)
        assert first["ok"] and first["error"] is None, (variant, first)
        encode = "QwenTurboVAEEncodeTiled" if variant == "pack" else "VAEEncode"
        sampler = "QwenTurboCUDAGraphSampler" if variant == "pack" else "KSampler"
        assert {encode, sampler, "QwenTurboTestEditConditioning"} <= first["nodes"].keys()
        assert card.comfy_estimate_gib(api) is not None  # the documented command's estimate
        assert first["loaded_mb"]["QwenImage"] > 0  # the DiT's share as ComfyUI counts it
        later = card.run_once(executor, server, api, 2, 0)
        assert later["ok"], (variant, later)
        assert sampler in later["nodes"] and encode not in later["nodes"]
        assert "QwenTurboTestEditConditioning" not in later["nodes"]
        card.new_prompt(api, 3)
        prompt = card.run_once(executor, server, api, 3, 0)
        assert prompt["ok"], (variant, prompt)
        assert {sampler, "QwenTurboTestEditConditioning"} <= prompt["nodes"].keys()
        assert encode not in prompt["nodes"]
    saved = sorted((comfy / "output").glob("*.png"))
    assert len(saved) == 6
    assert all(Image.open(p).size == (32, 32) for p in saved)


class _RecordingVAE:
    """Records the pixels a node encodes; gives a latent of their size (no weights run)."""

    def __init__(self):
        self.pixels = []

    def encode(self, pixels):
        self.pixels.append(pixels)
        return torch.zeros(1, 16, 1, pixels.shape[1] // 8, pixels.shape[2] // 8)


class _Clip:
    def tokenize(self, text, images=(), **kwargs):
        return len(images)

    def encode_from_tokens_scheduled(self, n_images):
        return [[torch.zeros(1, 5, 8), {}]]


def test_edit_conditioning_encodes_what_the_host_node_encodes():
    g = np.random.default_rng(0)
    images = [torch.from_numpy(g.random((1, h, w, 3), dtype=np.float32))
              for h, w in ((1536, 2048), (333, 517))]  # fmt: skip
    host, ours = _RecordingVAE(), _RecordingVAE()
    (want,) = TextEncodeQwenImageEditPlus.execute(_Clip(), "edit", host, *images).result
    (got,) = testing_nodes.TestEditConditioning.execute(7, 10, 64, 196, 1024, ours, *images).result
    assert len(ours.pixels) == len(host.pixels) == 2
    for a, b in zip(ours.pixels, host.pixels, strict=True):
        assert a.shape == b.shape and torch.equal(a, b)
    assert [r.shape for r in got[0][1]["reference_latents"]] == [
        r.shape for r in want[0][1]["reference_latents"]
    ]
    assert got[0][0].shape == (1, 10 + 2 * 196, 64)


def test_write_models_writes_the_files_the_workflows_name(comfy, monkeypatch):
    """Edit-2509's file: every matrix fp8; Edit-2511's: fp8mixed with the marker key, read as
    index_timestep_zero; the LoRA on every block linear, written where only it is missing."""
    from qwen_turbo.cli import bench
    from qwen_turbo.runtime.dit import config, convert

    small = bench.qwen_dit_state_dict
    monkeypatch.setattr(
        bench, "qwen_dit_state_dict", lambda layers, device: small(1, "cpu", **bench.NARROW)
    )
    methods, root = {}, comfy / "written"
    for name in ("qwen_image_edit_2509_2512px", "qwen_image_edit_2511_2512px"):
        api = card.prompts(ROOT / "workflows" / f"{name}.json")["pack"]
        names = {k: v for n in api.values() for k, v in n["inputs"].items() if k.endswith("_name")}
        card.write_models(root, api)
        sd = load_file(str(root / "diffusion_models" / names["unet_name"]))
        matrices = {k: t.dtype for k, t in sd.items() if t.ndim == 2}
        blocks = {k for k in matrices if k.startswith("transformer_blocks.")}
        assert all(matrices[k] == torch.float8_e4m3fn for k in blocks)
        if "2511" in name:
            assert any(k.endswith(".comfy_quant") for k in sd)
            assert all(matrices[k] == torch.bfloat16 for k in matrices.keys() - blocks)
        else:
            assert set(matrices.values()) == {torch.float8_e4m3fn}
        methods[name] = config.read_config(convert.from_mixed(sd)).default_ref_method
        lora = root / "loras" / names["lora_name"]
        assert len(load_file(str(lora))) == 2 * len(blocks)
        lora.unlink()
        card.write_models(root, api)
        assert lora.exists()
    assert methods == {
        "qwen_image_edit_2509_2512px": "index",
        "qwen_image_edit_2511_2512px": "index_timestep_zero",
    }


def test_random_models_have_every_weight_with_dynamic_vram(monkeypatch):
    """With dynamic VRAM on (v0.33's main.py), ComfyUI's Linear and Conv make their weights
    only when they load one; the random models the benchmarks write still have them all."""
    from qwen_turbo.cli import bench

    memory = pytest.importorskip("comfy.memory_management", reason="no dynamic VRAM here")
    want = (bench.qwen_dit_state_dict(1, "cpu", **bench.NARROW).keys(),
            bench.random_state_dict(bench.qwen_vae_module(), 0).keys())  # fmt: skip
    monkeypatch.setattr(memory, "aimdo_enabled", True)
    got = (bench.qwen_dit_state_dict(1, "cpu", **bench.NARROW).keys(),
           bench.random_state_dict(bench.qwen_vae_module(), 0).keys())  # fmt: skip
    assert got == want and "img_in.weight" in got[0]
    assert memory.aimdo_enabled  # set back


def test_set_latent_sizes_the_empty_latent(comfy):
    """--batch and --size reach the empty latent, and the graph still validates."""
    api = card.prompts(ROOT / "workflows" / "qwen_image_2512_turbo_2512px.json")["pack"]
    card.set_latent(api, 4, 1328)
    (latent,) = [n["inputs"] for n in api.values() if n["class_type"] == "EmptySD3LatentImage"]
    assert (latent["batch_size"], latent["width"], latent["height"]) == (4, 1328, 1328)
    valid, error, _, node_errors = asyncio.run(execution.validate_prompt("batch", api, None))
    assert valid and not node_errors, (error, node_errors)
    card.set_latent(api, 2, None)
    assert (latent["batch_size"], latent["width"]) == (2, 1328)


def test_set_steps_reaches_every_sampler_of_both_variants(comfy):
    """--steps: the hires workflow's two samplers, pack and stock, and the graph validates."""
    variants = card.prompts(ROOT / "workflows" / "qwen_image_2512_hires_2512px.json")
    for name in ("pack", "stock"):
        api = variants[name]
        card.set_steps(api, 3)
        samplers = [n["inputs"] for n in api.values() if "steps" in n["inputs"]]
        assert len(samplers) == 2 and all(s["steps"] == 3 for s in samplers)
        assert {s["denoise"] for s in samplers} == {1.0, 0.55}
        valid, error, _, node_errors = asyncio.run(execution.validate_prompt(name, api, None))
        assert valid and not node_errors, (error, node_errors)


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_new_prompt_changes_each_samplers_positive_only(comfy, path):
    """The harness's new-prompt run: with the real text encode nodes their text changes, with
    the test conditioning its seed; negatives and everything else stay."""
    for text_encoder in (True, False):
        api = card.prompts(path, text_encoder)["pack"]
        before = {k: dict(n["inputs"]) for k, n in api.items()}
        card.new_prompt(api, 1)
        positives = {n["inputs"]["positive"][0] for n in api.values() if "steps" in n["inputs"]}
        changed = {k for k, n in api.items() if n["inputs"] != before[k]}
        assert changed == positives, (text_encoder, changed, positives)
