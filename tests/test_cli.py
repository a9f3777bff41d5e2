"""`python -m qwen_turbo bench` and `run`: help, the CPU demonstration, the list of missing
model files, and a workflow run through ComfyUI's executor in this process."""

import asyncio
import json
import os
import subprocess
import sys

import folder_paths
import numpy as np
import pytest

import nodes
from qwen_turbo.cli import compare, convert, headless
from qwen_turbo.cli.workflow import object_info, ui_to_api
from qwen_turbo.nodes import NODES
from tests.harness import models
from tests.harness.comfyui import COMFY, ROOT
from tests.harness.templates import scaled_template, template
from tests.harness.workflows import WORKFLOWS as BUNDLED
from tests.harness.workflows import link_edit_2511, put_input_image, scaled_for_cpu

WORKFLOWS = ROOT / "workflows"


def _cli(tmp_path, *args, timeout=600):
    """The CLI as a user runs it: from the folder holding the pack, as package qwen_turbo."""
    if not (tmp_path / "qwen_turbo").exists():
        (tmp_path / "qwen_turbo").symlink_to(ROOT)
    env = dict(os.environ, COMFYUI_PATH=str(COMFY))
    return subprocess.run(
        [sys.executable, "-m", "qwen_turbo", *args], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


@pytest.mark.parametrize("command", [[], ["bench"], ["run"], ["compare"], ["convert"]])
def test_help(tmp_path, command):
    r = _cli(tmp_path, *command, "--help")
    assert r.returncode == 0 and "usage: python -m qwen_turbo" in r.stdout


def test_run_lists_missing_model_files(tmp_path):
    r = _cli(tmp_path, "run", str(WORKFLOWS / "qwen_image_2512_turbo_2512px.json"))
    assert r.returncode == 2, r.stderr[-2000:]
    for name in ("qwen_image_2512_fp8_e4m3fn.safetensors", "qwen_2.5_vl_7b_fp8_scaled.safetensors",
                 "qwen_image_vae.safetensors", "Lightning-4steps"):  # fmt: skip
        assert name in r.stderr
    assert r.stderr.count("download: https://huggingface.co/") == 4
    assert "put it in" in r.stderr and "loras" in r.stderr


@pytest.mark.parametrize(
    "content, problem",
    [
        (None, "no such file"),
        ("not a workflow\n", "not JSON (Expecting value at line 1, column 1)"),
        (b"\x89PNG\r\n\x1a\n\x00\xff", "not JSON (a binary file)"),
        ('{"3": {"class_type": "KSampler", "inputs": {}}}', "an API-format prompt"),
        ('{"nodes": 3}', 'not a ComfyUI workflow (no "nodes" list)'),
    ],
    ids=["missing", "text", "binary", "api_format", "other_json"],
)
def test_run_rejects_what_is_not_a_workflow(tmp_path, content, problem):
    """One line on stderr naming the file and what is wrong, exit 2, no traceback."""
    path = tmp_path / "input" / "my_workflow.json"
    path.parent.mkdir()
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    r = _cli(tmp_path, "run", str(path), timeout=60)
    assert r.returncode == 2 and not r.stdout
    (line,) = r.stderr.splitlines()
    assert line.startswith(f"python -m qwen_turbo run: error: {path}: ") and problem in line


def test_run_reads_comfyuis_own_template(tmp_path):
    """ComfyUI v0.33.0's template keeps its pipeline in a subgraph: `run` reads it and lists
    the model files its loaders (inside the subgraph) need, once each."""
    r = _cli(tmp_path, "run", str(template("image_qwen_Image_2512")))
    assert r.returncode == 2 and "/qwen_turbo/" not in r.stderr, r.stderr[-3000:]  # no traceback
    assert r.stderr.count("qwen_image_2512_fp8_e4m3fn.safetensors (UNETLoader)") == 1
    assert "Qwen-Image-2512-Lightning-4steps-V1.0-fp32.safetensors (LoraLoaderModelOnly)" in (
        r.stderr
    )


def test_convert_writes_the_twin_or_refuses_in_one_line(tmp_path):
    """convert --to stock writes `<name>_stock.json` beside the workflow and prints what it
    changed; converting again would overwrite it, an unknown node type is refused: one line,
    exit 2, the files as they were."""
    source = tmp_path / "input" / "turbo.json"
    source.parent.mkdir()
    source.write_text((WORKFLOWS / "qwen_image_2512_turbo_2512px.json").read_text())
    r = _cli(tmp_path, "convert", str(source), "--to", "stock")
    assert r.returncode == 0, r.stderr[-3000:]
    stock = source.with_name("turbo_stock.json")
    assert "changed  node 1 (QwenTurboLoader) -> UNETLoader" in r.stdout
    assert f"wrote {stock}" in r.stdout
    assert not any("QwenTurbo" in n["type"] for n in json.loads(stock.read_text())["nodes"])
    written = stock.read_text()
    ui = json.loads(source.read_text())
    ui["nodes"][0]["type"] = "NoSuchNode"
    source.write_text(json.dumps(ui))
    for args, problem in (
        (["--to", "stock"], f"{stock} exists; pass --out {stock} to replace it"),
        (["--to", "pack", "--out", str(tmp_path / "x.json")], "unknown node type 'NoSuchNode'"),
        (["--to", "pack", "--out", str(tmp_path / "x.json")], None),
    ):
        if problem is None:  # not a workflow: refused before ComfyUI starts
            source.write_text('{"nodes": 3}')
            problem = "not a ComfyUI workflow"
        before = source.read_text()
        r = _cli(tmp_path, "convert", str(source), *args, timeout=120)
        (line,) = r.stderr.strip().splitlines()[-1:]
        assert r.returncode == 2 and line.startswith("python -m qwen_turbo convert: error: ")
        assert problem in line and "/qwen_turbo/" not in r.stderr, r.stderr[-2000:]
        assert source.read_text() == before and stock.read_text() == written
    assert not (tmp_path / "x.json").exists()


def test_bench_without_cuda_runs_a_cpu_demonstration(tmp_path):
    r = _cli(tmp_path, "bench", "--size", "64")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "No CUDA GPU" in r.stdout
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert [row["what"] for row in result["rows"]] == ["DiT forward, 2 layers", "VAE decode"]
    assert all(row["rel_l2"] < 1e-3 and row["pack_ms"] > 0 for row in result["rows"])


def test_bench_rejects_sizes_not_multiple_of_16(tmp_path):
    r = _cli(tmp_path, "bench", "--size", "2500")
    assert r.returncode != 0 and "2500 is not a multiple of 16; use 2496 or 2512" in r.stderr


def test_prompt_and_seed_reach_every_sampler():
    """KSampler's seed, KSamplerAdvanced's noise_seed, the text of each sampler's positive
    prompt; the negative prompt and other nodes stay as they were."""
    api = {
        "1": {"class_type": "CLIPTextEncode", "inputs": {"text": "old", "clip": ["9", 0]}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"text": "neg", "clip": ["9", 0]}},
        "3": {"class_type": "KSampler", "inputs": {"seed": 0, "positive": ["1", 0],
                                                   "negative": ["2", 0]}},
        "4": {"class_type": "KSamplerAdvanced", "inputs": {"noise_seed": 0,
                                                           "positive": ["1", 0]}},
        "5": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "batch_size": 1}},
    }  # fmt: skip
    headless.set_prompt_and_seed(api, "a cat", 5)
    assert api["3"]["inputs"]["seed"] == 5 and api["4"]["inputs"]["noise_seed"] == 5
    assert api["1"]["inputs"]["text"] == "a cat" and api["2"]["inputs"]["text"] == "neg"
    assert api["5"]["inputs"] == {"width": 64, "batch_size": 1}
    headless.set_prompt_and_seed(api, None, None)  # nothing asked: nothing changes
    assert api["3"]["inputs"]["seed"] == 5 and api["1"]["inputs"]["text"] == "a cat"


