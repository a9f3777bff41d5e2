"""rms_norm_modulate, gated_rms_residual and the fused pair (Lumina-2 NextDiT) against float64.

On CPU the Triton kernels run through Triton's interpreter (TRITON_INTERPRET=1, set by
conftest), so shapes stay small. Tolerance rule (flash-attention's): the kernel's max error
against float64 may be at most twice the error of ComfyUI's own same-dtype ops, plus two ulps
of the output's magnitude. The fused op is held to the two separate ops bit for bit.
"""

import pytest
import torch

from qwen_turbo.kernels import rms_norm_gate as mod
from qwen_turbo.kernels.layernorm_modulate import MAX_D
from qwen_turbo.kernels.rms_norm_gate import (
    gated_rms_residual,
    gated_rms_residual_reference,
    gated_rms_residual_rms_norm_modulate,
    gated_rms_residual_rms_norm_modulate_reference,
    rms_norm_modulate,
    rms_norm_modulate_reference,
)
from tests.kernels.common import DTYPES, assert_error_rule, assert_logged_once, needs_triton, ulps

OP, OP_GATED, OP_FUSED = mod.OP, mod.OP_GATED, mod.OP_FUSED  # as the log names them
# what `kernel_only` makes fail
REFERENCES = (
    mod,
    "rms_norm_modulate_reference",
    "gated_rms_residual_reference",
    "gated_rms_residual_rms_norm_modulate_reference",
)
# (B, L, D): D = 96 and 33 leave masked lanes in the row's block; L = 1; B = 2 has two distinct
# scale and gate rows.
SHAPES = [(2, 5, 96), (2, 1, 33), (1, 7, 64)]
# the kernels' device: the GPU where there is one, else the CPU through Triton's interpreter
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
WHERE = "cuda:0" if DEVICE == "cuda" else "cpu"  # as the fallback messages name it


def _inputs(shape, dtype, seed):
    """x (B, L, D) with a non-zero mean, y, weight (D,) near 1, gate (B, D) (tanh's small and
    saturated ranges both), weight_next, scale_next (B, D); all rounded to `dtype`."""
    g = torch.Generator().manual_seed(seed)
    b, _, d = shape
    x = torch.randn(shape, generator=g) * 2 + 1
    y = torch.randn(shape, generator=g) * 3
    weight = 1 + 0.2 * torch.randn(d, generator=g)
    gate = torch.randn(b, d, generator=g) * 10 ** (torch.rand(b, d, generator=g) * 4 - 3)
    weight_next = 1 + 0.2 * torch.randn(d, generator=g)
    scale_next = torch.randn(b, d, generator=g) * 0.5
    return [t.to(DEVICE, dtype) for t in (x, y, weight, gate, weight_next, scale_next)]


def _rule(out, exact, eager):
    """Kernel error vs float64 <= 2 x (eager same-dtype error vs float64) + 2 ulps."""
    assert out.dtype == eager.dtype and out.shape == eager.shape and out.is_contiguous()
    assert not out.isnan().any()
    assert_error_rule(out, exact, eager, ulps(2, out.dtype, exact))


def _check_modulate(out, x, weight, scale):
    exact = rms_norm_modulate_reference(x.double(), weight.double(), scale.double())
    _rule(out, exact, rms_norm_modulate_reference(x, weight, scale))


