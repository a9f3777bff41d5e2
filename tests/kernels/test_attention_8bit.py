"""8-bit attention (int8 QK^T, fp8 or 16-bit PV) against its PyTorch model and exact attention.

On CPU the kernels run through Triton's interpreter (TRITON_INTERPRET=1, set by conftest).
The kernel works around the interpreter's float casts (fp32 -> fp8 mis-rounds values whose
mantissa carries into the exponent, fp32 -> bf16 truncates, bf16 dots multiply bit patterns;
see `_round_e4m3`), so on CPU it matches `attention_8bit_reference`, the same algorithm in
PyTorch, to float32 summation order (REF_TOL); only a rare fp8 tie can round apart.

Against exact float64 attention the error is the 8-bit path's own (relative L2):
- fp8 P.V, about 3.7 % on i.i.d. random inputs: e4m3 keeps 3 mantissa bits, so P and V
  each carry about 2.6 % relative RMS rounding error, which a zero-mean V does not average
  away; int8 scores add about 1.3 %. Bound: 5e-2.
- 16-bit P.V (pv_fp8=False), about 1.3 %, from the int8 scores. Bound: 2.5e-2.
The GPU tests hold the real Qwen-Image sequence to the same bounds against float32 SDPA.
"""

import pytest
import torch
import torch.nn.functional as F

from qwen_turbo.kernels import attention_8bit as mod
from qwen_turbo.kernels.attention_8bit import (
    attention_8bit,
    attention_8bit_reason,
    attention_8bit_reference,
)
from tests.kernels.common import (
    assert_compiles_full_graph,
    assert_cuda_graph_replays,
    assert_logged_once,
    assert_logged_once_per_reason,
    needs_cuda,
    needs_triton,
)

OP = "attention_8bit"  # as the fallback log names it
REFERENCES = (mod, "attention_exact")  # what `kernel_only` makes fail
EXACT_TOL = {True: 5e-2, False: 2.5e-2}  # relative L2 against exact attention, by pv_fp8
REF_TOL = 1e-3  # relative L2 of the kernel against the reference
DTYPES = [torch.bfloat16, torch.float16]


def _rel(out, exact):
    """Relative L2 error of `out` against `exact`, in float64."""
    return ((out.double() - exact.double()).norm() / exact.double().norm()).item()


def _exact(q, k, v):
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double())


def _qkv(b, h, lq, lk, d, dtype, seed, device="cpu"):
    """q, k, v ~ N(0, 1), k with a per-channel offset (as real keys have; smoothing removes
    it), in `dtype`: (B, H, Lq, D), (B, H, Lk, D), (B, H, Lk, D)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, lq, d, generator=g)
    k = torch.randn(b, h, lk, d, generator=g) + torch.randn(1, h, 1, d, generator=g)
    v = torch.randn(b, h, lk, d, generator=g)
    return tuple(t.to(device=device, dtype=dtype) for t in (q, k, v))


def _assert_accurate(out, q, k, v, pv_fp8, ref_tol=REF_TOL):
    """out is q's shape, dtype and contiguous, finite, within REF_TOL of the reference and
    EXACT_TOL of exact attention."""
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert out.isfinite().all()
    exact = _exact(q, k, v)
    if ref_tol is not None:
        ref = attention_8bit_reference(q, k, v, pv_fp8)
        assert _rel(out, ref) <= ref_tol, _rel(out, ref)
    assert _rel(out, exact) <= EXACT_TOL[pv_fp8], _rel(out, exact)


# (B, H, Lq, Lk, D): odd lengths with masked tails, Lq != Lk both ways, several key tiles
# (BLOCK_N 64) and query blocks (BLOCK_M 128), batch 2, head sizes 64 and 128.
CASES = [
    (2, 2, 37, 37, 64),
    (2, 1, 77, 37, 128),
    (1, 2, 37, 300, 128),
    (1, 2, 200, 77, 64),
]


@needs_triton
@pytest.mark.parametrize("pv_fp8", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,h,lq,lk,d", CASES)
def test_kernel_matches_reference_and_exact(dtype, pv_fp8, b, h, lq, lk, d):
    q, k, v = _qkv(b, h, lq, lk, d, dtype, seed=lq * 7 + lk + d)
    out = torch.full(q.shape, float("nan"), dtype=dtype)  # every element must be written
    assert mod._launch(q, k, v, out, pv_fp8) is out
    _assert_accurate(out, q, k, v, pv_fp8)


@needs_triton
@pytest.mark.parametrize("config", [(64, 64, 4, 3), (128, 128, 8, 3)])
def test_other_tilings(config):
    """Other block sizes: BLOCK_M 64 (two query blocks share one q scale; any divisor of
    Q_BLOCK works), BLOCK_N 128 (two k scales per tile, as in two of the autotuner's
    configs). The reference tiles keys the same way."""
    q, k, v = _qkv(1, 2, 150, 300, 64, torch.bfloat16, seed=1)
    out = torch.full(q.shape, float("nan"), dtype=q.dtype)
    mod._launch(q, k, v, out, True, config)
    ref = attention_8bit_reference(q, k, v, block_n=config[1])
    assert _rel(out, ref) <= REF_TOL
    _assert_accurate(out, q, k, v, True, ref_tol=None)


@needs_triton
@pytest.mark.parametrize("pv_fp8", [True, False])
def test_public_function(kernel_only, pv_fp8):
    q, k, v = _qkv(2, 2, 77, 45, 64, torch.bfloat16, seed=2)
    _assert_accurate(attention_8bit(q, k, v, pv_fp8), q, k, v, pv_fp8)


@needs_triton
def test_head_size_32(kernel_only):
    q, k, v = _qkv(1, 3, 33, 70, 32, torch.float16, seed=3)
    _assert_accurate(attention_8bit(q, k, v), q, k, v, True)


@needs_triton
def test_single_token(kernel_only):
    """One query and one key: the output is v itself, up to v's fp8 rounding (at most 2^-4
    relative) and the output's."""
    q, k, v = _qkv(2, 2, 1, 1, 64, torch.bfloat16, seed=4)
    out = attention_8bit(q, k, v)
    torch.testing.assert_close(out, v, rtol=2**-4 + 2**-8, atol=0)


