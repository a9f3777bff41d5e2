"""Block graphs (`runtime.graphs.blocks`): the fused blocks of uncaptured model calls replayed
from graphs. On the CPU a stand-in backend records the ops a capture issues and replays them
on the same tensors, as a CUDA graph does: the Python that issued them runs at capture only,
so a key that missed some Python state would replay the wrong computation. The kernels run as
their torch references here (a Triton launch is no op the recorder sees)."""

import contextlib

import comfy.sd
import pytest
import torch
from safetensors.torch import load_file

import nodes
from qwen_turbo.runtime import memory
from qwen_turbo.runtime.dit import blocks as dit_blocks
from qwen_turbo.runtime.dit import config, fp8, loader, probe, streaming
from qwen_turbo.runtime.dit.attention import OVERRIDE
from qwen_turbo.runtime.graphs import blocks
from tests.harness import models
from tests.harness.graphs import TracedBlocks


def _model(sd, graphs=True, backend=None):
    """(patcher with fused blocks, the block graphs or None), streaming as the loader sets it."""
    patcher = loader.build(dict(sd), config.read_config(sd), "fp8_e4m3fn_fast")
    loader.add_fused_blocks(patcher)
    made = loader.add_block_graphs(patcher, backend or TracedBlocks()) if graphs else None
    loader.stream_offloaded_weights(patcher)
    return patcher, made


def _inputs(patcher, seed, tokens=7, size=(12, 10)):
    cfg = config.read_config(patcher.model.diffusion_model.state_dict())
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, cfg.out_channels, 1, *size, generator=g)
    ctx = torch.randn(1, tokens, cfg.joint_attention_dim, generator=g)
    return tuple(t.to(patcher.load_device) for t in (x, ctx, torch.tensor([0.6])))


def _call(patcher, inputs, options=None):
    x, ctx, t = inputs
    opts = dict(patcher.model_options.get("transformer_options", {}), **(options or {}))
    return patcher.model.apply_model(x, t, c_crossattn=ctx, transformer_options=opts)


@contextlib.contextmanager
def _patched(*patchers, loaded=0):
    """The patchers' object patches on, under inference mode; `loaded` bytes of their weights
    on the GPU (0: all)."""
    with torch.inference_mode():
        for p in patchers:
            p.patch_model(p.load_device, lowvram_model_memory=loaded)
        try:
            yield
        finally:
            for p in patchers:
                p.unpatch_model(p.offload_device)
                memory.release(p.model)


@pytest.fixture(autouse=True)
def torch_kernels(request, monkeypatch):
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv("QWEN_TURBO_DISABLE_KERNELS", "1")


@pytest.fixture
def pair(narrow_sd):
    """(eager patcher, patcher with block graphs, its BlockGraphs), patched."""
    plain, _ = _model(narrow_sd, graphs=False)
    patcher, graphs = _model(narrow_sd)
    with _patched(plain, patcher):
        yield plain, patcher, graphs


def test_replays_give_the_eager_result_for_new_inputs(pair):
    """A key's first call runs eagerly, the second captures, later ones replay: each call's
    own inputs reach the graphs, the same bits as the eager blocks."""
    plain, patcher, graphs = pair
    n = len(graphs.blocks)
    for seed in range(4):
        inputs = _inputs(plain, seed)
        assert torch.equal(_call(patcher, inputs), _call(plain, inputs))
    assert graphs.backend.captures == n and graphs.replays == 3 * n  # a capture replays
    assert memory.held_bytes() >= graphs.held_bytes() > 100  # the pool and the buffers


def test_python_state_is_part_of_the_key(pair):
    """The safe path (NaN guard), the fidelity probe's kept blocks, a new size: each a
    capture of its own, never a replay of another's computation (on the GPU they compute
    differently; here the counts tell)."""
    plain, patcher, graphs = pair
    for _ in range(2):
        _call(patcher, _inputs(plain, 0))
    for seed in (1, 2):
        with fp8.safe_compute():
            want = _call(plain, _inputs(plain, seed))
            assert torch.equal(_call(patcher, _inputs(plain, seed)), want)
    for p in (plain, patcher):
        probe.apply(p.model, [0])
    for seed in (3, 4, 5):
        assert torch.equal(_call(patcher, _inputs(plain, seed)), _call(plain, _inputs(plain, seed)))
    bigger = _inputs(plain, 6, tokens=9, size=(8, 14))
    assert torch.equal(_call(patcher, bigger), _call(plain, bigger))
    n = len(graphs.blocks)
    assert graphs.backend.captures == 2 * n + 1  # lossy, safe path, block 0 kept


