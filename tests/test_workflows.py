"""The bundled workflows: each passes the frontend's schema rules, validates at full size
against the real server's /object_info, and runs end to end on the tiny random models through
the real executor (the text encoder replaced by the test conditioning node, sizes and steps
scaled down for CPU)."""

import json
import re
import uuid
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from qwen_turbo.cli import convert
from qwen_turbo.cli.subgraphs import WorkflowError
from qwen_turbo.cli.workflow import ui_to_api
from tests.harness import models
from tests.harness.comfyui import ROOT
from tests.harness.templates import TEMPLATES, scaled_template, template
from tests.harness.workflows import (
    SCALED,
    WORKFLOWS,
    is_newbie,
    link_edit_2511,
    put_input_image,
    scaled_for_cpu,
)

LOADERS = {"QwenTurboLoader", "CLIPLoader", "DualCLIPLoader", "VAELoader", "LoraLoaderModelOnly"}
FILE_INPUTS = {"unet_name", "clip_name", "clip_name1", "clip_name2", "vae_name", "lora_name",
               "image"}  # fmt: skip
# What the frontend's zod schema for workflow version 0.4 requires (workflowSchema.ts:
# zComfyWorkflow and zComfyNode); test_schema_rules_are_the_frontends checks them against the
# installed frontend. Its `id` is optional, but must be a UUID when present.
REQUIRED = {
    "workflow": {"last_node_id", "last_link_id", "nodes", "links", "version"},
    "node": {"id", "type", "pos", "size", "flags", "order", "mode", "properties"},
}
ALL_UI = [*WORKFLOWS, *sorted((ROOT / "tests" / "workflows").glob("*.json"))]


def test_every_expected_workflow_is_bundled():
    names = {p.name for p in WORKFLOWS}
    assert names == {
        "qwen_image_2512_t2i_2512px.json",
        "qwen_image_2512_turbo_2512px.json",
        "qwen_image_2512_hires_2512px.json",
        "qwen_image_2512_t2i_1328px.json",
        "qwen_image_edit_2509_2512px.json",
        "qwen_image_edit_2511_2512px.json",
        "newbie_image_exp0.1_1024px.json",
        "newbie_image_exp0.1_2048px.json",
    }


@pytest.mark.parametrize("path", ALL_UI, ids=lambda p: p.stem)
def test_workflow_passes_the_frontends_schema(path):
    """The rules of the frontend's zod schema (see REQUIRED); a miss is an alert on loading."""
    ui = json.loads(path.read_text())
    assert str(uuid.UUID(ui["id"])) == ui["id"] and uuid.UUID(ui["id"]).version == 4
    assert REQUIRED["workflow"] <= ui.keys() and ui["version"] == 0.4
    number = (int, float)
    assert isinstance(ui["last_node_id"], int) and isinstance(ui["last_link_id"], number)
    for node in ui["nodes"]:
        assert REQUIRED["node"] <= node.keys(), node.get("id")
        assert all(len(node[k]) == 2 and all(isinstance(v, number) for v in node[k])
                   for k in ("pos", "size")), node["id"]  # fmt: skip
        for model in node["properties"].get("models", []):
            assert {"name", "url", "directory"} <= model.keys()
            assert model["url"].startswith("https://")
    kinds = (int, int, int, int, int, str)
    assert all(len(link) == 6 and all(map(isinstance, link, kinds)) for link in ui["links"])


def _zod_object(source: str, name: str) -> dict[str, str]:
    """Field -> zod expression, for the object literal that `const <name> =` defines."""
    start = source.index("{", re.search(rf"const {name} =", source).end()) + 1
    fields, depth, entry = {}, 0, ""
    for ch in source[start:]:
        if depth == 0 and ch in ",}":
            key, _, expr = entry.partition(":")
            if key.strip():
                fields[key.strip()] = expr.strip()
            if ch == "}":
                return fields
            entry = ""
            continue
        depth += (ch in "([{") - (ch in ")]}")
        entry += ch
    raise ValueError(f"{name}: unterminated object")


def test_schema_rules_are_the_frontends():
    """REQUIRED is what the installed frontend's workflowSchema.ts requires: read from the
    source maps that comfyui_frontend_package ships."""
    frontend = pytest.importorskip("comfyui_frontend_package")
    maps = Path(frontend.__file__).parent.glob("static/assets/*.js.map")
    source = None
    for path in maps:
        text = path.read_text(errors="replace")
        if "workflowSchema.ts" in text:
            found = json.loads(text)
            named = zip(found["sources"], found["sourcesContent"], strict=True)
            source = next((s for n, s in named if n.endswith("/workflowSchema.ts")), None)
            if source:
                break
    if source is None:
        pytest.skip("the installed frontend ships no source map holding workflowSchema.ts")
    source = re.sub(r"/\*.*?\*/|^\s*//[^\n]*", "", source, flags=re.S | re.M)  # comments
    workflow = _zod_object(source, "zBaseExportableGraph") | _zod_object(source, "zComfyWorkflow")
    node = _zod_object(source, "zComfyNode")
    optional = re.compile(r"\.(optional|nullish)\(\)")
    assert {k for k, v in workflow.items() if not optional.search(v)} == REQUIRED["workflow"]
    assert {k for k, v in node.items() if not optional.search(v)} == REQUIRED["node"]
    assert ".uuid()" in workflow["id"]


