"""quantize_rows and fp8_linear: the Optimized Loader's fp8 GEMMs with per-row activation scales.

On CPU quantize_rows runs through Triton's interpreter (TRITON_INTERPRET=1, set by conftest).
The interpreter does store float8, but its float32 -> float8 conversion (Triton 3.6,
`triton/runtime/interpreter.py: _convert_float`) is not PyTorch's round-to-nearest-even:
ties round away from zero, subnormals truncate, and a mantissa that rounds up past 0b111 ORs
its carry into the exponent, so where the exponent's low bit is already set the value halves
(127.1 stores as 64, not 128). So the CPU cases feed values that need no rounding (fp8 values
times powers of two, which must come back bit for bit), check the float32 scales, and compare
the GELU through the scales; the kernel's rounding is held to fp8 precision against float64
in the `gpu` cases only. fp8 GEMMs (torch._scaled_mm with row-wise scales) need a CUDA GPU of
compute capability 8.9+: on CPU fp8_linear always takes its logged fallback.
"""

import pytest
import torch
import torch.nn.functional as F

from qwen_turbo.kernels import fp8_linear as mod
from qwen_turbo.kernels.fp8_linear import (
    FP8,
    FP8_MAX,
    MAX_K,
    MIN_SCALE,
    Unscaled,
    finished,
    fp8_gemm_reason,
    fp8_gemv,
    fp8_linear,
    fp8_linear_reference,
    fp8_linear_unscaled,
    quantize_rows,
    quantize_rows_reference,
)
from tests.kernels.common import (
    DTYPES,
    assert_cuda_graph_replays,
    assert_logged_once,
    needs_cuda,
    needs_triton,
)

OP, OP_QUANT, OP_GEMV = "fp8_linear", "quantize_rows", "fp8_gemv"  # as the log names them
REFERENCES = (mod, "quantize_rows_reference", "fp8_linear_reference")  # what `kernel_only` fails

# Every finite float8_e4m3fn value (254: +-0 and +-448 included), as float32.
FP8_VALUES = torch.arange(256, dtype=torch.uint8).view(FP8).float()
FP8_VALUES = FP8_VALUES[FP8_VALUES.isfinite()]


# The interpreter evaluates tl.sigmoid(2u) as 1 / (1 + exp(-2u)) in numpy, where exp overflows
# to inf (with a warning) for the GELU of large negative inputs; 1 / inf = 0 is still right.
interpreter_exp_overflow = pytest.mark.filterwarnings("ignore:overflow encountered in exp")


def _gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


def _fp8_grid_rows(m, k, dtype, seed, device="cpu"):
    """(x, q, scale): rows of random fp8 values (subnormals and zeros included), each holding
    one +-448, times a power of two 2^-6 .. 2^6 per row. x is exact in bfloat16 and float16
    (subnormals too), its row amax is 448 * scale, and x / scale = q with no rounding."""
    g = torch.Generator().manual_seed(seed)
    q = FP8_VALUES[torch.randint(len(FP8_VALUES), (m, k), generator=g)]
    col = torch.randint(k, (m,), generator=g)
    q[torch.arange(m), col] = FP8_MAX * (torch.randint(2, (m,), generator=g) * 2 - 1).float()
    scale = 2.0 ** torch.randint(-6, 7, (m, 1), generator=g).float()
    return (q * scale).to(dtype=dtype, device=device), q.to(device), scale.to(device)


def _assert_exact(xq, s, q, scale):
    assert xq.dtype == FP8 and xq.shape == q.shape
    assert s.dtype == torch.float32 and s.shape == (q.shape[0], 1)
    torch.testing.assert_close(s, scale, rtol=0, atol=0)
    torch.testing.assert_close(xq.float(), q, rtol=0, atol=0)


def _launch_poisoned(x, gelu=False, pad=5):
    """The op's kernel launch into NaN-filled outputs: q a (M, K) view of a (M, K + pad)
    buffer (row stride K + pad), s (M, 1). Returns (q buffer, q view, s)."""
    m, k = x.shape
    buf = torch.full((m, k + pad), float("nan")).to(FP8)
    q, s = buf[:, :k], torch.full((m, 1), float("nan"))
    block_k = mod.triton.next_power_of_2(k)
    mod._quantize_rows_kernel[(m,)](
        x, s, x, q, s, k, x.stride(0), q.stride(0), GELU=gelu, ROW_SCALE=False, HAS_BIAS=False,
        BLOCK_K=block_k, num_warps=8,
    )  # fmt: skip
    return buf, q, s


