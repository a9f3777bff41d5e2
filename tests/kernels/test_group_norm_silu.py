"""group_norm_silu: the Triton path against float64, every fallback branch, the module wrapper.

Without a GPU the kernels run on CPU tensors through Triton's interpreter (see conftest).
Tolerance rule (flash-attention's): the kernel's max error against float64 may be at most
twice the error of PyTorch's own same-dtype GroupNorm + SiLU, plus a few ulps of the dtype.
"""

import zlib

import pytest
import torch
import torch.nn.functional as F

from qwen_turbo.kernels import group_norm_silu as gns
from qwen_turbo.kernels.group_norm_silu import (
    GroupNormSiLU,
    group_norm_silu,
    group_norm_silu_reference,
)
from tests.kernels.common import DTYPES, LOGGER, assert_error_rule, needs_cuda, needs_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
REFERENCES = (gns, "group_norm_silu_reference")  # what `kernel_only` makes fail
# Absolute slack: a few ulps at 1.0. Triton's interpreter truncates float32 -> bfloat16
# stores instead of rounding to nearest, so on CPU bf16 outputs are off by up to one ulp
# where PyTorch is off by half; 2x + 4 eps covers that with room to spare.
ATOL = {dt: 4 * torch.finfo(dt).eps for dt in (torch.float32, torch.bfloat16, torch.float16)}
# The interpreter evaluates SiLU on masked-off lanes too (x = 0 there), where NumPy's exp may
# overflow to inf; those lanes are never stored, and inf gives y * 0 = -0 anyway.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def _seed(*key) -> int:
    return zlib.crc32(repr(key).encode())


