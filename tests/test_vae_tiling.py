"""VAE Tiling: exact against an untiled decode, for the Qwen/Wan VAE and AutoencoderKL."""

import logging

import comfy.model_management as mm
import pytest
import torch
from torch import nn

import qwen_turbo.runtime
from qwen_turbo.nodes import report
from qwen_turbo.nodes import vae_tiling as node
from qwen_turbo.runtime.vae import budget as vae_budget
from qwen_turbo.runtime.vae import describe, executor, planner
from tests.harness import models

TOL = 2 / 255  # images in 0..1
FALLBACK = "using ComfyUI's VAE decode"


_sent: list[dict] = []  # what node runs sent to the frontend badge


@pytest.fixture(autouse=True)
def badges(monkeypatch, caplog):
    """Capture the badge data; start from a fresh log-once record."""
    _sent.clear()
    monkeypatch.setattr(report, "send", lambda node_id, data: _sent.append(data))
    monkeypatch.setattr(qwen_turbo.runtime, "_logged", set())
    caplog.set_level(logging.INFO)


def _latent(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _tiled(vae, latent, tile_size=0, budget_gb=0.0, tiled=True):
    out = node.VAEDecodeTiled.execute({"samples": latent}, vae, tile_size, budget_gb).result[0]
    assert torch.isfinite(out).all()
    # the badge says whether it fell back to ComfyUI's decode: the tiled path really ran
    assert ("fallback" not in _sent[-1]) == tiled, _sent[-1].get("fallback")
    return out


def _fallbacks(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if FALLBACK in r.getMessage()]


def _stock(vae, latent):
    import nodes

    return nodes.VAEDecode().decode(vae, {"samples": latent})[0]


def _max_tiles(vae, latent, tile_size, budget_gb):
    if latent.ndim == 4 and vae.latent_dim == 3:
        latent = latent.unsqueeze(2)
    ops = describe.decoder_ops(vae.first_stage_model, latent)
    budget = int(budget_gb * 2**30) or 2**40
    return planner.plan_tiles(ops, latent.shape, vae.vae_dtype, budget, tile_size).max_tiles


@pytest.mark.slow
def test_qwen_vae_odd_latent_matches_untiled(qwen_vae):
    # 3 x 4 tiles either way: border and interior tiles, an odd size on both axes
    z = _latent((1, 16, 1, 21, 29), 0)
    ref = _stock(qwen_vae, z)
    assert ref.shape == (1, 168, 232, 3) and ref.std() > 0.05
    for tile in (0, 64):
        budget = 0.03 if tile == 0 else 0.0  # 30 MiB: the planner must tile
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
        describe.decoder_ops(qwen_vae.first_stage_model, z)
    out = _tiled(qwen_vae, z, 16, tiled=False)
    _tiled(qwen_vae, z, 16, tiled=False)
    torch.testing.assert_close(out, _stock(qwen_vae, z))
    assert len(_fallbacks(caplog)) == 1 and "T != 1" in _fallbacks(caplog)[0]  # logged once


class _Wrapped(nn.Module):
    """A conv behind a module VAE Tiling does not know; ComfyUI's decode just calls it."""

    def __init__(self, conv):
        super().__init__()
        self.inner = conv

    def forward(self, x):
        return self.inner(x)


def test_unrecognised_autoencoder_kl_layer_decodes_stock(sd_vae, monkeypatch, caplog):
    dec = sd_vae.first_stage_model.decoder
    # nn.Module keeps children in _modules: setattr's undo would delete conv_in for good
    monkeypatch.setitem(dec._modules, "conv_in", _Wrapped(dec.conv_in))
    z = _latent((1, 4, 5, 6), 7)
    with pytest.raises(NotImplementedError, match="conv_in is a _Wrapped"):
        describe.decoder_ops(sd_vae.first_stage_model, z)
    for _ in range(2):
        out = _tiled(sd_vae, z, 16, tiled=False)
    torch.testing.assert_close(out, _stock(sd_vae, z))
    (msg,) = _fallbacks(caplog)
    assert "conv_in is a _Wrapped" in msg


def test_unrecognised_wan_block_layout_decodes_stock(qwen_vae, monkeypatch, caplog):
    block = qwen_vae.first_stage_model.decoder.middle[0]
    monkeypatch.delattr(block, "in_dim")  # its forward does not read it; the ops do
    z = _latent((1, 16, 1, 5, 6), 8)
    with pytest.raises(NotImplementedError, match="Decoder3d layout .AttributeError"):
        describe.decoder_ops(qwen_vae.first_stage_model, z)
    torch.testing.assert_close(_tiled(qwen_vae, z, 16, tiled=False), _stock(qwen_vae, z))
    assert len(_fallbacks(caplog)) == 1


def test_wan_layer_needing_more_arguments_is_not_tiled(qwen_vae, monkeypatch):
    up = qwen_vae.first_stage_model.decoder.upsamples[3]

    def forward(x, feat_cache, feat_idx=None):  # a host that always passes the cache
        return type(up).forward(up, x)

    monkeypatch.setattr(up, "forward", forward)
    with pytest.raises(NotImplementedError, match="needs 'feat_cache'"):
        describe.decoder_ops(qwen_vae.first_stage_model, _latent((1, 16, 1, 4, 4), 9))


def test_decoder_failing_mid_decode_falls_back_to_stock(qwen_vae, monkeypatch, caplog):
    def execute(*a, **k):  # a module called in a way this host's does not take
        raise TypeError("forward() missing 1 required positional argument: 'feat_cache'")

    monkeypatch.setattr(executor, "execute", execute)
    z = _latent((1, 16, 1, 5, 6), 10)
    out = _tiled(qwen_vae, z, 16, tiled=False)
    torch.testing.assert_close(out, _stock(qwen_vae, z))
    (msg,) = _fallbacks(caplog)
    assert "does not run tile by tile (TypeError" in msg


def test_other_errors_are_raised_not_hidden_by_a_fallback(qwen_vae, monkeypatch, caplog):
    """An error that is neither out of memory nor a module called differently (a bug) reaches
    the user as it is: no stock decode, no retry."""
    calls = []

    def execute(*a, **k):
        calls.append(1)
        raise RuntimeError("boom")

    monkeypatch.setattr(executor, "execute", execute)
    with pytest.raises(RuntimeError, match="boom"):
        node.VAEDecodeTiled.execute({"samples": _latent((1, 16, 1, 5, 6), 15)}, qwen_vae, 16, 0)
    assert calls == [1] and not _fallbacks(caplog)


def test_a_latent_of_another_vae_is_named(qwen_vae):
    """A 4-channel latent (an SD VAE's) into the 16-channel Qwen VAE: the error says so."""
    with pytest.raises(ValueError, match="latent has 4 channels, and this VAE takes 16") as e:
        node.VAEDecodeTiled.execute({"samples": _latent((1, 4, 1, 5, 6), 17)}, qwen_vae, 0, 0)
    assert isinstance(e.value.__cause__, RuntimeError)  # the decode's own error, kept


def test_a_vae_without_stock_estimates_asks_for_the_automatic_request():
    x = torch.empty(1, 16, 1, 314, 314)
    assert vae_budget.request(object(), x, 0) == vae_budget.AUTO_REQUEST
    assert vae_budget.request(object(), x, 0, "memory_used_encode") == vae_budget.AUTO_REQUEST
    assert vae_budget.request(object(), x, 2**29) == 2**29


def test_latent_batch_norm_vae_matches_untiled():
    """Flux 2's VAE: a latent batch norm and 2x2 unpatchify before the AutoencoderKL decoder,
    on hosts that have it (its state dict loads without it elsewhere)."""
    vae = models.sd_vae_with_latent_batch_norm()
    if getattr(vae.first_stage_model, "bn", None) is None:
        pytest.skip("this ComfyUI has no latent batch norm")
    z = _latent((1, vae.latent_channels, 5, 7), 11) * 2
    ref = _stock(vae, z)
    assert ref.shape == (1, 80, 112, 3) and ref.std() > 0.05
    assert _max_tiles(vae, z, 24, 0) > 1
    assert (_tiled(vae, z, 24) - ref).abs().max() <= TOL


@pytest.fixture
def oom_once(monkeypatch):
    """The plans executed; the first runs out of memory (simulated), the others run."""
    plans, real = [], executor.execute

    def execute(plan, *a, **k):
        plans.append(plan)
        if len(plans) == 1:
            raise mm.OOM_EXCEPTION("simulated")
        return real(plan, *a, **k)

    monkeypatch.setattr(executor, "execute", execute)
    return plans


def test_out_of_memory_retries_with_a_smaller_budget(qwen_vae, oom_once):
    budgets = oom_once
    z = _latent((1, 16, 1, 9, 10), 4)
    out = _tiled(qwen_vae, z, 0, 1.0)
    assert len(budgets) == 2 and budgets[1].total >= budgets[0].total
    assert (out - _stock(qwen_vae, z)).abs().max() <= TOL


def test_out_of_memory_at_every_budget_names_the_fix(qwen_vae, monkeypatch):
    def execute(*a, **k):
        raise mm.OOM_EXCEPTION("simulated")

    monkeypatch.setattr(executor, "execute", execute)
    with pytest.raises(mm.OOM_EXCEPTION, match="unload other models"):  # the executor unloads
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
    ops = describe.decoder_ops(vae, z)
    budget = 4 * 2**30
    plan = planner.plan_tiles(ops, z.shape, torch.bfloat16, budget)
    chains = [s for s in plan.steps if isinstance(s, planner.Chain)]
    assert chains[-1].scale > 1 and len(chains[-1].tiles) > 1  # the 2512-px stages are tiled
    assert all(c.store_on_device for c in chains)


@pytest.fixture
def memory_requests(monkeypatch):
    """What VAE Tiling asks ComfyUI's memory manager for (memory_required of each
    load_models_gpu call, in bytes), the real call still made; and the budgets planned."""
    asked, planned = [], []
    load, plan = mm.load_models_gpu, planner.plan_tiles

    def load_models_gpu(models, memory_required=0, **kwargs):
        asked.append(memory_required)
        return load(models, memory_required=memory_required, **kwargs)

    def plan_tiles(ops, shape, dtype, budget, tile_size=0):
        planned.append(budget)
        return plan(ops, shape, dtype, budget, tile_size)

    monkeypatch.setattr(mm, "load_models_gpu", load_models_gpu)
    monkeypatch.setattr(planner, "plan_tiles", plan_tiles)
    return asked, planned


def test_automatic_budget_asks_comfyui_for_room_then_uses_what_it_counts_free(
    qwen_vae, memory_requests, monkeypatch
):
    """A small card: 3 GiB free. The decode asks ComfyUI to make room (stock's estimate, at
    most 1 GiB) before anything else, then plans with ComfyUI's free memory less its reserve."""
    asked, planned = memory_requests
    free = 3 * 2**30
    monkeypatch.setattr(mm, "get_free_memory", lambda dev=None, torch_free_too=False: free)
    monkeypatch.setattr(qwen_vae.patcher, "get_free_memory", lambda dev=None: free, raising=False)
    z = _latent((1, 16, 1, 9, 10), 7)
    _tiled(qwen_vae, z)
    stock = qwen_vae.memory_used_decode(z.shape, qwen_vae.vae_dtype)
    assert asked == [min(stock, vae_budget.AUTO_REQUEST)]
    assert planned == [free - mm.extra_reserved_memory()]
    # at 2512² stock's estimate is far larger: the request stays at AUTO_REQUEST
    big = qwen_vae.memory_used_decode((1, 16, 1, 314, 314), torch.bfloat16)
    assert big > 4 * vae_budget.AUTO_REQUEST
    assert (
        vae_budget.request(qwen_vae, torch.empty(1, 16, 1, 314, 314), 0) == vae_budget.AUTO_REQUEST
    )


def test_reserve_vram_shrinks_the_automatic_budget(qwen_vae, memory_requests, monkeypatch):
    """`--reserve-vram 2` (what ComfyUI's model_management sets from it at import): the decode
    leaves those 2 GiB out of the budget, as stock nodes leave them out of what they load."""
    asked, planned = memory_requests
    free = 8 * 2**30
    monkeypatch.setattr(mm, "get_free_memory", lambda dev=None, torch_free_too=False: free)
    monkeypatch.setattr(qwen_vae.patcher, "get_free_memory", lambda dev=None: free, raising=False)
    monkeypatch.setattr(mm, "EXTRA_RESERVED_VRAM", 2 * 2**30)
    _tiled(qwen_vae, _latent((1, 16, 1, 9, 10), 14))
    assert planned == [free - 2 * 2**30]


def test_set_budget_is_what_comfyui_is_asked_for(qwen_vae, memory_requests):
    asked, planned = memory_requests
    _tiled(qwen_vae, _latent((1, 16, 1, 9, 10), 8), 0, 0.5)
    assert asked == [2**29] and planned == [2**29]


def test_a_budget_above_the_device_is_the_device(qwen_vae, memory_requests, caplog):
    asked, planned = memory_requests
    total = mm.get_total_memory(qwen_vae.device)
    _tiled(qwen_vae, _latent((1, 16, 1, 9, 10), 16), 0, 1024.0)
    assert total < 1024 * 2**30 and asked == [int(total)] and planned == [int(total)]
    assert "vram_budget_gb 1024.0 is more than this device's" in caplog.text


def test_out_of_memory_asks_comfyui_again_before_retrying(qwen_vae, memory_requests, oom_once):
    asked, planned = memory_requests
    _tiled(qwen_vae, _latent((1, 16, 1, 9, 10), 9), 0, 1.0)
    assert asked == [2**30, 2**28] and planned == [2**30, 2**28]


@pytest.mark.parametrize("free_gib, kept", [(0.5, False), (64.0, True)])
def test_cached_graphs_go_before_comfyui_is_asked_for_room(qwen_vae, monkeypatch, free_gib, kept):
    """Short of room, the sampler's cached graphs are dropped before ComfyUI is asked to
    unload or offload a model; with room to spare they stay for the next run."""
    from qwen_turbo.runtime import memory
    from qwen_turbo.runtime.graphs.cache import Graph, cache_for

    free = int(free_gib * 2**30)
    monkeypatch.setattr(mm, "get_free_memory", lambda dev=None, torch_free_too=False: free)
    monkeypatch.setattr(qwen_vae.patcher, "get_free_memory", lambda dev=None: free, raising=False)
    model = nn.Linear(2, 2)
    cache = cache_for(model)
    cache.put("key", Graph(lambda: None, [], torch.zeros(1), 2**30))
    seen = []
    monkeypatch.setattr(mm, "load_models_gpu", lambda *a, **k: seen.append(len(cache.graphs)))
    vae_budget.make_room(qwen_vae, 2**30)
    assert seen == [1 if kept else 0]  # dropped before ComfyUI was asked
    assert bool(cache.graphs) == kept
    memory.release(model)


def test_out_of_memory_drops_cached_graphs_whatever_comfyui_counts(qwen_vae, monkeypatch):
    """ComfyUI counts 64 GiB free (its count takes a graph pool's unused memory as free), so a
    set budget keeps the sampler's cached graph; the decode runs out of memory, and the graph
    is gone before the retry."""
    from qwen_turbo.runtime import memory
    from qwen_turbo.runtime.graphs.cache import Graph, cache_for

    free = 64 * 2**30
    monkeypatch.setattr(mm, "get_free_memory", lambda dev=None, torch_free_too=False: free)
    monkeypatch.setattr(qwen_vae.patcher, "get_free_memory", lambda dev=None: free, raising=False)
    model = nn.Linear(2, 2)
    cache = cache_for(model)
    cache.put("key", Graph(lambda: None, [], torch.zeros(1), 2**30))
    graphs_at_run, real = [], executor.execute

    def execute(plan, *a, **k):
        graphs_at_run.append(len(cache.graphs))
        if len(graphs_at_run) == 1:
            raise mm.OOM_EXCEPTION("simulated")
        return real(plan, *a, **k)

    monkeypatch.setattr(executor, "execute", execute)
    z = _latent((1, 16, 1, 9, 10), 12)
    out = _tiled(qwen_vae, z, 0, 1.0)
    assert graphs_at_run == [1, 0]
    assert (out - _stock(qwen_vae, z)).abs().max() <= TOL
    memory.release(model)


def test_automatic_budget_leaves_out_the_cached_graphs(qwen_vae, memory_requests, monkeypatch):
    """ComfyUI counts 8 GiB free, 2 of them a cached graph's pool that it takes for free: the
    graph stays (room enough for the request) and the decode plans with the other 6, less
    ComfyUI's reserve."""
    from qwen_turbo.runtime import memory
    from qwen_turbo.runtime.graphs.cache import Graph, cache_for

    asked, planned = memory_requests
    free = 8 * 2**30
    monkeypatch.setattr(mm, "get_free_memory", lambda dev=None, torch_free_too=False: free)
    monkeypatch.setattr(qwen_vae.patcher, "get_free_memory", lambda dev=None: free, raising=False)
    model = nn.Linear(2, 2)
    memory.release_all()
    cache_for(model).put("key", Graph(lambda: None, [], torch.zeros(1), 2**31))
    _tiled(qwen_vae, _latent((1, 16, 1, 9, 10), 13))
    assert memory.held_bytes() == 2**31
    assert planned == [free - 2**31 - mm.extra_reserved_memory()]
    memory.release(model)


@pytest.mark.parametrize("disabled", [False, True])
def test_output_buffer_for_a_gpu_is_pinned_unless_comfyui_pinning_is_off(monkeypatch, disabled):
    """The decode's host buffer is page-locked for a GPU's tiles, never with ComfyUI's
    --disable-pinned-memory."""
    import comfy.cli_args

    monkeypatch.setattr(comfy.cli_args.args, "disable_pinned_memory", disabled, raising=False)
    asked, empty = [], torch.empty

    def host_empty(*args, pin_memory=False, **kwargs):  # CPU-only torch cannot pin
        asked.append(pin_memory)
        return empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", host_empty)
    buf = executor._host_buffer(torch.zeros(1, 3, 4, 5), 8, 10, "cuda")
    assert buf.shape == (1, 3, 8, 10) and asked == [not disabled]