# (M, K): a masked block (123), Qwen-Image's widths 3072 and 12288 (its MLP's hidden).
SHAPES = [(5, 123), (3, 3072), (2, 12288)]


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_exact_values_round_trip(kernel_only, dtype, shape):
    """Values that need no rounding: the fp8 rows and power-of-two scales come back exactly."""
    x, q, scale = _fp8_grid_rows(*shape, dtype, seed=shape[0] * 7 + shape[1])
    _assert_exact(*quantize_rows(x), q, scale)
    _assert_exact(*quantize_rows_reference(x), q, scale)  # the reference agrees


@needs_triton
def test_kernel_writes_every_element_and_nothing_else():
    """Poisoned outputs: every element of q and s is written, the padding of q's rows is not."""
    x, q, scale = _fp8_grid_rows(5, 123, torch.bfloat16, seed=1)
    buf, xq, s = _launch_poisoned(x)
    _assert_exact(xq, s, q, scale)
    assert buf[:, 123:].float().isnan().all()


@needs_triton
def test_strided_rows(kernel_only):
    """Rows of a wider buffer (row stride > K, unit stride along K) are read in place."""
    x, q, scale = _fp8_grid_rows(4, 123, torch.bfloat16, seed=2)
    wide = torch.full((4, 123 + 9), float("nan"), dtype=torch.bfloat16)
    wide[:, 3 : 3 + 123] = x
    view = wide[:, 3 : 3 + 123]
    assert not view.is_contiguous() and view.stride() == (132, 1)
    _assert_exact(*quantize_rows(view), q, scale)


@needs_triton
def test_column_major_input(kernel_only):
    """K not of unit stride (a transposed tensor) is copied to rows first."""
    x, q, scale = _fp8_grid_rows(4, 123, torch.float16, seed=3)
    xt = x.t().contiguous().t()
    assert xt.stride(1) != 1
    _assert_exact(*quantize_rows(xt), q, scale)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_is_row_amax_over_448(kernel_only, dtype):
    """Rows of magnitudes 1e-3 .. 5e3: each scale is the row's float32 amax / 448 (one
    division, as the reference), the largest element lands on +-448, and nothing overflows."""
    g = torch.Generator().manual_seed(4)
    mags = torch.tensor([1e-3, 0.5, 1.0, 3.0, 100.0, 5e3])
    x = (torch.randn(6, 3072, generator=g) * mags[:, None]).to(dtype)
    xq, s = quantize_rows(x)
    amax = x.float().abs().amax(dim=1, keepdim=True)
    torch.testing.assert_close(s, amax / FP8_MAX, rtol=0, atol=0)
    torch.testing.assert_close(s, quantize_rows_reference(x)[1], rtol=0, atol=0)
    i = (torch.arange(6), x.float().abs().argmax(dim=1))
    torch.testing.assert_close(xq.float()[i], x.float()[i].sign() * FP8_MAX, rtol=0, atol=0)
    assert xq.float().abs().max() <= FP8_MAX and not xq.float().isnan().any()


@interpreter_exp_overflow
@needs_triton
@pytest.mark.parametrize("gelu", [False, True])
def test_zero_rows(kernel_only, gelu):
    """An all-zero row gets the smallest scale, 1e-12, and zeros (0 / 0 would be NaN); the
    other rows are unaffected. gelu(0) = 0, so the same holds with the GELU."""
    x, q, scale = _fp8_grid_rows(4, 123, torch.bfloat16, seed=5)
    x[1] = 0
    x[3] = -0.0
    xq, s = quantize_rows(x, gelu)
    min_scale = torch.tensor(MIN_SCALE, dtype=torch.float32)
    for row in (1, 3):
        assert s[row, 0] == min_scale and not xq[row].float().any()
    assert not xq.float().isnan().any() and not s.isnan().any()
    if not gelu:
        _assert_exact(xq[[0, 2]], s[[0, 2]], q[[0, 2]], scale[[0, 2]])


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_through_the_scales(kernel_only, dtype):
    """One non-zero value v a row (the rest 0, gelu(0) = 0): the row's scale is |gelu(v)| / 448
    in float32, which shows the kernel's GELU to within the float32 division; the value itself
    is +-448. Against float64 GELU-tanh over v in [-4, 4] (GELU-erf differs by up to 80% of
    the value there, at v = -4)."""
    v = torch.linspace(-4, 4, 40).to(dtype)  # no 0 among 40 evenly spaced points
    cols = torch.arange(40) * 2 + 1
    x = torch.zeros(40, 96, dtype=dtype)
    x[torch.arange(40), cols] = v
    xq, s = quantize_rows(x, gelu=True)
    exact = _gelu_tanh(v.double())
    torch.testing.assert_close(s[:, 0].double() * FP8_MAX, exact.abs(), rtol=1e-5, atol=0)
    torch.testing.assert_close(xq.float()[torch.arange(40), cols], exact.sign().float() * FP8_MAX)
    xq[torch.arange(40), cols] = 0
    assert not xq.float().any()


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_then_quantize(kernel_only, dtype):
    """gelu=True gives what quantizing F.gelu(x, approximate="tanh") (in float32) gives: the
    kernel's sigmoid form and PyTorch's tanh form differ by float32 ulps, which move the odd
    element across an fp8 rounding boundary (float16 at this seed: 1 of 24576)."""
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(8, 3072, generator=g) * 2).to(dtype)
    xq, s = quantize_rows(x, gelu=True)
    xq_ref, s_ref = quantize_rows(_gelu_tanh(x.float()))
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(s, quantize_rows_reference(x, gelu=True)[1], rtol=1e-6, atol=0)
    assert (xq.float() != xq_ref.float()).float().mean().item() <= 1e-3


