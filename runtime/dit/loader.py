"""Building the Qwen-Image DiT as a plain MODEL (ModelPatcher): ComfyUI's QwenImage model of the
config read off the weights, with fp8 ops, the fused blocks, weight streaming, an attention
backend and regional compile attached as object patches and model options. `load` is what
the Optimized Loader node calls."""

import contextlib
import functools
import inspect
import itertools
import logging
import types
from pathlib import Path

import comfy.ldm.qwen_image.model as qwen_model
import comfy.model_management as mm
import comfy.patcher_extension as pe
import comfy.supported_models
import comfy.utils
import folder_paths
import torch

from ...kernels import warmup
from .. import host, log_once
from ..graphs import blocks as block_graphs
from . import blocks, convert, files, fp8, lockstep, nextdit_block, probe, streaming
from .attention import OVERRIDE, QUANTIZED, attention_override, kernel_note
from .config import DiTConfig, NotQwenImageDiT
from .fp8 import fp8_ops
from .nextdit import NextDiTConfig
from .patcher import LoaderState, Patcher

log = logging.getLogger(__name__)

WEIGHT_DTYPES = ["auto", "bf16", "fp8_e4m3fn", "fp8_e4m3fn_fast"]
ATTENTION = ["auto", "sdpa", "flash", "fp8", "fp8_cudnn"]
COMPILE = ["off", "regional"]
FUSED_KEY = "forward"  # object patch on each block's `forward`
PROBE_KEY = "qwen_turbo_fidelity_probe"
GRAPHS_KEY = "qwen_turbo_block_graphs"
# A block whose lossy contribution differs from the safe path's by more than this (relative L2)
# is kept on the safe path.
DEFAULT_THRESHOLD = 0.15
# ComfyUI's estimate of what a Qwen-Image call needs beside the weights (BaseModel.
# memory_required, memory_usage_factor 1.8) is about twice what the bundled workflows' settings
# take (fp8_e4m3fn_fast, fused blocks, fp8_cudnn): per 2512² picture 1.65 GiB resident and
# 1.8-2.1 GiB with the DiT streamed on a 12 GiB card, batches 1-4 (benchmarks/RESULTS.md,
# "Batches"), against its 3.46 (2.50 printed with 1.3, scaled to 1.8). ComfyUI keeps that much
# free and offloads weights for it;
# 1.3 (2.5 GiB) keeps more of the DiT on the GPU on small cards. fp8 storage with bf16 GEMMs and
# fp8_cudnn's sdpa fallback (GPUs before Hopper) hold the same token-sized tensors, plus one
# layer's weight in bf16 at a time. Other settings keep ComfyUI's estimate.
ACTIVATIONS_FACTOR = 1.3


@contextlib.contextmanager
def host_estimate(model):
    """ComfyUI's own activation estimate for `model` (a ModelPatcher) inside: for a run again
    after running out of memory with the measured one."""
    base = model.model
    measured = base.memory_usage_factor
    base.memory_usage_factor = base.model_config.memory_usage_factor
    try:
        yield
    finally:
        base.memory_usage_factor = measured


# the kernel modules whose recorded launches (kernels/warmup.json) a load compiles ahead
FP8_KERNELS = ("fp8_linear",)
QWEN_KERNELS = (*FP8_KERNELS, "qk_norm_rope", "gated_residual", "layernorm_modulate",
                "linear_gelu", "attention_fp8")  # fmt: skip

# The variants by their reference method (config.read_config), for messages.
VARIANTS = {"index_timestep_zero": "Qwen-Image-Edit-2511", "negative_index": "Qwen-Image-Layered"}


class HostLacks(ValueError):
    """The weights need a model setting this ComfyUI's Qwen-Image model does not take."""


# what a user can meet loading a checkpoint: each message names the fix
USER_ERRORS = (NotQwenImageDiT, HostLacks, files.Unreadable)


def check_host(config) -> None:
    """Raise HostLacks where this host's model cannot take the variant's settings: an older
    ComfyUI runs Edit-2511's weights with Edit-2509's reference method, or NewBie's without
    its pooled CLIP vector, silently wrong."""
    dit = qwen_model.QwenImageTransformer2DModel
    if isinstance(config, NextDiTConfig):
        import comfy.ldm.lumina.model

        dit = comfy.ldm.lumina.model.NextDiT
    takes = inspect.signature(dit.__init__).parameters
    for key, value in config.variant().items():
        if key not in takes:
            what = VARIANTS.get(getattr(config, "default_ref_method", ""), config.name)
            raise HostLacks(
                f"{what} needs {key}={value!r}, which this ComfyUI's {config.family} model does "
                "not take (its pictures would come out wrong); update ComfyUI"
            )