def test_a_workflow_saved_before_a_node_gained_optional_widgets_converts():
    """The Optimized Loader's five widget values from before quality_guard and
    quality_threshold: they take their defaults (the inputs are left out); fewer values than
    the required widgets, or more than all, is an error."""
    from qwen_turbo.cli.workflow import object_info, ui_to_api
    from qwen_turbo.nodes.loader import Loader

    info = object_info({"QwenTurboLoader": Loader})
    old = ["q.safetensors", "fp8_e4m3fn_fast", "fp8_cudnn", True, "off"]
    for values, taken in ((old, 5), ([*old, False, 0.3], 7)):
        ui = {"nodes": [{"id": 1, "type": "QwenTurboLoader", "widgets_values": values}]}
        inputs = ui_to_api(ui, info)["1"]["inputs"]
        assert list(inputs.values()) == values[:taken]
    assert (
        "quality_guard"
        not in ui_to_api(
            {"nodes": [{"id": 1, "type": "QwenTurboLoader", "widgets_values": old}]}, info
        )["1"]["inputs"]
    )
    for values in (old[:4], [*old, False, 0.3, 1]):
        ui = {"nodes": [{"id": 1, "type": "QwenTurboLoader", "widgets_values": values}]}
        with pytest.raises(ValueError, match="widget values, expected 7"):
            ui_to_api(ui, info)


