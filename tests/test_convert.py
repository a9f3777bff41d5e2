"""`convert` and the subgraph flattening, in this process against the host's node schemas:
subgraphs read as the frontend reads them, stock and pack twins of the bundled workflows and
ComfyUI's own templates, round trips, and the inputs it refuses."""

import asyncio
import copy
import json

import pytest

import nodes
from qwen_turbo.cli import convert
from qwen_turbo.cli.stock import PASSTHROUGH, stock_graph
from qwen_turbo.cli.subgraphs import WorkflowError
from qwen_turbo.cli.workflow import object_info, ui_to_api
from qwen_turbo.nodes import NODES
from tests.harness import models
from tests.harness.templates import TEMPLATES, template
from tests.harness.workflows import WORKFLOWS


@pytest.fixture(scope="module")
def info():
    """/object_info as the server builds it: ComfyUI's nodes and the pack's."""
    asyncio.run(nodes.init_extra_nodes(init_custom_nodes=False, init_api_nodes=False))
    pack = {node.define_schema().node_id: node for node in NODES}
    return object_info({**nodes.NODE_CLASS_MAPPINGS, **pack})


def _types(ui: dict) -> set[str]:
    graphs = [ui, *ui.get("definitions", {}).get("subgraphs", [])]
    return {n["type"] for g in graphs for n in g["nodes"]}


def _converted(data: dict, to: str, info: dict):
    data = copy.deepcopy(data)
    changed, left = convert.convert(data, to, info)
    return data, changed, left


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.stem)
def test_bundled_workflow_round_trip(info, path):
    """pack -> stock -> pack gives the same graph, UI and API; the stock twin has no pack
    node (the VAE patches taken out) and runs the graph `compare` runs as stock."""
    ui = json.loads(path.read_text())
    stock, changed, _ = _converted(ui, "stock", info)
    assert not any(t.startswith("QwenTurbo") for t in _types(stock)) and changed
    assert ui_to_api(stock, info) == stock_graph(ui_to_api(ui, info))
    back, _, left = _converted(stock, "pack", info)
    assert back == ui and not left
    api = ui_to_api(ui, info)
    assert _converted(_converted(api, "stock", info)[0], "pack", info)[0] == api


@pytest.mark.parametrize("name", TEMPLATES)
def test_comfyuis_template_accelerates(info, name):
    """Inside the template's subgraph the loader, sampler and decode (and the Edit encode),
    and the save outside it, become the pack's with every link and widget value kept; back
    to stock gives the template again."""
    ui = json.loads(template(name).read_text())
    if "edit_2511" in name and not models.host_runs_edit_2511():
        pytest.skip("v0.3.64 refuses it (test_workflows checks the refusal)")
    pack, changed, left = _converted(ui, "pack", info)
    assert not left and len(changed) == (5 if "edit" in name else 4), changed
    before, after = ui_to_api(ui, info), ui_to_api(pack, info)
    assert before.keys() == after.keys()
    for node_id, node in before.items():
        new = after[node_id]
        twin = convert.PACK_OF.get(node["class_type"], {}).get("new_node_id")
        assert new["class_type"] == (twin or node["class_type"])
        shared = {k: v for k, v in node["inputs"].items() if k != "weight_dtype"}
        assert shared.items() <= new["inputs"].items(), node_id
    loader = next(n for n in after.values() if n["class_type"] == "QwenTurboLoader")
    assert loader["inputs"]["weight_dtype"] == "auto"  # UNETLoader's "default"
    assert _converted(pack, "stock", info)[0] == ui


def _subgraph(sub_id: str, name: str, inputs: list, nodes_: list, links: list, out_link: int):
    return {"id": sub_id, "name": name, "nodes": nodes_, "links": links,
            "inputs": inputs, "outputs": [{"name": "LATENT", "type": "LATENT",
                                           "linkIds": [out_link]}]}  # fmt: skip


def _link(link_id, origin, oslot, target, tslot, kind):
    return {"id": link_id, "origin_id": origin, "origin_slot": oslot, "target_id": target,
            "target_slot": tslot, "type": kind}  # fmt: skip