def _unscaled(m, k, dtype, seed):
    """An `Unscaled` of (m, k): raw values, row scales of 1e-3 .. 1e3 and a bias."""
    g = torch.Generator().manual_seed(seed)
    raw = (torch.randn(m, k, generator=g) * 40).to(dtype)
    row_scale = 10.0 ** torch.linspace(-3, 3, m)[:, None]
    return Unscaled(raw, row_scale, torch.randn(k, generator=g).to(dtype))


@interpreter_exp_overflow
@needs_triton
@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_unscaled_input(kernel_only, shape, dtype, gelu):
    """An `Unscaled` is finished in float32 as it is read (raw * row scale + bias), not
    rounded to its dtype first: the same bits as quantizing that float32 value, and the
    reference's scales (the GELU's forms part by float32 ulps)."""
    y = _unscaled(*shape, dtype, seed=shape[1] + gelu)
    xq, s = quantize_rows(y, gelu)
    q, scale = quantize_rows(y.raw.float() * y.row_scale + y.bias.float(), gelu)
    _assert_exact(xq, s, q.float(), scale)
    s_ref = quantize_rows_reference(y.raw, gelu, y.row_scale, y.bias)[1]
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)


def test_unscaled_value():
    """value() = raw * row scale + bias in float32, rounded once; tensors pass `finished`."""
    y = _unscaled(3, 64, torch.bfloat16, seed=1)
    exact = y.raw.double() * y.row_scale.double() + y.bias.double()
    torch.testing.assert_close(y.value(), exact.to(torch.bfloat16), rtol=0, atol=0)
    y3 = Unscaled(y.raw.reshape(1, 3, 64), y.row_scale, None)
    torch.testing.assert_close(finished(y3), (y.raw.float() * y.row_scale)[None].bfloat16())
    assert finished(y.raw) is y.raw


def test_unscaled_linear_off_an_fp8_gpu():
    """No fp8 GEMMs here: None, so the caller runs `fp8_linear` (and its fallback)."""
    x, weight, scale_weight, b = _linear_inputs((3,), 48, 64, torch.bfloat16, seed=2)
    assert fp8_linear_unscaled(x, weight, scale_weight, b) is None


def test_unscaled_linear_needs_one_weight_scale(monkeypatch):
    """A scale per output column cannot go into the tensorwise GEMM: None."""
    monkeypatch.setattr(mod, "fp8_gemm_reason", lambda device: None)
    x, weight, _, b = _linear_inputs((3,), 48, 64, torch.bfloat16, seed=3)
    assert fp8_linear_unscaled(x, weight, torch.rand(1, 48), b) is None


@needs_triton
def test_empty_input(kernel_only):
    xq, s = quantize_rows(torch.zeros(0, 64, dtype=torch.bfloat16))
    assert xq.shape == (0, 64) and xq.dtype == FP8 and s.shape == (0, 1)


# quantize_rows fallbacks: each branch of the dispatcher sends the call to the reference.


def _assert_quant_falls_back(x, caplog, reason, gelu=False):
    xq, s = quantize_rows(x, gelu)
    xq_ref, s_ref = quantize_rows_reference(x, gelu)
    assert xq.dtype == FP8
    torch.testing.assert_close(xq.float(), xq_ref.float(), rtol=0, atol=0)
    torch.testing.assert_close(s, s_ref, rtol=0, atol=0)
    assert_logged_once(caplog, OP_QUANT, reason)


