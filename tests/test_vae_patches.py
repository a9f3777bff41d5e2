"""Fused GroupNorm Patch and Texture Upsample on real ComfyUI VAEs, alone and composed."""

import inspect
import logging

import comfy.model_management as mm
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nodes
import qwen_turbo.runtime
from qwen_turbo.kernels import warmup
from qwen_turbo.kernels.channel_rms_norm_silu import ChannelRMSNormSiLU
from qwen_turbo.kernels.group_norm_silu import GroupNormSiLU
from qwen_turbo.kernels.upsample_conv3x3 import UpsampleConv3x3
from qwen_turbo.nodes import vae_patches as node
from qwen_turbo.nodes.vae_tiling import VAEDecodeTiled
from qwen_turbo.runtime.vae import patches as vae_patches

TOL = 2 / 255


@pytest.fixture(autouse=True)
def fresh_log(monkeypatch):
    """Forget which reasons were logged once, so each test sees its own lines."""
    monkeypatch.setattr(qwen_turbo.runtime, "_logged", set())


def _decode(vae, latent):
    return nodes.VAEDecode().decode(vae, {"samples": latent})[0]


def _both(vae):
    vae = node.FusedNormPatch.execute(vae).result[0]
    return node.TextureUpsample.execute(vae).result[0]


def test_qwen_vae_patch_sites(qwen_vae):
    norms, skipped = vae_patches.norm_patches(qwen_vae.first_stage_model)
    assert not skipped
    rms = [m for m in norms.values() if isinstance(m, ChannelRMSNormSiLU)]
    silus = [p for p, m in norms.items() if isinstance(m, nn.Identity)]
    assert len(rms) == sum(
        type(m).__name__ == "RMS_norm" for m in qwen_vae.first_stage_model.modules()
    )
    assert len(silus) == sum(m.silu for m in rms) > 0
    assert norms["decoder.middle.0.residual.0"].silu
    assert not norms["decoder.middle.1.norm"].silu  # attention norm: no SiLU after it
    ups, skipped = vae_patches.upsample_patches(qwen_vae.first_stage_model)
    assert not skipped and sorted(ups) == [
        "decoder.upsamples.11.resample", "decoder.upsamples.3.resample",
        "decoder.upsamples.7.resample",
    ]  # fmt: skip


def test_sd_vae_patch_sites(sd_vae):
    norms, _ = vae_patches.norm_patches(sd_vae.first_stage_model)
    gn = [m for m in norms.values() if isinstance(m, GroupNormSiLU)]
    assert len(gn) == sum(isinstance(m, nn.GroupNorm) for m in sd_vae.first_stage_model.modules())
    assert norms["decoder.mid.block_1.norm1"].silu and not norms["decoder.norm_out"].silu
    assert isinstance(norms["decoder.mid.block_1.swish"], nn.Identity)
    ups, _ = vae_patches.upsample_patches(sd_vae.first_stage_model)
    assert len(ups) == 3 and all(isinstance(m, UpsampleConv3x3) for m in ups.values())


def test_unhandled_module_is_left_alone():
    from comfy.ldm.wan.vae import RMS_norm

    model = nn.Sequential(RMS_norm(8, channel_first=False), nn.SiLU())
    patches, skipped = vae_patches.norm_patches(model)
    assert patches == {} and len(skipped) == 1
    path, why = skipped[0]
    assert path == "0" and "channel_first=True" in why


@pytest.mark.parametrize("which", ["norm", "upsample", "both"])
def test_patched_qwen_decode_matches(qwen_vae, which):
    z = torch.randn((1, 16, 1, 9, 13), generator=torch.Generator().manual_seed(0))
    ref = _decode(qwen_vae, z)
    patched = {
        "norm": lambda v: node.FusedNormPatch.execute(v).result[0],
        "upsample": lambda v: node.TextureUpsample.execute(v).result[0],
        "both": _both,
    }[which](qwen_vae)
    out = _decode(patched, z)
    assert out.shape == ref.shape and ref.std() > 0.05
    assert (out - ref).abs().max() <= TOL
    # composed with VAE Tiling, tiles of 32 px
    tiled = VAEDecodeTiled.execute({"samples": z}, patched, 32, 0.0).result[0]
    assert tiled.shape == ref.shape and (tiled - ref).abs().max() <= TOL


def test_patched_sd_decode_and_encode_match(sd_vae):
    z = torch.randn((1, 4, 6, 7), generator=torch.Generator().manual_seed(1)) * 3
    patched = _both(sd_vae)
    ref = _decode(sd_vae, z)
    for out in (_decode(patched, z), VAEDecodeTiled.execute({"samples": z}, patched, 24).result[0]):
        assert out.shape == ref.shape and (out - ref).abs().max() <= TOL
    img = ref[:, :40, :48]
    enc_ref = nodes.VAEEncode().encode(sd_vae, img)[0]["samples"]
    enc = nodes.VAEEncode().encode(patched, img)[0]["samples"]
    torch.testing.assert_close(enc, enc_ref, rtol=1e-3, atol=1e-3)


