"""ControlNet with block graphs (issue 62): ComfyUI's two Qwen-Image ControlNet paths on the
Optimized Loader's model, through the real nodes: an InstantX ControlNet through
ControlNetApplyAdvanced (its residuals reach the transformer as the `control` argument, which
ComfyUI adds into each block's output) and QwenImageDiffsynthControlnet (a `double_block` model
patch that runs its control block after each block). The CUDA Graph Sampler's runners and the
block graphs run on stand-in backends that replay recorded ops without the Python that issued
them, as CUDA graphs do, so a replay that skipped the ControlNet's Python would show. The
result must be the pack's eager run (the same fused blocks, no graphs) bit for bit, with the
blocks replayed; a patch the policy does not know keeps them eager, still exact."""

import importlib.util
import sys

import comfy.model_patcher
import comfy.ops
import pytest
import torch

import nodes
from qwen_turbo.nodes import graph_sampler
from qwen_turbo.runtime import memory
from qwen_turbo.runtime.dit import config, loader
from qwen_turbo.runtime.graphs import blocks as block_graphs
from qwen_turbo.runtime.graphs import policy, sampling
from tests.harness.compat_nodes import StandInVAE, apply_instantx, diffsynth, instantx
from tests.harness.graphs import TracedBlocks, TracedGraphs
from tests.test_block_graphs import (
    _inputs,
    _model,
    _patched,
    torch_kernels,  # noqa: F401  (autouse: the kernels' torch references)
)

STEPS, CFG = 4, 2.5


@pytest.fixture
def pair(narrow_sd):
    """(the pack's eager model: fused blocks, no block graphs; the same with block graphs on
    the stand-in backend, and its BlockGraphs)."""
    made = []
    for graphs in (False, True):
        patcher = loader.build(dict(narrow_sd), config.read_config(narrow_sd), "fp8_e4m3fn_fast")
        loader.add_fused_blocks(patcher)
        blocks = loader.add_block_graphs(patcher, TracedBlocks()) if graphs else None
        loader.stream_offloaded_weights(patcher)
        made.append((patcher, blocks))
    yield made[0][0], *made[1]
    memory.release(made[1][0].model)


def _args(text):
    g = torch.Generator().manual_seed(1)
    positive = [[torch.randn(1, 6, text, generator=g), {}]]
    negative = [[torch.randn(1, 6, text, generator=g), {}]]
    latent = {"samples": torch.zeros(1, 16, 6, 8)}
    return [1, STEPS, CFG, "euler", "simple", positive, negative, latent]


def _with_control(path, model, args):
    """`model` and the sampler's arguments with the ControlNet of `path` applied by its node."""
    args = list(args)
    if path == "instantx":
        args[5], args[6] = apply_instantx(args[5], args[6], *instantx(model))
        return model, args
    size = (48, 64) if path == "diffsynth" else (40, 72)  # else re-encoded at the first call
    return diffsynth(model, *size), args


def _text(model):
    return model.model.diffusion_model.txt_in.weight.shape[1]


def _ksampler(model, args):
    with torch.inference_mode():  # as the executor runs nodes
        return nodes.common_ksampler(model, *args)[0]["samples"]


PATHS = ["instantx", "diffsynth", "diffsynth re-encoded"]
# the runners' path: the InstantX call is no capture (a nested argument, passed by name or, on
# v0.33.0, by position), the DiffSynth run no runner at all (a model patch in the transformer)
RUNNERS = {
    "instantx": "of type dict",
    "diffsynth": "ran as KSampler: model patches (double_block) run Python per step",
}