def _random(shape, dtype, seed=0):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype)


def test_quant_fallback_3d_input(fresh_log):
    """(B, L, K) is not the kernel's; the reference's amax over dim 1 would be over L, so the
    fallback's result is not per-row scaling either: callers flatten to (M, K) first."""
    x = _random((2, 3, 64), torch.float32)
    _assert_quant_falls_back(x, fresh_log, "x has shape (2, 3, 64), not (M, K)")


def test_quant_fallback_too_wide(fresh_log):
    k = MAX_K + 16
    _assert_quant_falls_back(_random((2, k), torch.bfloat16), fresh_log, f"K = {k} is wider")


# fp8_linear on CPU: always ComfyUI's scaled-fp8 compute, logged once.


def _linear_inputs(lead, n, k, dtype, seed, device="cpu", bias=True):
    """x (*lead, K) ~ N(0, 1); weight (N, K) ~ N(0, 1/K) stored as float8_e4m3fn with one
    float32 scale (as ComfyUI's scaled-fp8 checkpoints: w = w_fp8 * scale_weight); bias
    (N,) ~ N(0, 0.1) or None. x and bias in `dtype`."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, k, generator=g)
    w = torch.randn(n, k, generator=g) * k**-0.5
    scale_weight = w.abs().max() / FP8_MAX
    weight = (w / scale_weight).to(FP8)
    b = torch.randn(n, generator=g) * 0.1 if bias else None
    to = {"device": device}
    return (
        x.to(dtype=dtype, **to),
        weight.to(**to),
        scale_weight.to(**to),
        None if b is None else b.to(dtype=dtype, **to),
    )


def _comfy_scaled_fp8(x, weight, scale_weight, bias):
    """comfy.ops' scaled-fp8 Linear: weight and scale cast to x's dtype, then F.linear. (The
    scale is rounded to x's dtype before the product, as ComfyUI does: a float32 scale
    would give other bits.)"""
    w = weight.to(x.dtype) * scale_weight.to(x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


def test_fp8_gemm_reason():
    assert fp8_gemm_reason(torch.device("cpu")) == "fp8 GEMMs need a CUDA GPU, not cpu"
    assert fp8_gemm_reason(torch.device("meta")) == "fp8 GEMMs need a CUDA GPU, not meta"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("gelu_input", [False, True])
def test_fallback_on_cpu(fresh_log, dtype, bias, gelu_input):
    x, weight, scale_weight, b = _linear_inputs((2, 5), 48, 64, dtype, seed=9, bias=bias)
    for _ in range(3):
        out = fp8_linear(x, weight, scale_weight, b, gelu_input)
    assert out.dtype == dtype and out.shape == (2, 5, 48)
    expected = _comfy_scaled_fp8(_gelu_tanh(x) if gelu_input else x, weight, scale_weight, b)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert_logged_once(fresh_log, OP, "fp8 GEMMs need a CUDA GPU, not cpu")


def _scaled_fp8_linears():
    """The scaled-fp8 Linears the reference must match: the Optimized Loader's (every host)
    and ComfyUI v0.3's own (comfy.ops.scaled_fp8_ops, gone from newer hosts)."""
    import comfy.ops

    from qwen_turbo.runtime.dit.fp8 import Fp8Linear

    out = [Fp8Linear]
    if hasattr(comfy.ops, "scaled_fp8_ops"):
        ops = comfy.ops.scaled_fp8_ops(fp8_matrix_mult=False, scale_input=False, override_dtype=FP8)
        out.append(ops.Linear)
    return out


@pytest.mark.host
@pytest.mark.parametrize("linear_cls", _scaled_fp8_linears(), ids=lambda c: c.__module__)
def test_fallback_matches_scaled_fp8_linear(linear_cls):
    """The fallback is the scaled-fp8 Linear's bf16 path bit for bit when x has more elements
    than the weight (the image stream). With fewer (a short text stream: 256 tokens for a
    3072 x 3072 weight) that Linear scales x instead of the weight, F.linear(x * scale,
    weight, bias), which rounds differently; the fallback keeps one form."""
    x, weight, scale_weight, b = _linear_inputs((2, 65), 48, 64, torch.bfloat16, seed=10)
    assert x.numel() > weight.numel()
    linear = linear_cls(64, 48, bias=True, dtype=torch.bfloat16)
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    linear.bias = torch.nn.Parameter(b, requires_grad=False)
    linear.scale_weight = torch.nn.Parameter(scale_weight, requires_grad=False)
    with torch.inference_mode():
        comfy_out = linear(x)
        out = fp8_linear_reference(x, weight, scale_weight, b)
    torch.testing.assert_close(out, comfy_out, rtol=0, atol=0)