@needs_triton
def test_strided_inputs(kernel_only):
    """q, k, v as (B, H, L, D) views of other layouts, read through their strides: a
    transposed (B, L, H, D) tensor, the k and v slots of a fused (B, L, 3, H, D) projection,
    and a q with the head dim strided."""
    b, h, seq, d = 2, 3, 37, 64
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(b, seq, 3, h, d, generator=g).to(torch.bfloat16)
    k, v = (qkv[:, :, i].transpose(1, 2) for i in (1, 2))
    q = torch.randn(b, seq, h, d, generator=g).to(torch.bfloat16).transpose(1, 2)
    q = q.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert not any(t.is_contiguous() for t in (q, k, v)) and q.stride(-1) != 1
    _assert_accurate(attention_8bit(q, k, v), q, k, v, True)


@needs_triton
def test_empty_query(kernel_only):
    q, k, v = _qkv(2, 2, 0, 37, 64, torch.bfloat16, seed=6)
    assert attention_8bit(q, k, v).shape == (2, 2, 0, 64)


# Hard inputs: outlier channels, large magnitudes, zeros.


def _outliers(kind, seed, dtype=torch.bfloat16):
    """q, k with a few channels x20-x100 (rescaled so the logits stay O(1-10), as
    attention's are), v ~ N(0, 1): (1, 2, 77, 128), (1, 2, 300, 128)."""
    q, k, v = (t.float() for t in _qkv(1, 2, 77, 300, 128, torch.float32, seed))
    if kind == "same channels x20":  # q and k share the outliers: they set the logits
        q[..., :3] *= 20
        k[..., :3] *= 20
        q /= 20
    elif kind == "q and k in other channels x50":  # each outlier meets normal channels
        q[..., :3] *= 50
        k[..., 5:8] *= 50
        q /= 8
    elif kind == "q x100":
        q[..., :3] *= 100
        q /= 10
    elif kind == "k x100":
        k[..., 120:] *= 100
        k /= 10
    return tuple(t.to(dtype) for t in (q, k, v))