def _check_gated(h, x, y, weight, gate):
    exact = gated_rms_residual_reference(x.double(), y.double(), weight.double(), gate.double())
    _rule(h, exact, gated_rms_residual_reference(x, y, weight, gate))


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_modulate_matches_fp64(kernel_only, dtype, shape):
    x, _, weight, _, _, scale = _inputs(shape, dtype, seed=shape[2])
    _check_modulate(rms_norm_modulate(x, weight, scale), x, weight, scale)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_gated_rms_residual_matches_fp64(kernel_only, dtype, shape):
    x, y, weight, gate, _, _ = _inputs(shape, dtype, seed=shape[2] + 1)
    _check_gated(gated_rms_residual(x, y, weight, gate), x, y, weight, gate)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_equals_the_two_ops(kernel_only, dtype, shape):
    """Same bits as gated_rms_residual then rms_norm_modulate (the norm reads h as stored),
    and each output within the rule of float64 (out: of the rounded h)."""
    x, y, weight, gate, weight_next, scale_next = args = _inputs(shape, dtype, seed=shape[2] + 2)
    h, out = gated_rms_residual_rms_norm_modulate(*args)
    h2 = gated_rms_residual(x, y, weight, gate)
    torch.testing.assert_close(h, h2, rtol=0, atol=0)
    torch.testing.assert_close(out, rms_norm_modulate(h2, weight_next, scale_next), rtol=0, atol=0)
    _check_gated(h, x, y, weight, gate)
    _check_modulate(out, h, weight_next, scale_next)


@needs_triton
def test_batch_rows_take_their_own_scale_and_gate(kernel_only):
    """B = 2 with the same tokens: only the (B, D) rows differ, and so do the outputs."""
    x, y, weight, gate, weight_next, scale_next = _inputs((2, 3, 40), torch.float32, seed=3)
    x, y = x[:1].expand(2, -1, -1), y[:1].expand(2, -1, -1)
    h, out = gated_rms_residual_rms_norm_modulate(x, y, weight, gate, weight_next, scale_next)
    for b in range(2):
        args = (x[b : b + 1], y[b : b + 1], weight, gate[b : b + 1], weight_next)
        h_b, out_b = gated_rms_residual_rms_norm_modulate(*args, scale_next[b : b + 1])
        torch.testing.assert_close(h[b : b + 1], h_b, rtol=0, atol=0)
        torch.testing.assert_close(out[b : b + 1], out_b, rtol=0, atol=0)
    assert not torch.equal(h[0], h[1]) and not torch.equal(out[0], out[1])


@needs_triton
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # saturation
def test_tanh_within_a_few_ulps(kernel_only):
    """x = 0, y = 1, weight = 1, eps = 0: h = tanh(gate) in float32, for gates from 1e-30 to
    100 of both signs (the polynomial below 1/4, the exp form above, saturation)."""
    mags = torch.cat(
        [torch.tensor([0.0, 1e-30, 1e-6]), torch.logspace(-4, 2, 61), torch.tensor([0.2499, 0.25])]
    )
    gate = torch.cat([mags, -mags])[None].to(DEVICE)
    d = gate.shape[1]
    x, y, weight = (torch.zeros(1, 1, d), torch.ones(1, 1, d), torch.ones(d))
    x, y, weight = x.to(DEVICE), y.to(DEVICE), weight.to(DEVICE)
    h = gated_rms_residual(x, y, weight, gate, eps=0.0)[0, 0].double()
    exact = gate[0].double().tanh()
    err = (h - exact).abs() / exact.abs().clamp_min(1e-300)
    assert err.max().item() <= 4 * torch.finfo(torch.float32).eps, err.max()


@needs_triton
def test_launchers_write_every_element():
    """Poisoned outputs, launched directly: every element written, the fused `out` too."""
    x, y, weight, gate, weight_next, scale_next = _inputs((2, 3, 48), torch.float32, seed=4)
    nans = [torch.full_like(x, float("nan")) for _ in range(3)]
    out = mod._launch(x, weight, scale_next, 1e-5, nans[0])
    _check_modulate(out, x, weight, scale_next)
    h, out = mod._launch_gated(x, y, weight, gate, 1e-5, nans[1], weight_next, scale_next, nans[2])
    _check_gated(h, x, y, weight, gate)
    _check_modulate(out, h, weight_next, scale_next)