@pytest.mark.parametrize(
    "change,reason",
    [
        ({"x": torch.float32}, "activation dtype torch.float32 is not bfloat16 or float16"),
        ({"weight": torch.bfloat16}, "weight dtype torch.bfloat16 is not float8_e4m3fn"),
        ({"n": 40}, "weight shape (40, 64) is not a multiple of 16"),
        ({"k": 72}, "weight shape (48, 72) is not a multiple of 16"),
        ({"per_channel": True}, "scale_weight is not one value per tensor"),
        ({"grad": True}, "require grad"),
    ],
)
def test_fallback_branches(monkeypatch, fresh_log, change, reason):
    """As if on an fp8 GPU (fp8_gemm_reason patched to None): each other check of the
    dispatcher sends the call to the reference. A per-channel (N, 1) scale still broadcasts
    there."""
    monkeypatch.setattr(mod, "fp8_gemm_reason", lambda device: None)
    n, k = change.get("n", 48), change.get("k", 64)
    x, weight, scale_weight, b = _linear_inputs((3,), n, k, torch.bfloat16, seed=11)
    x = x.to(change.get("x", x.dtype))
    if "weight" in change:
        weight = (weight.float() * scale_weight).to(change["weight"])
        scale_weight = torch.ones(())
    if change.get("per_channel"):
        scale_weight = scale_weight.expand(n, 1) * torch.linspace(0.5, 2, n)[:, None]
    if change.get("grad"):
        b = b.clone().requires_grad_()
    out = fp8_linear(x, weight, scale_weight, b)
    torch.testing.assert_close(out, fp8_linear_reference(x, weight, scale_weight, b))
    assert_logged_once(fresh_log, OP, reason)


def test_fp8_linear_imports_without_triton(without_triton):
    """A second copy of kernels/, imported with `import triton` failing, runs the reference
    (quantize_rows and fp8_gemv there: test_contract)."""
    copy = without_triton("fp8_linear")
    x, weight, scale_weight, b = _linear_inputs((3,), 48, 64, torch.bfloat16, seed=12)
    out = copy.fp8_linear(x, weight, scale_weight, b)
    torch.testing.assert_close(out, fp8_linear_reference(x, weight, scale_weight, b))


# fp8_gemv: a few rows against float64, through the interpreter on CPU.


def _gemv_exact(x, weight, scale_weight, b):
    w = weight.double() * scale_weight.double().reshape(-1, 1)
    return F.linear(x.double(), w, None if b is None else b.double())


def _assert_gemv_close(out, exact, x, weight, scale_weight, ulps_out):
    """|out - exact| within `ulps_out` of out's dtype (its rounding: 1/2 on the GPU, 1 in the
    interpreter, whose float32 -> bfloat16 cast truncates) plus float32 summation error."""
    eps = torch.finfo(out.dtype).eps
    w = weight.double().abs() * scale_weight.double().abs().reshape(-1, 1)
    sums = F.linear(x.double().abs(), w)  # sum_k |x w|: bounds the float32 sum's error
    bound = ulps_out * eps * exact.abs() + 1e-6 * sums + 1e-30
    excess = ((out.double() - exact).abs() / bound).max().item()
    assert excess <= 1, excess


# (M, N, K): one row over a masked N and K; three rows; 17 rows (two row blocks).
GEMV_SHAPES = [(1, 96, 200), (3, 50, 64), (17, 40, 300)]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", GEMV_SHAPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("per_row_scale", [False, True])
def test_gemv_matches_float64(kernel_only, dtype, shape, bias, per_row_scale):
    m, n, k = shape
    x, weight, scale_weight, b = _linear_inputs((m,), n, k, dtype, seed=m + n + k, bias=bias)
    if per_row_scale:  # the loader's (1, N) row, here with a different value per column
        scale_weight = scale_weight * torch.linspace(0.5, 2, n).reshape(1, n)
    out = fp8_gemv(x, weight, scale_weight, b)
    assert out.dtype == dtype and out.shape == (m, n)
    exact = _gemv_exact(x, weight, scale_weight, b)
    _assert_gemv_close(out, exact, x, weight, scale_weight, ulps_out=1)