@functools.cache
def nextdit_mlp_factor() -> int:
    """How many times its width this host's NextDiT blocks give their MLP before
    `ffn_dim_multiplier` (v0.33: 1, v0.3.64: 4): read off a small block built on meta."""
    from comfy.ldm.lumina.model import JointTransformerBlock

    ops = types.SimpleNamespace(Linear=torch.nn.Linear, RMSNorm=torch.nn.RMSNorm)
    settings = {"operations": ops, "device": "meta", "dtype": None}
    block = JointTransformerBlock(0, 12, 2, 2, 1, None, 1e-5, True, operation_settings=settings)
    return block.feed_forward.w1.out_features // 12


def _progress(n: int):
    """A step callback for the loader's pass over n tensors on the CPU (a 38 GiB bf16 file to
    fp8 takes a while): ComfyUI's progress bar, updated each percent, and its interrupt."""
    bar, done, every = comfy.utils.ProgressBar(n), 0, max(1, -(-n // 100))  # ceil(n / 100)

    def step():
        nonlocal done
        done += 1
        if done % every == 0 or done == n:
            mm.throw_exception_if_processing_interrupted()
            bar.update_absolute(done, n)

    return step


def build(sd, config: DiTConfig | NextDiTConfig, weight_dtype: str = "auto"):
    """A ModelPatcher holding ComfyUI's model of `config` (QwenImage, or Lumina2 for NewBie)
    with the weights of `sd`. Raises HostLacks where this host cannot run the variant."""
    check_host(config)
    load_device = mm.get_torch_device()
    offload_device = mm.unet_offload_device()
    model_class = getattr(comfy.supported_models, config.host_model)
    if isinstance(config, NextDiTConfig):
        model_config = model_class(config.unet_config(nextdit_mlp_factor()))
    else:
        model_config = model_class(config.unet_config())
    mode = convert.weight_mode(weight_dtype, sd, load_device)
    sd = convert.to_mode(sd, mode, _progress, config.blocks, load_device)
    unet_dtype = torch.bfloat16
    if mode.startswith("fp8"):
        # fp8 Linear weights with scales; the rest (biases, norm gains, the layers outside
        # the blocks) in bf16.
        model_config.custom_operations = fp8_ops(fast=mode == "fp8_e4m3fn_fast")
    elif mode == "auto":  # ComfyUI's own choice for the device (float32 on CPU)
        params = convert.count_params(sd)
        supported = model_class.supported_inference_dtypes
        unet_dtype = mm.unet_dtype(model_params=params, supported_dtypes=supported)
    manual_cast = mm.unet_manual_cast(
        unet_dtype, load_device, model_class.supported_inference_dtypes
    )
    model_config.set_inference_dtype(unet_dtype, manual_cast)
    model = model_config.get_model(sd, "")
    for t in itertools.chain(model.parameters(), model.buffers()):
        if not t.is_meta:  # the fp8 Linears' weights, until the state dict's tensors replace them
            t.data = t.data.to(offload_device)
    # with dynamic VRAM the state dict's tensors are views of comfy-aimdo's file mapping
    aimdo = getattr(getattr(comfy, "memory_management", None), "aimdo_enabled", False)
    views = {t.data_ptr() for t in sd.values() if t.device.type == "cpu"} - {0} if aimdo else set()
    model.load_model_weights(sd, "")
    missing = [n for n, p in model.named_parameters() if p.is_meta]  # Linears the file lacks
    if missing:
        raise files.Unreadable(
            f"the checkpoint lacks {len(missing)} weights of a {config.family} DiT ({missing[0]}, "
            "...): it is incomplete; download it again"
        )
    mapped = {p.data_ptr() for p in model.parameters()} & views
    if aimdo:
        log_once(log, logging.INFO, "Optimized Loader: ComfyUI's dynamic VRAM is on; this "
                 "model loads through ComfyUI's standard partial loading, whose offloaded "
                 "weights the pack streams (its fp8 layers are not comfy-aimdo's)")  # fmt: skip
    model.qwen_turbo = LoaderState(weights=mode, mapped=mapped, blocks=config.blocks)
    return Patcher(model, load_device, offload_device)


def main_blocks(model) -> str:
    """The attribute of `model.diffusion_model` (a BaseModel's) holding its main blocks: the
    loader's record, else Qwen-Image's."""
    return getattr(getattr(model, "qwen_turbo", None), "blocks", "transformer_blocks")


def _host_block(reason: str) -> None:
    log_once(log, logging.INFO, f"Optimized Loader: fused block not used for {reason}")


def add_fused_blocks(patcher) -> None:
    """Object patches: each transformer block's forward runs the fused kernels (NextDiT: its
    main blocks; the refiners run ComfyUI's)."""
    attr = main_blocks(patcher.model)
    for i, block in enumerate(getattr(patcher.model.diffusion_model, attr)):
        if attr == "layers":
            forward = nextdit_block.fused_block_forward(block, _host_block)
        else:
            forward = blocks.fused_block_forward(
                block, qwen_model.optimized_attention_masked, _host_block
            )
        patcher.add_object_patch(f"diffusion_model.{attr}.{i}.{FUSED_KEY}", forward)


BLOCK_ARGS = {"hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "temb",
              "image_rotary_emb", "timestep_zero_index", "transformer_options"}  # fmt: skip


def add_block_graphs(patcher, backend=None) -> block_graphs.BlockGraphs:
    """Object patches: each fused block replays a CUDA graph of itself in model calls that run
    eagerly, while its weights are on the GPU or staged there by the streamer
    (`graphs.blocks`)."""
    base = patcher.model
    layers = base.diffusion_model.transformer_blocks
    state = base.qwen_turbo

    def call_key():
        return streaming.lockstep_call(), fp8.compute_mode()

    def block_key(i: int, kwargs: dict):
        streamer = state.streamer
        extra = {k: v for k, v in kwargs.items() if k not in BLOCK_ARGS}
        options = kwargs.get("transformer_options") or {}
        mask = kwargs.get("encoder_hidden_states_mask")
        if (streamer is not None and streamer.after is not None) or blocks.why_host_block(
            mask, extra, options
        ) is not None:  # the fidelity probe's rerun, or the host's own block
            return None
        return i in state.safe_blocks

    gains = {id(getattr(b.attn, n)) for b in layers for n in blocks.GAIN_NORMS}

    def reads(m, device):  # the fused block reads the norms' gains where they lie
        if id(m) in gains:
            return blocks.gain_tensors(m, device)
        return block_graphs.parameters_read(m, device)

    graphs = state.block_graphs = block_graphs.BlockGraphs(
        base, layers, call_key, block_key, backend, reads
    )
    for i in range(len(layers)):
        key = f"diffusion_model.transformer_blocks.{i}.{FUSED_KEY}"
        patcher.add_object_patch(key, graphs.forward(i, patcher.object_patches[key]))

    def new_run(executor, *args, **kwargs):  # before the load, which leaves the graphs' room
        graphs.retry()
        return executor(*args, **kwargs)

    patcher.add_wrapper_with_key(pe.WrappersMP.OUTER_SAMPLE, GRAPHS_KEY, new_run)
    return graphs


def stream_offloaded_weights(patcher) -> streaming.BlockStreamer:
    """Object patches: each block's forward (fused or not) copies the next block's offloaded
    fp8 weights ahead (`streaming`), where ComfyUI's partial load leaves some on the
    host."""
    attr = main_blocks(patcher.model)
    layers = getattr(patcher.model.diffusion_model, attr)
    streamer = streaming.BlockStreamer(layers, patcher.model)
    for i, block in enumerate(layers):
        key = f"diffusion_model.{attr}.{i}.{FUSED_KEY}"
        inner = patcher.object_patches.get(key, block.forward)
        patcher.add_object_patch(key, streamer.forward(i, inner))
    patcher.model.qwen_turbo.streamer = streamer
    return streamer


def set_attention(patcher, attention: str) -> None:
    if attention != "auto":
        options = patcher.model_options.setdefault("transformer_options", {})
        state = patcher.model.qwen_turbo
        options[OVERRIDE] = attention_override(
            attention, safe_blocks=state.safe_blocks, unindexed_exact=state.blocks == "layers"
        )


def fidelity_cache() -> probe.Cache:
    return probe.Cache(Path(folder_paths.get_user_directory()) / "qwen_turbo" / "fidelity.json")


def guard_fidelity(patcher, path: Path, setting: str, threshold: float) -> None:
    """The fidelity probe for a model with lossy compute: its cached result applied now, or
    the probe run at the first sampling (SAMPLER_SAMPLE: ComfyUI has loaded the weights by then),
    then cached. The result is logged and in `LoaderState.fidelity` for the badges."""
    state = patcher.model.qwen_turbo
    key = probe.cache_key(path, f"{setting}, threshold {threshold}")
    found = fidelity_cache().get(key)
    if found is not None:
        probe.apply(patcher.model, found.kept)
        state.fidelity = found.summary()
        log.info("Optimized Loader: %s: %s (fidelity probe, cached)", path.name, state.fidelity)
        return

    def probe_once(guider) -> None:
        model = guider.model_patcher
        override = guider.model_options.get("transformer_options", {}).get(OVERRIDE)
        try:
            result = probe.measure(model.model, model.load_device, override, threshold)
        except Exception as e:  # the picture goes on without it, lossy as set
            why = "out of memory" if host.is_oom(e) else f"{type(e).__name__}: {e}"
            state.fidelity = "fidelity probe skipped"
            log.warning("Optimized Loader: %s: fidelity probe skipped (%s)", path.name, why)
            mm.soft_empty_cache()
            return
        state.fidelity = result.summary()
        fidelity_cache().put(key, result)
        log.info("Optimized Loader: %s: %s (fidelity probe, %.2f s)", path.name,
                 state.fidelity, result.seconds)  # fmt: skip

    def run_probe(executor, guider, *args, **kwargs):
        if state.fidelity is None:
            probe_once(guider)
        return executor(guider, *args, **kwargs)

    patcher.add_wrapper_with_key(pe.WrappersMP.SAMPLER_SAMPLE, PROBE_KEY, run_probe)


def compile_blocks(patcher) -> None:
    """Regional torch.compile: each block compiled on its own (one graph, reused by all)."""
    from comfy_api.torch_helpers import set_torch_compile_wrapper

    attr = main_blocks(patcher.model)
    n = len(getattr(patcher.model.diffusion_model, attr))
    keys = [f"diffusion_model.{attr}.{i}" for i in range(n)]
    set_torch_compile_wrapper(patcher, backend="inductor", keys=keys)


def _host_allows(feature: str, setting: str, notes: list[str]) -> bool:
    """Whether this host has what `feature` needs; else a logged note that `setting` is off."""
    why = host.missing(feature)
    if why is not None:
        notes.append(f"{setting} off: {why}")
        log_once(log, logging.WARNING, f"Optimized Loader: {notes[-1]}")
    return why is None


def load(name: str, weight_dtype="auto", attention="auto", fused_kernels=True, compile="off",
         quality_guard=True, threshold=DEFAULT_THRESHOLD):  # fmt: skip
    """The Optimized Loader: a MODEL that every stock node accepts. Settings this host cannot
    run are turned off; `patcher.model.qwen_turbo.notes` says which and why. With
    `quality_guard`, lossy compute on a GPU is checked by the fidelity probe (`guard_fidelity`)."""
    path = files.resolve(name)
    sd, config = files.read_checkpoint(path)
    # compiles the kernels it launches while the weights load: the Qwen workflows' recorded
    # launches (NewBie's fp8 GEMMs' share theirs)
    warmup.start(
        mm.get_torch_device(), QWEN_KERNELS if isinstance(config, DiTConfig) else FP8_KERNELS
    )
    notes: list[str] = []
    if weight_dtype.startswith("fp8") and not _host_allows("fp8_weights", weight_dtype, notes):
        weight_dtype = "bf16"
    patcher = build(sd, config, weight_dtype)
    state = patcher.model.qwen_turbo
    qwen = isinstance(config, DiTConfig)
    variant = f", {VARIANTS[config.default_ref_method]}" if qwen and config.variant() else ""
    log.info("Optimized Loader: %s, %s, weights %s%s", name, config.summary(), state.weights,
             variant)  # fmt: skip
    feature = "fused_blocks" if qwen else "fused_nextdit_blocks"
    fused = fused_kernels and _host_allows(feature, "fused_kernels", notes)
    if fused:
        add_fused_blocks(patcher)
        if compile != "regional" and qwen:  # a compiled block is one graph already
            add_block_graphs(patcher)
    if fused and not qwen and compile != "regional":
        notes.append(f"block graphs: Qwen-Image's blocks only ({config.name}: the CUDA Graph "
                     "Sampler's whole-step graphs)")  # fmt: skip
    if state.weights.startswith("fp8"):
        stream_offloaded_weights(patcher)
        if _host_allows("lockstep", "cond and uncond in lockstep", notes):
            lockstep.add(patcher)
    if attention != "auto" and _host_allows("attention_override", f"{attention} attention", notes):
        set_attention(patcher, attention)
        note = kernel_note(attention, patcher.load_device, config.head_dim)
        if note is not None:
            notes.append(note)
            log.info("Optimized Loader: %s", note)
        if fused and attention in QUANTIZED and state.weights.startswith("fp8"):
            patcher.model.memory_usage_factor = ACTIVATIONS_FACTOR  # as measured (Qwen-Image)
    if compile == "regional" and _host_allows("regional_compile", "regional compile", notes):
        compile_blocks(patcher)
    state.notes = notes
    options = patcher.model_options.get("transformer_options", {})
    attention = getattr(options.get(OVERRIDE), "backend", "auto")
    lossy = state.weights == "fp8_e4m3fn_fast" or attention in QUANTIZED
    if quality_guard and lossy and patcher.load_device.type == "cuda":
        setting = f"{state.weights}, {attention} attention, fused {fused}"
        guard_fidelity(patcher, path, setting, threshold)
    return patcher