def _inputs(shape, dtype, seed, affine=True, mean=20.0, std=3.0):
    """x with a large mean (E[x^2] - E[x]^2 would cancel), weight and bias in x's dtype."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * std + mean
    w = torch.randn(shape[1], generator=g) if affine else None
    b = torch.randn(shape[1], generator=g) if affine else None
    to = dict(device=DEVICE, dtype=dtype)
    return x.to(**to), None if w is None else w.to(**to), None if b is None else b.to(**to)


def _ref64(x, groups, w, b, eps, silu):
    dbl = [None if t is None else t.double() for t in (x, w, b)]
    return group_norm_silu_reference(dbl[0], groups, dbl[1], dbl[2], eps, silu)


def _check(x, groups, w, b, eps=1e-6, silu=True):
    """Run the Triton path and hold it to the tolerance rule; returns the output."""
    assert gns._why_not(x, groups, w, b) is None, "the Triton path was not taken"
    out = group_norm_silu(x, groups, w, b, eps, silu)
    assert out.shape == x.shape and out.dtype == x.dtype and out.is_contiguous()
    assert not out.isnan().any()
    ref = _ref64(x, groups, w, b, eps, silu)
    base = group_norm_silu_reference(x, groups, w, b, eps, silu)
    assert_error_rule(out, ref, base, ATOL[x.dtype])
    return out


CASES = [
    ((2, 96, 17, 29), 32),  # 3 channels a group; 8-row apply tiles cross groups and samples
    ((1, 128, 157, 31), 32),  # 3 stats chunks a group, the last short; 2 blocks a row
    ((2, 512, 1, 1), 32),  # 1x1 maps: 16 elements a group, 256-row apply tiles
    ((2, 256, 17, 29), 1),  # one group a sample: 16 stats chunks merged
    ((1, 128, 3, 17, 29), 8),  # 5-D video (B, C, T, H, W)
]


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,groups", CASES)
def test_matches_float64(shape, groups, dtype):
    x, w, b = _inputs(shape, dtype, _seed(shape, groups, str(dtype)))
    _check(x, groups, w, b)


@needs_triton
@pytest.mark.parametrize(
    "shape,groups,dtype",
    [
        ((2, 128, 157), 32, torch.bfloat16),  # 1-D (B, C, L)
        ((2, 32, 1, 1), 32, torch.float32),  # one element a group: N = 1 (constexpr on GPU)
    ],
)
def test_edge_shapes(shape, groups, dtype):
    x, w, b = _inputs(shape, dtype, _seed(shape, groups, str(dtype)))
    _check(x, groups, w, b)


@needs_triton
@pytest.mark.parametrize("silu,affine", [(False, True), (True, False), (False, False)])
def test_silu_and_affine_switches(silu, affine):  # (True, True) is test_matches_float64
    x, w, b = _inputs((2, 96, 17, 29), torch.bfloat16, _seed(silu, affine), affine)
    _check(x, 32, w, b, eps=1e-5, silu=silu)


@needs_triton
@pytest.mark.parametrize(
    "base_shape,view",
    [
        ((2, 96, 29, 17), lambda t: t.transpose(2, 3)),
        ((2, 192, 18, 29), lambda t: t[:, ::2, 1:]),  # every other channel, cropped rows
    ],
    ids=["transposed", "strided"],
)
def test_non_contiguous(base_shape, view):
    base, w, b = _inputs(base_shape, torch.bfloat16, _seed(base_shape))
    x = view(base)
    assert not x.is_contiguous() and x.shape == (2, 96, 17, 29)
    _check(x, 32, w[:96], b[:96])


@needs_triton
def test_large_offset_float32():
    # mean 1000, std 1: E[x^2] - E[x]^2 in float32 would lose all but ~3 bits of variance.
    x, w, b = _inputs((2, 256, 17, 29), torch.float32, 11, mean=1000.0, std=1.0)
    out = _check(x, 1, w, b)
    ref = _ref64(x, 1, w, b, 1e-6, True)
    assert (out.double() - ref).abs().max() < 2e-4  # PyTorch's CPU kernel: ~3e-4


@needs_triton
def test_constant_groups_give_bias():
    # Zero variance: rounding must not make it negative (NaN rstd); y = silu(bias).
    x = torch.full((1, 96, 5, 7), 3.0, device=DEVICE)
    w = torch.randn(96, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    b = torch.randn(96, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    out = group_norm_silu(x, 32, w, b, 1e-6)
    torch.testing.assert_close(out, F.silu(b).reshape(1, 96, 1, 1).expand_as(x))


@needs_triton
@pytest.mark.parametrize(
    "shape,groups", [((1, 96, 5, 7), 32), ((2, 256, 17, 29), 1)], ids=["row-tail", "chunks"]
)
def test_poisoned_buffers_are_fully_written(shape, groups, monkeypatch):
    # The output and the float32 workspace (partials, mean, rstd) start as NaN: any
    # element or statistic the kernels fail to write shows up as NaN.
    monkeypatch.setattr(
        gns, "_scratch", lambda n, device: torch.full((n,), float("nan"), device=device)
    )
    x, w, b = _inputs(shape, torch.float32, _seed(shape, "poison"))
    out = torch.full_like(x, float("nan"))
    gns._launch(x, groups, w, b, 1e-6, True, out)
    assert not out.isnan().any()
    ref = _ref64(x, groups, w, b, 1e-6, True).float()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


# --- fallbacks: each branch logs its reason once and returns the eager reference ---------


@pytest.fixture
def fallback_log(monkeypatch, fresh_log):
    """Fresh once-only log state; the op itself must not run."""

    def _no_kernel(*args, **kwargs):
        raise AssertionError("the Triton op ran on a fallback branch")

    monkeypatch.setattr(gns, "_group_norm_silu_op", _no_kernel, raising=False)

    def count(reason: str) -> int:
        return sum(reason in r.getMessage() for r in fresh_log.records if r.name == LOGGER)

    return count


def _call_twice(x, groups, w=None, b=None):
    outs = [group_norm_silu(x, groups, w, b, 1e-6) for _ in range(2)]
    ref = group_norm_silu_reference(x, groups, w, b, 1e-6)
    for out in outs:
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
    return outs[0]


def test_fallback_channels_not_divisible(fallback_log):
    x, w, b = _inputs((1, 100, 5, 7), torch.float32, 4)
    for _ in range(2):  # the reference raises PyTorch's own error
        with pytest.raises(RuntimeError, match="divisible"):
            group_norm_silu(x, 32, w, b)
    assert fallback_log("100 channels do not split into 32 groups") == 1


def test_fallback_weight_size(fallback_log):
    x, w, b = _inputs((1, 96, 5, 7), torch.float32, 5)
    for _ in range(2):
        with pytest.raises(RuntimeError):
            group_norm_silu(x, 32, w[:64], b)
    assert fallback_log("weight is not 96 values") == 1


def test_fallback_two_dims(fallback_log):
    x, w, b = _inputs((4, 96), torch.float32, 6)
    _call_twice(x, 32, w, b)
    assert fallback_log("x has 2 dims") == 1


def test_fallback_empty(fallback_log):
    x, w, b = _inputs((0, 96, 5, 7), torch.float32, 7)
    assert _call_twice(x, 32, w, b).shape == x.shape
    assert fallback_log("x is empty") == 1


# --- module wrapper ----------------------------------------------------------------------


def _random_norm(norm, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(norm.num_channels, generator=g))
        norm.bias.copy_(torch.randn(norm.num_channels, generator=g))
    return norm


@pytest.fixture
def kernel_only(kernel_only):
    """Fail if the wrapper falls back (conftest's kernel_only); inference runs without grad,
    as in ComfyUI."""
    with torch.no_grad():
        yield


@needs_triton
@pytest.mark.parametrize("silu", [True, False])
def test_module_matches_group_norm_and_silu(silu, kernel_only):
    norm = _random_norm(torch.nn.GroupNorm(32, 128, eps=1e-6), 1).to(DEVICE)
    mod = GroupNormSiLU(norm, silu)
    assert mod.weight is norm.weight and list(mod.state_dict()) == ["weight", "bias"]
    x, _, _ = _inputs((1, 128, 17, 29), torch.float32, 12)
    ref = F.silu(norm(x)) if silu else norm(x)
    torch.testing.assert_close(mod(x), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.host
@needs_triton
def test_module_casts_comfy_parameters_to_x(kernel_only):
    # ComfyUI keeps parameters in their own dtype (and maybe device) and casts per call.
    import comfy.ops

    norm = comfy.ops.manual_cast.GroupNorm(32, 96, eps=1e-6, dtype=torch.float32)
    mod = GroupNormSiLU(_random_norm(norm, 2).to(DEVICE), silu=True)
    x, _, _ = _inputs((2, 96, 17, 29), torch.bfloat16, 13)
    out = mod(x)
    expected = _check(x, 32, norm.weight.to(x), norm.bias.to(x))
    assert out.dtype == torch.bfloat16 and norm.weight.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_module_without_affine_and_bad_norm():
    mod = GroupNormSiLU(torch.nn.GroupNorm(8, 64, affine=False), silu=False)
    x, _, _ = _inputs((1, 64, 5, 7), torch.float32, 14)
    torch.testing.assert_close(mod(x), F.group_norm(x, 8), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="GroupNorm"):
        GroupNormSiLU(torch.nn.LayerNorm(64), silu=True)


# --- GPU: the VAE's largest shapes -------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", [(1, 128, 2048, 2048), (1, 512, 256, 256)])
def test_vae_shapes_bf16_gpu(shape):
    g = torch.Generator(device="cuda").manual_seed(_seed(shape, "gpu"))
    x = torch.empty(shape, device="cuda", dtype=torch.bfloat16).normal_(20.0, 3.0, generator=g)
    w = torch.randn(shape[1], device="cuda", generator=g).bfloat16()
    b = torch.randn(shape[1], device="cuda", generator=g).bfloat16()
    assert gns._why_not(x, 32, w, b) is None
    out = group_norm_silu(x, 32, w, b, 1e-6)
    base = group_norm_silu_reference(x, 32, w, b, 1e-6)
    truth = group_norm_silu_reference(x.float(), 32, w.float(), b.float(), 1e-6)
    assert_error_rule(out, truth, base, ATOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.slow
@needs_cuda
def test_past_int32_offsets_gpu():
    # 128 x 4104 x 4104 = 2.156e9 elements > 2^31: the last groups sit past int32 offsets.
    shape = (1, 128, 4104, 4104)
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.empty(shape, device="cuda", dtype=torch.bfloat16).normal_(20.0, 3.0, generator=g)
    w = torch.randn(128, device="cuda", generator=g).bfloat16()
    b = torch.randn(128, device="cuda", generator=g).bfloat16()
    out = group_norm_silu(x, 32, w, b, 1e-6)
    for grp in (0, 31):  # first group and last group, checked in float32 one at a time
        cs = slice(4 * grp, 4 * grp + 4)
        xs = x[:, cs].float()
        var, mean = torch.var_mean(xs, correction=0)
        y = (xs - mean) * torch.rsqrt(var + 1e-6)
        truth = F.silu(y * w[cs].float().reshape(1, 4, 1, 1) + b[cs].float().reshape(1, 4, 1, 1))
        err = (out[:, cs].float() - truth).abs().max().item()
        assert err <= 2 * 2**-8 * truth.abs().max().item() + ATOL[torch.bfloat16], (grp, err)