@pytest.fixture
def executor_setup(models_dir, tmp_path, monkeypatch):
    """ComfyUI's node table with the pack's and the test conditioning; the tiny models as the
    diffusion_models, vae and loras folders; tmp_path as the output folder, its input/ as the
    input folder."""
    from tests.testing_nodes import TestConditioning

    asyncio.run(nodes.init_extra_nodes(init_custom_nodes=False, init_api_nodes=False))
    for node in [*NODES, TestConditioning]:
        monkeypatch.setitem(nodes.NODE_CLASS_MAPPINGS, node.define_schema().node_id, node)
    for kind in ("diffusion_models", "vae", "loras"):
        paths = ([str(models_dir / kind)], {".safetensors"})
        monkeypatch.setitem(folder_paths.folder_names_and_paths, kind, paths)
    monkeypatch.setattr(folder_paths, "filename_list_cache", {})
    monkeypatch.setattr(folder_paths, "output_directory", str(tmp_path))
    (tmp_path / "input").mkdir()
    monkeypatch.setattr(folder_paths, "input_directory", str(tmp_path / "input"))


def test_run_executes_a_workflow(executor_setup, tmp_path, capsys):
    """headless.run through PromptExecutor, a seed given: images saved, timings printed."""
    workflow = ROOT / "tests" / "workflows" / "tiny_qwen_vae.json"
    assert headless.run(workflow, prompt=None, seed=5) == 0
    out = capsys.readouterr().out
    assert "QwenTurboVAEDecodeTiled" in out and "total" in out
    assert len(list(tmp_path.glob("*.png"))) == 3


def test_compare_metrics():
    """PSNR and SSIM on pictures whose answer is known; the difference picture amplifies."""
    rng = np.random.default_rng(0)
    a = rng.integers(0, 250, (40, 48, 3), dtype=np.uint8)
    assert compare.psnr(a, a) == float("inf") and compare.ssim(a, a) == pytest.approx(1.0)
    b = a + np.uint8(4)
    assert compare.psnr(a, b) == pytest.approx(10 * np.log10(255**2 / 16))
    noise = rng.integers(0, 256, a.shape, dtype=np.uint8)
    assert compare.ssim(a, noise) < 0.1 < compare.ssim(a, b) < 1
    assert (compare.difference(a, b) == 4 * compare.AMPLIFY).all()


def test_compare_without_kornia_says_so_and_runs_nothing(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "kornia.metrics", None)  # import raises ImportError
    monkeypatch.setattr(compare, "_run", lambda *a: pytest.fail("a side ran"))
    assert compare.compare(ROOT / "tests" / "workflows" / "tiny_qwen_vae.json", None, 5) == 2
    assert "pip install kornia" in capsys.readouterr().out


def test_compare_runs_stock_and_pack(executor_setup, capsys):
    """compare on a workflow with the pack's VAE nodes: both sides run through the executor,
    each save node's pictures are paired (the pack's decodes as close to stock's as its tests
    require), difference pictures written, times printed."""
    workflow = ROOT / "tests" / "workflows" / "tiny_qwen_vae.json"
    assert compare.compare(workflow, prompt=None, seed=5) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    by_node = {r["node"]: r for r in result["pictures"]}
    assert set(by_node) == {"10", "11", "15"}
    for r in result["pictures"]:
        assert r["psnr_db"] > 30 and r["ssim"] > 0.9, r
    for r in result["pictures"]:
        assert "/stock_" in r["stock"] and "/pack_" in r["pack"]
        assert os.path.exists(r["difference"])
    assert result["stock_s"] > 0 and result["pack_s"] > 0 and "stock" in out and "x)" in out