def test_input_vae_is_never_changed(qwen_vae):
    patched = _both(qwen_vae)
    assert patched.patcher is not qwen_vae.patcher and not qwen_vae.patcher.object_patches
    mm.load_models_gpu([patched.patcher])
    live = qwen_vae.first_stage_model.decoder.middle[0].residual[0]
    assert isinstance(live, ChannelRMSNormSiLU)  # the clone's patches are applied now
    mm.load_models_gpu([qwen_vae.patcher])
    assert type(qwen_vae.first_stage_model.decoder.middle[0].residual[0]).__name__ == "RMS_norm"
    assert type(qwen_vae.first_stage_model.decoder.upsamples[3].resample) is nn.Sequential
    # patching again while nothing is applied finds the same sites
    assert len(_both(qwen_vae).patcher.object_patches) == len(patched.patcher.object_patches)


def _causal_reference(conv, x, k, pad):
    """A causal conv3d as the Wan VAE defines it: zero frames in front, none behind."""
    k = (k,) * 3 if isinstance(k, int) else k
    pad = (pad,) * 3 if isinstance(pad, int) else pad
    xp = F.pad(x, (pad[2], pad[2], pad[1], pad[1], 2 * pad[0], 0))
    return F.conv3d(xp, conv.weight, conv.bias)


def test_single_frame_causal_conv_equals_conv3d():
    """The patch runs one frame as conv2d; where the host already has its own single-frame
    path, the patch is not built and the host's conv gives the same result."""
    from comfy.ldm.wan.vae import CausalConv3d

    g = torch.Generator().manual_seed(7)
    for k, pad in [(3, 1), (1, 0), ((3, 1, 1), (1, 0, 0))]:
        conv = CausalConv3d(6, 5, k, padding=pad)
        with torch.no_grad():
            for p in conv.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        x = torch.randn(2, 6, 1, 9, 11, generator=g)
        ref = _causal_reference(conv, x, k, pad)
        torch.testing.assert_close(conv(x), ref, rtol=1e-5, atol=1e-5)
        patches, skipped = vae_patches.causal_conv_patches(nn.Sequential(conv))
        if skipped:
            assert patches == {} and skipped == [("0", vae_patches.HOST_SINGLE_FRAME)]
            continue
        fwd = patches["0.forward"]
        assert fwd.ok
        torch.testing.assert_close(fwd(x), ref, rtol=1e-5, atol=1e-5)
        # two frames, or a cached frame, take the original path
        x2 = torch.randn(1, 6, 2, 4, 5, generator=g)
        torch.testing.assert_close(fwd(x2), conv(x2))
        cache = [torch.randn(1, 6, 1, 4, 5, generator=g)]
        expected = conv(x2[:, :, :1], cache_x=cache[0])
        torch.testing.assert_close(fwd(x2[:, :, :1], cache_list=cache, cache_idx=0), expected)
        assert cache == [None]


def test_causal_convs_keep_their_class_when_patched(qwen_vae, caplog):
    from comfy.ldm.wan.vae import CausalConv3d

    host_does_it = vae_patches._host_single_frame(qwen_vae.first_stage_model.decoder.conv1)
    with caplog.at_level(logging.INFO):
        patched = node.FusedNormPatch.execute(qwen_vae).result[0]
        node.FusedNormPatch.execute(qwen_vae)
    mm.load_models_gpu([patched.patcher])
    conv1 = qwen_vae.first_stage_model.decoder.conv1
    assert isinstance(conv1, CausalConv3d)  # the Wan decoder dispatches on this
    assert isinstance(conv1.forward, vae_patches.SingleFrameCausalConv) != host_does_it
    skips = [r for r in caplog.records if vae_patches.HOST_SINGLE_FRAME in r.getMessage()]
    if host_does_it:  # not patched twice: one info line for all of them, once
        assert len(skips) == 1 and skips[0].levelno == logging.INFO
        assert not any(p.endswith(".forward") for p in patched.patcher.object_patches)
    else:
        assert skips == []
    mm.load_models_gpu([qwen_vae.patcher])
    assert not isinstance(qwen_vae.first_stage_model.decoder.conv1.forward,
                          vae_patches.SingleFrameCausalConv)  # fmt: skip


def test_unrecognised_causal_conv_is_left_alone(qwen_vae, monkeypatch, caplog):
    conv = qwen_vae.first_stage_model.decoder.conv1
    monkeypatch.setattr(conv, "_padding", (1, 1, 1))  # neither layout this pack knows
    with caplog.at_level(logging.INFO):
        patched = node.FusedNormPatch.execute(qwen_vae).result[0]
    assert "decoder.conv1.forward" not in patched.patcher.object_patches
    (msg,) = [r.getMessage() for r in caplog.records if "unrecognised causal" in r.getMessage()]
    assert "decoder.conv1 as it is" in msg


