"""The NaN guard: each guided step's output is checked with one reduction; a step whose output
is not finite (NaN or Inf: a black picture) runs again on the safe path, the fp8 GEMMs in bf16
compute (`fp8.safe_compute`), ComfyUI's own attention and no graph. Not finite there either,
the run stops with an error that says what to try."""

import logging

import comfy.patcher_extension as pe
import torch

from .. import host
from ..dit import fp8
from ..dit.attention import OVERRIDE
from .runners import eager

log = logging.getLogger(__name__)
KEY = "qwen_turbo_finite_guard"


def finite(t: torch.Tensor) -> bool:
    """Whether `t` (nested or not) holds no NaN or Inf: one reduction, one sync."""
    parts = t.unbind() if getattr(t, "is_nested", False) else [t]
    return all(bool(torch.isfinite(p).all()) for p in parts)


class FiniteGuard:
    """PREDICT_NOISE wrapper, outside the graph runners; counts the steps it ran again."""

    def __init__(self):
        self.steps = self.reruns = 0
        self.override = False  # whether a rerun left an attention override out

    def __call__(self, executor, x, timestep, model_options, seed=None):
        out = executor(x, timestep, model_options, seed)
        self.steps += 1
        if not isinstance(out, torch.Tensor) or finite(out):
            return out
        options = model_options.get("transformer_options", {})
        self.override |= OVERRIDE in options
        safe = {**model_options, "transformer_options": {
            k: v for k, v in options.items() if k != OVERRIDE}}  # fmt: skip
        if not self.reruns:
            log.warning("CUDA Graph Sampler: a step's output is not finite (NaN or Inf); "
                        "running it again with %s", self.safe_path())  # fmt: skip
        with fp8.safe_compute(), eager():
            out = executor(x, timestep, safe, seed)
        self.reruns += 1
        if not finite(out):
            raise ValueError(
                "CUDA Graph Sampler: the model's output is not finite (NaN or Inf), also run "
                f"again with {self.safe_path()}; the picture would be black. Try the Optimized "
                "Loader with weight_dtype bf16, a lower cfg, or no LoRA; check the model file."
            )
        return out

    def safe_path(self) -> str:
        return "bf16 compute" + (" and ComfyUI's attention" if self.override else "")

    def note(self) -> str | None:
        """The badge's note, where a step ran again."""
        if not self.reruns:
            return None
        return (f"not finite: {self.reruns} of {self.steps} steps ran again with "
                f"{self.safe_path()}")  # fmt: skip


def guarded(model) -> tuple:
    """(a clone of `model` with a FiniteGuard on it, outside any graph runner added after it;
    the guard), or on a host without the wrapper level (logged) `model` itself and a guard
    that sees nothing: the sampler's check of the finished latent remains."""
    guard = FiniteGuard()
    if host.missing("finite_guard") is not None:
        return model, guard
    model = model.clone()
    model.add_wrapper_with_key(pe.WrappersMP.PREDICT_NOISE, KEY, guard)
    return model, guard