@needs_triton
def test_gemv_kernel_writes_every_element_and_nothing_else():
    """Into a NaN-filled (M, N) view of a wider buffer, from strided rows of x."""
    m, n, k = 3, 50, 64
    x, weight, scale_weight, b = _linear_inputs((m,), n, k, torch.bfloat16, seed=20)
    wide = torch.full((m, k + 7), float("nan"), dtype=torch.bfloat16)
    wide[:, :k] = x
    buf = torch.full((m, n + 5), float("nan"), dtype=torch.bfloat16)
    scale = scale_weight.reshape(1).expand(n).contiguous()
    mod._gemv_kernel[(mod.triton.cdiv(n, mod.GEMV_BLOCK_N), 1)](
        wide, weight, scale, b, buf, m, n, k, wide.stride(0), weight.stride(0), buf.stride(0),
        HAS_BIAS=True, BLOCK_M=16, BLOCK_N=mod.GEMV_BLOCK_N, BLOCK_K=mod.GEMV_BLOCK_K,
        K_STEPS=mod.triton.cdiv(k, mod.GEMV_BLOCK_K), INTERPRET=True,
    )  # fmt: skip
    assert buf[:, n:].isnan().all() and buf[:, :n].isfinite().all()
    _assert_gemv_close(buf[:, :n], _gemv_exact(x, weight, scale_weight, b), x, weight,
                       scale_weight, ulps_out=1)  # fmt: skip


@needs_triton
def test_gemv_lead_dims_and_strided_x(kernel_only):
    """(B, L, K) input with a row stride wider than K: read in place, shaped (B, L, N)."""
    x, weight, scale_weight, b = _linear_inputs((2, 3), 48, 64, torch.bfloat16, seed=21)
    wide = torch.full((2, 3, 70), float("nan"), dtype=torch.bfloat16)
    wide[..., 3:67] = x
    out = fp8_gemv(wide[..., 3:67], weight, scale_weight, b)
    assert out.shape == (2, 3, 48)
    exact = _gemv_exact(x, weight, scale_weight, b)
    _assert_gemv_close(out, exact, x, weight, scale_weight, ulps_out=1)


@pytest.mark.parametrize(
    "change,reason",
    [
        ({"x": torch.float32}, "activation dtype torch.float32 is not bfloat16 or float16"),
        ({"weight": torch.bfloat16}, "is not row-major float8_e4m3fn"),
        ({"transposed": True}, "is not row-major float8_e4m3fn"),
        ({"per_channel": True}, "scale_weight is not one value per tensor or a (1, N) row"),
        ({"bias_row": True}, "bias shape (1, 48) is not (48,)"),
    ],
)
def test_gemv_fallback_branches(fresh_log, change, reason):
    """Each check of the dispatcher sends the call to the reference (bf16 compute on the
    dequantized weight), logged once."""
    x, weight, scale_weight, b = _linear_inputs((3,), 48, 64, torch.bfloat16, seed=23)
    x = x.to(change.get("x", x.dtype))
    if "weight" in change:
        weight = (weight.float() * scale_weight).to(change["weight"])
        scale_weight = torch.ones(())
    if change.get("transposed"):
        weight = weight.t().contiguous().t()
    if change.get("per_channel"):
        scale_weight = scale_weight.expand(48, 1) * torch.linspace(0.5, 2, 48)[:, None]
    if change.get("bias_row"):
        b = b.reshape(1, 48)
    for _ in range(2):
        out = fp8_gemv(x, weight, scale_weight, b)
    torch.testing.assert_close(out, fp8_linear_reference(x, weight, scale_weight, b))
    assert_logged_once(fresh_log, OP_GEMV, reason)


def test_gemv_fallback_old_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 6))
    reason = mod._gemv_device_reason(torch.device("cuda", 0))
    assert reason == "compute capability 8.6: Triton has no float8_e4m3fn below 8.9"
    assert mod._gemv_device_reason(torch.device("cpu")) is None  # the interpreter


# GPU: the kernel's rounding against float64, and the fp8 GEMMs at Qwen-Image's shapes.

needs_fp8_gemm = pytest.mark.skipif(
    not torch.cuda.is_available() or fp8_gemm_reason(torch.device("cuda")) is not None,
    reason="needs a CUDA GPU with fp8 GEMMs (compute capability 8.9+)",
)


