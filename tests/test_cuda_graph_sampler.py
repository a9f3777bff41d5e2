"""CUDA Graph Sampler: the graph runner's cache logic, and KSampler-equal results on CPU.

On CPU a stand-in backend (tests/harness/graphs.py) gives graph semantics (capture once,
replay into the same output buffer from the static inputs), so the whole capture/replay path
runs inside real sampling.
"""

import asyncio
import contextlib
import copy
import logging
import sys
import types
import weakref
from pathlib import Path

import comfy.conds
import comfy.model_management as mm
import comfy.model_patcher
import comfy.model_sampling
import comfy.patcher_extension as pe
import comfy.sampler_helpers
import comfy.sd
import pytest
import torch
from comfy_api.torch_helpers import set_torch_compile_wrapper
from comfy_extras.nodes_easycache import EasyCacheNode, LazyCacheNode
from comfy_extras.nodes_model_advanced import ModelSamplingAuraFlow

import nodes
from qwen_turbo.nodes import graph_sampler
from qwen_turbo.runtime import batch_fit, memory
from qwen_turbo.runtime.dit import files, fp8, loader
from qwen_turbo.runtime.graphs import guard, sampling
from qwen_turbo.runtime.graphs.cache import Graph, cache_for
from qwen_turbo.runtime.graphs.capture import CudaGraphs
from qwen_turbo.runtime.graphs.inputs import cond_inputs, with_cond_buffers
from qwen_turbo.runtime.graphs.policy import PACK, foreign_code, foreign_object_patch
from qwen_turbo.runtime.graphs.runners import (
    GraphRunner,
    ModelRunner,
    free_on_unload,
    innermost_free,
)
from tests.harness import models
from tests.harness.graphs import (
    CountingGraphs,
    FailingGraphs,
    FakeGraphs,
    OutOfMemoryGraphs,
    TracedGraphs,
    cached,
)


@pytest.fixture(scope="module")
def dit():
    model = comfy.sd.load_diffusion_model(str(models.qwen_dit_file()))
    return ModelSamplingAuraFlow().patch_aura(model, 3.1)[0]


def _cond(tokens, seed):
    return [[torch.randn((1, tokens, 3584), generator=torch.Generator().manual_seed(seed)), {}]]


def _sample(model, sampler="euler", scheduler="simple", denoise=1.0, neg_tokens=8, steps=2,
            positive=None):  # fmt: skip
    g = torch.Generator().manual_seed(5)
    latent = {"samples": torch.randn((1, 16, 6, 8), generator=g) * (1.0 - denoise)}
    out = nodes.common_ksampler(
        model, 42, steps, 2.5, sampler, scheduler, positive or _cond(8, 1), _cond(neg_tokens, 2),
        latent, denoise=denoise,
    )  # fmt: skip
    return out[0]["samples"]


SAMPLINGS = pytest.mark.parametrize(
    "sampler,scheduler,denoise,neg_tokens",
    [("euler", "simple", 1.0, 8), ("dpmpp_2m", "karras", 0.6, 12), ("uni_pc", "beta", 1.0, 5)],
)


@SAMPLINGS
def test_replayed_sampling_equals_ksampler(dit, sampler, scheduler, denoise, neg_tokens):
    cache = cache_for(dit.model)
    cache.clear()
    before = (cache.stats.captured, cache.stats.replayed)
    ref = _sample(dit, sampler, scheduler, denoise, neg_tokens)
    out = _sample(sampling.with_cuda_graphs(dit, TracedGraphs), sampler, scheduler, denoise,
                  neg_tokens)  # fmt: skip
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    captured = cache.stats.captured - before[0]
    # equal text lengths batch cond and uncond into one forward; different ones need two
    assert captured == (1 if neg_tokens == 8 else 2)
    assert cache.stats.replayed - before[1] > 0


@SAMPLINGS
def test_whole_step_graph_equals_ksampler(dit, sampler, scheduler, denoise, neg_tokens):
    cache = cache_for(dit.model)
    cache.clear()
    before = copy.deepcopy(cache.stats)
    ref = _sample(dit, sampler, scheduler, denoise, neg_tokens)
    model = sampling.with_cuda_graphs(dit, TracedGraphs, whole_step=True)
    out = _sample(model, sampler, scheduler, denoise, neg_tokens)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    # one graph holds the step's cond and uncond forwards, whatever their text lengths
    assert cache.stats.captured - before.captured == 1
    assert cache.stats.replayed - before.replayed > 0
    assert cache.stats.reasons == before.reasons


def test_step_graph_inputs_are_the_conds_tensors():
    """The step graph's inputs are the tensors of the processed conds (copied into its
    buffers before each replay, so a new prompt of the same shape reuses it); constants and
    areas go into its key. On a GPU, benchmarks/sampler.py checks a second prompt for real."""
    text, ref = torch.randn(1, 5, 8), [torch.randn(1, 4, 2, 2), torch.randn(1, 4, 3, 3)]
    conds = {
        "positive": [{"model_conds": {"c_crossattn": comfy.conds.CONDRegular(text),
                                      "ref_latents": comfy.conds.CONDList(ref),
                                      "method": comfy.conds.CONDConstant("index")},
                      "uuid": object(), "area": (4, 4, 0, 0), "strength": 0.5}],
        "negative": None,
    }  # fmt: skip
    tensors, desc = cond_inputs(conds)
    paths = [p for p, _ in tensors]
    assert paths == [("positive", 0, "c_crossattn", 0), ("positive", 0, "ref_latents", 0),
                     ("positive", 0, "ref_latents", 1)]  # fmt: skip
    assert [t for _, t in tensors][0] is text
    assert ("method", 0, "index") in desc and ("positive", 0, (4, 4, 0, 0), 0.5) in desc
    buffers = {p: t.clone() + 1 for p, t in tensors}
    static = with_cond_buffers(conds, buffers)
    mc = static["positive"][0]["model_conds"]
    assert mc["c_crossattn"].cond is buffers[paths[0]]
    assert mc["ref_latents"].cond[1] is buffers[paths[2]]
    assert mc["method"].cond == "index" and static["negative"] is None
    assert conds["positive"][0]["model_conds"]["c_crossattn"].cond is text  # original untouched
    conds["positive"][0]["mask"] = torch.ones(1, 4, 4)
    assert cond_inputs(conds) == (None, "conditioning with 'mask'")


