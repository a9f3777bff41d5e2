"""The guard for the next ComfyUI: each host internal the pack relies on (runtime/host.py),
removed from the real host, turns its feature off with the reason, and the rest keeps
working."""

import importlib
import logging

import comfy.model_management as mm
import comfy.model_patcher
import pytest
import torch

import nodes
from qwen_turbo.nodes.graph_sampler import CUDAGraphSampler
from qwen_turbo.nodes.loader import Loader
from qwen_turbo.runtime import batch_fit, host

CHECKS = [(feature, check) for feature, checks in host.FEATURES.items() for check in checks]


def _remove(monkeypatch, check) -> None:
    """Take the internal a check looks for out of the host."""
    module, path = check.internal
    *parents, name = path.split(".")
    obj = importlib.import_module(module)
    for part in parents:
        obj = getattr(obj, part)
    monkeypatch.delattr(obj, name)


@pytest.fixture(autouse=True)
def fresh_host():
    host.reset()
    yield
    host.reset()  # after monkeypatch has put the internals back


def test_the_running_host_has_every_internal():
    assert host.check() == {}


@pytest.mark.parametrize(
    "feature, check", CHECKS, ids=[f"{f}:{'.'.join(c.internal)}" for f, c in CHECKS]
)
def test_each_missing_internal_turns_its_feature_off(monkeypatch, caplog, feature, check):
    _remove(monkeypatch, check)
    with caplog.at_level(logging.WARNING):
        off = host.check()
    # that feature, and any other relying on the same internal
    assert feature in off and all(
        any(c.internal == check.internal for c in host.FEATURES[f]) for f in off
    ), off
    assert "missing" in off[feature] or "takes no" in off[feature]
    assert any(feature in r.getMessage() for r in caplog.records)


def test_loader_without_fused_block_internals_loads_plain_blocks(monkeypatch, sent, models_dir):
    """A host whose Qwen block no longer takes the arguments the fused block reproduces: the
    loader leaves the blocks alone, says so on its badge, and the model still runs."""
    import folder_paths

    from tests.harness import models

    monkeypatch.setitem(
        folder_paths.folder_names_and_paths, "diffusion_models",
        ([str(models_dir / "diffusion_models")], {".safetensors"}),
    )  # fmt: skip
    monkeypatch.setattr(folder_paths, "filename_list_cache", {})
    check = host.FEATURES["fused_blocks"][0]
    _remove(monkeypatch, check)
    name = models.qwen_dit_file().name
    model = Loader.execute(name, "bf16", "auto", True, "off").result[0]
    assert not any(k.endswith("forward") for k in model.object_patches)
    assert "fused_kernels off" in sent[-1]["note"]
    monkeypatch.undo()  # the host's block back, to run it
    x = torch.randn(1, 16, 1, 8, 8)
    ctx = torch.randn(1, 5, 3584)
    with torch.inference_mode():
        mm.load_models_gpu([model])
        out = model.model.apply_model(x, torch.tensor([0.5]), c_crossattn=ctx)
    assert out.isfinite().all()
    mm.unload_all_models()


def _compiles(model) -> bool:
    from comfy.patcher_extension import WrappersMP

    return "torch.compile" in model.wrappers.get(WrappersMP.APPLY_MODEL, {})


def _overrides_attention(model) -> bool:
    return "optimized_attention_override" in model.model_options.get("transformer_options", {})


# feature -> the loader's settings that need it, whether a loaded model has it, the badge's note
LOADER_SETTINGS = {
    "fp8_weights": (
        ("fp8_e4m3fn", "auto", "off"),
        lambda m: m.model.qwen_turbo.weights == "fp8_e4m3fn",
        "fp8_e4m3fn off",
    ),
    "attention_override": (("bf16", "sdpa", "off"), _overrides_attention, "sdpa attention off"),
    "regional_compile": (("bf16", "auto", "regional"), _compiles, "regional compile off"),
}


@pytest.mark.parametrize("feature", LOADER_SETTINGS)
def test_loader_turns_off_a_setting_whose_internal_is_missing(
    monkeypatch, sent, diffusion_models, feature
):
    """Each loader setting is on with the host as it is, and off, named on the badge, where an
    internal it needs is missing; the model loads either way."""
    from tests.harness import models

    (weight_dtype, attention, compile), has, note = LOADER_SETTINGS[feature]
    name = models.qwen_dit_file().name
    on = Loader.execute(name, weight_dtype, attention, True, compile).result[0]
    assert has(on) and note not in sent[-1].get("note", "")
    _remove(monkeypatch, host.FEATURES[feature][0])
    host.reset()
    off = Loader.execute(name, weight_dtype, attention, True, compile).result[0]
    assert not has(off)
    assert f"{note}: " in sent[-1]["note"] and "missing" in sent[-1]["note"]


def test_sampler_without_wrapper_internals_runs_as_ksampler(monkeypatch, sent):
    """Without the wrapper levels the graph runners hook into, the sampler is KSampler."""
    _remove(monkeypatch, host.FEATURES["cuda_graphs"][1])
    model = comfy.model_patcher.ModelPatcher(torch.nn.Linear(2, 2), "cpu", "cpu")
    monkeypatch.setattr(model, "load_device", torch.device("cuda"), raising=False)
    latent = {"samples": torch.zeros(1, 4, 8, 8)}
    calls = []
    monkeypatch.setattr(nodes, "common_ksampler", lambda *a, **k: calls.append(a) or [latent])
    monkeypatch.setattr(batch_fit, "check", lambda *a: (None, None))  # a Linear: no estimate
    CUDAGraphSampler.execute(model, 0, 1, 1.0, "euler", "simple", [], [], latent)
    assert len(calls) == 1 and calls[0][0] is model  # the model as given: no graph wrappers
    assert "WrappersMP.PREDICT_NOISE is missing" in sent[-1]["graphs"]


def test_is_oom_is_the_executors_judgement():
    """OOM errors stay OOM errors (ComfyUI's executor then unloads models); others do not
    count."""
    assert host.is_oom(mm.OOM_EXCEPTION("CUDA out of memory"))
    assert not host.is_oom(RuntimeError("boom"))
    assert not host.is_oom(mm.InterruptProcessingException())
