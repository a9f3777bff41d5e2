"""linear_gelu: the MLP's first linear with GELU-tanh in cuBLASLt's GELU_BIAS epilogue.

No Triton: the CUDA path is `torch._addmm_activation(bias, x, w.t(), use_gelu=True)`, and
every other call (CPU tensors included, interpreter or not) takes the logged eager reference,
ComfyUI's `F.gelu(F.linear(x, w, b), approximate="tanh")`. So on CPU only the fallbacks are
tested; the `gpu` cases hold the epilogue to float64 by the error rule of the other kernels,
and check that its GELU is the tanh form (ComfyUI's) and not erf.
"""

import pytest
import torch
import torch.nn.functional as F

from qwen_turbo.kernels import linear_gelu as mod
from qwen_turbo.kernels.linear_gelu import linear_gelu, linear_gelu_reference
from tests.kernels.common import (
    assert_cuda_graph_replays,
    assert_error_rule,
    assert_logged_once,
    needs_cuda,
    ulps,
)

OP = "linear_gelu"  # as the fallback log names it
REFERENCES = (mod, "linear_gelu_reference")  # what `kernel_only` makes fail


def _gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


def _inputs(lead, n, k, dtype, seed, device="cpu", bias=True):
    """x (*lead, K) ~ N(0, 1), weight (N, K) ~ N(0, 4/K), bias (N,) ~ N(0, 0.5): the
    pre-activation ~ N(0, 2^2), so the GELU's curved part around 0 and both tails are hit."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, k, generator=g)
    w = torch.randn(n, k, generator=g) * 2 * k**-0.5
    b = torch.randn(n, generator=g) * 0.5
    ts = (x, w, b if bias else None)
    return [None if t is None else t.to(dtype=dtype, device=device) for t in ts]


def _exact(x, weight, bias):
    """gelu_tanh(x @ weight.T + bias) in float64."""
    lin = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    return _gelu_tanh(lin)


# Fallbacks: each branch of the dispatcher sends the call to the reference, logged once.


def _assert_falls_back(x, weight, bias, caplog, reason):
    for _ in range(3):
        out = linear_gelu(x, weight, bias)
    torch.testing.assert_close(out, linear_gelu_reference(x, weight, bias), rtol=0, atol=0)
    assert out.shape == (*x.shape[:-1], weight.shape[0])
    assert_logged_once(caplog, OP, reason)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fallback_cpu(fresh_log, dtype):
    """CPU tensors always use the reference, also under Triton's interpreter (no Triton here)."""
    x, weight, bias = _inputs((2, 5), 48, 64, dtype, seed=0)
    _assert_falls_back(x, weight, bias, fresh_log, "tensors on cpu are not supported")


def test_fallback_cpu_without_bias(fresh_log):
    """No bias on CPU: the device is checked first."""
    x, weight, _ = _inputs((5,), 48, 64, torch.bfloat16, seed=2, bias=False)
    _assert_falls_back(x, weight, None, fresh_log, "tensors on cpu are not supported")


@pytest.mark.host
def test_reference_is_comfyui_feedforward_first_half():
    """The reference is ComfyUI's FeedForward up to the second linear: net[0] (GELU module,
    approximate="tanh"), bit for bit."""
    import comfy.ldm.qwen_image.model as qwen
    import comfy.ops

    ff = qwen.FeedForward(
        dim=64, dim_out=64, dtype=torch.bfloat16, operations=comfy.ops.disable_weight_init
    )
    x, weight, bias = _inputs((2, 5), ff.net[0].proj.weight.shape[0], 64, torch.bfloat16, 3)
    with torch.no_grad():
        ff.net[0].proj.weight.copy_(weight)
        ff.net[0].proj.bias.copy_(bias)
    with torch.inference_mode():
        comfy_out = ff.net[0](x)
    torch.testing.assert_close(linear_gelu_reference(x, weight, bias), comfy_out, rtol=0, atol=0)


def test_cpu_addmm_activation_is_erf_gelu():
    """On CPU, torch._addmm_activation(..., use_gelu=True) is addmm then the *erf* GELU (ATen's
    addmm_activation_out_cpu calls gelu_ with approximate="none"), not GELU-tanh. So the CPU
    op is no stand-in for the CUDA epilogue, and linear_gelu must keep CPU tensors on the
    reference (it does: the device check comes first). The GELU-tanh of the CUDA path is
    checked in test_gpu_epilogue_is_gelu_tanh. If this fails, PyTorch changed the CPU op."""
    x, weight, bias = _inputs((7,), 48, 64, torch.float64, seed=4)
    out = torch._addmm_activation(bias, x, weight.t(), use_gelu=True)
    lin = F.linear(x, weight, bias)
    torch.testing.assert_close(out, F.gelu(lin), rtol=1e-12, atol=1e-12)
    assert (out - _gelu_tanh(lin)).abs().max().item() > 1e-4  # tanh and erf differ by ~5e-4