def _timestep_range(model):
    return model, nodes.ConditioningSetTimestepRange().set_range(_cond(8, 1), 0.0, 0.5)[0]


def _cfg_function(model):
    model = model.clone()
    model.set_model_sampler_cfg_function(lambda a: a["uncond"] + (a["cond"] - a["uncond"]) * 2)
    return model, None


def _step_callback(model):
    model = model.clone()
    model.add_callback_with_key("on_prepare_state", "someone", lambda *a: None)
    return model, None


@pytest.mark.parametrize(
    "setup,reason",
    [(_timestep_range, "conditioning with 'timestep_start'"),
     (_cfg_function, "sampler_cfg_function set"),
     (_step_callback, "'someone' on_prepare_state callback runs Python per step")],
)  # fmt: skip
def test_whole_step_falls_back_to_model_call_graphs(dit, setup, reason, caplog):
    model, positive = setup(dit)
    cache = cache_for(dit.model)
    cache.clear()
    before = copy.deepcopy(cache.stats)
    with caplog.at_level(logging.INFO):
        out = _sample(sampling.with_cuda_graphs(model, TracedGraphs, whole_step=True),
                      positive=positive)  # fmt: skip
    torch.testing.assert_close(out, _sample(model, positive=positive), rtol=0, atol=0)
    assert f"whole step not captured: {reason}" in caplog.text
    assert cache.stats.captured > before.captured and cache.stats.replayed > before.replayed
    assert cache.stats.eager == before.eager


def test_sampler_takes_a_compiled_model(dit):
    """ComfyUI's compile wrapper (TorchCompileModel's) swaps the compiled module in around
    apply_model; both capture modes run it. aot_eager traces as inductor does, without
    inductor's C++ build on CPU."""
    compiled = dit.clone()
    set_torch_compile_wrapper(compiled, backend="aot_eager")
    cache = cache_for(dit.model)
    cache.clear()
    before = copy.deepcopy(cache.stats)
    ref = _sample(compiled)
    for whole_step in (False, True):
        out = _sample(sampling.with_cuda_graphs(compiled, TracedGraphs, whole_step))
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert cache.stats.captured - before.captured == 2 and cache.stats.eager == before.eager


@pytest.mark.parametrize("whole_step", [False, True])
def test_interrupt_stops_at_a_step_and_leaves_the_next_run_exact(dit, whole_step):
    """An interrupt (raised from the progress hook, as ComfyUI's server does) stops the run
    after its first step; the next run replays the graphs and equals KSampler."""
    import comfy.model_management as mm
    import comfy.utils

    cache_for(dit.model).clear()
    steps = []

    def hook(value, total, preview, node_id=None):
        steps.append(value)
        mm.interrupt_current_processing(True)
        mm.throw_exception_if_processing_interrupted()

    comfy.utils.set_progress_bar_global_hook(hook)
    try:
        with pytest.raises(mm.InterruptProcessingException):
            _sample(sampling.with_cuda_graphs(dit, TracedGraphs, whole_step), steps=3)
    finally:
        comfy.utils.set_progress_bar_global_hook(None)
        mm.interrupt_current_processing(False)
    assert steps == [1]
    captured = cache_for(dit.model).stats.captured
    out = _sample(sampling.with_cuda_graphs(dit, TracedGraphs, whole_step), steps=3)
    assert cache_for(dit.model).stats.captured == captured  # replayed
    torch.testing.assert_close(out, _sample(dit, steps=3), rtol=0, atol=0)


def test_node_on_cpu_is_ksampler(dit, sent):
    latent = {"samples": torch.zeros((1, 16, 6, 8))}
    args = (dit, 7, 2, 1.0, "euler", "simple", _cond(8, 3), _cond(8, 4), latent)
    out = graph_sampler.CUDAGraphSampler.execute(*args).result[0]["samples"]
    torch.testing.assert_close(out, nodes.common_ksampler(*args)[0]["samples"], rtol=0, atol=0)
    assert sent[-1]["graphs"] == "off (runs on cpu)"  # KSampler by design: no graph ran


def test_a_latent_of_another_model_is_named(dit):
    """A 4-channel latent (an SD VAE's encode) into Qwen-Image: the error says what to do; an
    all-zero one ComfyUI resizes itself, so it runs."""
    args = (dit, 7, 1, 1.0, "euler", "simple", _cond(8, 3), _cond(8, 4))
    with pytest.raises(ValueError, match="has 4 channels, and this model takes 16. Encode"):
        graph_sampler.CUDAGraphSampler.execute(*args, {"samples": torch.ones((1, 4, 6, 8))})
    out = graph_sampler.CUDAGraphSampler.execute(*args, {"samples": torch.zeros((1, 4, 6, 8))})
    assert out.result[0]["samples"].shape[1] == 16


@pytest.mark.parametrize(
    "capture, route", [("whole CFG step", True), ("model forward", False), ("off", "KSampler")]
)
def test_node_on_a_gpu_routes_each_capture_mode(monkeypatch, sent, capture, route):
    """On a CUDA model the capture input picks the runners: whole steps, model calls, or
    KSampler itself."""
    model = comfy.model_patcher.ModelPatcher(torch.nn.Linear(2, 2), "cpu", "cpu")
    monkeypatch.setattr(model, "load_device", torch.device("cuda"), raising=False)
    latent = {"samples": torch.zeros(1, 4, 8, 8)}
    routes = []

    def with_graphs(model, whole_step, backend, *args, **kwargs):
        routes.append(whole_step)
        return latent, "captured 1"

    monkeypatch.setattr(sampling, "sample_within_memory", with_graphs)
    monkeypatch.setattr(
        nodes, "common_ksampler", lambda *a, **k: routes.append("KSampler") or [latent]
    )
    monkeypatch.setattr(batch_fit, "check", lambda *a: (None, None))  # a Linear: no estimate
    args = (model, 0, 1, 1.0, "euler", "simple", [], [], latent)
    graph_sampler.CUDAGraphSampler.execute(*args, capture=capture)
    assert routes == [route]
    assert sent[-1]["graphs"] == ("off (capture off)" if capture == "off" else "captured 1")