@needs_triton
@pytest.mark.parametrize("pv_fp8", [True, False])
@pytest.mark.parametrize(
    "kind", ["same channels x20", "q and k in other channels x50", "q x100", "k x100"]
)
def test_outlier_channels(kernel_only, kind, pv_fp8):
    """Without channel balancing the int8 scores of these inputs are 4-20x worse (the
    "other channels" case: 84 % error); with it they meet the random-input bounds."""
    q, k, v = _outliers(kind, seed=7)
    _assert_accurate(attention_8bit(q, k, v, pv_fp8), q, k, v, pv_fp8)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_large_magnitudes(kernel_only, dtype):
    """Values of 1e3: q x1e3 with k x1e-3 (the logits of N(0, 1) inputs), v x1e3, and k
    with channel offsets of 100 (smoothing takes them out). Per-block and per-channel
    scales absorb magnitudes: the random-input bounds hold."""
    q, k, v = _qkv(1, 2, 77, 300, 128, torch.float32, seed=8)
    k = k + 100 * torch.randn(1, 2, 1, 128, generator=torch.Generator().manual_seed(8))
    q, k, v = ((q * 1e3).to(dtype), (k * 1e-3).to(dtype), (v * 1e3).to(dtype))
    _assert_accurate(attention_8bit(q, k, v), q, k, v, True)


def _v_bound(v):
    """What |out| cannot pass: each channel's max |v|, times 1 + 2^-4 for v's fp8 rounding
    and 1 + 2^-4 for P's (l sums the unrounded P)."""
    return v.float().abs().amax(dim=2, keepdim=True) * (1 + 2**-4) ** 2


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_huge_logits_stay_finite(kernel_only, dtype):
    """q, k, v of 1e3 (float16: up to 5e3 of its 65504): logits of about 1e6, so every row
    is a hard argmax. The output is finite and within each channel's range of v; most rows
    pick exact attention's key (their error is v's fp8 rounding), and a few (2 % here) a
    key whose score is within int8 rounding of the top one, as any 8-bit QK^T can."""
    q, k, v = (t.float() * 1e3 for t in _qkv(1, 2, 77, 300, 128, torch.float32, seed=9))
    q, k, v = (t.to(dtype) for t in (q, k, v))
    out = attention_8bit(q, k, v)
    assert out.isfinite().all()
    assert (out.float().abs() <= _v_bound(v)).all()
    exact = _exact(q, k, v)
    row_err = (out.double() - exact).norm(dim=-1) / exact.norm(dim=-1)
    assert (row_err > EXACT_TOL[True]).float().mean() <= 0.05


@needs_triton
def test_zero_blocks_and_channels(kernel_only):
    """A zero block of queries (uniform attention), a zero channel of v, and a constant key
    channel (zero after smoothing): MIN_SCALE keeps the scales finite, the result exact."""
    q, k, v = _qkv(1, 2, 200, 77, 64, torch.bfloat16, seed=10)
    q[:, :, :128] = 0
    v[..., 3] = 0
    k[..., 5] = 2.5
    out = attention_8bit(q, k, v)
    _assert_accurate(out, q, k, v, True)
    assert (out[..., 3] == 0).all()


# Custom op, torch.compile.


@needs_triton
def test_custom_op_registration():
    q, k, v = _qkv(1, 2, 5, 7, 64, torch.bfloat16, seed=11)
    for pv_fp8 in (True, False):
        torch.library.opcheck(mod._attention_8bit_op.op, (q, k, v, pv_fp8))


@needs_triton
def test_torch_compile_full_graph(kernel_only):
    q, k, v = _qkv(1, 2, 5, 7, 64, torch.bfloat16, seed=12)

    def step(x):
        return attention_8bit(x, k, v) * 2

    assert_compiles_full_graph(step, q)


# Fallbacks: each branch sends the call to exact SDPA on the inputs as given, logged once.


def _assert_falls_back(q, k, v, caplog, reason, fn=attention_8bit, **kwargs):
    out = fn(q, k, v, **kwargs)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), rtol=0, atol=0)
    assert_logged_once(caplog, OP, reason)


def test_fallback_env_switch(monkeypatch, fresh_log):
    monkeypatch.setenv("QWEN_TURBO_DISABLE_KERNELS", "1")
    q, k, v = _qkv(1, 2, 5, 7, 64, torch.bfloat16, seed=0)
    _assert_falls_back(q, k, v, fresh_log, "QWEN_TURBO_DISABLE_KERNELS")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fallback_dtype(fresh_log, dtype):
    q, k, v = _qkv(1, 2, 5, 7, 64, dtype, seed=0)
    _assert_falls_back(q, k, v, fresh_log, f"dtype {dtype} is not supported")