def _host_upsample(cls=None):
    from comfy.ldm.modules.diffusionmodules.model import Upsample

    up = (cls or Upsample)(8, True)
    with torch.no_grad():
        for p in up.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(5)))
    return up


def test_texture_upsample_takes_the_host_upsample_call():
    """The host's Upsample, with whatever extra arguments its forward takes (newer hosts:
    conv_carry_in, conv_carry_out), passed as the host's decoder passes them for images."""
    up = _host_upsample()
    patches, skipped = vae_patches.upsample_patches(nn.ModuleDict({"up": up}))
    assert not skipped and isinstance(patches["up"], UpsampleConv3x3)
    extra = [None] * (len(inspect.signature(up.forward).parameters) - 1)
    x = torch.randn(1, 8, 5, 7)
    torch.testing.assert_close(patches["up"](x, *extra), up(x, *extra), rtol=1e-5, atol=1e-5)


def test_upsample_with_an_unknown_forward_is_left_alone():
    """A later host's Upsample (same class name) whose forward takes a new argument."""
    from comfy.ldm.modules.diffusionmodules import model

    class Upsample(model.Upsample):
        def forward(self, x, mode="bilinear"):
            return super().forward(x)

    patches, skipped = vae_patches.upsample_patches(nn.ModuleDict({"up": _host_upsample(Upsample)}))
    assert patches == {} and skipped == [
        ("up", "Upsample.forward takes 'mode' not defaulting to None")
    ]


def test_norm_with_an_unknown_forward_is_left_alone():
    """A later host's RMS_norm (same class name) whose forward takes a new argument."""
    from comfy.ldm.wan import vae

    class RMS_norm(vae.RMS_norm):
        def forward(self, x, scale=None):
            return super().forward(x)

    model = nn.Sequential(RMS_norm(8, images=True), nn.SiLU(), nn.GroupNorm(2, 8), nn.SiLU())
    patches, skipped = vae_patches.norm_patches(model)
    assert skipped == [("0", "RMS_norm.forward takes 'scale'")]
    assert list(patches) == ["2"] and "1" not in patches  # its SiLU stays too


def test_unreadable_vae_is_returned_unpatched(qwen_vae, caplog):
    def find(model, backups):
        raise AttributeError("'Decoder3d' object has no attribute 'upsamples'")

    with caplog.at_level(logging.INFO):
        for _ in range(2):
            out, n = vae_patches.patched_vae(qwen_vae, find)
    assert n == 0 and out is not qwen_vae and not out.patcher.object_patches
    (msg,) = [r.getMessage() for r in caplog.records if "returned unpatched" in r.getMessage()]
    assert "AttributeError" in msg


def test_skipped_modules_log_one_line_per_reason(qwen_vae, caplog):
    skipped = [(f"decoder.m{i}", "a reason") for i in range(5)] + [("decoder.x", "another")]
    with caplog.at_level(logging.INFO):
        vae_patches.patched_vae(qwen_vae, lambda model, backups: ({}, skipped))
    lines = [r.getMessage() for r in caplog.records if "Qwen Turbo: left" in r.getMessage()]
    assert lines == [
        "Qwen Turbo: left 5 modules (decoder.m0, decoder.m1, decoder.m2, ...) as they are: "
        "a reason",
        "Qwen Turbo: left decoder.x as it is: another",
    ]


@pytest.mark.parametrize("vae_name", ["qwen_vae", "sd_vae"])
def test_patched_tree_names_its_weights_as_the_original(vae_name, request):
    """ComfyUI's ModelPatcher (v0.33's dynamic one) backs weights up by name while the
    patches are on and restores them by name after: every name must resolve in both trees."""
    vae = request.getfixturevalue(vae_name)
    original = dict(vae.first_stage_model.named_parameters()).keys()
    patched = _both(vae)
    mm.load_models_gpu([patched.patcher])
    try:
        assert dict(patched.first_stage_model.named_parameters()).keys() == original
    finally:
        mm.unload_all_models()
    assert dict(vae.first_stage_model.named_parameters()).keys() == original


def test_a_patched_vae_warms_its_own_kernels(qwen_vae, sd_vae):
    """The Qwen-Image VAE's patches start the whole recorded manifest (the Qwen workflows'
    DiT kernels then compile during text encoding); another VAE's (SD's, Flux's: NewBie's)
    only its own kernels', none of which the manifest holds: nothing compiles for them."""

    def patches(vae):
        norms, _ = vae_patches.norm_patches(vae.first_stage_model)
        ups, _ = vae_patches.upsample_patches(vae.first_stage_model)
        return {**norms, **ups}

    assert vae_patches.warmed(patches(qwen_vae)) is None
    assert vae_patches.warmed(patches(sd_vae)) == {"group_norm_silu", "upsample_conv3x3"}
    assert not warmup.selected(warmup.MANIFEST, vae_patches.warmed(patches(sd_vae)))
