"""CUDA Graph Sampler with each model-modifying node a Qwen-Image user puts between the loader
and the sampler: the node's real function on a tiny DiT, then KSampler and the sampler in both
capture modes with the recording stand-in backend (`TracedGraphs`: a replay reruns the recorded
aten ops without the Python that issued them, as a CUDA graph does).

Every case asserts that the node changes KSampler's result (so a replay that skipped the node's
Python would show) and that the sampler's latent is bit-identical to KSampler's with the node;
the path the sampler took (whole step / per model call / eager) is read from its badge text and
checked against the README's compatibility table.
"""

import importlib

import comfy.model_patcher
import comfy.ops
import folder_paths
import pytest
import torch
from comfy_extras.nodes_model_advanced import ModelSamplingAuraFlow

import nodes
from qwen_turbo.nodes import graph_sampler
from qwen_turbo.runtime import cuda_graphs, qwen_loader
from tests.harness import models
from tests.test_cuda_graph_sampler import TracedGraphs, _cached

STEPS, CFG = 6, 2.5
TEXT = models.NARROW["joint_attention_dim"]


@pytest.fixture(scope="module")
def loaded():
    """The narrow 2-block Qwen-Image DiT as a plain ModelPatcher, as UNETLoader's (ComfyUI's
    loader reads full-width configs only; the pack's builder, without its kernels)."""
    return qwen_loader.build(*qwen_loader.read_checkpoint(models.qwen_dit_narrow_file()))


@pytest.fixture(scope="module")
def dit(loaded):
    """Loader → ModelSamplingAuraFlow, as in the bundled workflows."""
    return ModelSamplingAuraFlow().patch_aura(loaded, 3.1)[0]


def _cond(tokens, seed):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn((1, tokens, TEXT), generator=g), {}]]


def _args():
    latent = {"samples": torch.zeros((1, 16, 6, 8))}
    return (42, STEPS, CFG, "euler", "simple", _cond(8, 1), _cond(8, 2), latent)


def _node(module, name):
    """The node class from comfy_extras.`module` (or nodes.py), skipped where this host lacks it."""
    try:
        mod = nodes if module is None else importlib.import_module(f"comfy_extras.{module}")
    except ImportError as e:
        pytest.skip(f"comfy_extras.{module} does not import here: {e}")
    cls = getattr(mod, name, None)
    if cls is None:
        pytest.skip(f"{name} is not in this ComfyUI")
    return cls


def _apply(module, name, model, **kwargs):
    """The node's own function, as the executor calls it."""
    cls = _node(module, name)
    with torch.no_grad():  # as the executor runs nodes (no autograd history in their tensors)
        return _call(cls, model, kwargs)


def _call(cls, model, kwargs):
    if hasattr(cls, "define_schema"):  # a v3 (io.ComfyNode) node
        return cls.execute(model=model, **kwargs).result[0]
    return getattr(cls(), cls.FUNCTION)(model=model, **kwargs)[0]


def _lora(model):
    file = models.narrow_lora_file()
    folder_paths.add_model_folder_path("loras", str(file.parent))
    return _apply(None, "LoraLoaderModelOnly", model, lora_name=file.name, strength_model=1.0)


class _StandInVAE:
    """Only what DiffSynth's patch asks of a VAE: a 16-channel video latent at 1/8 of the
    image (the real Qwen-Image VAE encodes on CPU in seconds; the patch only projects it)."""

    def encode(self, image):
        x = torch.nn.functional.avg_pool2d(image.movedim(-1, 1), 8)
        return x.repeat(1, 6, 1, 1)[:, :16, None] * 2 - 1  # (B, C, T, H, W), as Wan's

    def spacial_compression_encode(self):
        return 8


def _diffsynth(model):
    """QwenImageDiffsynthControlnet with a random block-wise ControlNet built for the narrow
    DiT (what ModelPatchLoader builds from a file, at this width) and a stand-in VAE."""
    mp = importlib.import_module("comfy_extras.nodes_model_patch")
    if not hasattr(mp, "QwenImageBlockWiseControlNet"):
        pytest.skip("QwenImageBlockWiseControlNet is not in this ComfyUI")
    dim = models.NARROW["attention_head_dim"] * models.NARROW["num_attention_heads"]
    net = mp.QwenImageBlockWiseControlNet(num_layers=2, dim=dim, operations=comfy.ops.manual_cast)
    g = torch.Generator().manual_seed(3)
    for p in net.parameters():  # ComfyUI's ops leave them uninitialized
        p.data = torch.randn(p.shape, generator=g) * 0.1
    patch = comfy.model_patcher.ModelPatcher(net, load_device=torch.device("cpu"),
                                             offload_device=torch.device("cpu"))  # fmt: skip
    image = torch.rand((1, 48, 64, 3), generator=torch.Generator().manual_seed(4))
    return _apply("nodes_model_patch", "QwenImageDiffsynthControlnet", model, model_patch=patch,
                  vae=_StandInVAE(), image=image, strength=1.0)  # fmt: skip


