"""VAE Tiling: exact against an untiled decode, for the Qwen/Wan VAE and AutoencoderKL."""

import comfy.model_management as mm
import pytest
import torch

from qwen_turbo.nodes import vae_tiling as node
from qwen_turbo.runtime import vae_tiling
from tests.harness import models

TOL = 2 / 255  # images in 0..1


def _latent(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _tiled(vae, latent, tile_size=0, budget_gb=0.0):
    out = node.VAEDecodeTiled.execute({"samples": latent}, vae, tile_size, budget_gb).result[0]
    assert torch.isfinite(out).all()
    return out


def _stock(vae, latent):
    import nodes

    return nodes.VAEDecode().decode(vae, {"samples": latent})[0]


def _max_tiles(vae, latent, tile_size, budget_gb):
    if latent.ndim == 4 and vae.latent_dim == 3:
        latent = latent.unsqueeze(2)
    ops = vae_tiling.decoder_ops(vae.first_stage_model, latent)
    budget = int(budget_gb * 2**30) or 2**40
    return vae_tiling.plan_decode(ops, latent.shape, vae.vae_dtype, budget, tile_size).max_tiles


@pytest.mark.slow
def test_qwen_vae_odd_latent_matches_untiled(qwen_vae):
    z = _latent((1, 16, 1, 37, 53), 0)
    ref = _stock(qwen_vae, z)
    assert ref.shape == (1, 296, 424, 3) and ref.std() > 0.05
    for tile in (0, 96):
        budget = 0.05 if tile == 0 else 0.0  # 50 MiB: the planner must tile
        assert _max_tiles(qwen_vae, z, tile, budget) > 1
        out = _tiled(qwen_vae, z, tile, budget)
        assert (out - ref).abs().max() <= TOL


@pytest.mark.parametrize("tile", [8, 24, 40, 1000])
def test_qwen_vae_any_tile_size(qwen_vae, tile):
    z = _latent((2, 16, 11, 19), 1)  # 4-D, as EmptySD3LatentImage gives it
    ref = _stock(qwen_vae, z.unsqueeze(2))
    out = _tiled(qwen_vae, z, tile)
    assert out.shape == ref.shape == (2, 88, 152, 3)
    if tile < 152:
        assert _max_tiles(qwen_vae, z, tile, 0) > 1
    assert (out - ref).abs().max() <= TOL


@pytest.mark.parametrize("tile,budget", [(16, 0.0), (48, 0.0), (0, 0.004)])
def test_autoencoder_kl_matches_untiled(sd_vae, tile, budget):
    z = _latent((1, 4, 9, 13), 2) * 3
    ref = _stock(sd_vae, z)
    assert ref.std() > 0.05
    assert _max_tiles(sd_vae, z, tile, budget) > 1
    out = _tiled(sd_vae, z, tile, budget)
    assert out.shape == ref.shape == (1, 72, 104, 3)
    assert (out - ref).abs().max() <= TOL


def test_unsupported_latent_falls_back_to_stock_decode(qwen_vae, caplog):
    z = _latent((1, 16, 2, 6, 7), 3)  # two frames: not tiled, decoded by ComfyUI
    with pytest.raises(NotImplementedError, match="T != 1"):
        vae_tiling.decoder_ops(qwen_vae.first_stage_model, z)
    out = _tiled(qwen_vae, z, 16)
    torch.testing.assert_close(out, _stock(qwen_vae, z))
    assert "using ComfyUI's VAE decode" in caplog.text


def test_out_of_memory_retries_with_a_smaller_budget(qwen_vae, monkeypatch):
    budgets = []
    real = vae_tiling.execute

    def execute(plan, *a, **k):
        budgets.append(plan)
        if len(budgets) == 1:
            raise mm.OOM_EXCEPTION("simulated")
        return real(plan, *a, **k)

    monkeypatch.setattr(vae_tiling, "execute", execute)
    z = _latent((1, 16, 1, 9, 10), 4)
    out = _tiled(qwen_vae, z, 0, 1.0)
    assert len(budgets) == 2 and budgets[1].total >= budgets[0].total
    assert (out - _stock(qwen_vae, z)).abs().max() <= TOL


def test_out_of_memory_at_every_budget_names_the_fix(qwen_vae, monkeypatch):
    def execute(*a, **k):
        raise mm.OOM_EXCEPTION("simulated")

    monkeypatch.setattr(vae_tiling, "execute", execute)
    with pytest.raises(RuntimeError, match="unload other models"):
        _tiled(qwen_vae, _latent((1, 16, 1, 4, 4), 5))


def test_interrupt_stops_between_tiles_and_next_run_works(qwen_vae):
    z = _latent((1, 16, 1, 9, 10), 6)
    mm.interrupt_current_processing(True)
    try:
        with pytest.raises(mm.InterruptProcessingException):
            _tiled(qwen_vae, z, 16)
    finally:
        mm.interrupt_current_processing(False)
    assert (_tiled(qwen_vae, z, 16) - _stock(qwen_vae, z)).abs().max() <= TOL


def test_plan_for_2512px_qwen_stays_within_4_gib():
    """The planner's own accounting at full size; the GPU benchmark measures the real peak."""
    vae = models.qwen_vae_module()
    z = torch.empty((1, 16, 1, 314, 314), device="meta")
    ops = vae_tiling.decoder_ops(vae, z)
    budget = 4 * 2**30
    plan = vae_tiling.plan_decode(ops, z.shape, torch.bfloat16, budget)
    chains = [s for s in plan.steps if isinstance(s, vae_tiling.Chain)]
    assert chains[-1].scale > 1 and len(chains[-1].tiles) > 1  # the 2512-px stages are tiled
    assert all(c.store_on_device for c in chains)