@pytest.mark.parametrize("whole_step", [False, True], ids=["model_forward", "whole_step"])
@pytest.mark.parametrize("path", PATHS)
def test_controlnet_runs_with_block_graphs_bit_for_bit(pair, path, whole_step):
    """The CUDA Graph Sampler with a ControlNet: the blocks replay from their graphs, the
    ControlNet's Python runs between them at every call, and the latent is the pack's eager
    one bit for bit."""
    plain, patcher, graphs = pair
    args = _args(_text(plain))
    without = _ksampler(plain, args)
    eager, eager_args = _with_control(path, plain, args)
    want = _ksampler(eager, eager_args)
    assert not torch.equal(want, without)  # the ControlNet changes the picture
    model, args = _with_control(path, patcher, args)
    with torch.inference_mode():
        got, status = sampling.sample_with_graphs(model, whole_step, TracedGraphs, *args)
    torch.testing.assert_close(got["samples"], want, rtol=0, atol=0)
    assert RUNNERS[path.split()[0]] in status, status
    assert graphs.backend.captures == len(graphs.blocks)  # one call signature
    assert graphs.replays >= (STEPS - 1) * len(graphs.blocks) and not graphs.refused


@pytest.mark.parametrize("path", ["instantx", "diffsynth"])
def test_the_sampler_badge_counts_the_replayed_blocks(pair, path, sent):
    """Through the node (on the CPU it samples as KSampler, the block graphs on): the badge
    says how many blocks replayed; the latent is the eager one."""
    plain, patcher, graphs = pair
    args = _args(_text(plain))
    want = _ksampler(*_with_control(path, plain, args))
    model, args = _with_control(path, patcher, args)
    with torch.inference_mode():
        got = graph_sampler.CUDAGraphSampler.execute(model, *args).result[0]["samples"]
    assert torch.equal(got, want)
    assert graphs.replays > 0
    assert sent[-1]["graphs"] == f"off (runs on cpu); blocks replayed {graphs.replays}"


def _nudge(kwargs):
    """Another node's patch between the blocks: the policy cannot know what it keeps."""
    kwargs["img"] = kwargs["img"] * 1.01
    return kwargs


def test_an_unknown_patch_between_blocks_keeps_them_eager(pair, sent):
    plain, patcher, graphs = pair
    args = _args(_text(plain))
    models = []
    for m in (plain, patcher):
        m = diffsynth(m)  # a known patch with it does not make it known
        m.set_model_double_block_patch(_nudge)
        models.append(m)
    want = _ksampler(models[0], args)
    with torch.inference_mode():
        got = graph_sampler.CUDAGraphSampler.execute(models[1], *args).result[0]["samples"]
    assert torch.equal(got, want)
    assert graphs.backend.captures == 0 and graphs.replays == 0
    why = "model patch _nudge (double_block) runs Python per step"
    assert sent[-1]["graphs"] == f"off (runs on cpu); blocks eager: {why}"


def _diffsynth_class(module=None):
    if module is None:
        module = importlib.import_module("comfy_extras.nodes_model_patch")
    cls = getattr(module, "DiffSynthCnetPatch", None)
    if cls is None:
        pytest.skip("DiffSynthCnetPatch is not in this ComfyUI")
    return cls


def test_block_patch_policy_knows_comfys_diffsynth_patch_alone(monkeypatch):
    """ComfyUI's own DiffSynth patch class (imported by its module name, or by the file path
    ComfyUI's node loader names it after) runs between the blocks; a subclass, a class of that
    name elsewhere, another kind of patch or a block replacement keeps the blocks eager."""
    cls = _diffsynth_class()
    path = policy.COMFY_ROOT / "comfy_extras" / "nodes_model_patch.py"
    name = str(path.with_suffix(""))  # as ComfyUI's node loader imports comfy_extras
    spec = importlib.util.spec_from_file_location(name, path)
    copy = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, copy)
    spec.loader.exec_module(copy)
    for known in (cls, _diffsynth_class(copy)):
        options = {"patches": {"double_block": [object.__new__(known)]}}
        assert policy.block_patches(options) is None
        assert policy.foreign_code(options, "diffusion_model", [], blocks=True) is None
        assert policy.foreign_code(options, "diffusion_model", []) is not None  # a whole call
    lookalike = type("DiffSynthCnetPatch", (), {"__call__": lambda self, kwargs: kwargs})
    sub = type("DiffSynthCnetPatch", (cls,), {"__call__": lambda self, kwargs: kwargs})
    for other in (lookalike, sub):
        options = {"patches": {"double_block": [object.__new__(other)]}}
        assert policy.block_patches(options).startswith("model patch DiffSynthCnetPatch")
    options = {"patches": {"post_input": [object.__new__(cls)]}}
    assert policy.block_patches(options) == (
        "model patch DiffSynthCnetPatch (post_input) runs Python per step"
    )
    replaced = {"patches_replace": {"dit": {("double_block", 0): _nudge}}}
    assert policy.block_patches(replaced) == "model patches (dit) run Python per step"


