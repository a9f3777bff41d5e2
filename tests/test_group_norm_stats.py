"""Tile-wise GroupNorm statistics against F.group_norm in float64."""

import pytest
import torch
import torch.nn.functional as F

from qwen_turbo.kernels.group_norm_stats import (
    finalize_moments,
    group_moments,
    group_norm_apply,
    merge_moments,
)

pytestmark = pytest.mark.host_independent

# rel error bound: a few ulps of the dtype on unit-scale outputs
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize(
    "shape,groups,rows",
    [((2, 96, 17, 29), 32, 5), ((1, 128, 157, 31), 32, 40), ((1, 64, 5, 3), 1, 1)],
)
def test_tiled_group_norm_matches_reference(dtype, shape, groups, rows):
    g = torch.Generator().manual_seed(hash((shape, groups)) % 2**31)
    # an offset mean makes E[x^2] - E[x]^2 cancel badly; merged moments must not
    x = (torch.randn(shape, generator=g) * 3 + 20).to(dtype)
    w = torch.randn(shape[1], generator=g)
    b = torch.randn(shape[1], generator=g)
    acc = None
    for r in range(0, shape[2], rows):
        m = group_moments(x[:, :, r : r + rows], groups)
        acc = m if acc is None else merge_moments(acc, m)
    mean, rstd = finalize_moments(acc, 1e-6)
    out = torch.full_like(x, float("nan"))
    out.copy_(group_norm_apply(x, mean, rstd, w.to(dtype), b.to(dtype)))
    ref = F.group_norm(x.double(), groups, w.to(dtype).double(), b.to(dtype).double(), 1e-6)
    err = (out.double() - ref).abs().max() / ref.abs().max()
    assert err < TOL[dtype], err


def test_non_contiguous_tile_and_no_affine():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 29, 64, 32, generator=g).transpose(1, 2)[:, :, 3:20]  # (1, 64, 17, 32)
    mean, rstd = finalize_moments(group_moments(x, 8), 1e-5)
    out = group_norm_apply(x, mean, rstd, None, None)
    ref = F.group_norm(x.double(), 8, eps=1e-5)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
