"""Qwen-Image-Edit through the pack: the Optimized Loader reads Edit-2509 (Qwen-Image's
architecture; the edit comes from reference latents in the conds), Edit-2511 (its reference
tokens modulated at timestep 0) and Layered as ComfyUI's UNETLoader does, and its model gives
UNETLoader's outputs with one and two reference images of different sizes; hosts without a
variant's setting refuse it by name. The CUDA Graph Sampler equals KSampler on Edit conds."""

import comfy.model_detection
import comfy.model_management as mm
import comfy.sd
import node_helpers
import pytest
import torch
from comfy_extras.nodes_model_advanced import ModelSamplingAuraFlow
from safetensors.torch import load_file

import nodes
from qwen_turbo.nodes.loader import Loader
from qwen_turbo.runtime.dit import config, files, loader
from qwen_turbo.runtime.graphs import sampling
from qwen_turbo.runtime.graphs.cache import cache_for
from tests.harness import models
from tests.harness.graphs import FakeGraphs, TracedGraphs

VARIANTS_ON_HOST = models.host_runs_edit_2511()
needs_variants = pytest.mark.skipif(
    not VARIANTS_ON_HOST, reason="this ComfyUI's Qwen-Image model has no default_ref_method"
)
# latent (H, W) of the generated image; reference images of other sizes (odd: padded)
LATENT = (8, 6)
REFS = {"one": [(10, 6)], "two": [(6, 14), (9, 7)]}


def _file(variant: str):
    return (
        models.qwen_dit_file() if variant == "edit_2509" else models.qwen_dit_variant_file(variant)
    )


def _inputs(batch=1, refs=(), seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 16, 1, *LATENT, generator=g)
    ctx = torch.randn(batch, 5, 3584, generator=g)
    latents = [r.expand(batch, -1, -1, -1, -1) for r in models.reference_latents(refs, seed)]
    return x, ctx, latents


def _forward(patcher, x, ctx, refs, **kwargs):
    """One forward as a sampler runs it (loaded, under inference_mode), with the reference
    latents a conditioning's `reference_latents` become."""
    opts = dict(patcher.model_options.get("transformer_options", {}), wrappers=patcher.wrappers)
    extra = {"ref_latents": refs} if refs else {}
    with torch.inference_mode():
        mm.load_models_gpu([patcher])
        out = patcher.model.apply_model(
            x, torch.tensor([0.6] * x.shape[0]), c_crossattn=ctx, transformer_options=opts,
            **extra, **kwargs,
        )  # fmt: skip
    return out.float()


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture
def host_block_reasons(monkeypatch):
    """Why the fused block handed a call to the host's block, for each such call."""
    reasons = []
    monkeypatch.setattr(loader, "_host_block", reasons.append)
    return reasons


# --- config -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "variant,method,t_cond",
    [("edit_2509", "index", False), ("edit_2511", "index_timestep_zero", False),
     ("layered", "negative_index", True)],
)  # fmt: skip
def test_config_is_what_comfys_detection_reads(variant, method, t_cond):
    """The variant by its marker key; every setting ComfyUI's own detection reads from these
    weights (this host's: v0.3.64 reads no variant) is the same in the loader's config."""
    sd = load_file(str(_file(variant)))
    cfg = config.read_config(sd)
    assert (cfg.default_ref_method, cfg.use_additional_t_cond) == (method, t_cond)
    unet = cfg.unet_config()
    assert ("default_ref_method" in unet) == (variant != "edit_2509")
    stock = comfy.model_detection.detect_unet_config(sd, "")
    assert stock and all(unet[k] == v for k, v in stock.items()), (stock, unet)


def test_diffusers_folder_of_edit_2511(tmp_path):
    """A diffusers folder says Edit-2511 by `zero_cond_t` in its config.json."""
    import json

    folder = models.diffusers_folder(models.qwen_dit_narrow_file(), tmp_path)
    assert files.read_checkpoint(folder)[1].default_ref_method == "index"
    config_json = folder / "transformer" / "config.json"
    config_json.write_text(json.dumps(json.loads(config_json.read_text()) | {"zero_cond_t": True}))
    assert files.read_checkpoint(folder)[1].default_ref_method == "index_timestep_zero"


