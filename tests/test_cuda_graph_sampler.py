"""CUDA Graph Sampler: the graph runner's cache logic, and KSampler-equal results on CPU.

On CPU a stand-in backend gives graph semantics (capture once, replay into the same output
buffer from the static inputs), so the whole capture/replay path runs inside real sampling.
"""

import logging

import comfy.sd
import pytest
import torch
from comfy_extras.nodes_model_advanced import ModelSamplingAuraFlow

import nodes
from qwen_turbo.nodes import graph_sampler
from qwen_turbo.runtime import cuda_graphs
from tests.harness import models


class FakeGraphs:
    calls = 0

    @staticmethod
    def supports(x):
        return None

    @classmethod
    def capture(cls, run):
        cls.calls += 1
        out = run()
        return (lambda: out.copy_(run())), out, 100


class FailingGraphs(FakeGraphs):
    @classmethod
    def capture(cls, run):
        cls.calls += 1
        raise RuntimeError("operation not permitted when stream is capturing")


@pytest.fixture(scope="module")
def dit():
    model = comfy.sd.load_diffusion_model(str(models.qwen_dit_file()))
    return ModelSamplingAuraFlow().patch_aura(model, 3.1)[0]


def _cond(tokens, seed):
    return [[torch.randn((1, tokens, 3584), generator=torch.Generator().manual_seed(seed)), {}]]


def _sample(model, sampler="euler", scheduler="simple", denoise=1.0, neg_tokens=8, steps=2):
    g = torch.Generator().manual_seed(5)
    latent = {"samples": torch.randn((1, 16, 6, 8), generator=g) * (1.0 - denoise)}
    out = nodes.common_ksampler(
        model, 42, steps, 2.5, sampler, scheduler, _cond(8, 1), _cond(neg_tokens, 2), latent,
        denoise=denoise,
    )  # fmt: skip
    return out[0]["samples"]


@pytest.mark.parametrize(
    "sampler,scheduler,denoise,neg_tokens",
    [("euler", "simple", 1.0, 8), ("dpmpp_2m", "karras", 0.6, 12), ("uni_pc", "beta", 1.0, 5)],
)
def test_replayed_sampling_equals_ksampler(dit, sampler, scheduler, denoise, neg_tokens):
    cache = cuda_graphs.cache_for(dit.model.diffusion_model)
    cache.clear()
    before = (cache.stats.captured, cache.stats.replayed)
    ref = _sample(dit, sampler, scheduler, denoise, neg_tokens)
    out = _sample(graph_sampler.with_cuda_graphs(dit, FakeGraphs), sampler, scheduler, denoise,
                  neg_tokens)  # fmt: skip
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    captured = cache.stats.captured - before[0]
    # equal text lengths batch cond and uncond into one forward; different ones need two
    assert captured == (1 if neg_tokens == 8 else 2)
    assert cache.stats.replayed - before[1] > 0


def test_node_on_cpu_is_ksampler(dit):
    latent = {"samples": torch.zeros((1, 16, 6, 8))}
    args = (dit, 7, 2, 1.0, "euler", "simple", _cond(8, 3), _cond(8, 4), latent)
    out = graph_sampler.CUDAGraphSampler.execute(*args).result[0]["samples"]
    torch.testing.assert_close(out, nodes.common_ksampler(*args)[0]["samples"], rtol=0, atol=0)


def test_new_weights_recapture_and_drop_stale_graphs(dit):
    cache = cuda_graphs.cache_for(dit.model.diffusion_model)
    cache.clear()
    _sample(graph_sampler.with_cuda_graphs(dit, FakeGraphs))
    old_keys = set(cache.graphs)
    layer = dit.model.diffusion_model.img_in
    original = layer.weight
    try:
        layer.weight = torch.nn.Parameter(original.detach() * 1.5)  # as a LoRA patch replaces it
        ref = _sample(dit)
        out = _sample(graph_sampler.with_cuda_graphs(dit, FakeGraphs))
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        assert set(cache.graphs).isdisjoint(old_keys) and cache.graphs
    finally:
        layer.weight = original


def test_failed_capture_runs_eagerly_with_the_same_result(dit, caplog):
    cuda_graphs.cache_for(dit.model.diffusion_model).clear()
    FailingGraphs.calls = 0
    with caplog.at_level(logging.INFO):
        out = _sample(graph_sampler.with_cuda_graphs(dit, FailingGraphs), steps=3)
    torch.testing.assert_close(out, _sample(dit, steps=3), rtol=0, atol=0)
    assert FailingGraphs.calls == 1  # not retried for the same shape
    assert "capture failed" in caplog.text


def test_unload_frees_the_graphs(dit):
    model = dit.model.diffusion_model
    cuda_graphs.cache_for(model).clear()
    _sample(graph_sampler.with_cuda_graphs(dit, FakeGraphs))
    assert cuda_graphs.cache_for(model).graphs
    graph_sampler._free_on_unload(dit, unpatch_all=False)  # weights stay: graphs stay
    assert cuda_graphs.cache_for(model).graphs
    graph_sampler._free_on_unload(dit, unpatch_all=True)
    assert not cuda_graphs.cache_for(model).graphs


class _Executor:
    """Stands in for ComfyUI's WrapperExecutor around a tiny model."""

    def __init__(self):
        self.class_obj = torch.nn.Linear(4, 4)
        self.calls = 0

    def __call__(self, x, timestep, context=None, transformer_options=None, **kw):
        self.calls += 1
        return self.class_obj(x) * timestep[:, None, None] + (0 if context is None else 1)


def _run(runner, ex, x, **kw):
    options = {"wrappers": {}, **kw.pop("options", {})}
    return runner(ex, x, torch.ones(x.shape[0]), transformer_options=options, **kw)


def test_runner_keys_graphs_by_shape_and_bounds_the_cache():
    ex = _Executor()
    cache = cuda_graphs.cache_for(ex.class_obj)
    cache.max_graphs = 2
    runner = cuda_graphs.GraphRunner(lambda: True, FakeGraphs)
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
    runner = cuda_graphs.GraphRunner(lambda: resident, FakeGraphs)
    x = torch.randn(2, 3, 4)
    with caplog.at_level(logging.INFO):
        out = _run(runner, ex, x, **kwargs)
    torch.testing.assert_close(out, ex.class_obj(x))
    stats = cuda_graphs.cache_for(ex.class_obj).stats
    assert stats.captured == 0 and stats.eager == 1
    assert reason in caplog.text


def test_graph_status_reports_this_run_only():
    from qwen_turbo.nodes.graph_sampler import graph_status
    from qwen_turbo.runtime.cuda_graphs import Stats

    before = Stats(captured=1, replayed=5, reasons={"lowvram": 2})
    after = Stats(captured=2, replayed=8, eager=1, reasons={"lowvram": 2, "new reason": 1})
    assert graph_status(before, after) == "captured 1, replayed 3, eager 1; fallback: new reason"
    assert graph_status(after, after) == ""