@needs_triton
def test_non_contiguous_inputs(kernel_only):
    """The block's layouts: x the image rows of a joint sequence (strided rows, taken as they
    are), y a transposed view (D not contiguous: copied first), scale and gate chunks of the
    (B, 4D) adaLN vector, a strided weight (copied)."""
    x, y, weight, gate, weight_next, scale_next = _inputs((2, 5, 96), torch.bfloat16, seed=5)
    x = torch.cat([torch.zeros(2, 3, 96, dtype=x.dtype, device=x.device), x], dim=1)[:, 3:]
    y = y.mT.contiguous().mT
    scale, gate_, scale_next, gate_next = torch.cat([scale_next, gate, scale_next, gate], 1).chunk(
        4, 1
    )
    weight = torch.stack([weight, weight], 1)[:, 0]
    assert x.stride(-1) == 1 and not x.is_contiguous() and y.stride(-1) != 1
    assert gate_.stride(0) == 4 * 96 and weight.stride(0) == 2
    _check_modulate(rms_norm_modulate(x, weight, scale), x, weight, scale)
    _check_gated(gated_rms_residual(x, y, weight, gate_), x, y, weight, gate_)
    h, out = gated_rms_residual_rms_norm_modulate(x, y, weight, gate_, weight_next, scale_next)
    _check_gated(h, x, y, weight, gate_)
    assert h.is_contiguous() and out.is_contiguous()


@needs_triton
def test_empty_input(kernel_only):
    x, y, weight, gate, weight_next, scale_next = _inputs((2, 0, 64), torch.bfloat16, seed=0)
    assert rms_norm_modulate(x, weight, scale_next).shape == x.shape
    assert gated_rms_residual(x, y, weight, gate).shape == x.shape
    h, out = gated_rms_residual_rms_norm_modulate(x, y, weight, gate, weight_next, scale_next)
    assert h.shape == out.shape == x.shape


# Fallbacks: each branch of the dispatchers sends the call to the reference, logged once.

CALLS = {  # op -> (entry point, reference, which of _inputs' tensors it takes)
    OP: (rms_norm_modulate, rms_norm_modulate_reference, (0, 2, 5)),
    OP_GATED: (gated_rms_residual, gated_rms_residual_reference, (0, 1, 2, 3)),
    OP_FUSED: (
        gated_rms_residual_rms_norm_modulate,
        gated_rms_residual_rms_norm_modulate_reference,
        range(6),
    ),
}


def _assert_falls_back(op, args, caplog, reason):
    fn, reference, _ = CALLS[op]
    out, expected = fn(*args), reference(*args)
    for a, b in zip(out if op == OP_FUSED else [out], expected if op == OP_FUSED else [expected],
                    strict=True):  # fmt: skip
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert_logged_once(caplog, op, reason)


def _args(op, shape=(2, 3, 64), dtype=torch.float32, device=DEVICE, **change):
    """The op's arguments from _inputs on `device`, with those named in `change` (x, y, weight,
    gate, weight_next, scale_next: a function of the tensor) replaced."""
    names = ("x", "y", "weight", "gate", "weight_next", "scale_next")
    ts = {n: t.to(device) for n, t in zip(names, _inputs(shape, dtype, seed=6), strict=True)}
    for name, f in change.items():
        ts[name] = f(ts[name])
    return [ts[names[i]] for i in CALLS[op][2]]


@pytest.mark.parametrize("op", list(CALLS))
def test_fallback_cpu_outside_interpreter(op, no_interpreter, fresh_log):
    _assert_falls_back(op, _args(op, device="cpu"), fresh_log, "tensors on cpu are not supported")


@pytest.mark.parametrize("op", list(CALLS))
def test_fallback_disabled(op, monkeypatch, fresh_log):
    monkeypatch.setenv("QWEN_TURBO_DISABLE_KERNELS", "1")
    _assert_falls_back(op, _args(op), fresh_log, "disabled by QWEN_TURBO_DISABLE_KERNELS")


@pytest.mark.parametrize("op", list(CALLS))
def test_fallback_no_triton(op, triton_missing, fresh_log):
    _assert_falls_back(op, _args(op), fresh_log, "Triton is not installed")


@pytest.mark.parametrize("op", list(CALLS))
def test_fallback_float64(op, fresh_log):
    _assert_falls_back(op, _args(op, dtype=torch.float64), fresh_log, "dtype torch.float64")


@pytest.mark.parametrize("op", list(CALLS))
def test_fallback_requires_grad(op, fresh_log):
    args = _args(op, weight=lambda t: t.requires_grad_())
    _assert_falls_back(op, args, fresh_log, "require grad")