def _compiled(model):
    compiled = _apply("nodes_torch_compile", "TorchCompileModel", model, backend="inductor")
    try:  # inductor builds C++ on CPU: where that cannot run, there is nothing to compare
        nodes.common_ksampler(compiled, *_args()[:1], 1, *_args()[2:])
    except Exception as e:
        pytest.skip(f"TorchCompileModel (inductor) cannot run on this CPU: {type(e).__name__}")
    return compiled


WHOLE, CALL, EAGER = "whole step", "per model call", "eager"
INNER = "per transformer call"  # inside the node's own per-call Python
SLG = "per model call (the skip-layer call eager)"
# node: (how to apply it, path in model-forward mode, path in whole-step mode)
CASES = {
    "LoraLoaderModelOnly": (_lora, CALL, WHOLE),
    "ModelSamplingAuraFlow": (None, CALL, WHOLE),
    "CFGNorm": (lambda m: _apply("nodes_cfg", "CFGNorm", m, strength=0.5), CALL, CALL),
    "EasyCache": (lambda m: _cached(_node("nodes_easycache", "EasyCacheNode"), m), INNER, INNER),
    "LazyCache": (lambda m: _cached(_node("nodes_easycache", "LazyCacheNode"), m), CALL, WHOLE),
    "TorchCompileModel": (_compiled, CALL, WHOLE),
    "SkipLayerGuidanceDiT": (
        lambda m: _apply("nodes_slg", "SkipLayerGuidanceDiT", m, scale=3.0, start_percent=0.3,
                         end_percent=0.7, double_layers="1", single_layers=""),
        SLG, SLG,
    ),
    "SkipLayerGuidanceDiTSimple": (
        lambda m: _apply("nodes_slg", "SkipLayerGuidanceDiTSimple", m, start_percent=0.3,
                         end_percent=0.7, double_layers="1", single_layers=""),
        SLG, SLG,
    ),
    "APG": (lambda m: _apply("nodes_apg", "APG", m, eta=0.5, norm_threshold=1.0, momentum=-0.5),
            CALL, CALL),
    "Mahiro": (lambda m: _apply("nodes_mahiro", "Mahiro", m), CALL, CALL),
    "RenormCFG": (lambda m: _apply("nodes_lumina2", "RenormCFG", m, cfg_trunc=0.5, renorm_cfg=1.0),
                  CALL, CALL),
    "CFGZeroStar": (lambda m: _apply("nodes_cfg", "CFGZeroStar", m), CALL, CALL),
    "TCFG": (lambda m: _apply("nodes_tcfg", "TCFG", m), CALL, CALL),
    "PerpNeg": (
        lambda m: _apply("nodes_perpneg", "PerpNeg", m, empty_conditioning=_cond(8, 9),
                         neg_scale=1.5),
        CALL, CALL,
    ),
    "QwenImageDiffsynthControlnet": (_diffsynth, EAGER, EAGER),
}  # fmt: skip


def path_taken(status: str, whole_step: bool) -> str:
    """The badge text of a run ('captured 1, replayed 5, eager 2; reasons') as a path."""
    counts = dict(p.rsplit(" ", 1) for p in status.split(";")[0].split(", ") if p)
    graphs = any(k in counts for k in ("captured", "replayed"))
    if "eager" in counts:
        return (CALL + " (the skip-layer call eager)") if graphs else EAGER
    assert graphs, status
    if "model call captured inside its wrappers" in status:
        return INNER
    return WHOLE if whole_step and "whole step not captured" not in status else CALL


@pytest.mark.parametrize("whole_step", [False, True], ids=["model_forward", "whole_step"])
@pytest.mark.parametrize("name", list(CASES))
def test_node_through_the_graph_sampler_equals_ksampler(loaded, dit, name, whole_step):
    setup, model_call, step = CASES[name]
    base = loaded if name == "ModelSamplingAuraFlow" else dit
    model = dit if setup is None else setup(dit)
    cuda_graphs.cache_for(base.model).clear()
    ref = nodes.common_ksampler(model, *_args())[0]["samples"]
    out, status = graph_sampler.sample_with_graphs(model, whole_step, TracedGraphs, *_args())
    if name == "TorchCompileModel":
        # compiling is meant to keep the result: its Python is the compile wrapper around
        # apply_model, which the sampler must keep (SAFE_WRAPPERS)
        assert "torch.compile" in model.wrappers["apply_model"]
        # inductor's fused CPU kernels are no aten ops: the stand-in records the eager ops of
        # the same math instead (a CUDA graph would hold inductor's kernels), so the sum
        # order differs: 1e-3 relative L2
        rel = (out["samples"] - ref).norm() / ref.norm()
        assert rel <= 1e-3, rel
    else:
        # the node changes the result: a replay that skipped its Python could not match
        assert not torch.equal(ref, nodes.common_ksampler(base, *_args())[0]["samples"])
        torch.testing.assert_close(out["samples"], ref, rtol=0, atol=0)
    assert path_taken(status, whole_step) == (step if whole_step else model_call), status