@pytest.mark.skipif(VARIANTS_ON_HOST, reason="this ComfyUI runs Edit-2511")
@pytest.mark.parametrize("variant", ["edit_2511", "layered"])
def test_host_without_the_variant_refuses_it_by_name(diffusion_models, variant):
    """v0.3.64's model has no reference method setting: its UNETLoader would run Edit-2511 as
    Edit-2509, silently wrong. The Optimized Loader says so instead."""
    path = models.qwen_dit_variant_file(variant)
    (diffusion_models / path.name).unlink(missing_ok=True)
    (diffusion_models / path.name).symlink_to(path)
    name = {"edit_2511": "Qwen-Image-Edit-2511", "layered": "Qwen-Image-Layered"}[variant]
    with pytest.raises(ValueError, match=f"{path.name}: {name} needs default_ref_method=.*"
                       "does not take.*update ComfyUI"):  # fmt: skip
        Loader.execute(path.name, "auto", "auto", True, "off")


# --- the loaded model against UNETLoader's ------------------------------------------------


@pytest.mark.parametrize(
    "variant,refs,batch",
    [("edit_2509", "one", 1), ("edit_2509", "two", 2),
     pytest.param("edit_2511", "one", 1, marks=needs_variants),
     pytest.param("edit_2511", "two", 2, marks=needs_variants),  # cond and uncond batched
     pytest.param("layered", "two", 1, marks=needs_variants)],
)  # fmt: skip
def test_loader_equals_unetloader_with_reference_latents(variant, refs, batch, host_block_reasons):
    """Full width, one layer, reference latents of other sizes than the image's: fused off
    gives UNETLoader's output bit for bit, fused on within float32 rounding and without
    handing a call to the host's block. Edit-2511's and Layered's settings change the result
    (a loader that missed them would fail)."""
    path = _file(variant)
    x, ctx, latents = _inputs(batch, REFS[refs])
    stock = comfy.sd.load_diffusion_model(str(path))
    ref = _forward(stock, x, ctx, latents)
    sd, cfg = files.read_checkpoint(path)
    ours = loader.build(dict(sd), cfg)
    torch.testing.assert_close(_forward(ours, x, ctx, latents), ref, rtol=0, atol=0)
    loader.add_fused_blocks(ours)
    assert _rel(_forward(ours, x, ctx, latents), ref) < 1e-5
    assert host_block_reasons == []
    assert _rel(_forward(ours, x, ctx, []), ref) > 1e-2  # the references count
    if variant != "edit_2509":  # the same weights read as Edit-2509's
        as_2509 = loader.build(*files.read_checkpoint(models.qwen_dit_file()))
        assert _rel(_forward(as_2509, x, ctx, latents), ref) > 1e-3
    mm.unload_all_models()


@pytest.mark.parametrize(
    "method", ["offset", pytest.param("index_timestep_zero", marks=needs_variants)]
)
def test_reference_method_from_the_conds(method, host_block_reasons):
    """FluxKontextMultiReferenceLatentMethod's choice (ComfyUI's Edit-2511 template sets
    index_timestep_zero) overrides the model's default: the fused model follows it."""
    path = models.qwen_dit_file()
    x, ctx, latents = _inputs(1, REFS["two"])
    stock = comfy.sd.load_diffusion_model(str(path))
    ref = _forward(stock, x, ctx, latents, ref_latents_method=method)
    sd, cfg = files.read_checkpoint(path)
    ours = loader.build(dict(sd), cfg)
    loader.add_fused_blocks(ours)
    assert _rel(_forward(ours, x, ctx, latents, ref_latents_method=method), ref) < 1e-5
    assert host_block_reasons == []
    mm.unload_all_models()