def test_calls_in_lockstep_keep_buffers_of_their_own(pair):
    """Two calls of one signature taking turns block by block: each has its own chain."""
    plain, patcher, graphs = pair
    streamer = patcher.model.qwen_turbo.streamer
    assert streamer is not None
    inputs = [_inputs(plain, 10), _inputs(plain, 11)]
    want = [_call(plain, i) for i in inputs]
    for _ in range(3):
        got = streamer.in_lockstep([lambda i=i: _call(patcher, i) for i in inputs])
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert len(graphs.chains) == 2 and graphs.replays == 2 * 2 * len(graphs.blocks)


def test_foreign_attention_keeps_blocks_eager(pair):
    """Another node's attention override runs Python at every call: never captured."""
    plain, patcher, graphs = pair

    def attention(func, *args, **kwargs):
        return func(*args, **kwargs)

    for seed in range(3):
        inputs = _inputs(plain, seed)
        got = _call(patcher, inputs, {OVERRIDE: attention})
        assert torch.equal(got, _call(plain, inputs, {OVERRIDE: attention}))
    assert graphs.backend.captures == 0


def test_out_of_memory_drops_the_graphs_and_runs_eagerly(narrow_sd, caplog):
    plain, _ = _model(narrow_sd, graphs=False)
    patcher, graphs = _model(narrow_sd, backend=TracedBlocks(oom=True))
    with _patched(plain, patcher):
        for seed in range(3):
            inputs = _inputs(plain, seed)
            assert torch.equal(_call(patcher, inputs), _call(plain, inputs))
    assert graphs.out_of_memory and graphs.backend.captures == 1 and not graphs.chains
    assert "Block graphs: out of memory" in caplog.text


def test_graphs_off_after_running_out_of_memory_are_tried_at_the_next_run(narrow_sd, caplog):
    """After the first error the next run captures again; after the second, none does."""
    patcher, graphs = _model(narrow_sd, backend=TracedBlocks(oom=True))
    cfg = config.read_config(narrow_sd)
    cond = [[torch.randn(1, 6, cfg.joint_attention_dim), {}]]
    latent = {"samples": torch.zeros(1, cfg.out_channels, 1, 8, 8)}
    for run, captures in ((1, 1), (2, 2), (3, 2)):
        nodes.common_ksampler(patcher, run, 3, 1.0, "euler", "simple", cond, cond, latent)
        assert graphs.out_of_memory and graphs.backend.captures == captures
    assert "eagerly until its next run" in caplog.text
    assert "eagerly until it is unloaded" in caplog.text


def test_dropped_graphs_are_captured_again(pair):
    """ComfyUI asking the model for room (`memory.drop`) frees the graphs; the next call
    captures again, and nothing replays inside `blocks.off()`."""
    plain, patcher, graphs = pair
    for seed in range(2):
        _call(patcher, _inputs(plain, seed))
    assert memory.drop(patcher.model) > 0 and not graphs.chains
    inputs = _inputs(plain, 5)
    assert torch.equal(_call(patcher, inputs), _call(plain, inputs))
    assert graphs.backend.captures == 2 * len(graphs.blocks)
    replays = graphs.replays
    with blocks.off():
        assert torch.equal(_call(patcher, inputs), _call(plain, inputs))
    assert graphs.replays == replays


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("loaded", [1.0, 0.85, 0.45, 0.05])
def test_block_graphs_full_width_on_gpu(loaded, monkeypatch):
    """Six full-width blocks, fp8_fast with fp8_cudnn attention, 1328², the whole model on the
    GPU or part of it (the other layers streamed into the streamer's slabs): new inputs each
    call, and texts of 256 and 31 tokens in lockstep, give the eager blocks' bits, every block
    replayed."""
    from qwen_turbo.cli import bench

    sd = {k: v.cpu() for k, v in bench.qwen_dit_state_dict(6, "cuda").items()}
    monkeypatch.setattr(loader.mm, "get_torch_device", lambda: torch.device("cuda"))
    plain, _ = _model(sd, graphs=False)
    patcher, graphs = _model(sd, backend=blocks.CudaBlockCapture())
    for p in (plain, patcher):
        loader.set_attention(p, "fp8_cudnn")
    part = 0 if loaded == 1.0 else int(loaded * patcher.model_size())
    size = (166, 166)
    with _patched(plain, patcher, loaded=part):
        for seed in range(3):
            inputs = _inputs(plain, seed, tokens=256, size=size)
            assert torch.equal(_call(patcher, inputs), _call(plain, inputs))
        pair = [_inputs(plain, 7, tokens=256, size=size), _inputs(plain, 8, tokens=31, size=size)]
        want = [_call(plain, i) for i in pair]
        streamer = patcher.model.qwen_turbo.streamer
        for _ in range(3):
            got = streamer.in_lockstep([lambda i=i: _call(patcher, i) for i in pair])
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        streamed = sum(any(streaming.offloaded(m) for m in b) for b in streamer.layers)
        norms = sum(streaming.offloaded(getattr(b.attn, k)) for b in graphs.blocks
                    for k in dit_blocks.GAIN_NORMS)  # fmt: skip
        assert (streamed == 0) == (loaded == 1.0)
        assert graphs.replays == 6 * (2 + 2 * 2)  # every block
        pool = graphs.backend.pool_bytes() / (83 * 83 * 3072 * 2)  # bf16 hidden states
    print(f"{loaded}: {streamed} of 6 blocks streamed, {norms} norms on the host; pool {pool:.1f}x "
          "the image tokens' bytes")  # fmt: skip