# GPU: the epilogue against float64.


def _erf_coefficient(out, x, weight, bias):
    """Least-squares c in out ~ gelu_tanh(z) + c (gelu_erf(z) - gelu_tanh(z)), z the float64
    pre-activation: about 0 for a GELU-tanh epilogue, 1 for GELU-erf. The rounding to bf16
    or fp16 is noise that averages out over the ~1e6 elements."""
    z = F.linear(x.double(), weight.double(), bias.double())
    d = out.double() - _gelu_tanh(z)
    e = F.gelu(z) - _gelu_tanh(z)
    return ((d * e).sum() / (e * e).sum()).item()


# (lead, N, K): the MLP's first linear (3072 -> 12288) over odd row counts, one row (cuBLAS
# may take another path for M = 1), and a batch of two samples.
GPU_CASES = [((113,), 12288, 3072), ((1,), 12288, 3072), ((2, 57), 12288, 3072)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lead,n,k", GPU_CASES)
def test_gpu_matches_fp64(kernel_only, dtype, lead, n, k):
    """One rounding of the float32 accumulator after the GELU (ComfyUI rounds the linear,
    then the GELU): error against float64 at most twice ComfyUI's, plus two ulps."""
    x, weight, bias = _inputs(lead, n, k, dtype, seed=n + k + len(lead), device="cuda")
    out = linear_gelu(x, weight, bias)
    assert out.dtype == dtype and out.shape == (*lead, n)
    exact = _exact(x, weight, bias)
    eager = linear_gelu_reference(x, weight, bias)
    assert_error_rule(out, exact, eager, ulps(2, dtype, exact))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,calls", [(113, 1), (1, 16)])
def test_gpu_epilogue_is_gelu_tanh(kernel_only, dtype, m, calls):
    """tanh and erf GELU differ by at most ~5e-4, well inside a bf16 rounding, so the error
    rule cannot tell them apart; the projection onto their difference can (on an H200: c
    below 0.06 here, about 1 for PyTorch's erf GELU rounded from float32, so it would see an
    erf epilogue). One-row calls (cuBLAS may take another path for M = 1) are made for 16
    rows, to average enough elements."""
    x, weight, bias = _inputs((calls, m), 12288, 3072, dtype, seed=5 + m, device="cuda")
    out = torch.stack([linear_gelu(rows, weight, bias) for rows in x])
    c = _erf_coefficient(out, x, weight, bias)
    assert abs(c) < 0.25, c
    erf = F.gelu(F.linear(x.float(), weight.float(), bias.float())).to(dtype)
    assert _erf_coefficient(erf, x, weight, bias) > 0.75


@pytest.mark.gpu
@needs_cuda
def test_gpu_strided_input(kernel_only):
    """x a slice of a wider buffer (rows not contiguous): reshaped to rows, then the GEMM."""
    x, weight, bias = _inputs((2, 57), 3072, 3072, torch.bfloat16, seed=6, device="cuda")
    wide = torch.cat([x, x[..., :64]], dim=-1)[..., :3072]
    assert not wide.is_contiguous()
    out = linear_gelu(wide, weight, bias)
    exact = _exact(x, weight, bias)
    assert_error_rule(out, exact, linear_gelu_reference(x, weight, bias), ulps(2, x.dtype, exact))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "change,reason",
    [
        ("no_bias", "no bias (the epilogue is GELU_BIAS)"),
        ("float32", "dtypes x torch.float32, weight torch.float32 are not one of"),
        ("float32_weight", "dtypes x torch.bfloat16, weight torch.float32 are not one of"),
        ("float32_bias", "bias or weight differ from x in dtype or device"),
        ("grad", "require grad"),
    ],
)
def test_gpu_fallback_branches(fresh_log, change, reason):
    x, weight, bias = _inputs((5,), 64, 32, torch.bfloat16, seed=7, device="cuda")
    if change == "no_bias":
        bias = None
    elif change == "float32":
        x, weight, bias = x.float(), weight.float(), bias.float()
    elif change == "float32_weight":
        weight = weight.float()
    elif change == "float32_bias":
        bias = bias.float()
    else:
        weight = weight.clone().requires_grad_()
    if change in ("float32_weight", "float32_bias"):  # the reference raises on mixed dtypes
        with pytest.raises(RuntimeError):
            linear_gelu(x, weight, bias)
        assert_logged_once(fresh_log, OP, reason)
        return
    _assert_falls_back(x, weight, bias, fresh_log, reason)


@pytest.mark.gpu
@needs_cuda
def test_gpu_cuda_graph_capture(kernel_only):
    x, weight, bias = _inputs((33,), 12288, 3072, torch.bfloat16, seed=8, device="cuda")
    assert_cuda_graph_replays(lambda: linear_gelu(x, weight, bias), x, 0)