@needs_variants
def test_edit_2511_fp8mixed_loads_as_comfy_ships_it(diffusion_models, host_block_reasons):
    """`qwen_image_edit_2511_fp8mixed.safetensors`, as ComfyUI's Edit-2511 template loads it:
    through the node, its variant and fp8 weights kept; equal to UNETLoader's model (run
    unloaded: the host's own quantized weights fail to load under inference_mode, see
    test_qwen_loader) within float32 rounding of the fused block."""
    path = models.qwen_dit_variant_file("edit_2511", fp8mixed=True)
    (diffusion_models / path.name).unlink(missing_ok=True)
    (diffusion_models / path.name).symlink_to(path)
    model = Loader.execute(path.name, "auto", "auto", True, "off").result[0]
    assert model.model.qwen_turbo.weights == "fp8_e4m3fn"
    assert model.model.diffusion_model.default_ref_method == "index_timestep_zero"
    x, ctx, latents = _inputs(1, REFS["two"])
    ours = _forward(model, x, ctx, latents)
    mm.unload_all_models()
    stock = comfy.sd.load_diffusion_model(str(path))
    assert stock.model.diffusion_model.default_ref_method == "index_timestep_zero"
    want = stock.model.apply_model(
        x, torch.tensor([0.6]), c_crossattn=ctx, ref_latents=latents, transformer_options={}
    ).float()
    assert _rel(ours, want) < 1e-5
    assert host_block_reasons == []
    mm.unload_all_models()


# --- sampling: CUDA Graph Sampler against KSampler ----------------------------------------


def _edit_model(variant: str, fused: bool):
    sd, cfg = files.read_checkpoint(_file(variant))
    patcher = loader.build(sd, cfg)
    if fused:  # the Triton interpreter runs them on CPU: slow, so not in every case
        loader.add_fused_blocks(patcher)
    return ModelSamplingAuraFlow().patch_aura(patcher, 3.1)[0]


def _edit_cond(tokens, seed, refs):
    """A conditioning as TextEncodeQwenImageEditPlus makes it: text plus reference latents."""
    text = torch.randn((1, tokens, 3584), generator=torch.Generator().manual_seed(seed))
    latents = models.reference_latents(refs, seed)
    return node_helpers.conditioning_set_values(
        [[text, {}]], {"reference_latents": latents}, append=True
    )


def _ksampler_args(refs, positive_seed=1, steps=2):
    latent = {"samples": torch.zeros((1, 16, 1, *LATENT))}
    return (42, steps, 2.5, "euler", "simple", _edit_cond(8, positive_seed, refs),
            _edit_cond(8, 2, refs), latent)  # fmt: skip


@pytest.mark.parametrize(
    "variant,refs,whole_step,fused",
    [("edit_2509", "one", False, True), ("edit_2509", "two", True, False),
     pytest.param("edit_2511", "one", True, False, marks=needs_variants),
     pytest.param("edit_2511", "two", False, True, marks=needs_variants)],
)  # fmt: skip
def test_graph_sampler_equals_ksampler_on_edit_conds(variant, refs, whole_step, fused):
    """Steps whose conds carry reference latents (one or two pictures, of other sizes than the
    output) are captured and replayed, keyed by their shapes, and give KSampler's latent bit
    for bit. New references of the same shapes replay the same graphs with the new values.
    The traced stand-in replays only the recorded aten ops, as a CUDA graph would; it cannot
    replay kernels that Triton's CPU interpreter runs, so the fused model takes the stand-in
    that reruns the forward on the graph's input buffers (model forward mode: a whole step
    rerun would call the finished first run's guider)."""
    model = _edit_model(variant, fused)
    backend = FakeGraphs if fused else TracedGraphs
    cache = cache_for(model.model)
    cache.clear()
    args = _ksampler_args(REFS[refs])
    ref = nodes.common_ksampler(model, *args)[0]["samples"]
    without = nodes.common_ksampler(model, *_ksampler_args([]))[0]["samples"]
    assert not torch.equal(ref, without)  # the references change the result
    out, status = sampling.sample_with_graphs(model, whole_step, backend, *args)
    torch.testing.assert_close(out["samples"], ref, rtol=0, atol=0)
    assert "captured" in status and "replayed" in status and "eager" not in status, status
    captured = cache.stats.captured
    other = _ksampler_args(REFS[refs], positive_seed=7)
    out, status = sampling.sample_with_graphs(model, whole_step, backend, *other)
    assert cache.stats.captured == captured, status
    torch.testing.assert_close(
        out["samples"], nodes.common_ksampler(model, *other)[0]["samples"], rtol=0, atol=0
    )
    mm.unload_all_models()
