"""VAE Tiling Encode: exact against ComfyUI's VAEEncode, for the Qwen/Wan VAE and AutoencoderKL."""

from fractions import Fraction

import comfy.model_management as mm
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from torch import nn

import nodes
from qwen_turbo.nodes import vae_patches
from qwen_turbo.nodes import vae_tiling as node
from qwen_turbo.runtime.vae import budget as vae_budget
from qwen_turbo.runtime.vae import describe, executor, planner
from tests import test_vae_tiling as decode_tests
from tests.harness import models

# the decode tests' fixtures: badge capture (autouse), ComfyUI's memory requests, an OOM once
badges, memory_requests, oom_once = (
    decode_tests.badges, decode_tests.memory_requests, decode_tests.oom_once
)  # fmt: skip
_sent, _Wrapped = decode_tests._sent, decode_tests._Wrapped

TOL = 1e-4  # relative L2 of the latent, fp32
FALLBACK = "using ComfyUI's VAE encode"


def _pixels(shape, seed):
    """Smooth random images in 0..1 (noise upsampled 4x, plus fine noise)."""
    g = torch.Generator().manual_seed(seed)
    b, h, w, c = shape
    coarse = torch.rand((b, c, h // 4 + 1, w // 4 + 1), generator=g)
    smooth = nn.functional.interpolate(coarse, scale_factor=4, mode="bilinear")[..., :h, :w]
    return (0.8 * smooth + 0.2 * torch.rand((b, c, h, w), generator=g)).movedim(1, -1)


def _stock(vae, pixels):
    return nodes.VAEEncode().encode(vae, pixels)[0]["samples"]


def _tiled(vae, pixels, tile_size=0, budget_gb=0.0, tiled=True):
    out = node.VAEEncodeTiled.execute(pixels, vae, tile_size, budget_gb).result[0]["samples"]
    assert torch.isfinite(out).all()
    # the badge says whether it fell back to ComfyUI's encode: the tiled path really ran
    assert ("fallback" not in _sent[-1]) == tiled, _sent[-1].get("fallback")
    return out


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _encoder_input(vae, pixels):
    """The pixels as VAE.encode hands them to the model (cropped, channels first, frames)."""
    x = vae.process_input(vae.vae_encode_crop_pixels(pixels[..., :3]).movedim(-1, 1))
    return x.movedim(1, 0).unsqueeze(0) if vae.latent_dim == 3 else x


def _max_tiles(vae, pixels, tile_size, budget_gb):
    x = _encoder_input(vae, pixels)
    ops = describe.encoder_ops(vae.first_stage_model, x)
    budget = int(budget_gb * 2**30) or 2**40
    return planner.plan_tiles(ops, x.shape, vae.vae_dtype, budget, tile_size).max_tiles


def _fallbacks(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if FALLBACK in r.getMessage()]


@pytest.mark.slow
@pytest.mark.parametrize("vae_name", ["qwen_vae", "sd_vae"])
def test_odd_size_matches_stock_encode(vae_name, request):
    """200x328: not a multiple of the tiles; 50 MiB forces the planner to tile."""
    vae = request.getfixturevalue(vae_name)
    px = _pixels((1, 200, 328, 3), 0)
    ref = _stock(vae, px)
    assert ref.shape[-2:] == (25, 41) and ref.std() > 0.05
    for tile, budget in [(96, 0.0), (0, 0.05)]:
        assert _max_tiles(vae, px, tile, budget) > 1
        out = _tiled(vae, px, tile, budget)
        assert out.shape == ref.shape and out.dtype == ref.dtype
        assert _rel(out, ref) <= TOL


@pytest.mark.parametrize("tile,budget", [(16, 0.0), (24, 0.0), (40, 0.0), (1000, 0.0), (40, 0.002)])
def test_qwen_vae_any_tile_size(qwen_vae, tile, budget):
    """2 MiB: the whole encoder up to the mid attention is one chain (halo 40, on the 8-px
    grid)."""
    px = _pixels((1, 91, 157, 4), 1)  # cropped to 88x152 as VAEEncode does; an alpha channel
    ref = _stock(qwen_vae, px)
    out = _tiled(qwen_vae, px, tile, budget)
    assert out.shape == ref.shape == (1, 16, 1, 11, 19) and out.is_contiguous()
    if tile < 152:
        assert _max_tiles(qwen_vae, px, tile, budget) > 1
    assert _rel(out, ref) <= TOL


@pytest.mark.parametrize("tile,budget", [(16, 0.0), (48, 0.0), (0, 0.004)])
def test_autoencoder_kl_matches_stock(sd_vae, tile, budget):
    px = _pixels((2, 72, 104, 3), 2)  # a batch of two
    ref = _stock(sd_vae, px)
    assert ref.std() > 0.05
    assert _max_tiles(sd_vae, px, tile, budget) > 1
    out = _tiled(sd_vae, px, tile, budget)
    assert out.shape == ref.shape == (2, 4, 9, 13)
    assert _rel(out, ref) <= TOL


def test_tile_borders_sit_on_the_downscale_grid(qwen_vae):
    """Every tile border of a downsampling chain, and its halo, is a multiple of the chain's
    downscale factor."""
    x = _encoder_input(qwen_vae, _pixels((1, 88, 152, 3), 3))
    ops = describe.encoder_ops(qwen_vae.first_stage_model, x)
    for budget, first in [(2**22, Fraction(1, 4)), (2**21, Fraction(1, 8))]:
        plan = planner.plan_tiles(ops, x.shape, torch.float32, budget, 20)
        chains = [s for s in plan.steps if isinstance(s, planner.Chain)]
        assert chains[0].scale == first and len(chains[0].tiles) > 1
        for c in chains:
            step = c.scale.denominator
            assert c.halo % step == 0
            assert all(v % step == 0 for tile in c.tiles for v in tile)


def test_batch_of_images_for_the_wan_vae_encodes_stock(qwen_vae, caplog):
    """The Wan VAE takes a batch of images as the frames of one video: not tiled."""
    px = _pixels((2, 32, 40, 3), 4)
    with pytest.raises(NotImplementedError, match="T != 1"):
        describe.encoder_ops(qwen_vae.first_stage_model, _encoder_input(qwen_vae, px))
    out = _tiled(qwen_vae, px, 16, tiled=False)
    _tiled(qwen_vae, px, 16, tiled=False)
    torch.testing.assert_close(out, _stock(qwen_vae, px), rtol=0, atol=0)
    assert len(_fallbacks(caplog)) == 1 and "T != 1" in _fallbacks(caplog)[0]  # logged once


def test_unrecognised_encoder_layer_encodes_stock(sd_vae, monkeypatch, caplog):
    enc = sd_vae.first_stage_model.encoder
    # in _modules: newer pytest's setattr would delete an attribute not in __dict__ on undo
    monkeypatch.setitem(enc._modules, "conv_in", _Wrapped(enc.conv_in))
    px = _pixels((1, 40, 48, 3), 5)
    with pytest.raises(NotImplementedError, match="conv_in is a _Wrapped"):
        describe.encoder_ops(sd_vae.first_stage_model, _encoder_input(sd_vae, px))
    out = _tiled(sd_vae, px, 16, tiled=False)
    assert "conv_in is a _Wrapped" in _sent[-1]["fallback"]
    torch.testing.assert_close(out, _stock(sd_vae, px), rtol=0, atol=0)
    (msg,) = _fallbacks(caplog)
    assert "conv_in is a _Wrapped" in msg


def test_unrecognised_wan_downsample_encodes_stock(qwen_vae, monkeypatch, caplog):
    down = qwen_vae.first_stage_model.encoder.downsamples[2]
    assert down.mode == "downsample2d"
    monkeypatch.setattr(down, "mode", "downsample4x")  # a layer the ops do not describe
    px = _pixels((1, 32, 40, 3), 6)
    with pytest.raises(NotImplementedError, match="Encoder3d layer 2 Resample .downsample4x"):
        describe.encoder_ops(qwen_vae.first_stage_model, _encoder_input(qwen_vae, px))
    out = _tiled(qwen_vae, px, 16, tiled=False)
    torch.testing.assert_close(out, _stock(qwen_vae, px), rtol=0, atol=0)
    assert len(_fallbacks(caplog)) == 1


def _raising(error):
    def fn(*a, **k):
        raise error

    return fn


def test_encoder_failing_mid_run_falls_back_to_stock(qwen_vae, monkeypatch, caplog):
    error = TypeError("forward() missing 1 required positional argument: 'feat_cache'")
    monkeypatch.setattr(executor, "execute", _raising(error))
    px = _pixels((1, 32, 40, 3), 7)
    torch.testing.assert_close(_tiled(qwen_vae, px, 16, tiled=False), _stock(qwen_vae, px))
    (msg,) = _fallbacks(caplog)
    assert "the encoder does not run tile by tile (TypeError" in msg


def test_latent_batch_norm_vae_matches_stock():
    """Flux 2's VAE: the AutoencoderKL encoder, then 2x2 pixels to channels and a batch norm,
    on hosts that have it."""
    vae = models.sd_vae_with_latent_batch_norm()
    if getattr(vae.first_stage_model, "bn", None) is None:
        pytest.skip("this ComfyUI has no latent batch norm")
    px = _pixels((1, 80, 112, 3), 8)
    ref = _stock(vae, px)
    assert ref.shape == (1, 16, 5, 7) and ref.std() > 0.05
    assert _max_tiles(vae, px, 24, 0) > 1
    assert _rel(_tiled(vae, px, 24), ref) <= TOL


@pytest.mark.parametrize("vae_name", ["qwen_vae", "sd_vae"])
def test_patched_vae_encodes_with_its_patches(vae_name, request):
    """Fused GroupNorm Patch's fused norms (and, on hosts without their own single-frame
    path, 2-D causal convs) sit in the encoder too; the tiled encode runs through them."""
    vae = request.getfixturevalue(vae_name)
    patched = vae_patches.FusedNormPatch.execute(vae).result[0]
    encoder = {p for p in patched.patcher.object_patches if p.startswith("encoder.")}
    assert len(encoder) > 10
    px = _pixels((1, 48, 64, 3), 9)
    ref = _stock(vae, px)
    try:
        for out in (_stock(patched, px), _tiled(patched, px, 24)):
            assert out.shape == ref.shape and _rel(out, ref) <= 1e-3
    finally:  # the patched clone stays loaded, its patches in the shared VAE's modules
        mm.unload_all_models()


def test_out_of_memory_retries_with_a_smaller_budget(qwen_vae, oom_once):
    plans = oom_once
    px = _pixels((1, 48, 56, 3), 10)
    out = _tiled(qwen_vae, px, 0, 1.0)
    assert len(plans) == 2 and plans[1].total >= plans[0].total
    assert _rel(out, _stock(qwen_vae, px)) <= TOL


def test_automatic_budget_asks_comfyui_for_room(qwen_vae, memory_requests, monkeypatch):
    """A small card: 3 GiB free. The encode asks ComfyUI for stock's encode estimate (at most
    4 GiB) before anything else, then plans with ComfyUI's free memory less its reserve."""
    import comfy.model_management as mm

    asked, planned = memory_requests
    free = 3 * 2**30
    monkeypatch.setattr(mm, "get_free_memory", lambda dev=None, torch_free_too=False: free)
    monkeypatch.setattr(qwen_vae.patcher, "get_free_memory", lambda dev=None: free, raising=False)
    px = _pixels((1, 48, 56, 3), 11)
    _tiled(qwen_vae, px)
    stock = qwen_vae.memory_used_encode((1, 3, 1, 48, 56), qwen_vae.vae_dtype)
    assert asked == [min(stock, vae_budget.AUTO_REQUEST)]
    assert planned == [free - mm.extra_reserved_memory()]
    big = torch.empty(1, 3, 1, 2512, 2512, device="meta")
    assert vae_budget.request(qwen_vae, big, 0, "memory_used_encode") == vae_budget.AUTO_REQUEST


def test_set_budget_is_asked_for_and_again_after_out_of_memory(qwen_vae, memory_requests, oom_once):
    asked, planned = memory_requests
    _tiled(qwen_vae, _pixels((1, 48, 56, 3), 12), 0, 1.0)
    assert asked == [2**30, 2**28] and planned == [2**30, 2**28]


def test_plan_for_2512px_qwen_stays_on_the_device_within_4_gib():
    """The planner's own accounting at full size; the GPU benchmark measures the real peak."""
    x = torch.empty((1, 3, 1, 2512, 2512), device="meta")
    ops = describe.encoder_ops(models.qwen_vae_module(), x)
    plan = planner.plan_tiles(ops, x.shape, torch.bfloat16, 4 * 2**30)
    chains = [s for s in plan.steps if isinstance(s, planner.Chain)]
    assert chains[0].scale < 1 and len(chains[0].tiles) > 1  # the 2512-px stage is tiled
    assert all(c.store_on_device for c in chains)


def test_node_in_comfyui_equals_stock_vae_encode(comfy_server):
    """LoadImage (odd size, cropped by both) -> VAEEncode and VAE Tiling Encode (32-px tiles)
    -> SaveLatent, through the server's executor."""
    info = comfy_server.get("/object_info")["QwenTurboVAEEncodeTiled"]
    assert info["display_name"] == "VAE Tiling Encode" and info["category"] == "QwenTurbo"
    assert list(info["input"]["required"]) == ["pixels", "vae"]
    assert list(info["input"]["optional"]) == ["tile_size", "vram_budget_gb"]
    assert info["output"] == ["LATENT"]
    image = (_pixels((1, 91, 157, 3), 13)[0].numpy() * 255).round().astype(np.uint8)
    (comfy_server.base / "input").mkdir(exist_ok=True)
    Image.fromarray(image).save(comfy_server.base / "input" / "qt_encode.png")
    vae = ["1", 0]
    prompt = {
        "1": {"class_type": "VAELoader",
              "inputs": {"vae_name": models.qwen_vae_file().name}},
        "2": {"class_type": "LoadImage", "inputs": {"image": "qt_encode.png"}},
        "3": {"class_type": "VAEEncode", "inputs": {"pixels": ["2", 0], "vae": vae}},
        "4": {"class_type": "QwenTurboVAEEncodeTiled",
              "inputs": {"pixels": ["2", 0], "vae": vae, "tile_size": 32,
                         "vram_budget_gb": 0.0}},
        "5": {"class_type": "SaveLatent", "inputs": {"samples": ["3", 0],
                                                     "filename_prefix": "qt_stock"}},
        "6": {"class_type": "SaveLatent", "inputs": {"samples": ["4", 0],
                                                     "filename_prefix": "qt_tiled"}},
    }  # fmt: skip
    entry = comfy_server.run(prompt)
    stock, tiled = (
        load_file(str(comfy_server.output / f["subfolder"] / f["filename"]))["latent_tensor"]
        for f in (entry["outputs"][n]["latents"][0] for n in ("5", "6"))
    )
    assert stock.shape == (1, 16, 1, 11, 19) and stock.std() > 0.05
    assert tiled.shape == stock.shape and tiled.dtype == stock.dtype
    assert _rel(tiled, stock) <= TOL