@pytest.mark.parametrize("d", [16, 96, 256])
def test_fallback_head_size(fresh_log, d):
    q, k, v = _qkv(1, 2, 5, 7, d, torch.bfloat16, seed=0)
    _assert_falls_back(q, k, v, fresh_log, f"head size {d} is not supported")


def test_fallback_3d_input(fresh_log):
    """(H, L, D) without the batch axis: SDPA takes it, the kernel does not."""
    q, k, v = (t[0] for t in _qkv(1, 2, 5, 7, 64, torch.bfloat16, seed=0))
    _assert_falls_back(q, k, v, fresh_log, "q has 3 dims")


def test_fallback_broadcast_batch(fresh_log):
    """k and v of batch 1 for q's 2: SDPA broadcasts them, the kernel does not."""
    q, _, _ = _qkv(2, 2, 5, 7, 64, torch.bfloat16, seed=0)
    _, k, v = _qkv(1, 2, 5, 7, 64, torch.bfloat16, seed=1)
    _assert_falls_back(q, k, v, fresh_log, "k has shape (1, 2, 7, 64), not (2, 2, L, 64)")


def test_fallback_mixed_dtypes(fresh_log):
    q, k, v = _qkv(1, 2, 5, 7, 64, torch.bfloat16, seed=0)
    v = v.float()
    with pytest.raises(RuntimeError):  # SDPA's own error for mixed dtypes
        attention_8bit(q, k, v)
    assert_logged_once(fresh_log, OP, "v is torch.float32 on cpu, q is torch.bfloat16")


def test_fallback_no_keys(fresh_log):
    q, k, v = _qkv(1, 2, 5, 0, 64, torch.bfloat16, seed=0)
    _assert_falls_back(q, k, v, fresh_log, "k and v have no tokens")


def test_fallback_autograd(fresh_log):
    q, k, v = _qkv(1, 2, 5, 7, 64, torch.bfloat16, seed=0)
    q.requires_grad_()
    _assert_falls_back(q, k, v, fresh_log, "require grad")
    attention_8bit(q, k, v).float().sum().backward()
    assert q.grad is not None and q.grad.isfinite().all()


def test_fallback_device(no_interpreter, fresh_log):
    """Outside the interpreter, CPU tensors are not the kernel's."""
    q, k, v = _qkv(1, 2, 5, 7, 64, torch.bfloat16, seed=0)
    _assert_falls_back(q, k, v, fresh_log, "tensors on cpu")


def test_fallback_triton_unavailable(monkeypatch, fresh_log):
    monkeypatch.setattr(mod, "unsupported", lambda x: "Triton is not installed (test)")
    q, k, v = _qkv(1, 2, 5, 7, 64, torch.bfloat16, seed=0)
    _assert_falls_back(q, k, v, fresh_log, "Triton is not installed")


def test_module_imports_without_triton(without_triton, caplog):
    """A second copy of kernels/, imported with `import triton` failing, runs exact SDPA."""
    copy = without_triton("attention_8bit")
    assert not copy.HAS_TRITON and not hasattr(copy, "_launch")
    q, k, v = _qkv(1, 2, 5, 7, 64, torch.bfloat16, seed=0)
    _assert_falls_back(q, k, v, caplog, "not installed", fn=copy.attention_8bit)