@pytest.mark.parametrize(
    "case, asked", [("partly loaded", True), ("all loaded", False), ("on demand", False),
                    ("too much to free", False), ("texts of two lengths", False),
                    ("no negative", False)],
)  # fmt: skip
def test_a_model_streaming_its_weights_frees_room_for_the_cond_batch(dit, monkeypatch, case, asked):
    """With a statically loaded model partly on the host, the sampler's load is followed by
    freeing what ComfyUI needs free to run cond and uncond as one batch (1.5 times its
    estimate, and a margin): never for a model all on the GPU, one loading on demand, conds
    ComfyUI cannot batch, or where that would take more than half of the weights on the GPU."""
    model = dit.clone()
    size = 40 * 2**30  # as the full DiT: the estimate below is for 512² pictures
    monkeypatch.setattr(model, "model_size", lambda: size)
    latent = torch.zeros(1, 16, 64, 64)
    neg_tokens = 5 if case == "texts of two lengths" else 8
    conds = {"positive": _cond(8, 1), "negative": _cond(neg_tokens, 2)}
    if case == "no negative":
        del conds["negative"]
    conds = {k: comfy.sampler_helpers.convert_cond(v) for k, v in conds.items()}
    batch = comfy.sampler_helpers.estimate_memory(model, latent.shape, conds)[0]
    free = 10 * 2**20
    loaded = {"all loaded": size, "too much to free": 2**20}.get(case, size // 2)
    monkeypatch.setattr(model, "loaded_size", lambda: loaded)
    monkeypatch.setattr(model, "is_dynamic", lambda: case == "on demand", raising=False)
    monkeypatch.setattr(model, "get_free_memory", lambda device: free, raising=False)
    monkeypatch.setattr(mm, "get_free_memory", lambda *a, **k: free)
    freed = []
    monkeypatch.setattr(model, "partially_unload", lambda device, n: freed.append(n) or n)
    out = sampling.room_for_cond_batch(lambda *a, **k: "prepared", model, latent.shape, conds)
    assert out == "prepared"
    want = int(sampling.COND_BATCH_FACTOR * batch + sampling.COND_BATCH_MARGIN - free)
    assert freed == ([want] if asked else [])


@pytest.mark.parametrize("case", ["partly loads", "loads whole", "more than half", "loaded"])
def test_the_load_of_a_model_streaming_its_weights_leaves_the_cond_batch_room(dit, monkeypatch,
                                                                              case):  # fmt: skip
    """Where ComfyUI's load would leave a static model partly on the host, that room is held
    on the GPU during the load, so that the load leaves it free: what ComfyUI leaves free for
    one cond, subtracted from 1.5 times the batch's estimate and a margin. Nothing is held where
    the whole model loads or where the room would take more than half of what it loads; and
    nothing is unloaded after a load that left the room."""
    model = dit.clone()
    latent = torch.zeros(1, 16, 64, 64)
    conds = {k: comfy.sampler_helpers.convert_cond(_cond(8, i))
             for i, k in enumerate(("positive", "negative"))}  # fmt: skip
    batch, single = comfy.sampler_helpers.estimate_memory(model, latent.shape, conds)
    left = max(mm.minimum_inference_memory(), single + mm.extra_reserved_memory())
    want = int(sampling.COND_BATCH_FACTOR * batch + sampling.COND_BATCH_MARGIN - left)
    assert want > 0
    size = {"loads whole": 2**30, "more than half": 3 * want}.get(case, 40 * 2**30)
    monkeypatch.setattr(model, "model_size", lambda: size)
    free = {"more than half": left + 3 * want // 2}.get(case, left + 8 * want)
    monkeypatch.setattr(mm, "get_free_memory", lambda *a, **k: free)
    monkeypatch.setattr(model, "get_free_memory", lambda device: free - want, raising=False)
    monkeypatch.setattr(mm, "current_loaded_models", [])
    loaded = size // 4 if case == "loaded" else 0
    monkeypatch.setattr(model, "loaded_size", lambda: loaded)
    holds, freed = [], []

    @contextlib.contextmanager
    def held(device, nbytes):
        holds.append(nbytes)
        yield

    monkeypatch.setattr(memory, "hold", held)
    monkeypatch.setattr(model, "partially_unload", lambda device, n: freed.append(n) or n)

    def load(model, *args, **kwargs):
        assert holds, "the room is held while ComfyUI loads"
        monkeypatch.setattr(model, "loaded_size", lambda: loaded or size // 2)
        monkeypatch.setattr(model, "get_free_memory", lambda device: free, raising=False)
        return "prepared"

    assert sampling.room_for_cond_batch(load, model, latent.shape, conds) == "prepared"
    assert holds == [want if case in ("partly loads", "loaded") else 0]
    assert freed == []


@pytest.mark.parametrize("limit, sizes", [(None, [400, 400, 200]), (1, [400])])
def test_hold_takes_the_bytes_for_the_block_as_far_as_they_are_free(monkeypatch, limit, sizes):
    """The room is held in pieces of at most HOLD_PIECE while the block runs and let go after
    it; where memory runs out the block runs with the pieces taken so far."""
    monkeypatch.setattr(memory, "HOLD_PIECE", 400)
    made = []
    empty = torch.empty

    def allocate(n, *args, **kwargs):
        if len(made) == limit:
            raise torch.OutOfMemoryError("out of memory")
        made.append(empty(n, *args, **kwargs))
        return made[-1]

    monkeypatch.setattr(torch, "empty", allocate)
    with memory.hold(torch.device("cpu"), 1000):
        assert [t.numel() for t in made] == sizes
        pieces = [weakref.ref(t) for t in made]
        made.clear()
        assert all(p() is not None for p in pieces)
    assert all(p() is None for p in pieces)


@pytest.mark.parametrize("cfg", [1.0, 2.5])
def test_guided_sampling_keeps_room_for_the_cond_batch(monkeypatch, sent, cfg):
    """The node adds the cond-batch room (above) to guided runs on a GPU; cfg 1 runs no uncond."""
    model = comfy.model_patcher.ModelPatcher(torch.nn.Linear(2, 2), "cpu", "cpu")
    monkeypatch.setattr(model, "load_device", torch.device("cuda"), raising=False)
    latent = {"samples": torch.zeros(1, 4, 8, 8)}
    seen = []

    def with_graphs(model, whole_step, backend, *args, **kwargs):
        wrappers = model.wrappers.get(pe.WrappersMP.PREPARE_SAMPLING, {})
        seen.append([f for fs in wrappers.values() for f in fs])
        return latent, "captured 1"

    monkeypatch.setattr(sampling, "sample_within_memory", with_graphs)
    monkeypatch.setattr(batch_fit, "check", lambda *a: (None, None))
    graph_sampler.CUDAGraphSampler.execute(model, 0, 1, cfg, "euler", "simple", [], [], latent)
    assert seen == [[sampling.room_for_cond_batch] if cfg != 1.0 else []]


def test_the_capturing_step_is_not_replayed(dit):
    """The capture's warm-up computes the first step: 3 whole steps replay twice, and the
    result is KSampler's."""
    latent = {"samples": torch.zeros((1, 16, 6, 8))}
    args = (7, 3, 2.5, "euler", "simple", _cond(8, 3), _cond(8, 4), latent)
    memory.release(dit.model)
    CountingGraphs.calls = CountingGraphs.replays = 0
    out, _ = sampling.sample_with_graphs(dit, True, CountingGraphs, *args)
    assert CountingGraphs.calls == 1 and CountingGraphs.replays == 2
    ref = nodes.common_ksampler(dit, *args)[0]["samples"]
    torch.testing.assert_close(out["samples"], ref, rtol=0, atol=0)


@pytest.mark.parametrize("free", [4000, 200])
def test_graphs_stay_after_a_run_only_with_room_beside_them(dit, monkeypatch, free):
    """FakeGraphs' pool holds 100 bytes (cond and uncond run as one call): with 4000 bytes
    free beside it, it stays and the next run replays; with 200 it is dropped, the badge says
    so, and the next run captures again."""
    latent = {"samples": torch.zeros((1, 16, 6, 8))}
    args = (7, 2, 2.5, "euler", "simple", _cond(8, 3), _cond(8, 4), latent)
    memory.release(dit.model)
    monkeypatch.setattr(
        "qwen_turbo.runtime.graphs.cache.free_beside_graphs", lambda device, held: free
    )
    _, status = sampling.sample_with_graphs(dit, False, FakeGraphs, *args)
    assert ("dropped after the run for room" in status) == (free == 200), status
    assert memory.held_bytes() == (100 if free == 4000 else 0)
    _, status = sampling.sample_with_graphs(dit, False, FakeGraphs, *args)
    assert status.startswith("replayed 2" if free == 4000 else "captured 1, replayed 1"), status


@pytest.mark.parametrize("gain", [150, 50])
def test_comfyui_asking_the_loaders_model_for_room_drops_its_graphs_first(monkeypatch, gain):
    """ComfyUI makes room by asking a model to free `memory_to_free` bytes (LoadedModel.
    model_unload → partially_unload). The Optimized Loader's model drops its cached graphs
    first; what that adds to ComfyUI's free count (`gain`) is taken off what its weights must
    free: of 100 bytes asked, none with 150 gained, 50 with 50."""
    loaded = loader.build(*files.read_checkpoint(models.qwen_dit_file()))
    model = ModelSamplingAuraFlow().patch_aura(loaded, 3.1)[0]
    latent = {"samples": torch.zeros((1, 16, 6, 8))}
    args = (7, 2, 2.5, "euler", "simple", _cond(8, 3), _cond(8, 4), latent)
    memory.release_all()
    sampling.sample_with_graphs(model, False, FakeGraphs, *args)
    assert memory.held_bytes() == 100

    def free(device=None, torch_free_too=False):
        return 1000 + (0 if memory.held_bytes() else gain)

    asked = []

    def weights_free(self, device_to, memory_to_free=0, *args, **kwargs):
        asked.append(memory_to_free)
        return memory_to_free

    monkeypatch.setattr(mm, "get_free_memory", free)
    monkeypatch.setattr(comfy.model_patcher.ModelPatcher, "partially_unload", weights_free)
    freed = model.partially_unload(model.offload_device, 100)
    assert memory.held_bytes() == 0
    assert asked == ([] if gain >= 100 else [100 - gain])
    assert freed == max(gain, 100)
    # no graphs left: the weights free all of it
    assert model.partially_unload(model.offload_device, 100) == 100 and asked[-1] == 100


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_room_asked_of_the_loaders_model_on_a_gpu_comes_from_its_graphs_first():
    """The Optimized Loader's model on a GPU with a real CUDA graph of its weights cached:
    asked for 1 byte (ComfyUI's partially_unload), it drops the graph, whose output returns
    to ComfyUI's free count, and every weight stays on the GPU. Asked again with no graph
    left, it offloads weights as ComfyUI does."""
    cuda = torch.device("cuda")
    with torch.inference_mode():  # as the executor runs nodes
        model = loader.build(*files.read_checkpoint(models.qwen_dit_file()))
        model.load_device = cuda
        model.load(cuda, full_load=True)
        w = model.model.diffusion_model.img_in.weight
        x = torch.randn((4096, w.shape[1]), device=cuda, dtype=w.dtype)
        replay, out, nbytes, _ = CudaGraphs.capture(lambda: x @ w.t())
        memory.release_all()
        graph = Graph(replay, [x], out, nbytes)
        cache_for(model.model.diffusion_model).put(("test",), graph)
        del graph, out
        assert memory.held_bytes() == nbytes > 0
        assert model.partially_unload(model.offload_device, 1) >= 1
        assert memory.held_bytes() == 0
        assert all(p.device.type == "cuda" for p in model.model.parameters())
        assert model.partially_unload(model.offload_device, 1) >= 1
        assert any(p.device.type == "cpu" for p in model.model.parameters())
        model.unpatch_model(torch.device("cpu"))


def test_out_of_memory_with_graphs_drops_them_and_runs_as_ksampler(dit, caplog, monkeypatch):
    """The run again asks ComfyUI for its own activation estimate, where the model had a
    smaller one (as the Optimized Loader's has), and the model keeps its own afterwards."""
    latent = {"samples": torch.zeros((1, 16, 6, 8))}
    args = (7, 3, 2.5, "euler", "simple", _cond(8, 3), _cond(8, 4), latent)
    ref = nodes.common_ksampler(dit, *args)[0]["samples"]
    asked, handling, load = [], [], comfy.model_management.load_models_gpu

    def load_models_gpu(models, memory_required=0, **kwargs):
        asked.append(memory_required)
        handling.append(sys.exc_info()[0])
        return load(models, memory_required=memory_required, **kwargs)

    monkeypatch.setattr(comfy.model_management, "load_models_gpu", load_models_gpu)
    monkeypatch.setattr(dit.model, "memory_usage_factor", 0.9)
    with caplog.at_level(logging.WARNING):
        out, status = sampling.sample_within_memory(dit, False, OutOfMemoryGraphs, *args)
    torch.testing.assert_close(out["samples"], ref, rtol=0, atol=0)
    assert asked[1] == pytest.approx(asked[0] * dit.model.model_config.memory_usage_factor / 0.9)
    assert dit.model.memory_usage_factor == 0.9
    assert handling == [None, None]  # run again after the handler: the failed run's frames freed
    assert status.startswith("off (out of memory with graphs") and "ran as KSampler" in status
    assert not cache_for(dit.model).graphs  # dropped
    assert "out of memory with graphs" in caplog.text


def test_out_of_memory_names_the_size_and_what_to_change(dit, monkeypatch):
    def oom(*args, **kwargs):
        raise comfy.model_management.OOM_EXCEPTION("CUDA out of memory. Tried to allocate 9 GiB")

    monkeypatch.setattr(sampling.comfy_nodes, "common_ksampler", oom)
    latent = {"samples": torch.zeros((2, 16, 6, 8))}
    args = (dit, 7, 2, 1.0, "euler", "simple", _cond(8, 3), _cond(8, 4), latent)
    with pytest.raises(comfy.model_management.OOM_EXCEPTION) as e:  # ComfyUI then unloads
        graph_sampler.CUDAGraphSampler.execute(*args)
    msg = str(e.value)
    need = dit.model.memory_required(latent["samples"].shape) / 2**30
    assert "at 64×48, batch 2" in msg and f"estimates {need:.1f} GiB" in msg, msg
    assert "--lowvram" in msg and "Tried to allocate 9 GiB" in msg


def test_a_graph_is_never_replayed_for_a_clone_with_other_wrappers(dit):
    """Graphs are kept per model object and weights, which clones share: a clone with another
    wrapper inside the captured region (even the pack's own) captures its own graph rather
    than replaying one that skips that wrapper."""
    calls = []

    def counting(executor, *args, **kwargs):  # the pack's: trusted inside a graph
        calls.append(1)
        return executor(*args, **kwargs)

    counting.__module__ = PACK
    other = dit.clone()
    other.add_wrapper_with_key("diffusion_model", "counting", counting)
    cache = cache_for(dit.model)
    cache.clear()
    latent = {"samples": torch.zeros((1, 16, 6, 8))}
    for model in (dit, other):
        before = cache.stats.captured
        sampling.sample_with_graphs(model, False, FakeGraphs, 42, 2, 2.5, "euler", "simple",
                                         _cond(8, 1), _cond(8, 2), latent)  # fmt: skip
        assert cache.stats.captured == before + 1
    assert calls  # the wrapper ran: captured with it, not replayed without it


def test_a_wrapper_that_talks_per_call_keeps_graphs_inside_it():
    """A pack wrapper flagged `runs_python_per_call` (the Multi-GPU driver) is foreign to a
    graph around it; a ModelRunner inside it may still capture."""

    class Driver:
        runs_python_per_call = True

        def __call__(self, executor, *args, **kwargs):
            return executor(*args, **kwargs)

    Driver.__module__ = PACK
    inner = ModelRunner(lambda: True, FakeGraphs)
    driver = Driver()
    options = {"wrappers": {"diffusion_model": {"multigpu": [driver], "graphs": [inner]}}}
    reason = "'multigpu' diffusion_model wrapper runs Python per step"
    assert foreign_code(options, "apply_model", []) == reason
    assert innermost_free(options)
    options["wrappers"]["diffusion_model"] = {"graphs": [inner], "multigpu": [driver]}
    assert not innermost_free(options)


def test_new_weights_recapture_and_drop_stale_graphs(dit):
    cache = cache_for(dit.model)
    cache.clear()
    _sample(sampling.with_cuda_graphs(dit, TracedGraphs))
    old_keys = set(cache.graphs)
    layer = dit.model.diffusion_model.img_in
    original = layer.weight
    try:
        layer.weight = torch.nn.Parameter(original.detach() * 1.5)  # as a LoRA patch replaces it
        ref = _sample(dit)
        out = _sample(sampling.with_cuda_graphs(dit, TracedGraphs))
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        assert set(cache.graphs).isdisjoint(old_keys) and cache.graphs
    finally:
        layer.weight = original


def test_failed_capture_runs_eagerly_with_the_same_result(dit, caplog):
    cache_for(dit.model).clear()
    FailingGraphs.calls = 0
    with caplog.at_level(logging.INFO):
        out = _sample(sampling.with_cuda_graphs(dit, FailingGraphs), steps=3)
    torch.testing.assert_close(out, _sample(dit, steps=3), rtol=0, atol=0)
    assert FailingGraphs.calls == 1  # not retried for the same shape
    assert "capture failed" in caplog.text


def test_unload_frees_the_graphs(dit):
    model = dit.model
    cache_for(model).clear()
    _sample(sampling.with_cuda_graphs(dit, FakeGraphs))
    assert cache_for(model).graphs
    free_on_unload(dit, unpatch_all=False)  # weights stay: graphs stay
    assert cache_for(model).graphs
    free_on_unload(dit, unpatch_all=True)
    assert not cache_for(model).graphs


class _Executor:
    """Stands in for ComfyUI's WrapperExecutor around a tiny model."""

    def __init__(self):
        self.class_obj = torch.nn.Linear(4, 4)
        self.wrappers, self.idx = [None], 0  # the runner's own wrapper, none inside it
        self.calls = 0

    def __call__(self, x, timestep, context=None, transformer_options=None, **kw):
        self.calls += 1
        return self.class_obj(x) * timestep[:, None, None] + (0 if context is None else 1)


def _run(runner, ex, x, **kw):
    options = {"wrappers": {}, **kw.pop("options", {})}
    return runner(ex, x, torch.ones(x.shape[0]), transformer_options=options, **kw)


def test_runner_keys_graphs_by_shape_and_bounds_the_cache():
    ex = _Executor()
    cache = cache_for(ex.class_obj)
    cache.max_graphs = 2
    runner = GraphRunner(lambda: True, FakeGraphs)
    for n in (3, 3, 5, 7, 3):
        x = torch.randn(1, n, 4)
        torch.testing.assert_close(_run(runner, ex, x), ex.class_obj(x))
    assert cache.stats.captured == 4 and cache.stats.replayed == 1  # 3 was evicted by 5, 7
    assert len(cache.graphs) == 2
    cache.max_bytes = 150  # each fake graph reports 100 bytes
    _run(runner, ex, torch.randn(1, 9, 4))
    assert len(cache.graphs) == 1


@pytest.mark.parametrize(
    "kwargs,resident,reason",
    [
        ({"options": {"patches": {"double_block": [print]}}}, True, "model patches"),
        ({"control": {"input": [torch.zeros(1)]}}, True, "argument 'control'"),
        ({}, False, "not all on the GPU"),
    ],
)
def test_runner_falls_back_to_eager(kwargs, resident, reason, caplog):
    ex = _Executor()
    runner = GraphRunner(lambda: resident, FakeGraphs)
    x = torch.randn(2, 3, 4)
    with caplog.at_level(logging.INFO):
        out = _run(runner, ex, x, **kwargs)
    torch.testing.assert_close(out, ex.class_obj(x))
    stats = cache_for(ex.class_obj).stats
    assert stats.captured == 0 and stats.eager == 1
    assert reason in caplog.text


def test_host_inputs_are_copied_only_when_they_change():
    """Inputs on another device than their buffer (ComfyUI's host-side text conds) are copied
    again only when they are a new tensor or were written to."""
    copies = []

    class Buffer(torch.Tensor):
        def copy_(self, src):
            copies.append(src)
            return self

    buf = torch.empty(3, device="meta").as_subclass(Buffer)
    t = torch.randn(3)
    graph = Graph(lambda: None, [buf], torch.zeros(1), 0, [(t, t._version)])
    graph.load([t])
    assert copies == []
    t.add_(1)
    graph.load([t])
    other = torch.randn(3)
    graph.load([other])
    graph.load([other])
    with torch.inference_mode():
        frozen = torch.randn(3)
    graph.load([frozen])
    graph.load([frozen])
    assert [c is x for c, x in zip(copies, (t, other, frozen), strict=True)] == [True] * 3


def test_graph_status_reports_this_run_only():
    from qwen_turbo.runtime.graphs.cache import Stats, graph_status

    before = Stats(captured=1, replayed=5, reasons={"lowvram": 2})
    after = Stats(captured=2, replayed=8, eager=1, reasons={"lowvram": 2, "new reason": 1})
    assert graph_status(before, after) == "captured 1, replayed 3, eager 1; new reason"
    assert graph_status(after, after) == ""
    assert graph_status(before, Stats(1, 5, 0, {"lowvram": 2, "why": 1})) == "why"


def _scaled(out, timestep):
    """A Python decision per call: scale by the step's timestep, read as a float."""
    return out * (1 + 0.1 * float(timestep[0]))


def _foreign_wrapper(model):
    model = model.clone()
    wrapper = lambda executor, *a, **kw: _scaled(executor(*a, **kw), a[1])  # noqa: E731
    model.add_wrapper_with_key("diffusion_model", "someone", wrapper)
    return model


def _foreign_forward(model):
    model = model.clone()
    forward = model.model.diffusion_model.forward
    model.add_object_patch(
        "diffusion_model.forward", lambda *a, **kw: _scaled(forward(*a, **kw), a[1])
    )
    return model


def _foreign_block(model):
    """A block replacement that decides per call in Python, inside the transformer."""
    model = model.clone()

    def block(args, extra):
        out = extra["original_block"](args)
        return {**out, "img": _scaled(out["img"], args["vec"].flatten())}

    model.set_model_patch_replace(block, "dit", "double_block", 0)
    return model


INSIDE = "model call captured inside its wrappers: "


@pytest.mark.parametrize("whole_step", [False, True], ids=["model_forward", "whole_step"])
@pytest.mark.parametrize(
    "setup,outer,step,eager",
    [
        (lambda m: cached(EasyCacheNode, m), "'easycache' diffusion_model wrapper",
         "'easycache' calc_cond_batch wrapper", None),
        (lambda m: cached(LazyCacheNode, m), None, None, None),
        (_foreign_wrapper, "'someone' diffusion_model wrapper",
         "'someone' diffusion_model wrapper", None),
        (_foreign_forward, "object patch on 'diffusion_model.forward'",
         "object patch on 'diffusion_model.forward'", None),
        (_foreign_block, None, "model patches (dit)", "model patches (dit)"),
    ],
    ids=["easycache", "lazycache", "foreign_wrapper", "foreign_forward", "foreign_block"],
)  # fmt: skip
def test_python_that_a_replay_would_skip_stays_outside_the_graphs(
    dit, setup, outer, step, eager, whole_step
):
    """Per-call Python around the diffusion model (EasyCache decides there whether to skip a
    step) runs every call while the transformer inside it replays; Python inside the
    transformer (a block replacement) makes the run KSampler's, no runner around it; code
    around the whole step (LazyCache) runs each step around the step's graph. Each reason is
    in the badge, and the latent equals KSampler's with the same node, while a replay that
    froze the Python would not."""
    model = setup(dit)
    cache_for(dit.model).clear()
    ref = _sample(model, steps=6)
    assert not torch.equal(ref, _sample(dit, steps=6))  # the node changes the result
    out, status = sampling.sample_with_graphs(
        model, whole_step, TracedGraphs, 42, 6, 2.5, "euler", "simple", _cond(8, 1), _cond(8, 2),
        {"samples": torch.zeros((1, 16, 6, 8))},
    )  # fmt: skip
    torch.testing.assert_close(out["samples"], ref, rtol=0, atol=0)
    if eager is not None:  # no runner installed: KSampler's own path
        assert status == f"ran as KSampler: {eager} run Python per step"
        assert not cache_for(dit.model).stats.eager
        return
    counts = status.split(";")[0]
    assert "eager" not in counts and "replayed" in counts
    if outer is not None:
        assert f"{INSIDE}{outer} runs Python per step" in status
    if whole_step and step is not None:
        assert f"whole step not captured: {step} run" in status


@pytest.mark.parametrize("node", [EasyCacheNode, LazyCacheNode])
def test_badge_reports_the_steps_a_caching_node_skipped(dit, node):
    model = cached(node, dit)
    ref = _sample(model, steps=6)
    out, status = sampling.sample_with_graphs(
        model, False, TracedGraphs, 42, 6, 2.5, "euler", "simple", _cond(8, 1), _cond(8, 2),
        {"samples": torch.zeros((1, 16, 6, 8))},
    )  # fmt: skip
    torch.testing.assert_close(out["samples"], ref, rtol=0, atol=0)
    name = node.__name__.removesuffix("Node")
    skipped = int(status.split(f"{name} skipped ")[1].split(" of 6 steps")[0])
    assert 0 < skipped < 6, status
    assert "skipped" not in sampling.sample_with_graphs(
        dit, False, TracedGraphs, 42, 6, 2.5, "euler", "simple", _cond(8, 1), _cond(8, 2),
        {"samples": torch.zeros((1, 16, 6, 8))},
    )[1]  # fmt: skip


def test_policy_trusts_the_packs_code_only(dit):
    """The Optimized Loader's fused block forwards and attention override, ComfyUI's model
    sampling, torch.compile and wrappers outside the runner's own are allowed in a graph;
    a foreign wrapper inside it or below its level, or a foreign attention override, is not."""
    from qwen_turbo.runtime.dit import attention

    patcher = dit.clone()
    loader.add_fused_blocks(patcher)
    assert "model_sampling" in patcher.object_patches and len(patcher.object_patches) > 1
    assert foreign_object_patch(patcher.object_patches) is None

    def outer(ex, *a, **kw):
        return ex(*a, **kw)

    def inner(ex, *a, **kw):
        return ex(*a, **kw)

    runner = GraphRunner(lambda: True, FakeGraphs)
    own = {"optimized_attention_override": attention.attention_override("sdpa")}
    apply_model = {"someone": [outer], "torch.compile": [print], "qwen_turbo_cuda_graphs": [runner]}
    options = {"wrappers": {"apply_model": apply_model}, **own}
    assert foreign_code(options, "apply_model", [print]) is None
    apply_model["later"] = [inner]
    reason = "'later' apply_model wrapper runs Python per step"
    assert foreign_code(options, "apply_model", [inner]) == reason
    assert foreign_code(options, "predict_noise", []).startswith("'someone' apply")
    options = {"wrappers": {}, "optimized_attention_override": outer}
    assert "'optimized_attention_override'" in foreign_code(options, "apply_model", [])
    # fp8 attention taking its scales over Multi-GPU ranks: their collectives run eagerly
    group = types.SimpleNamespace(group_name="scales")  # the name is all it is asked for
    scaled = attention.attention_override("fp8_cudnn", amax_group=group)
    options = {"wrappers": {}, "optimized_attention_override": scaled}
    why = foreign_code(options, "apply_model", [])
    assert why == "transformer option 'optimized_attention_override' talks to other processes"


def test_trim_drops_graphs_holding_more_than_a_quarter_of_the_free_memory():
    memory.release_all()
    model = torch.nn.Linear(1, 1)
    cache = cache_for(model)
    cache.put(("a",), Graph(None, [], torch.zeros(1), 300, []))
    assert memory.trim(1200) == 0 and cache.graphs
    assert memory.trim(1199) == 300 and not cache.graphs


def _loaded_as_comfyui_does(name):
    """The node class `name` from comfy_extras/nodes_model_advanced.py as ComfyUI's node loader
    (init_extra_nodes) imports it for the executor: in a module named after the file's path."""
    path = Path(nodes.__file__).parent / "comfy_extras" / "nodes_model_advanced.py"
    assert asyncio.run(nodes.load_custom_node(str(path), module_parent="comfy_extras"))
    return nodes.NODE_CLASS_MAPPINGS[name]


class _ShiftedInput(comfy.model_sampling.ModelSamplingDiscreteFlow, comfy.model_sampling.CONST):
    """Model sampling with a method of its own, whose Python a replay would freeze: the
    input's scale grows with each call."""

    calls = 0

    def calculate_input(self, sigma, noise):
        self.calls += 1
        return noise * (1 + 0.01 * self.calls)


_ShiftedInput.__module__ = "comfy_someone"  # a name alone proves nothing


@pytest.mark.parametrize("whole_step", [False, True], ids=["model_forward", "whole_step"])
def test_model_sampling_node_as_the_executor_loads_it_is_captured(dit, whole_step):
    """ModelSamplingAuraFlow in the bundled workflows: its class, built by the node in a module
    named after the node file's path, has only comfy.model_sampling's methods, so its steps
    replay; a model sampling class with a method of its own keeps the calls eager."""
    node = _loaded_as_comfyui_does("ModelSamplingAuraFlow")
    model = node().patch_aura(dit, 3.1)[0]
    assert not type(model.object_patches["model_sampling"]).__module__.startswith("comfy")
    for patched, replays in ((model, True), (model.clone(), False)):
        if not replays:
            patched.add_object_patch("model_sampling", _ShiftedInput(patched.model.model_config))
        memory.release(dit.model)
        ref = _sample(patched, steps=4)
        patched.object_patches["model_sampling"].calls = 0
        out, status = sampling.sample_with_graphs(
            patched, whole_step, TracedGraphs, 42, 4, 2.5, "euler", "simple", _cond(8, 1),
            _cond(8, 2), {"samples": torch.zeros((1, 16, 6, 8))},
        )  # fmt: skip
        torch.testing.assert_close(out["samples"], ref, rtol=0, atol=0)
        assert ("replayed" in status) == replays, status
        why = "object patch on 'model_sampling' runs Python per step"
        assert (why in status) != replays, status


def _nan_attention(func, *args, **kwargs):
    return torch.full_like(func(*args, **kwargs), float("nan"))


NAN_ARGS = (7, 2, 2.5, "euler", "simple", _cond(8, 3), _cond(8, 4))


@pytest.mark.parametrize("whole_step", [False, True])
def test_a_step_that_is_not_finite_runs_again_without_graphs_or_attention_override(dit, whole_step):
    """An attention override that gives NaN (8-bit attention on an outlier): each step, replayed
    from a graph or captured, runs again eagerly with ComfyUI's attention, and the run gives
    bit for bit what KSampler gives without the override."""
    model = dit.clone()
    model.model_options["transformer_options"]["optimized_attention_override"] = _nan_attention
    latent = {"samples": torch.zeros((1, 16, 6, 8))}
    run, finite_guard = guard.guarded(model)
    out, status = sampling.sample_with_graphs(run, whole_step, TracedGraphs, *NAN_ARGS, latent)
    want = nodes.common_ksampler(dit, *NAN_ARGS, latent)[0]["samples"]
    assert torch.isfinite(want).all()
    torch.testing.assert_close(out["samples"], want, rtol=0, atol=0)
    assert finite_guard.reruns == finite_guard.steps == 2
    assert finite_guard.note() == (
        "not finite: 2 of 2 steps ran again with bf16 compute and ComfyUI's attention"
    )


def test_a_nan_in_an_fp8_block_gives_the_safe_paths_result(sent, caplog):
    """fp8_e4m3fn_fast weights, a NaN in one block's output off the safe path: the sampler's
    result is bit for bit that of the safe path run throughout, and the badge and the log say
    so. (On CPU the loader computes fp8 in bf16 anyway; the GPU suite and
    test_qwen_loader's safe-compute test show the safe path's fp8 layers.)"""
    sd, cfg = files.read_checkpoint(models.qwen_dit_file())
    fast = ModelSamplingAuraFlow().patch_aura(loader.build(sd, cfg, "fp8_e4m3fn_fast"), 3.1)[0]
    latent = {"samples": torch.zeros((1, 16, 6, 8))}
    with fp8.safe_compute():
        want = nodes.common_ksampler(fast, *NAN_ARGS, latent)[0]["samples"]
    with models.nan_in_block(fast, 0), caplog.at_level(logging.WARNING):
        out = graph_sampler.CUDAGraphSampler.execute(fast, *NAN_ARGS, latent).result[0]
    torch.testing.assert_close(out["samples"], want, rtol=0, atol=0)
    assert sent[-1]["graphs"].endswith("; not finite: 2 of 2 steps ran again with bf16 compute")
    assert "not finite" in caplog.text


def test_a_model_whose_output_is_never_finite_stops_with_an_error(dit):
    """Not finite on the safe path too: an error that says the picture would be black and
    what to try, not a black picture."""
    model = dit.clone()
    model.set_model_unet_function_wrapper(
        lambda apply, p: torch.full_like(apply(p["input"], p["timestep"], **p["c"]), float("inf"))
    )
    latent = {"samples": torch.zeros((1, 16, 6, 8))}
    args = (7, 1, 1.0, "euler", "simple", _cond(8, 3), _cond(8, 4), latent)
    with pytest.raises(ValueError, match="not finite .* would be black. Try the Optimized Loader"):
        graph_sampler.CUDAGraphSampler.execute(model, *args)


def test_a_latent_not_finite_from_finite_steps_stops_with_an_error(dit, monkeypatch):
    """A latent that is not finite although no step's output was (the sampler's own math): an
    error, as no safe path of the model's would change it."""
    nan = {"samples": torch.full((1, 16, 6, 8), float("nan"))}
    monkeypatch.setattr(sampling.comfy_nodes, "common_ksampler", lambda *a, **k: (nan,))
    latent = {"samples": torch.zeros((1, 16, 6, 8))}
    with pytest.raises(ValueError, match="the sampled latent is not finite"):
        graph_sampler.CUDAGraphSampler.execute(dit, *NAN_ARGS, latent)
