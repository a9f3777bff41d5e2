"""Cond and uncond in lockstep. ComfyUI calls a model once per cond where it cannot batch them
(Qwen-Image's prompt and negative prompt of different lengths); where the Optimized Loader's
model is partly offloaded, each call copies the offloaded weights to the GPU again. Here the
calls of a step run on threads of their own, one at a time, block by block
(`streaming.BlockStreamer.in_lockstep`): each block's weights cross once a step. Each call
computes what it computes alone, in the same order on the same stream: the same bits.

The second call's tensors between blocks (its hidden states, inputs and RoPE table) need room
that ComfyUI's load, which leaves free what one call needs, does not leave: it is held while
ComfyUI loads the model for a guided run (the CUDA Graph Sampler asks `lockstep_room`), so a
little more of the model streams; elsewhere a lockstep short of memory runs the calls one by
one.

Only what is known to hold no per-call Python state runs so: steps with another node's
wrapper or model patch inside, per-step conds (hooks, ControlNet, masks), a model function
wrapper or ComfyUI's own multi-GPU go as ComfyUI runs them, with the reason logged once.
"""

import logging

import comfy.model_management as mm
import comfy.patcher_extension as pe
import comfy.sampler_helpers
import comfy.samplers
import torch

from .. import batch_fit, host, log_once
from ..graphs.policy import PER_STEP_CONDS, STEP_CALLBACKS, foreign_code, own

log = logging.getLogger(__name__)
KEY = "qwen_turbo_lockstep"
# The room held while ComfyUI loads, as a share of its estimate for one call.
ROOM_SHARE = 0.5


def add(patcher) -> None:
    """The lockstep wrapper on `patcher`'s model calls (a model with a `BlockStreamer`)."""
    patcher.add_wrapper_with_key(pe.WrappersMP.CALC_COND_BATCH, KEY, CondsInLockstep())


def lockstep_room(model, noise_shape, conds: dict) -> int:
    """The room a guided run's second call needs, for ComfyUI's load of `model` to leave
    (`ROOM_SHARE` of ComfyUI's estimate for one call), and the block graphs of both calls
    (`graphs.blocks`): where the conds' texts differ in length (ComfyUI calls the model once
    per cond) and the load would leave a model that streams its weights partly on the host;
    else 0."""
    if getattr(getattr(model.model, "qwen_turbo", None), "streamer", None) is None:
        return 0
    texts = {tuple(c["cross_attn"].shape) for cs in conds.values() for c in cs
             if isinstance(c.get("cross_attn"), torch.Tensor)}  # fmt: skip
    if len(texts) < 2 or model.load_device.type != "cuda":
        return 0
    one = comfy.sampler_helpers.estimate_memory(model, noise_shape, conds)[1]
    left = max(mm.minimum_inference_memory(), one + mm.extra_reserved_memory())
    if batch_fit.freeable(model.load_device) - left >= model.model_size():
        return 0
    graphs = model.model.qwen_turbo.block_graphs
    if graphs is None:
        return int(ROOM_SHARE * one)
    b, h, w = noise_shape[0], noise_shape[-2], noise_shape[-1]
    tokens = b * -(-h // 2) * -(-w // 2)  # 2x2 patches
    return int(ROOM_SHARE * one) + graphs.room_for(tokens, b * max(t[1] for t in texts), 2)


def why_not(executor, model, conds: list, x_in, timestep, options: dict) -> str | None:
    """Why this step's conds do not run in lockstep: '' where ComfyUI batches them itself (or
    there is one), else the reason; None where they may."""
    if "multigpu_clones" in options:
        return "ComfyUI's multi-GPU runs the conds"
    if "model_function_wrapper" in options:
        return "a model function wrapper runs Python per call"
    if torch.is_autocast_enabled("cuda"):
        return "autocast is on"
    inner = executor.wrappers[executor.idx + 1 :]
    why = foreign_code(options.get("transformer_options", {}), "calc_cond_batch", inner)
    if why is not None:
        return why
    patcher = model.current_patcher
    for kind in STEP_CALLBACKS:
        if any(not own(f) for f in patcher.get_all_callbacks(kind)):
            return f"a {kind} callback runs Python per call"
    given = [c for c in conds if c is not None]
    if any(len(c) != 1 for c in given):
        return "a cond of several parts"
    found = [k for c in given for k in PER_STEP_CONDS if k in c[0]]
    if found:
        return f"cond {found[0]!r} runs Python per call"
    parts = [comfy.samplers.get_area_and_mult(c[0], x_in, timestep) for c in given]
    if None in parts:
        return "a cond outside its timestep range"
    if any(comfy.samplers.can_concat_cond(a, b) for a in parts for b in parts if a is not b):
        return ""  # ComfyUI runs them as one batch, memory permitting
    return None


class CondsInLockstep:
    """CALC_COND_BATCH wrapper: a step's conds in lockstep where the model's weights stream and
    ComfyUI would call the model once per cond. After an out-of-memory error the step runs as
    ComfyUI runs it, and so does every later step of that latent size."""

    def __init__(self):
        self.out_of_memory: set[tuple] = set()

    def __call__(self, executor, model, conds, x_in, timestep, model_options):
        def as_comfyui():
            return executor(model, conds, x_in, timestep, model_options)

        streamer = getattr(getattr(model, "qwen_turbo", None), "streamer", None)
        given = [k for k, c in enumerate(conds) if c is not None]
        if (
            streamer is None or len(given) < 2 or tuple(x_in.shape) in self.out_of_memory
            or (x_in.is_cuda and torch.cuda.is_current_stream_capturing())
            or not streamer.streams_now()
        ):  # fmt: skip
            return as_comfyui()
        why = why_not(executor, model, conds, x_in, timestep, model_options)
        if why is not None:
            if why:
                log_once(log, logging.INFO, f"Optimized Loader: conds not in lockstep: {why}")
            return as_comfyui()

        def call(k):
            alone = [c if j == k else None for j, c in enumerate(conds)]
            return lambda: executor(model, alone, x_in, timestep, model_options)

        try:
            results = streamer.in_lockstep([call(k) for k in given])
        except Exception as e:
            if not host.is_oom(e):
                raise
            results, why = None, str(e).splitlines()[0] if str(e) else type(e).__name__
        if results is None:  # outside the handler: the failed calls' frames are gone
            self.out_of_memory.add(tuple(x_in.shape))
            log.warning("Optimized Loader: cond and uncond in lockstep ran out of memory (%s); "
                        "they run one after the other at this size", why)  # fmt: skip
            mm.soft_empty_cache()
            return as_comfyui()
        log_once(log, logging.INFO, "Optimized Loader: cond and uncond run in lockstep, block by "
                 "block: the offloaded weights cross once a step")  # fmt: skip
        out = list(results[0])  # a cond no call ran is zeros in each
        for result, k in zip(results, given, strict=True):
            out[k] = result[k]
        return out
