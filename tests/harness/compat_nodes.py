"""Model-modifying nodes of docs/NODES.md's "With other nodes" table, applied
as the executor applies them, and the sampler's badge text read as the path it took; shared by
tests/test_graph_compat.py and benchmarks/compat.py."""

import importlib

import comfy.model_management as mm
import comfy.model_patcher
import comfy.ops
import pytest
import torch

import nodes

WHOLE, CALL, EAGER = "whole step", "per model call", "eager"
INNER = "per transformer call"  # inside the node's own per-call Python
SLG = "per model call (the skip-layer call eager)"


def node_class(module, name):
    """The node class from comfy_extras.`module` (or nodes.py), skipped where this host lacks
    it (pytest.skip; outside pytest, catch `pytest.skip.Exception`)."""
    try:
        mod = nodes if module is None else importlib.import_module(f"comfy_extras.{module}")
    except ImportError as e:
        pytest.skip(f"comfy_extras.{module} does not import here: {e}")
    cls = getattr(mod, name, None)
    if cls is None:
        pytest.skip(f"{name} is not in this ComfyUI")
    return cls


def apply_node(module, name, model, **kwargs):
    """The node's own function, as the executor calls it."""
    cls = node_class(module, name)
    with torch.no_grad():  # as the executor runs nodes (no autograd history in their tensors)
        return call_node(cls, model, kwargs)


def call_node(cls, model, kwargs):
    if hasattr(cls, "define_schema"):  # a v3 (io.ComfyNode) node
        return cls.execute(model=model, **kwargs).result[0]
    return getattr(cls(), cls.FUNCTION)(model=model, **kwargs)[0]


class StandInVAE:
    """Only what DiffSynth's patch asks of a VAE: a 16-channel video latent at 1/8 of the
    image (the real Qwen-Image VAE encodes on CPU in seconds; the patch only projects it)."""

    def encode(self, image):
        x = torch.nn.functional.avg_pool2d(image.movedim(-1, 1), 8)
        return x.repeat(1, 6, 1, 1)[:, :16, None] * 2 - 1  # (B, C, T, H, W), as Wan's

    def spacial_compression_encode(self):
        return 8


def diffsynth(model, height=48, width=64, dtype=torch.float32):
    """QwenImageDiffsynthControlnet with a random block-wise ControlNet of the DiT's width and
    depth (what ModelPatchLoader builds from a file) on a `height`×`width` picture (the
    latent's size: another size is re-encoded on the first step) and a stand-in VAE."""
    mp = importlib.import_module("comfy_extras.nodes_model_patch")
    if not hasattr(mp, "QwenImageBlockWiseControlNet"):
        pytest.skip("QwenImageBlockWiseControlNet is not in this ComfyUI")
    dit = model.model.diffusion_model
    net = mp.QwenImageBlockWiseControlNet(
        num_layers=len(dit.transformer_blocks), dim=dit.inner_dim, operations=comfy.ops.manual_cast
    )
    g = torch.Generator().manual_seed(3)
    for p in net.parameters():  # ComfyUI's ops leave them uninitialized
        p.data = (torch.randn(p.shape, generator=g) * 0.1).to(dtype)
    patch = comfy.model_patcher.ModelPatcher(net, load_device=mm.get_torch_device(),
                                             offload_device=mm.unet_offload_device())  # fmt: skip
    image = torch.rand((1, height, width, 3), generator=torch.Generator().manual_seed(4))
    return apply_node("nodes_model_patch", "QwenImageDiffsynthControlnet", model,
                      model_patch=patch, vae=StandInVAE(), image=image, strength=1.0)  # fmt: skip


def instantx(model, height=48, width=64, strength=1.0, dtype=torch.float32):
    """A random InstantX ControlNet of the DiT's width and depth as ComfyUI's ControlNet object
    (what `comfy.controlnet.load_controlnet_qwen_instantx` builds from a file, whose model
    detection reads full-width configs only), with a `height`×`width` hint picture and a
    stand-in VAE: pass it to ControlNetApplyAdvanced."""
    import comfy.controlnet
    import comfy.latent_formats
    from comfy.ldm.qwen_image.controlnet import QwenImageControlNetModel

    dit = model.model.diffusion_model
    attn = dit.transformer_blocks[0].attn
    net = QwenImageControlNetModel(
        num_layers=len(dit.transformer_blocks), attention_head_dim=attn.dim_head,
        num_attention_heads=attn.heads, joint_attention_dim=dit.txt_in.weight.shape[1],
        axes_dims_rope=tuple(dit.pe_embedder.axes_dim), operations=comfy.ops.manual_cast,
        dtype=dtype,
    )  # fmt: skip
    g = torch.Generator().manual_seed(5)
    for p in net.parameters():  # ComfyUI's ops leave them uninitialized
        p.data = (torch.randn(p.shape, generator=g) * 0.1).to(dtype)
    control = comfy.controlnet.ControlNet(
        net, compression_ratio=1, latent_format=comfy.latent_formats.Wan21(),
        load_device=mm.get_torch_device(), manual_cast_dtype=None, extra_conds=[],
    )  # fmt: skip
    image = torch.rand((1, height, width, 3), generator=torch.Generator().manual_seed(6))
    return control, image


def apply_instantx(positive, negative, control, image, strength=1.0, end=1.0):
    """ControlNetApplyAdvanced, as the executor runs it (with a stand-in VAE)."""
    with torch.no_grad():
        node = nodes.ControlNetApplyAdvanced()
        return node.apply_controlnet(positive, negative, control, image, strength, 0.0, end,
                                     vae=StandInVAE())  # fmt: skip


def path_taken(status: str, whole_step: bool) -> str:
    """The badge text of a run ('captured 1, replayed 5, eager 2; reasons') as a path."""
    if status.startswith("ran as KSampler"):
        return EAGER
    counts = dict(p.rsplit(" ", 1) for p in status.split(";")[0].split(", ") if p)
    graphs = any(k in counts for k in ("captured", "replayed"))
    if "eager" in counts:
        return (CALL + " (the skip-layer call eager)") if graphs else EAGER
    assert graphs, status
    if "model call captured inside its wrappers" in status:
        return INNER
    return WHOLE if whole_step and "whole step not captured" not in status else CALL