@pytest.mark.parametrize("op", list(CALLS))
def test_fallback_4d_input(op, fresh_log):
    """(B, 1, L, D) still broadcasts in the reference against (B, 1, D) scales and gates."""
    args = _args(op, x=lambda t: t[:, None], y=lambda t: t[:, None], gate=lambda t: t[:, None],
                 scale_next=lambda t: t[:, None])  # fmt: skip
    _assert_falls_back(op, args, fresh_log, "x has 4 dims")


@pytest.mark.parametrize("op", [OP_GATED, OP_FUSED])
def test_fallback_y_broadcast(op, fresh_log):
    """y (B, 1, D) broadcast over the tokens: the reference only."""
    _assert_falls_back(op, _args(op, y=lambda t: t[:, :1]), fresh_log, "y ((2, 1, 64)")


@pytest.mark.parametrize("op", [OP_GATED, OP_FUSED])
def test_fallback_y_dtype(op, fresh_log):
    args = _args(op, y=lambda t: t.bfloat16())
    _assert_falls_back(op, args, fresh_log, f"torch.bfloat16, {WHERE}) is not as x")


@pytest.mark.parametrize("op", list(CALLS))
def test_fallback_weight_shape(op, fresh_log):
    """A (1, D) weight: F.rms_norm normalises over x's last two dims (L = 1 here)."""
    args = _args(op, shape=(2, 1, 64), weight=lambda t: t[None])
    _assert_falls_back(op, args, fresh_log, "weight of shape (1, 64) is not (D,)")


@pytest.mark.parametrize("op", list(CALLS))
def test_fallback_scale_shape(op, fresh_log):
    """One (1, D) scale or gate for a batch of 2 still broadcasts in the reference."""
    args = _args(op, gate=lambda t: t[:1], scale_next=lambda t: t[:1])
    _assert_falls_back(op, args, fresh_log, "is not (B, D) = (2, 64)")


@pytest.mark.parametrize("op", list(CALLS))
def test_fallback_scale_dtype(op, fresh_log):
    """float32 scales and gates with bf16 x and y: ComfyUI's ops promote; so does the
    fallback (the kernels would return bf16)."""
    args = _args(op, dtype=torch.bfloat16, gate=lambda t: t.float(), scale_next=lambda t: t.float())
    _assert_falls_back(op, args, fresh_log, f"torch.float32, {WHERE}) is not (B, D)")


@pytest.mark.parametrize("op", list(CALLS))
def test_fallback_too_wide(op, fresh_log):
    d = MAX_D + 8
    _assert_falls_back(op, _args(op, shape=(1, 2, d)), fresh_log, f"D = {d} is wider")


# The references are ComfyUI's own ops (comfy.ops RMSNorm, lumina's modulate), bit for bit.


@pytest.mark.host
@pytest.mark.parametrize("cast", [False, True])
def test_references_are_comfyuis_ops(cast):
    import comfy.ops
    from comfy.ldm.lumina.model import modulate

    ops = comfy.ops.manual_cast if cast else comfy.ops.disable_weight_init
    x, y, weight, gate, weight_next, scale = (
        t.cpu() for t in _inputs((2, 5, 64), torch.bfloat16, seed=7)
    )
    norm1, norm2 = (ops.RMSNorm(64, eps=1e-5, elementwise_affine=True, dtype=torch.bfloat16)
                    for _ in range(2))  # fmt: skip
    with torch.no_grad():
        norm1.weight.copy_(weight_next)
        norm2.weight.copy_(weight)
        h = x + gate.unsqueeze(1).tanh() * norm2(y)  # JointTransformerBlock.forward
        out = modulate(norm1(h), scale)
    h_ref, out_ref = gated_rms_residual_rms_norm_modulate_reference(
        x, y, weight, gate, weight_next, scale
    )
    torch.testing.assert_close(h_ref, h, rtol=0, atol=0)
    torch.testing.assert_close(out_ref, out, rtol=0, atol=0)