@pytest.mark.parametrize(
    "cap,pv_fp8,reason",
    [
        ((8, 6), True, "compute capability 8.6 has no fp8 tensor cores (needs 8.9+)"),
        ((7, 5), False, "compute capability 7.5 has no int8 tensor cores (needs 8.0+)"),
        ((8, 6), False, None),
        ((8, 9), True, None),
        ((9, 0), True, None),
    ],
)
def test_device_capability(monkeypatch, cap, pv_fp8, reason):
    """fp8 P.V needs compute capability 8.9+ (Ada, Hopper), int8 QK^T 8.0+."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    assert mod._device_reason(torch.device("cuda"), pv_fp8) == reason


def test_fallback_old_gpu(monkeypatch, fresh_log):
    """The dispatcher's use of the capability check (CPU tensors stand in for a GPU's)."""
    message = "compute capability 8.6 has no fp8 tensor cores (needs 8.9+)"
    monkeypatch.setattr(mod, "_device_reason", lambda device, pv_fp8: message)
    q, k, v = _qkv(1, 2, 5, 7, 64, torch.bfloat16, seed=0)
    _assert_falls_back(q, k, v, fresh_log, message)


def test_reason_of_q_alone(monkeypatch):
    """attention_8bit_reason(x) answers from one tensor what that tensor decides."""
    q, _, _ = _qkv(1, 2, 5, 7, 64, torch.bfloat16, seed=0)
    assert attention_8bit_reason(q) is None
    assert "head size 80" in attention_8bit_reason(torch.ones(1, 2, 5, 80, dtype=q.dtype))
    assert "torch.float32" in attention_8bit_reason(q.float())
    monkeypatch.setenv("QWEN_TURBO_DISABLE_KERNELS", "1")
    assert "QWEN_TURBO_DISABLE_KERNELS" in attention_8bit_reason(q)


def test_fallback_logged_once_per_reason(monkeypatch, fresh_log):
    q, k, v = _qkv(1, 2, 5, 7, 64, torch.bfloat16, seed=0)
    x64_args = (q.double(), k.double(), v.double())
    assert_logged_once_per_reason(
        monkeypatch, fresh_log, OP, attention_8bit, (q, k, v), x64_args, x64_args
    )


# GPU: the real Qwen-Image joint sequence at 2512^2 (256 text + 157 x 157 image tokens).

QWEN_SHAPE = (1, 24, 24905, 128)


def _gpu_rel_to_fp32_sdpa(out, q, k, v):
    """Relative L2 of out against float32 SDPA (float64 stand-in: its error is ~1e-6)."""
    exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    return ((out.float() - exact).norm() / exact.norm()).item()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("pv_fp8", [True, False])
def test_gpu_qwen_shape(kernel_only, pv_fp8):
    b, h, seq, d = QWEN_SHAPE
    q, k, v = _qkv(b, h, seq, seq, d, torch.bfloat16, seed=20, device="cuda")
    out = attention_8bit(q, k, v, pv_fp8)
    assert out.shape == q.shape and out.dtype == q.dtype and out.isfinite().all()
    assert _gpu_rel_to_fp32_sdpa(out, q, k, v) <= EXACT_TOL[pv_fp8]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("pv_fp8", [True, False])
def test_gpu_kernel_matches_reference(kernel_only, pv_fp8, d):
    """The compiled kernel at a fixed tiling against the PyTorch model of the algorithm: the
    GPU's exp2, divisions and fp8 tensor-core sums differ from it only in rounding."""
    q, k, v = _qkv(2, 4, 1000, 2077, d, torch.bfloat16, seed=21, device="cuda")
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device="cuda")
    mod._launch(q, k, v, out, pv_fp8, config=(128, 64, 8, 4))
    ref = attention_8bit_reference(q, k, v, pv_fp8, block_n=64)
    assert _rel(out, ref) <= 3e-3
    assert _gpu_rel_to_fp32_sdpa(out, q, k, v) <= EXACT_TOL[pv_fp8]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "kind", ["same channels x20", "q and k in other channels x50", "q x100", "k x100"]
)
def test_gpu_outliers(kernel_only, kind):
    q, k, v = (t.cuda() for t in _outliers(kind, seed=22))
    out = attention_8bit(q, k, v)
    assert out.isfinite().all()
    assert _gpu_rel_to_fp32_sdpa(out, q, k, v) <= EXACT_TOL[True]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_huge_values_finite(kernel_only, dtype):
    """Values near float16's range at the real sequence length: finite, within v's range."""
    b, h, seq, d = QWEN_SHAPE
    q, k, v = _qkv(b, h, seq, seq, d, dtype, seed=23, device="cuda")
    q, k, v = q * 1e3, k * 1e3, v * 5e3  # float16: |v| up to ~3e4 of 65504
    out = attention_8bit(q, k, v)
    assert out.isfinite().all()
    assert (out.float().abs() <= _v_bound(v)).all()


@pytest.mark.gpu
@needs_cuda
def test_gpu_cuda_graph_capture(kernel_only):
    q, k, v = _qkv(1, 24, 1000, 1000, 128, torch.bfloat16, seed=24, device="cuda")
    assert_cuda_graph_replays(lambda: attention_8bit(q, k, v), q, 2)