def test_workflows_are_in_the_templates_menu(comfy_server):
    templates = comfy_server.get("/workflow_templates")
    (listed,) = [v for k, v in templates.items() if "qwen" in k.lower()]
    assert sorted(listed) == sorted(p.stem for p in WORKFLOWS)


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_full_size_graph_is_valid(comfy_server, path):
    info = comfy_server.get("/object_info")
    ui = json.loads(path.read_text())
    api = ui_to_api(ui, info)  # node types and widget counts
    if is_newbie(api) and not models.host_takes_newbie():
        pytest.skip("this ComfyUI has no NewBie text encoder (DualCLIPLoader type 'newbie')")
    for node_id, node in api.items():
        spec = info[node["class_type"]]["input"]
        for name, value in node["inputs"].items():
            kind = (spec.get("required", {}) | spec.get("optional", {}))[name][0]
            options = kind if isinstance(kind, list) else None
            if kind == "COMBO":
                options = (spec.get("required", {}) | spec.get("optional", {}))[name][1]["options"]
            if options is not None and name not in FILE_INPUTS:
                assert value in options, (node_id, name, value)
    for node in ui["nodes"]:
        if node["type"] in LOADERS:
            listed = node["properties"]["models"]
            assert len(listed) == (2 if node["type"] == "DualCLIPLoader" else 1)
            for model in listed:
                assert model["name"] in node["widgets_values"]
                assert model["url"].startswith("https://huggingface.co/")
                assert model["url"].endswith(model["name"])
                assert model["directory"] in {"diffusion_models", "text_encoders", "vae", "loras"}
    sizes = [n["inputs"]["width"] for n in api.values() if "width" in n["inputs"]]
    assert all(s % 16 == 0 for s in sizes) and max(sizes) in (1024, 1328, 2048, 2512)


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_workflow_runs_on_tiny_models(comfy_server, models_dir, path):
    ui = json.loads(path.read_text())
    api = scaled_for_cpu(ui_to_api(ui, comfy_server.get("/object_info")))
    put_input_image(comfy_server.base / "input")
    link_edit_2511(models_dir)
    if "edit_2511" in path.stem and not models.host_runs_edit_2511():
        with pytest.raises(RuntimeError, match="QwenTurboLoader.*Qwen-Image-Edit-2511 needs "
                           "default_ref_method.*update ComfyUI"):  # fmt: skip
            comfy_server.run(api)
        return
    if path.stem.startswith("newbie") and not models.host_takes_newbie():
        with pytest.raises(RuntimeError, match="QwenTurboLoader.*NewBie-image needs "
                           "clip_text_dim.*update ComfyUI"):  # fmt: skip
            comfy_server.run(api)
        return
    entry = comfy_server.run(api)
    (save,) = [k for k, n in api.items() if n["class_type"] == "QwenTurboSaveImage"]
    (image,) = comfy_server.images(entry, save)
    pixels = np.asarray(Image.open(image).convert("RGB"))
    side = SCALED[int(re.search(r"_(\d+)px$", path.stem).group(1))]
    assert pixels.shape == (side, side, 3)
    assert pixels.std() > 1, "flat image"


@pytest.mark.parametrize("name", TEMPLATES)
def test_comfyuis_template_accelerated_runs_on_tiny_models(comfy_server, models_dir, name):
    """ComfyUI v0.33.0's own Qwen-Image templates (the pipeline in a subgraph, If/Else
    Switches; on v0.3.64, which lacks them, each switch replaced by the input it selects),
    accelerated as `convert --to pack` does it and run through the executor. On v0.3.64 the
    Edit-2511 one is refused: its CFGNorm has v0.33's second widget."""
    info = comfy_server.get("/object_info")
    ui = json.loads(template(name).read_text())
    if "edit_2511" in name and not models.host_runs_edit_2511():  # v0.3.64
        with pytest.raises(WorkflowError, match=r"CFGNorm\): 2 widget values, expected 1 "):
            convert.convert(ui, "pack", info)  # saved by a newer ComfyUI
        return
    _, left = convert.convert(ui, "pack", info)
    assert not left
    api = ui_to_api(ui, info)
    kinds = {n["class_type"] for n in api.values()}
    assert {"QwenTurboLoader", "QwenTurboCUDAGraphSampler", "QwenTurboVAEDecodeTiled"} <= kinds
    assert not {"UNETLoader", "KSampler", "VAEDecode", "VAEEncode", "SaveImage"} & kinds
    api = scaled_template(api)
    put_input_image(comfy_server.base / "input")
    link_edit_2511(models_dir)
    entry = comfy_server.run(api)
    (save,) = [k for k, n in api.items() if n["class_type"] == "QwenTurboSaveImage"]
    (image,) = comfy_server.images(entry, save)
    pixels = np.asarray(Image.open(image).convert("RGB"))
    side = 64 if "edit" in name else SCALED[1328]
    assert pixels.shape == (side, side, 3) and pixels.std() > 1