def test_nested_subgraphs_flatten_as_the_frontend_does(info):
    """A width promoted through two subgraphs takes the outer instance's value; a bypassed
    node passes its input of the output's type on; a muted one gives nothing."""
    inner = _subgraph(
        "bbbbbbbb-0000-4000-8000-000000000002", "inner",
        [{"name": "width", "type": "INT", "linkIds": [1]}],
        [{"id": 5, "type": "EmptyLatentImage", "mode": 0, "widgets_values": [512, 512, 1],
          "inputs": [{"name": "width", "type": "INT", "widget": {"name": "width"}, "link": 1}],
          "outputs": [{"name": "LATENT", "type": "LATENT", "links": [2]}]}],
        [_link(1, -10, 0, 5, 0, "INT"), _link(2, 5, 0, -20, 0, "LATENT")], 2,
    )  # fmt: skip
    outer = _subgraph(
        "aaaaaaaa-0000-4000-8000-000000000001", "outer",
        [{"name": "width", "type": "INT", "linkIds": [3]}],
        [{"id": 12, "type": inner["id"], "mode": 0, "inputs": [{"name": "width", "link": 3}],
          "outputs": [{"name": "LATENT", "type": "LATENT", "links": [4]}]},
         {"id": 13, "type": "LatentUpscaleBy", "mode": 4, "widgets_values": ["nearest-exact", 2],
          "inputs": [{"name": "samples", "type": "LATENT", "link": 4}],
          "outputs": [{"name": "LATENT", "type": "LATENT", "links": [5]}]},
         {"id": 14, "type": "EmptyLatentImage", "mode": 2, "widgets_values": [64, 64, 1],
          "outputs": [{"name": "LATENT", "type": "LATENT", "links": []}]}],
        [_link(3, -10, 0, 12, 0, "INT"), _link(4, 12, 0, 13, 0, "LATENT"),
         _link(5, 13, 0, -20, 0, "LATENT")], 5,
    )  # fmt: skip
    ui = {"nodes": [
        {"id": 238, "type": outer["id"], "mode": 0, "widgets_values": [640],
         "inputs": [{"name": "width", "type": "INT", "widget": {"name": "width"}, "link": None}],
         "outputs": [{"name": "LATENT", "type": "LATENT", "links": [9]}]},
        {"id": 60, "type": "LatentUpscaleBy", "mode": 0, "widgets_values": ["bilinear", 1.5],
         "inputs": [{"name": "samples", "type": "LATENT", "link": 9}]}],
        "links": [[9, 238, 0, 60, 0, "LATENT"]],
        "definitions": {"subgraphs": [outer, inner]}}  # fmt: skip
    api = ui_to_api(ui, info)
    assert api == {
        "238:12:5": {"class_type": "EmptyLatentImage",
                     "inputs": {"width": 640, "height": 512, "batch_size": 1}},
        "60": {"class_type": "LatentUpscaleBy",
               "inputs": {"upscale_method": "bilinear", "scale_by": 1.5,
                          "samples": ["238:12:5", 0]}},
    }  # fmt: skip
    ui["nodes"][0]["widgets_values"] = []  # nothing saved on the instance: the inner widget's
    assert ui_to_api(ui, info)["238:12:5"]["inputs"]["width"] == 512
    ui["links"][0][1] = 239
    with pytest.raises(WorkflowError, match="link 9 starts at node 239, not there"):
        ui_to_api(ui, info)


def test_a_loader_the_optimized_loader_cannot_take_stays(info):
    """A Flux file and an fp8_e5m2 dtype stay stock, each with its reason; a graph with no
    Qwen-Image model is refused; the pass-through nodes have their inputs named."""
    ui = json.loads(template("image_qwen_image").read_text())
    sub = ui["definitions"]["subgraphs"][0]
    loader = next(n for n in sub["nodes"] if n["type"] == "UNETLoader")
    loader["widgets_values"][1] = "fp8_e5m2"
    _, changed, left = _converted(ui, "pack", info)
    assert len(changed) == 3 and "weight_dtype 'fp8_e5m2'" in left[0], left
    loader["widgets_values"][0] = "flux1-dev.safetensors"
    with pytest.raises(convert.Refused, match="no Qwen-Image or NewBie model: .*flux1-dev.safe"):
        _converted(ui, "pack", info)
    assert set(PASSTHROUGH.values()) == {"vae", "model"}


@pytest.mark.parametrize(
    "edit, error",
    [
        (lambda ui: ui["nodes"][0].update(type="NoSuchNode"), "unknown node type 'NoSuchNode'"),
        (lambda ui: ui.update(links=[], nodes=[{"id": 1, "type": "EmptyLatentImage",
                                                "widgets_values": [64, 64, 1]}]),
         "nothing to convert to stock"),
    ],
    ids=["unknown_type", "no_pack_node"],
)  # fmt: skip
def test_convert_refuses(info, edit, error):
    ui = json.loads(WORKFLOWS[0].read_text())
    edit(ui)
    with pytest.raises(WorkflowError, match=error):
        convert.convert(ui, "stock", info)
