"""NewBie-image (Lumina-2's NextDiT) in the Optimized Loader on CPU: its config read from the
weights as ComfyUI reads it, the model equal to UNETLoader's bit for bit in bf16 and close in
fp8, the fidelity probe and weight streaming on its blocks, and clear errors where a host or
a file cannot run it."""

import comfy.model_detection
import comfy.model_management as mm
import comfy.sd
import pytest
import torch
from safetensors.torch import load_file

from qwen_turbo.nodes.loader import Loader
from qwen_turbo.runtime.dit import config, files, fp8, loader, nextdit, nextdit_block, probe
from tests.harness import models

newbie_host = pytest.mark.skipif(
    not models.host_takes_newbie(), reason="this ComfyUI's NextDiT has no NewBie input"
)


def _conds(cfg: nextdit.NextDiTConfig, seed=1, tokens=7, batch=1) -> dict:
    g = torch.Generator().manual_seed(seed)
    conds = {"c_crossattn": torch.randn(batch, tokens, cfg.cap_feat_dim, generator=g),
             "num_tokens": tokens}  # fmt: skip
    if cfg.clip_text_dim:
        conds["clip_text_pooled"] = torch.randn(batch, cfg.clip_text_dim, generator=g)
    return conds


def _forward(patcher, cfg, h=8, w=6, batch=1, **kwargs):
    """One model call as a sampler makes it, loaded and under inference_mode."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, cfg.in_channels, h, w, generator=g)
    opts = dict(patcher.model_options.get("transformer_options", {}), wrappers=patcher.wrappers)
    with torch.inference_mode():
        mm.load_models_gpu([patcher])
        out = patcher.model.apply_model(
            x, torch.tensor([0.6] * batch), transformer_options=opts, **_conds(cfg, batch=batch),
            **kwargs,
        )  # fmt: skip
    return out.float()


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("clip", [True, False], ids=["newbie", "lumina2"])
def test_config_is_what_comfyui_detects(clip):
    """Full width: the constructor arguments ComfyUI's model detection reads from the file."""
    sd = load_file(str(models.newbie_dit_file(clip=clip)))
    cfg = nextdit.read_config(sd)
    detected = comfy.model_detection.detect_unet_config(sd, "")
    ours = cfg.unet_config(loader.nextdit_mlp_factor())
    for key, value in detected.items():
        if key in ("rope_theta",):  # NextDiT's default; older hosts have no such argument
            continue
        assert ours[key] == value, key
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.n_layers) == (24, 8, 96, 1)
    assert cfg.name == ("NewBie-image" if clip else "Lumina-2")
    assert (cfg.clip_text_dim == 1024) is clip


def test_narrow_config_reads_its_own_shapes():
    cfg = nextdit.read_config(load_file(str(models.newbie_dit_file(n_layers=2, narrow=True))))
    assert (cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.axes_dims) == (96, 4, 2, (8, 8, 8))
    assert (cfg.cap_feat_dim, cfg.clip_text_dim, cfg.n_layers) == (64, 32, 2)
    assert cfg.mlp_hidden == 512  # int(4.0 * 96) rounded up to 256
    assert cfg.unet_config(1)["ffn_dim_multiplier"] == 512 / 96
    assert cfg.unet_config(4)["ffn_dim_multiplier"] == 512 / 384


def test_files_that_are_not_newbie_are_named():
    sd = load_file(str(models.newbie_dit_file(narrow=True)))
    z_image = {**sd, nextdit.Z_IMAGE: torch.ones(2, 2)}
    with pytest.raises(config.NotQwenImageDiT, match="Z-Image.*UNETLoader"):
        nextdit.read_config(z_image)
    no_norms = {k: v for k, v in sd.items() if "q_norm" not in k}
    with pytest.raises(config.NotQwenImageDiT, match="without q/k norms"):
        nextdit.read_config(no_norms)
    gapped = {k.replace("noise_refiner.1.", "noise_refiner.2."): v for k, v in sd.items()}
    with pytest.raises(config.NotQwenImageDiT, match="noise_refiner blocks are not numbered"):
        nextdit.read_config(gapped)


@newbie_host
@pytest.mark.parametrize("clip", [True, False], ids=["newbie", "lumina2"])
def test_loader_equals_stock_unetloader(clip):
    """Full width, one block: the Optimized Loader's bf16 model gives UNETLoader's output bit
    for bit, batch 2 (cond and uncond); fp8 storage within its rounding."""
    path = models.newbie_dit_file(clip=clip)
    stock = comfy.sd.load_diffusion_model(str(path))
    sd, cfg = files.read_checkpoint(path)
    assert isinstance(cfg, nextdit.NextDiTConfig)
    ref = _forward(stock, cfg, batch=2)
    ours = loader.build(dict(sd), cfg, "bf16")
    torch.testing.assert_close(_forward(ours, cfg, batch=2), ref, rtol=0, atol=0)
    fp8_model = loader.build(dict(sd), cfg, "fp8_e4m3fn")
    blocks = fp8_model.model.diffusion_model.layers
    assert blocks[0].attention.qkv.weight.dtype == torch.float8_e4m3fn
    assert fp8_model.model.diffusion_model.noise_refiner[0].attention.qkv.weight.dtype != (
        torch.float8_e4m3fn
    )  # refiners, embedders and the final layer stay in bf16
    assert _rel(_forward(fp8_model, cfg, batch=2), ref) < 0.05
    mm.unload_all_models()


