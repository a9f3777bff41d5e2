"""A guided step's model calls in lockstep, where the model streams its weights from the host.

ComfyUI runs the conds of a step as separate model calls where they do not batch (Qwen-Image
never batches texts of different lengths, as a prompt and its negative are) or where memory is
short, and a model left partly on the host copies its offloaded weights to the GPU at every
call. Run in lockstep (`dit.lockstep`: block i of each call in turn) they cross once a step.

ComfyUI makes a call only once the one before has returned, so the step runs ComfyUI's own
`calc_cond_batch` twice: first recording each diffusion-model call (given zeros, so nothing of
the model runs), then, once the recorded calls have run in lockstep, giving each call its
output. Only code that runs the same both times may sit around the calls: where another node's
may, the step runs as ComfyUI runs it (`why_alone`).
"""

import contextvars
import logging

import comfy.patcher_extension as pe
import torch

from .. import log_once
from ..dit import lockstep
from .policy import foreign_code

log = logging.getLogger(__name__)
KEY = "qwen_turbo_cond_lockstep"
# set while a step records its calls (a list of them) or replays them (an iterator of outputs)
_pass = contextvars.ContextVar("qwen_turbo_cond_calls", default=None)

# Cond keys whose Python runs outside the diffusion model (a ControlNet's model, hook patching)
# and would run twice; model_options entries that run Python around a step's calls.
OWN_PYTHON_CONDS = ("control", "hooks", "gligen")
OWN_PYTHON_OPTIONS = (
    "model_function_wrapper", "sampler_calc_cond_batch_function", "context_handler",
    "multigpu_clones",
)  # fmt: skip


def replaying() -> bool:
    """Whether a step is giving its calls the outputs they had in lockstep."""
    return isinstance(_pass.get(), Replay)


class Replay:
    def __init__(self, calls: list, outputs: list):
        self.pending = list(zip(calls, outputs, strict=True))

    def output(self, executor, args, kwargs) -> torch.Tensor:
        """The output of this call as it ran in lockstep; where the call is not the one
        recorded (never seen), it runs now."""
        if self.pending:
            (_, recorded, _), out = self.pending.pop(0)
            if recorded[0].shape == args[0].shape and len(recorded) == len(args):
                return out
        log_once(log, logging.WARNING, "cond lockstep: a step made other model calls than "
                 "it recorded; they ran one after another")  # fmt: skip
        self.pending.clear()
        return executor(*args, **kwargs)


def why_alone(model, conds, model_options: dict, inner: list) -> str | None:
    """Why this step's calls run one after another, as ComfyUI makes them: the model's weights
    are all on the GPU, or code other than the pack's and ComfyUI's runs around the calls
    (`inner`: the CALC_COND_BATCH wrappers inside this one)."""
    if not getattr(model, "model_lowvram", False):
        return "weights all on the GPU"
    if torch.is_autocast_enabled():
        return "autocast"
    options = [k for k in OWN_PYTHON_OPTIONS if k in model_options]
    keys = {k for cs in conds if cs for c in cs for k in OWN_PYTHON_CONDS if c.get(k) is not None}
    if options or keys:
        return f"{', '.join([*options, *sorted(keys)])} per call"
    # torch.compile's wrapper swaps the compiled model in only around the recorded calls
    return foreign_code(model_options.get("transformer_options", {}), "calc_cond_batch",
                        inner, safe=())  # fmt: skip


def install(patcher) -> None:
    """Put the wrappers on `patcher` (a clone its caller owns)."""
    patcher.add_wrapper_with_key(pe.WrappersMP.CALC_COND_BATCH, KEY, calc_cond_batch)
    patcher.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, KEY, diffusion_model)


def calc_cond_batch(executor, model, conds, x_in, timestep, model_options):
    """CALC_COND_BATCH wrapper: the step's calls in lockstep where it streams weights."""
    why = why_alone(model, conds, model_options, executor.wrappers[executor.idx + 1 :])
    if why is not None:
        return executor(model, conds, x_in, timestep, model_options)
    calls = []
    token = _pass.set(calls)
    try:
        executor(model, conds, x_in, timestep, model_options)
    finally:
        _pass.reset(token)
    if len(calls) > 1:
        log_once(log, logging.INFO, "cond lockstep: the weights stream from the host; the "
                 "step's model calls run block by block together, so they cross once")  # fmt: skip
    outputs = lockstep.run([(_unrecorded(*call), context) for call, context in calls])
    token = _pass.set(Replay([c for c, _ in calls], outputs))
    try:
        return executor(model, conds, x_in, timestep, model_options)
    finally:
        _pass.reset(token)


def _unrecorded(executor, args, kwargs):
    def call():
        _pass.set(None)  # the context was copied while recording
        return executor(*args, **kwargs)

    return call


def diffusion_model(executor, *args, **kwargs):
    """DIFFUSION_MODEL wrapper, outside the graph runners': records a step's calls (their
    output here: zeros of the latent's shape, which Qwen-Image's output has) or replays them."""
    state = _pass.get()
    if isinstance(state, list):
        state.append(((executor, args, kwargs), contextvars.copy_context()))
        return torch.zeros_like(args[0])
    if isinstance(state, Replay):
        return state.output(executor, args, kwargs)
    return executor(*args, **kwargs)