@pytest.mark.parametrize("path", BUNDLED, ids=lambda p: p.stem)
def test_compare_runs_every_bundled_workflow(executor_setup, models_dir, tmp_path, capsys, path):
    """compare on each bundled workflow scaled to the tiny models (test conditioning for the
    text encoder): both sides run, and each saved picture is paired with a difference picture
    and its PSNR and SSIM."""
    if "edit_2511" in path.stem and not models.host_runs_edit_2511():
        pytest.skip("this ComfyUI cannot run Qwen-Image-Edit-2511 (see test_workflows)")
    if path.stem.startswith("newbie") and not models.host_takes_newbie():
        pytest.skip("this ComfyUI cannot run NewBie-image (see test_workflows)")
    link_edit_2511(models_dir)
    put_input_image(tmp_path / "input")
    ui = json.loads(path.read_text())
    api = scaled_for_cpu(ui_to_api(ui, object_info(nodes.NODE_CLASS_MAPPINGS)))
    assert compare.compare_graph(api, path.name, prompt=None, seed=3) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["workflow"] == path.name and result["pictures"]
    for r in result["pictures"]:
        assert "error" not in r and r["ssim"] > 0 and os.path.exists(r["difference"]), r


def test_compare_runs_an_accelerated_template(executor_setup, models_dir, capsys):
    """`compare` on ComfyUI's Qwen-Image-2512 template after `convert --to pack` (the
    Optimized Loader at its defaults): the stock side is the template's own graph, and the
    two pictures agree."""
    ui = json.loads(template("image_qwen_Image_2512").read_text())
    info = object_info(nodes.NODE_CLASS_MAPPINGS)
    convert.convert(ui, "pack", info)
    api = scaled_template(ui_to_api(ui, info))
    assert compare.compare_graph(api, "image_qwen_Image_2512.json", prompt=None, seed=3) == 0
    (row,) = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["pictures"]
    assert row["psnr_db"] > 30 and row["ssim"] > 0.9, row


def test_compare_runs_comfyuis_newbie_template_accelerated(executor_setup, models_dir, capsys):
    """ComfyUI's NewBie-image template (its pipeline in a subgraph) after `convert --to pack`:
    the loader, sampler and decode become the pack's; `compare` runs both on the tiny models
    (the Optimized Loader's bf16 NewBie against UNETLoader's) and the pictures agree."""
    if not models.host_takes_newbie():
        pytest.skip("this ComfyUI cannot run NewBie-image (see test_workflows)")
    ui = json.loads(template("image_newbieimage_exp0_1-t2i").read_text())
    info = object_info(nodes.NODE_CLASS_MAPPINGS)
    changed, left = convert.convert(ui, "pack", info)
    assert not left and len(changed) == 4, (changed, left)
    api = scaled_template(ui_to_api(ui, info))
    kinds = {n["class_type"] for n in api.values()}
    assert {"QwenTurboLoader", "QwenTurboCUDAGraphSampler"} <= kinds and "KSampler" not in kinds
    assert compare.compare_graph(api, "image_newbieimage_exp0_1-t2i.json", prompt=None, seed=3) == 0
    (row,) = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["pictures"]
    assert row["psnr_db"] > 30 and row["ssim"] > 0.9, row


def test_roofline_counts_the_forwards_flops():
    """The DiT forward's FLOPs from its shapes, checked against the figures worked out by hand
    from Qwen-Image's widths (3072, MLP 12288; 24,905 tokens at 2512², 7,145 at 1328²)."""
    from qwen_turbo.cli import bench

    gemm, attention = bench.forward_flops(60, 2512, 2512)
    assert gemm == pytest.approx(60 * 24 * 24905 * 3072**2) and 0.33e15 < gemm < 0.35e15
    assert attention == pytest.approx(60 * 4 * 24905**2 * 3072) and 0.45e15 < attention < 0.47e15
    assert sum(bench.forward_flops(30, 1328, 1328)) == pytest.approx(0.067e15, rel=0.02)
    assert bench.forward_flops(1, 1664, 928)[0] == 24 * (104 * 58 + 256) * 3072**2
    bf16, fp8 = bench.peaks("NVIDIA H100 80GB HBM3")
    # 30 layers at 2512² in 524 ms: 0.76 PFLOP/s, 38% of the dense fp8 peak
    assert sum(bench.forward_flops(30, 2512, 2512)) / 0.524 / 1e12 / fp8 == pytest.approx(
        0.38, abs=0.01
    )
    assert bench.peaks("NVIDIA GeForce RTX 4090") is None
