"""GroupNorm split into a statistics pass and an apply pass, for tensors seen tile by tile.

Statistics are accumulated per (batch, group) as (count, mean, M2) and merged with Chan's
parallel formula in float64, so tiles of any size give the same result as one pass.
"""

import torch


def group_moments(x: torch.Tensor, groups: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Moments of one tile.

    x: (B, C, *spatial), any float dtype, C divisible by `groups`.
    Returns (count, mean, m2): count per group (int), mean and sum of squared deviations,
    each (B, groups) float64.
    """
    b = x.shape[0]
    xg = x.reshape(b, groups, -1).float()
    var, mean = torch.var_mean(xg, dim=-1, correction=0)
    n = xg.shape[-1]
    return n, mean.double(), var.double() * n


def merge_moments(a, b):
    """Chan et al.: combine two (count, mean, m2) triples."""
    na, ma, m2a = a
    nb, mb, m2b = b
    n = na + nb
    delta = mb - ma
    return n, ma + delta * (nb / n), m2a + m2b + delta * delta * (na * nb / n)


def finalize_moments(moments, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, rstd), each (B, G) float32; the variance is clamped at zero against rounding."""
    n, mean, m2 = moments
    var = (m2 / n).clamp_min(0.0)
    return mean.float(), torch.rsqrt(var + eps).float()


def group_norm_apply(
    x: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """Normalise x (B, C, *spatial) with per-(B, G) mean and rstd, then the affine (C,).

    Computes in float32 and returns x's dtype.
    """
    b, c = x.shape[:2]
    g = mean.shape[1]
    spatial = x.shape[2:]
    xg = x.float().reshape(b, g, c // g, -1)
    y = (xg - mean[:, :, None, None]) * rstd[:, :, None, None]
    y = y.reshape(b, c, *spatial)
    shape = (1, c) + (1,) * len(spatial)
    if weight is not None:
        y = y * weight.float().reshape(shape)
    if bias is not None:
        y = y + bias.float().reshape(shape)
    return y.to(x.dtype)
