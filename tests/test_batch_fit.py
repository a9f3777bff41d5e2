"""The CUDA Graph Sampler's batch count: ComfyUI's own activation estimate against the room a
small card leaves, with ComfyUI's memory functions patched to report that card."""

import logging

import comfy.model_management as mm
import comfy.model_patcher
import comfy.sampler_helpers
import comfy.sd
import pytest
import torch

from qwen_turbo.runtime import batch_fit, host
from qwen_turbo.runtime.graphs import sampling
from tests.harness import models

GiB = 2**30


@pytest.fixture(scope="module")
def dit():
    return comfy.sd.load_diffusion_model(str(models.qwen_dit_file()))


@pytest.fixture
def card(monkeypatch):
    """A card with `free` GiB free, a 0.4 GiB reserve and `loaded` (models ComfyUI holds)."""

    class Card:
        free, loaded = 10.0, []

    monkeypatch.setattr(mm, "get_free_memory", lambda dev=None, torch_free_too=False: Card.free
                        * GiB)  # fmt: skip
    monkeypatch.setattr(mm, "extra_reserved_memory", lambda: int(0.4 * GiB))
    monkeypatch.setattr(mm, "current_loaded_models", Card.loaded)
    return Card


def _cond(seed, refs=()):
    extra = {"reference_latents": list(refs)} if refs else {}
    return [[torch.randn((1, 8, 3584), generator=torch.Generator().manual_seed(seed)), extra]]


def _room(card) -> float:
    return card.free * GiB - 0.4 * GiB - batch_fit.WEIGHTS_FLOOR


@pytest.mark.parametrize("batch", [1, 3, 7])
def test_counts_the_pictures_that_comfyuis_estimate_fits(dit, card, batch, caplog):
    """At 2512² (a latent of 314²), on a card with room for 4.5 pictures by ComfyUI's own
    estimate for one: 4 fit; a batch within that gets a plain note, one above it a warning
    naming the count."""
    latent = torch.zeros((batch, 16, 314, 314))
    each = dit.model.memory_required([1, 16, 314, 314])
    card.free = (4.5 * each + 0.4 * GiB + batch_fit.WEIGHTS_FLOOR) / GiB
    want = int(_room(card) // each)
    assert want == 4
    with caplog.at_level(logging.WARNING):
        n, note = batch_fit.check(dit, latent, _cond(1), _cond(2))
    assert n == want
    if batch <= n:
        assert note == f"batch {batch} of up to {n} at 2512×2512" and not caplog.text
    else:
        assert f"more than the {n} that fit" in note and f"batch of {n} or less fits" in note
        assert note in caplog.text


def test_models_comfyui_can_offload_add_room_and_references_take_it(dit, card):
    """Memory held by loaded models on the device counts (ComfyUI offloads it for the run);
    Edit's reference latents enlarge each picture's estimate, so fewer fit."""
    latent = torch.zeros((1, 16, 128, 128))

    class Loaded:
        device, model = dit.load_device, dit

        @staticmethod
        def model_loaded_memory():
            return 6 * GiB

    n, _ = batch_fit.check(dit, latent, _cond(1), _cond(2))
    card.loaded.append(Loaded())
    more, _ = batch_fit.check(dit, latent, _cond(1), _cond(2))
    each = dit.model.memory_required([1, 16, 128, 128])
    assert more == int((_room(card) + 6 * GiB) // each) > n
    refs = [torch.zeros((1, 16, 128, 128))]
    fewer, _ = batch_fit.check(dit, latent, _cond(1, refs), _cond(2, refs))
    assert fewer < more


def test_a_model_comfyui_still_lists_after_its_patcher_is_gone_holds_nothing(dit, card):
    """ComfyUI keeps a LoadedModel whose patcher was collected (a weak reference) until its
    next cleanup; the count skips it (it failed the new prompt after an interrupt, 16 GiB)."""
    gone = comfy.model_patcher.ModelPatcher(torch.nn.Linear(2, 2), dit.load_device, "cpu")
    loaded = mm.LoadedModel(gone)
    del gone
    assert loaded.model is None
    latent = torch.zeros((1, 16, 128, 128))
    n, _ = batch_fit.check(dit, latent, _cond(1), _cond(2))
    card.loaded.append(loaded)
    assert batch_fit.check(dit, latent, _cond(1), _cond(2))[0] == n


def test_no_room_for_one_picture_says_to_lower_the_size(dit, card):
    card.free = 0.5
    n, note = batch_fit.check(dit, torch.zeros((1, 16, 314, 314)), _cond(1), _cond(2))
    assert n == 0 and note.endswith("lower the size")


def test_a_host_without_the_estimate_gives_no_count(dit, card, monkeypatch):
    latent = torch.zeros((1, 16, 8, 8))
    with monkeypatch.context() as m:
        m.delattr(comfy.sampler_helpers, "estimate_memory")
        host.reset()
        try:
            assert batch_fit.check(dit, latent, _cond(1), _cond(2)) == (None, None)
        finally:
            host.reset()
    each = dit.model.memory_required([1, 16, 8, 8])
    assert batch_fit.check(dit, latent, _cond(1), _cond(2))[0] == int(_room(card) // each)


def test_out_of_memory_names_the_batch_that_fits(dit):
    latent = {"samples": torch.zeros((6, 16, 314, 314))}
    e = mm.OOM_EXCEPTION("CUDA out of memory.")
    msg = str(sampling.out_of_memory(dit, latent, 3, e))
    assert "batch 6" in msg and "By that estimate 3 pictures of this size fit." in msg
    assert "First try: a batch of 3." in msg
    assert "pictures of this size fit" not in str(sampling.out_of_memory(dit, latent, None, e))


def test_out_of_memory_names_the_card_what_was_on_it_and_what_to_change(dit, card, monkeypatch):
    """The card's total as ComfyUI counts it, each model ComfyUI holds on the card by what a
    user knows it as, and, where other models hold a GiB or more, unloading them first."""

    class Held:  # a loaded model as ComfyUI lists it: a text encoder holding 3 GiB
        device = dit.load_device
        model = type("Patcher", (), {"model": type("QwenImageTEModel_", (), {})(),
                                     "loaded_size": lambda self: 3 * GiB})()  # fmt: skip

    card.loaded.append(Held())
    monkeypatch.setattr(mm, "get_total_memory", lambda dev=None, torch_total_too=False: 24 * GiB)
    latent = {"samples": torch.zeros((1, 16, 314, 314))}
    msg = str(sampling.out_of_memory(dit, latent, None, mm.OOM_EXCEPTION("CUDA out of memory.")))
    assert "on this 24.0 GiB GPU. On it: the text encoder 3.0 GiB." in msg
    assert "First try: unload the other models" in msg
    card.loaded.clear()
    msg = str(sampling.out_of_memory(dit, latent, None, mm.OOM_EXCEPTION("CUDA out of memory.")))
    assert "On it: nothing." in msg and "First try: a lower size or batch" in msg
