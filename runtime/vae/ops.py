"""The ops a VAE's decoder or encoder is described as, and the checks the descriptions make.

- `Local`: maps a spatial crop to a crop `scale` times as large (1/2 for a downsampling op);
  an output pixel depends only on input pixels within `radius` (in input pixels).
- `Global`: needs the whole tensor (the mid-block attention). It runs untiled, at latent size.
- `Stats`: a GroupNorm's statistics over the whole tensor, accumulated tile by tile and read by
  the Local op that follows.

A check that fails raises NotImplementedError naming what is not recognised.
"""

from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

import torch

from ...kernels.group_norm_stats import group_norm_apply
from .patches import input_only_reason

State = tuple[torch.Tensor, ...]


@dataclass
class Local:
    fn: Callable[..., State]
    out_channels: int  # summed over the output state
    peak_channels: float  # working set, in channels at output resolution
    scale: int = 1
    radius: float = 0.0


@dataclass
class Global:
    fn: Callable[..., State]
    out_channels: int


@dataclass
class Stats:
    """GroupNorm statistics of state[index]; Local ops read them through `apply`."""

    norm: torch.nn.Module
    index: int = 0
    mean: torch.Tensor | None = None
    rstd: torch.Tensor | None = None

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        w = None if self.norm.weight is None else self.norm.weight.to(x.device)
        b = None if self.norm.bias is None else self.norm.bias.to(x.device)
        return group_norm_apply(x, self.mean, self.rstd, w, b)


def call(module) -> Callable[..., State]:
    return lambda x: (module(x),)


def require(condition: bool, what: str) -> None:
    if not condition:
        raise NotImplementedError(what)


def require_callable(module, where: str) -> None:
    """The ops call `module(x)` where the host passes only arguments that are None or the
    defaults for one frame / a 2-D run; a forward that needs more is not recognised."""
    why = input_only_reason(module)
    require(why is None, f"{where}: {why}")


def require_conv(module, where: str, kind: type = torch.nn.Conv2d):
    require(
        isinstance(module, kind),
        f"{where} is a {type(module).__name__}, not a {kind.__name__}",
    )
    return module


HALF = Fraction(1, 2)