def _assert_fp8_precision(xq, s, exact):
    """x_fp8 * scale is within half an fp8 ulp of the float64 `exact`: e4m3 keeps 3 mantissa
    bits, so 2^-4 of |exact| for normal values, and half the subnormal step (2^-9 / 2) times
    the scale below 2^-6 * scale; a little slack for the float32 division and GELU."""
    deq = xq.double() * s.double()
    bound = (2**-4 + 1e-5) * exact.abs() + 2**-10 * s.double()
    excess = ((deq - exact).abs() / bound).max().item()
    assert excess <= 1, excess


GPU_QUANT_SHAPES = [(257, 3072), (3, 12288), (5, 123)]


@pytest.mark.gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", GPU_QUANT_SHAPES)
def test_gpu_quantize_rows_precision(kernel_only, shape, dtype, gelu):
    """Rows of magnitudes 1e-3 .. 1e3 and a zero row, through the compiled kernel. Round to
    nearest gives at most 16/17 of the bound (half an ulp just above a power of two); one
    ulp off anywhere breaks it. (Triton's float32 `/` is not IEEE-rounded, so a few elements
    in a million may sit on the other side of a tie from the reference's: still half an ulp.)"""
    m, k = shape
    g = torch.Generator().manual_seed(m + k)
    mags = 10.0 ** torch.linspace(-3, 3, m)
    x = (torch.randn(m, k, generator=g) * mags[:, None]).to(dtype=dtype, device="cuda")
    x[m // 2] = 0
    xq, s = quantize_rows(x, gelu)
    assert xq.dtype == FP8 and s.shape == (m, 1)
    exact = _gelu_tanh(x.double()) if gelu else x.double()
    scale = (exact.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(MIN_SCALE)
    torch.testing.assert_close(s.double(), scale, rtol=1e-5 if gelu else 1e-6, atol=0)
    assert s[m // 2, 0].item() == torch.tensor(MIN_SCALE).item() and not xq[m // 2].float().any()
    _assert_fp8_precision(xq, s, exact)


def _rel_l2(out, ref):
    return ((out.float() - ref).norm() / ref.norm()).item()


# (lead, N, K, bias, gelu_input): Qwen-Image's attention projection over an odd row count,
# one token of the modulation's 6 x 3072, the MLP's second linear (GELU fused) in batch.
GPU_LINEAR_CASES = [
    ((257,), 3072, 3072, True, False),
    ((1,), 18432, 3072, False, False),
    ((2, 113), 3072, 12288, True, True),
]


@pytest.mark.gpu
@needs_fp8_gemm
@pytest.mark.parametrize("lead,n,k,bias,gelu_input", GPU_LINEAR_CASES)
def test_gpu_fp8_linear_matches_fp32(kernel_only, lead, n, k, bias, gelu_input):
    """Against float32 compute on the dequantized weight: only the activations' fp8 rounding
    separates them (2.6% relative L2 on an H200; bf16 compute on the same weight: 0.3%)."""
    args = _linear_inputs(lead, n, k, torch.bfloat16, seed=n + k, device="cuda", bias=bias)
    x, weight, scale_weight, b = args
    out = fp8_linear(x, weight, scale_weight, b, gelu_input)
    assert out.dtype == torch.bfloat16 and out.shape == (*lead, n)
    x32 = _gelu_tanh(x.float()) if gelu_input else x.float()
    ref = F.linear(x32, weight.float() * scale_weight, None if b is None else b.float())
    assert _rel_l2(out, ref) < 5e-2


@pytest.mark.gpu
@needs_fp8_gemm
@pytest.mark.parametrize("lead,n,k,bias,gelu_input", GPU_LINEAR_CASES)
def test_gpu_unscaled_matches_fp8_linear(kernel_only, lead, n, k, bias, gelu_input):
    """The tensorwise GEMM finished by `value()` computes fp8_linear's sums: they part by two
    bf16 roundings (about 2e-3 relative RMS; fp8's own error is 2.6%)."""
    args = _linear_inputs(lead, n, k, torch.bfloat16, seed=n + k, device="cuda", bias=bias)
    x, weight, scale_weight, b = args
    y = fp8_linear_unscaled(x, weight, scale_weight, b, gelu_input)
    assert isinstance(y, Unscaled) and y.raw.shape == (*lead, n)
    ref = fp8_linear(x, weight, scale_weight, b, gelu_input).float()
    assert _rel_l2(y.value(), ref) < 8e-3
    x_fp8 = quantize_rows(x.reshape(-1, k), gelu_input)  # given, not made again
    torch.testing.assert_close(fp8_linear_unscaled(x, weight, scale_weight, b, gelu_input,
                                                   x_fp8).raw, y.raw, rtol=0, atol=0)  # fmt: skip


@pytest.mark.gpu
@needs_fp8_gemm
def test_gpu_unscaled_cuda_graph_capture(kernel_only):
    x, weight, scale_weight, b = _linear_inputs((33,), 3072, 3072, torch.bfloat16, 16, "cuda")
    fp8_linear_unscaled(x, weight, scale_weight, b)  # its scale of one made outside the graph
    assert_cuda_graph_replays(lambda: fp8_linear_unscaled(x, weight, scale_weight, b).value(),
                              x, 0)  # fmt: skip


@pytest.mark.gpu
@needs_fp8_gemm
def test_gpu_fp8_linear_float16(kernel_only):
    x, weight, scale_weight, b = _linear_inputs((33,), 3072, 3072, torch.float16, 13, "cuda")
    out = fp8_linear(x, weight, scale_weight, b)
    assert out.dtype == torch.float16
    ref = F.linear(x.float(), weight.float() * scale_weight, b.float())
    assert _rel_l2(out, ref) < 5e-2


@pytest.mark.gpu
@needs_fp8_gemm
def test_gpu_fp8_linear_large_rows(kernel_only):
    """Every other row scaled by 1e4: per-row scales keep each row's own relative error (2.8%
    at most on an H200; one per-tensor scale gives 5.8% on the small rows), and nothing
    overflows."""
    x, weight, scale_weight, b = _linear_inputs((64,), 3072, 3072, torch.bfloat16, 14, "cuda")
    x[::2] *= 1e4
    out = fp8_linear(x, weight, scale_weight, b)
    assert out.isfinite().all()
    ref = F.linear(x.float(), weight.float() * scale_weight, b.float())
    row_err = (out.float() - ref).norm(dim=1) / ref.norm(dim=1)
    assert row_err.max().item() < 5e-2, row_err


@pytest.mark.gpu
@needs_fp8_gemm
def test_gpu_cuda_graph_capture(kernel_only):
    x, weight, scale_weight, b = _linear_inputs((33,), 3072, 3072, torch.bfloat16, 15, "cuda")
    assert_cuda_graph_replays(lambda: fp8_linear(x, weight, scale_weight, b, True), x, 0)


# (M, N, K): the modulation linear of Qwen-Image (one row, 6 x 3072 outputs), with CFG's
# two rows, and a masked tail.
GPU_GEMV_SHAPES = [(1, 18432, 3072), (2, 18432, 3072), (5, 1000, 333)]


@pytest.mark.gpu
@needs_fp8_gemm
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", GPU_GEMV_SHAPES)
def test_gpu_gemv_matches_float64(kernel_only, dtype, shape):
    """Half an ulp of the output plus float32 summation error, against float64: closer than
    the reference, which rounds the dequantized weight to bf16 first."""
    m, n, k = shape
    x, weight, scale_weight, b = _linear_inputs((m,), n, k, dtype, seed=n + k, device="cuda")
    x = x * 3 + 1  # a mean, as the timestep embedding has
    out = fp8_gemv(x, weight, scale_weight, b)
    exact = _gemv_exact(x, weight, scale_weight, b)
    _assert_gemv_close(out, exact, x, weight, scale_weight, ulps_out=0.5)
    reference = fp8_linear_reference(x, weight, scale_weight, b)
    assert (out.double() - exact).norm() <= (reference.double() - exact).norm()


@pytest.mark.gpu
@needs_fp8_gemm
def test_gpu_gemv_cuda_graph_capture(kernel_only):
    x, weight, scale_weight, b = _linear_inputs((2,), 18432, 3072, torch.bfloat16, 27, "cuda")
    assert_cuda_graph_replays(lambda: fp8_gemv(x, weight, scale_weight, b), x, 1)


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])]
)
def test_scale_row_equals_one_scale(device):
    """scale_weight given as the (1, N) row `_scaled_mm` takes (the loader keeps it per
    module) gives the scalar's result bit for bit, on the fp8 path and on the fallback."""
    x, weight, scale_weight, b = _linear_inputs((2, 33), 48, 64, torch.bfloat16, 13, device)
    row = scale_weight.float().reshape(1, 1).expand(1, 48).clone()
    with torch.inference_mode():
        one, per_row = fp8_linear(x, weight, scale_weight, b), fp8_linear(x, weight, row, b)
    assert one.isfinite().all()
    torch.testing.assert_close(per_row, one, rtol=0, atol=0)