@pytest.mark.skipif(models.host_takes_newbie(), reason="this ComfyUI runs NewBie")
def test_an_older_host_refuses_newbie_and_says_why(diffusion_models):
    name = "newbie_on_old_host.safetensors"
    (diffusion_models / name).symlink_to(models.newbie_dit_file(narrow=True))
    try:
        with pytest.raises(ValueError, match="NewBie-image needs clip_text_dim.*update ComfyUI"):
            Loader.execute(name, "auto", "auto", True, "off")
    finally:
        (diffusion_models / name).unlink()


def test_lumina2_loads_on_every_host():
    sd, cfg = files.read_checkpoint(models.newbie_dit_file(narrow=True, clip=False))
    patcher = loader.build(dict(sd), cfg, "fp8_e4m3fn")
    out = _forward(patcher, cfg)
    assert out.shape == (1, 16, 8, 6) and torch.isfinite(out).all()
    mm.unload_all_models()


@newbie_host
def test_the_node_loads_newbie_and_notes_what_it_leaves_to_comfyui(diffusion_models, monkeypatch):
    warmed = []
    monkeypatch.setattr(loader.warmup, "start", lambda device, modules: warmed.append(modules))
    name = "newbie_narrow.safetensors"
    (diffusion_models / name).symlink_to(models.newbie_dit_file(n_layers=2, narrow=True))
    try:
        model = Loader.execute(name, "fp8_e4m3fn", "sdpa", True, "off").result[0]
    finally:
        (diffusion_models / name).unlink()
    assert warmed == [loader.FP8_KERNELS]  # not the Qwen blocks' recorded launches
    state = model.model.qwen_turbo
    assert state.blocks == "layers" and state.weights == "fp8_e4m3fn"
    assert any("block graphs: Qwen-Image's blocks only" in n for n in state.notes)
    assert state.streamer is not None  # offloaded fp8 layers stream on small cards
    fused = [k for k in model.object_patches if k.endswith(".forward")]
    assert fused == ["diffusion_model.layers.0.forward", "diffusion_model.layers.1.forward"]
    cfg = nextdit.read_config(model.model.diffusion_model.state_dict())
    assert torch.isfinite(_forward(model, cfg)).all()
    mm.unload_all_models()


@newbie_host
def test_fidelity_probe_measures_each_newbie_block(monkeypatch):
    """The probe runs NextDiT's inputs (text features and the pooled CLIP vector) and reruns
    each main block lossy on a copy of its input; blocks over the threshold keep bf16."""
    sd, cfg = files.read_checkpoint(models.newbie_dit_file(n_layers=3, narrow=True))
    patcher = loader.build(dict(sd), cfg, "fp8_e4m3fn")
    monkeypatch.setattr(probe, "SIDE", 64)
    mm.load_models_gpu([patcher])
    result = probe.measure(patcher.model, torch.device("cpu"), None, threshold=0.0)
    assert len(result.errors) == 3 and all(e >= 0 for e in result.errors)
    assert result.kept == [i for i, e in enumerate(result.errors) if e > 0]
    assert patcher.model.qwen_turbo.safe_blocks == set(result.kept)
    probe.apply(patcher.model, [])
    assert not patcher.model.qwen_turbo.safe_blocks
    assert fp8  # the probe's safe path is fp8.safe_compute
    mm.unload_all_models()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fused_blocks_equal_comfyuis_within_rounding(dtype):
    """The model with the fused NextDiT blocks against ComfyUI's blocks on the same weights:
    fp32 within float32 rounding, bf16 within bf16's (the fused ops round once)."""
    path = models.newbie_dit_file(n_layers=2, narrow=True, clip=models.host_takes_newbie())
    sd, cfg = files.read_checkpoint(path)
    weights = "auto" if dtype == "fp32" else "bf16"  # auto: float32 on CPU
    plain = loader.build(dict(sd), cfg, weights)
    ref = _forward(plain, cfg, batch=2)
    fused = loader.build(dict(sd), cfg, weights)
    loader.add_fused_blocks(fused)
    got = _forward(fused, cfg, batch=2)
    assert _rel(got, ref) < (1e-5 if dtype == "fp32" else 2e-2)
    assert not torch.equal(got, ref) or dtype == "fp32"  # the fused path ran
    mm.unload_all_models()


def test_fused_block_sends_what_it_does_not_handle_to_comfyuis_block():
    """A mask or an attention patch runs the block's own forward, told; so would fp16
    activations (ComfyUI clamps them between its ops) and reference images."""
    patcher = loader.build(*files.read_checkpoint(models.newbie_dit_file(narrow=True, clip=False)))
    dm = patcher.model.diffusion_model
    block, told = dm.layers[0], []
    forward = nextdit_block.fused_block_forward(block, told.append)
    g = torch.Generator().manual_seed(0)
    x, adaln = torch.randn(1, 10, 96, generator=g), torch.randn(1, 96, generator=g)
    freqs = dm.rope_embedder(torch.zeros(1, 10, 3)).movedim(1, 2)
    mask = torch.ones(1, 10, dtype=torch.bool)
    with torch.inference_mode():
        assert torch.equal(forward(x, mask, freqs, adaln), block.forward(x, mask, freqs, adaln))
        assert told == ["an attention mask"]
        forward(x, None, freqs, adaln)
        assert len(told) == 1  # computed fused
        opts = {"patches": {"attn1_patch": [lambda *a: None]}}
        forward(x, None, freqs, adaln, transformer_options=opts)
        assert told[-1] == "attn1_patch model patches"
        with pytest.raises(TypeError):  # an argument ComfyUI's block does not know either
            forward(x, None, freqs, adaln, aaa=None, zzz=1)
        assert told[-1] == "block argument 'zzz'"  # the one that is set
    why = nextdit_block.why_host_block
    assert why(block, x.half(), None, None, {}) == "fp16 activations"
    assert why(block, x, None, [(0, 4)], {}) == "reference images (timestep_zero_index)"