def _control_inputs(patcher, seed, size):
    """What a transformer call gets from each ControlNet path, new values per seed: InstantX's
    residuals (the `control` argument, one per block, the last None) and a DiffSynth patch in
    transformer_options (a random block-wise ControlNet of the DiT's width and depth)."""
    mp = importlib.import_module("comfy_extras.nodes_model_patch")
    dit, device = patcher.model.diffusion_model, patcher.load_device
    n, width = len(dit.transformer_blocks), dit.inner_dim
    g = torch.Generator().manual_seed(100 + seed)
    tokens = (size[0] // 2) * (size[1] // 2)
    residuals = [torch.randn(1, tokens, width, generator=g).to(device, torch.bfloat16) * 0.1
                 for _ in range(n - 1)] + [None]  # fmt: skip
    net = mp.QwenImageBlockWiseControlNet(
        num_layers=n, dim=width, device=device, dtype=torch.bfloat16,
        operations=comfy.ops.manual_cast,
    )  # fmt: skip
    for p in net.parameters():
        p.data = (torch.randn(p.shape, generator=g) * 0.1).to(device, torch.bfloat16)
    holder = comfy.model_patcher.ModelPatcher(net, load_device=device, offload_device=device)
    image = torch.rand((1, size[0] * 8, size[1] * 8, 3), generator=g).to(device)
    patch = mp.DiffSynthCnetPatch(holder, StandInVAE(), image, 0.7)
    return {"input": residuals}, {"patches": {"double_block": [patch]}}


def _control_call(patcher, inputs, control, options):
    x, ctx, t = inputs
    opts = dict(patcher.model_options.get("transformer_options", {}), **options)
    return patcher.model.apply_model(x, t, c_crossattn=ctx, control=control,
                                     transformer_options=opts)  # fmt: skip


def _replays_with_controls(plain, patcher, graphs, tokens, size, calls=4):
    """New inputs and new ControlNet inputs every call, both paths at once: the blocks'
    replays give the eager blocks' bits."""
    for seed in range(calls):
        inputs = _inputs(plain, seed, tokens=tokens, size=size)
        control, options = _control_inputs(plain, seed, size)
        want = _control_call(plain, inputs, control, options)
        assert not torch.equal(want, _control_call(plain, inputs, None, {}))
        got = _control_call(patcher, inputs, control, options)
        assert torch.equal(got, want)
    n = len(graphs.blocks)
    assert graphs.replays == (calls - 1) * n and not graphs.refused  # a capture replays


def test_transformer_calls_with_both_controlnets_replay_their_blocks(narrow_sd):
    """A transformer call as ComfyUI makes it with both ControlNets: the residuals added in
    place into the replayed blocks' buffers, the DiffSynth patch run between the blocks."""
    plain, _ = _model(narrow_sd, graphs=False)
    patcher, graphs = _model(narrow_sd)
    with _patched(plain, patcher):
        _replays_with_controls(plain, patcher, graphs, tokens=7, size=(12, 10))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_controlnets_with_block_graphs_full_width_on_gpu(monkeypatch):
    """The same with CUDA graphs: six full-width blocks, fp8_fast with fp8_cudnn attention,
    1328², both ControlNets' inputs new at every call."""
    from qwen_turbo.cli import bench

    sd = {k: v.cpu() for k, v in bench.qwen_dit_state_dict(6, "cuda").items()}
    monkeypatch.setattr(loader.mm, "get_torch_device", lambda: torch.device("cuda"))
    plain, _ = _model(sd, graphs=False)
    patcher, graphs = _model(sd, backend=block_graphs.CudaBlockCapture())
    for p in (plain, patcher):
        loader.set_attention(p, "fp8_cudnn")
    with _patched(plain, patcher):
        _replays_with_controls(plain, patcher, graphs, tokens=256, size=(166, 166))
