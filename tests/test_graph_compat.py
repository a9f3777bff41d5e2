"""CUDA Graph Sampler with each model-modifying node a Qwen-Image user puts between the loader
and the sampler: the node's real function on a tiny DiT, then KSampler and the sampler in both
capture modes with the recording stand-in backend (`TracedGraphs`: a replay reruns the recorded
aten ops without the Python that issued them, as a CUDA graph does).

Every case asserts that the node changes KSampler's result (so a replay that skipped the node's
Python would show) and that the sampler's latent is bit-identical to KSampler's with the node;
the path the sampler took (whole step / per model call / eager) is read from its badge text and
checked against the compatibility table in docs/NODES.md.
"""

import shutil

import folder_paths
import pytest
import torch

import nodes
from qwen_turbo.runtime.graphs import sampling
from qwen_turbo.runtime.graphs.cache import cache_for
from tests.harness import models
from tests.harness.compat_nodes import (
    CALL,
    EAGER,
    INNER,
    SLG,
    WHOLE,
    apply_node,
    diffsynth,
    node_class,
    path_taken,
)
from tests.harness.graphs import TracedGraphs, cached

STEPS, CFG = 6, 2.5
TEXT = models.NARROW["joint_attention_dim"]


def _cond(tokens, seed):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn((1, tokens, TEXT), generator=g), {}]]


def _args():
    latent = {"samples": torch.zeros((1, 16, 6, 8))}
    return (42, STEPS, CFG, "euler", "simple", _cond(8, 1), _cond(8, 2), latent)


def _lora(model):
    file = models.narrow_lora_file()
    folder_paths.add_model_folder_path("loras", str(file.parent))
    return apply_node(None, "LoraLoaderModelOnly", model, lora_name=file.name, strength_model=1.0)


def _compiled(model):
    # inductor builds C++ on CPU: without a compiler there is nothing to compare; with one, any
    # failure is the test's
    if not (shutil.which("c++") or shutil.which("g++")):
        pytest.skip("TorchCompileModel (inductor) needs a C++ compiler on the CPU")
    return apply_node("nodes_torch_compile", "TorchCompileModel", model, backend="inductor")


# node: (how to apply it, path in model-forward mode, path in whole-step mode)
CASES = {
    "LoraLoaderModelOnly": (_lora, CALL, WHOLE),
    "ModelSamplingAuraFlow": (None, CALL, WHOLE),
    "CFGNorm": (lambda m: apply_node("nodes_cfg", "CFGNorm", m, strength=0.5), CALL, CALL),
    "EasyCache": (lambda m: cached(node_class("nodes_easycache", "EasyCacheNode"), m),
                  INNER, INNER),
    "LazyCache": (lambda m: cached(node_class("nodes_easycache", "LazyCacheNode"), m),
                  CALL, WHOLE),
    "TorchCompileModel": (_compiled, CALL, WHOLE),
    "SkipLayerGuidanceDiT": (
        lambda m: apply_node("nodes_slg", "SkipLayerGuidanceDiT", m, scale=3.0,
                             start_percent=0.3, end_percent=0.7, double_layers="1",
                             single_layers=""),
        SLG, SLG,
    ),
    "SkipLayerGuidanceDiTSimple": (
        lambda m: apply_node("nodes_slg", "SkipLayerGuidanceDiTSimple", m, start_percent=0.3,
                             end_percent=0.7, double_layers="1", single_layers=""),
        SLG, SLG,
    ),
    "APG": (lambda m: apply_node("nodes_apg", "APG", m, eta=0.5, norm_threshold=1.0,
                                 momentum=-0.5),
            CALL, CALL),
    "Mahiro": (lambda m: apply_node("nodes_mahiro", "Mahiro", m), CALL, CALL),
    "RenormCFG": (lambda m: apply_node("nodes_lumina2", "RenormCFG", m, cfg_trunc=0.5,
                                       renorm_cfg=1.0),
                  CALL, CALL),
    "CFGZeroStar": (lambda m: apply_node("nodes_cfg", "CFGZeroStar", m), CALL, CALL),
    "TCFG": (lambda m: apply_node("nodes_tcfg", "TCFG", m), CALL, CALL),
    "PerpNeg": (
        lambda m: apply_node("nodes_perpneg", "PerpNeg", m, empty_conditioning=_cond(8, 9),
                             neg_scale=1.5),
        CALL, CALL,
    ),
    "QwenImageDiffsynthControlnet": (diffsynth, EAGER, EAGER),
}  # fmt: skip


@pytest.mark.parametrize("whole_step", [False, True], ids=["model_forward", "whole_step"])
@pytest.mark.parametrize("name", list(CASES))
def test_node_through_the_graph_sampler_equals_ksampler(
    narrow_loaded, narrow_dit, name, whole_step
):
    setup, model_call, step = CASES[name]
    base = narrow_loaded if name == "ModelSamplingAuraFlow" else narrow_dit
    model = narrow_dit if setup is None else setup(narrow_dit)
    cache_for(base.model).clear()
    ref = nodes.common_ksampler(model, *_args())[0]["samples"]
    out, status = sampling.sample_with_graphs(model, whole_step, TracedGraphs, *_args())
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