def test_a_lora_switched_on_replays_its_own_weights(narrow_sd):
    """The graphs stay across ComfyUI's unpatch and a LoRA's patch of the same model: each
    block's key reads its weights as they are at the call, so the LoRA's new weights get
    graphs of their own."""
    lora = load_file(str(models.narrow_lora_file()))
    plain, _ = _model(narrow_sd, graphs=False)
    patcher, graphs = _model(narrow_sd)
    plain_lora = comfy.sd.load_lora_for_models(plain, None, lora, 1.0, 0)[0]
    with_lora = comfy.sd.load_lora_for_models(patcher, None, lora, 1.0, 0)[0]
    with torch.inference_mode():
        for runs in ((plain, patcher), (plain_lora, with_lora), (plain, patcher)):
            for p in runs:
                p.patch_model(p.load_device)
            for seed in range(3):
                inputs = _inputs(plain, seed)
                assert torch.equal(_call(runs[1], inputs), _call(runs[0], inputs))
            for p in runs:
                p.unpatch_model(p.offload_device)
    assert graphs.replays > 0
    memory.release(patcher.model)


@pytest.mark.parametrize("case", ["norms on the host", "norms loaded", "no room for copies"])
def test_blocks_streaming_their_weights_replay(narrow_sd, monkeypatch, case):
    """A partly loaded model: blocks whose offloaded layers take the streamer's copies are
    captured too (the copies lie at the same addresses at every call, in the streamer's
    slabs; a norm's gain left on the host is copied once) and give the eager blocks' bits for
    new inputs. Where ComfyUI copies the layers itself, the blocks run eagerly."""
    if case == "no room for copies":
        monkeypatch.setattr(streaming, "room", lambda device: 0)
    plain, _ = _model(narrow_sd, graphs=False)
    patcher, graphs = _model(narrow_sd)
    streamer = patcher.model.qwen_turbo.streamer
    n = len(graphs.blocks)
    loaded = int(0.6 * patcher.model_size()) if case == "norms loaded" else 1  # 1 byte: none
    with _patched(plain, patcher, loaded=loaded):
        norms = [getattr(b.attn, k) for b in graphs.blocks for k in dit_blocks.GAIN_NORMS]
        assert all(streaming.offloaded(m) for m in norms) == (loaded == 1)
        for seed in range(4):
            inputs = _inputs(plain, seed)
            assert torch.equal(_call(patcher, inputs), _call(plain, inputs))
        copied = case != "no room for copies"
        assert streamer.copies == 4 * n * copied  # every block streams some of its layers
        assert graphs.backend.captures == n * copied
        assert graphs.replays == 3 * graphs.backend.captures  # a capture replays
        assert bool(streamer.slabs) == copied
        memory.drop(patcher.model)  # ComfyUI asking the model for room
        assert not streamer.slabs
        _call(patcher, inputs)
        assert bool(streamer.slabs) == copied  # made again
        patcher.unpatch_model(patcher.offload_device)
        patcher.patch_model(patcher.load_device)  # loaded whole: the slabs go at the next call
        assert torch.equal(_call(patcher, inputs), _call(plain, inputs))
        assert not streamer.slabs


def test_a_norm_patched_per_call_gets_a_new_gain():
    """ComfyUI's per-call patches on a norm left on the host (a LoRA's, which may add into
    the weight they are given) apply to a copy: the weight stays as it was."""
    norm = torch.nn.RMSNorm(8)
    weight = norm.weight.detach().clone()
    norm.weight_function = [lambda w: w.add_(1.0)]
    assert torch.equal(dit_blocks.norm_gain(norm, norm.weight.device), weight + 1)
    assert torch.equal(norm.weight, weight) and dit_blocks.gain_tensors(norm, "cpu") is None
