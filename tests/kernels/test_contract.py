"""The contract every kernel entry point keeps, checked from one table (KERNELS).

Its custom op passes torch.library.opcheck and traces into one torch.compile graph with no
fallback. Each common reason not to run the kernel (FALLBACKS: the env switch, no Triton,
CPU tensors outside the interpreter, float64, autograd, kernels/ imported without Triton)
returns the eager reference bit for bit, gradients included, without running the op, and is
logged once per reason. Each kernel's own file tests its numerics and its other fallbacks.
"""

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from qwen_turbo.kernels.fp8_linear import FP8, FP8_MAX
from qwen_turbo.kernels.qk_norm_rope import qk_norm_rope_reference
from qwen_turbo.kernels.upsample_conv3x3 import phase_weights
from tests.kernels.common import (
    assert_compiles_full_graph,
    fallback_messages,
    needs_triton,
    rotations,
)

# The interpreter evaluates SiLU and GELU on masked-off lanes too, where NumPy's exp may
# overflow; those lanes are never stored.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

DTYPE = torch.bfloat16  # the inputs' dtype, but for the float64 fallback
# why -> (the fixture that sets it up, the reason logged); "import" runs the fixture's copy
FALLBACKS = {
    "disabled": (None, "disabled by QWEN_TURBO_DISABLE_KERNELS"),
    "no_triton": ("triton_missing", "Triton is not installed"),
    "cpu": ("no_interpreter", "tensors on cpu"),
    "float64": (None, "torch.float64"),
    "grad": (None, "require grad"),
    "import": ("without_triton", "Triton is not installed"),
}
# torch.library.opcheck's default tests
OPCHECK = (
    "test_schema",
    "test_autograd_registration",
    "test_faketensor",
    "test_aot_dispatch_dynamic",
)


def _randn(dtype, *shapes):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g).to(dtype) for shape in shapes]


def _tensors(out):
    return list(out) if isinstance(out, tuple) else [out]


def _doubled(fn, *args):
    """The outputs times 2: the op inside the graph, not at its edge."""
    return [t.float() * 2 for t in _tensors(fn(*args))]


@dataclass
class Kernel:
    """An entry point of kernels/, what it is called with, and what it falls back to."""

    module: str  # kernels/<module>.py
    fn: str  # the entry point, called with inputs(dtype)
    inputs: Callable  # dtype -> the entry point's arguments, small CPU tensors
    reference: str | Callable  # what a fallback returns: this, or the module's function so named
    fallbacks: tuple = tuple(FALLBACKS)  # those that apply
    grad: int = 0  # the argument that requires grad in the "grad" fallback
    op: str | None = None  # the module's custom op, if any
    opcheck: Callable | None = None  # the inputs -> the op's argument tuples; None: not on CPU
    test_utils: tuple = OPCHECK
    step: Callable = _doubled  # (entry point, *inputs) -> what torch.compile's graph returns
    log: str = ""  # the name the fallback log gives, if not fn
    setup: Callable = lambda monkeypatch, module: None  # what the kernel needs besides CPU tensors
    triton: bool = True  # the op is a Triton kernel

    def __post_init__(self):
        self.log = self.log or self.fn


def _freqs_inputs(dtype):
    x, weight = _randn(dtype, (1, 1, 2, 64), (64,))
    return [x, weight, rotations((1, 1, 1, 32, 2, 2)).to(dtype)]


def _fp8_inputs(dtype):
    """x (3, K), an fp8 weight (N, K) with its float32 scale, bias (N,)."""
    x, w, b = _randn(torch.float32, (3, 64), (48, 64), (48,))
    scale = w.abs().max() / FP8_MAX
    return [x.to(dtype), (w / scale).to(FP8), scale, b.to(dtype)]


def _group_norm_inputs(dtype):
    x, weight, bias = _randn(dtype, (1, 96, 5, 7), (96,), (96,))
    return [x, 32, weight, bias]


def _into_joint(fn, x, weight, freqs, out):
    """Into rows of a buffer made in the graph, as the joint attention's."""
    joint = x.new_zeros(x.shape[0], x.shape[1] + 2, *x.shape[2:])
    fn(x, weight, freqs, joint[:, 1:-1])
    return joint * 2


def _on_gpu(monkeypatch, module):
    """cuDNN's frontend present and the device check passed (the interpreter stands in)."""
    monkeypatch.setattr(module, "cudnn", object())
    monkeypatch.setattr(module, "_device_reason", lambda device: None)


KERNELS = [
    Kernel(
        "channel_rms_norm_silu",
        "channel_rms_norm_silu",
        lambda dt: _randn(dt, (1, 96, 3, 5), (96, 1, 1), (96, 1, 1)),
        "channel_rms_norm_silu_reference",
        op="_channel_rms_norm_silu_op",
        opcheck=lambda x, g, b: [
            (x, g.reshape(-1), b.reshape(-1), True, 1e-12),
            (x, g.reshape(-1), None, False, 1e-12),
        ],
    ),
    Kernel(
        "gated_residual",
        "gated_residual",
        lambda dt: _randn(dt, (1, 3, 64), (1, 3, 64), (1, 64)),
        "gated_residual_reference",
        grad=2,
        op="_gated_residual_op",
        opcheck=lambda x, y, gate: [
            (x, y, gate, None, None),
            (x, y.mT.contiguous().mT, gate, None, None),
            (x, y, gate, torch.rand(3, 1) + 0.5, gate[0]),  # an Unscaled y
        ],
    ),
    Kernel(
        "gated_residual",
        "gated_residual_layernorm_modulate",
        lambda dt: _randn(dt, (1, 3, 64), (1, 3, 64), (1, 64), (1, 64), (1, 64)),
        "gated_residual_layernorm_modulate_reference",
        grad=4,
        op="_gated_residual_layernorm_modulate_op",
        opcheck=lambda x, y, *mods: [
            (x, y.mT.contiguous().mT, *mods, 1e-6, None, None),
            (x, y, *mods, 1e-6, torch.rand(3, 1) + 0.5, mods[0][0]),  # an Unscaled y
        ],
    ),
    Kernel(
        "layernorm_modulate",
        "layernorm_modulate",
        lambda dt: _randn(dt, (1, 3, 64), (1, 64), (1, 64)),
        "layernorm_modulate_reference",
        grad=2,
        op="_layernorm_modulate_op",
        opcheck=lambda x, *mods: [(x, *mods, 1e-6), (x.mT.contiguous().mT, *mods, 1e-6)],
    ),
    Kernel(
        "rms_norm_gate",
        "rms_norm_modulate",
        lambda dt: _randn(dt, (1, 3, 64), (64,), (1, 64)),
        "rms_norm_modulate_reference",
        grad=2,
        op="_rms_norm_modulate_op",
        opcheck=lambda x, w, scale: [(x, w, scale, 1e-5), (x.mT.contiguous().mT, w, scale, 1e-5)],
    ),
    Kernel(
        "rms_norm_gate",
        "gated_rms_residual",
        lambda dt: _randn(dt, (1, 3, 64), (1, 3, 64), (64,), (1, 64)),
        "gated_rms_residual_reference",
        grad=3,
        op="_gated_rms_residual_op",
        opcheck=lambda x, y, w, gate: [
            (x, y, w, gate, 1e-5),
            (x, y.mT.contiguous().mT, w, gate, 1e-5),
        ],
    ),
    Kernel(
        "rms_norm_gate",
        "gated_rms_residual_rms_norm_modulate",
        lambda dt: _randn(dt, (1, 3, 64), (1, 3, 64), (64,), (1, 64), (64,), (1, 64)),
        "gated_rms_residual_rms_norm_modulate_reference",
        grad=5,
        op="_gated_rms_residual_rms_norm_modulate_op",
        opcheck=lambda x, y, *rest: [(x, y.mT.contiguous().mT, *rest, 1e-5)],
    ),
    Kernel(
        "qk_norm_rope",
        "qk_norm_rope",
        _freqs_inputs,
        "qk_norm_rope_reference",
        grad=1,
        op="_qk_norm_rope_op",
        opcheck=lambda *args: [(*args, 1e-6, "bhld"), (*args, 1e-6, "blhd")],
    ),
    Kernel(
        "qk_norm_rope",
        "qk_norm_rope_into",
        lambda dt: [*_freqs_inputs(dt), torch.full((1, 1, 2, 64), float("nan"), dtype=dt)],
        lambda x, weight, freqs, out: qk_norm_rope_reference(x, weight, freqs, 1e-6, "blhd"),
        grad=1,
        op="_qk_norm_rope_into_op",
        opcheck=lambda x, weight, freqs, out: [
            (x, weight, freqs, 1e-6, out, None, None),
            (
                x,
                weight,
                freqs,
                1e-6,
                out,
                torch.rand(x.shape[0] * x.shape[1], 1) + 0.5,
                weight.repeat(x.shape[2]),
            ),  # an Unscaled x
        ],
        step=_into_joint,
        log="qk_norm_rope",
    ),
    Kernel(
        "group_norm_silu",
        "group_norm_silu",
        _group_norm_inputs,
        "group_norm_silu_reference",
        op="_group_norm_silu_op",
        opcheck=lambda x, groups, w, b: [
            (x, groups, w, b, 1e-6, True),
            (x, groups, None, None, 1e-6, False),
        ],
    ),
    Kernel(
        "fp8_linear",
        "quantize_rows",
        lambda dt: [*_randn(dt, (3, 64)), True],
        "quantize_rows_reference",
        op="_quantize_rows_op",
        opcheck=lambda x, gelu: [
            (x, False, None, None),
            (x, True, None, None),
            (x, True, torch.rand(3, 1) + 0.5, x[0]),  # an Unscaled x
        ],
    ),
    Kernel(
        "fp8_linear",
        "fp8_gemv",
        _fp8_inputs,
        "fp8_linear_reference",
        op="_fp8_gemv_op",
        opcheck=lambda x, w, scale, b: [
            (x, w, scale.reshape(1).expand(48).contiguous(), bias) for bias in (b, None)
        ],
        # not test_schema: it mutates the inputs to catch undeclared writes, and CPU torch
        # has no arithmetic on float8
        test_utils=OPCHECK[1:],
    ),
    Kernel(
        "attention_fp8",
        "attention_fp8",
        lambda dt: _randn(dt, (1, 2, 5, 64), (1, 2, 7, 64), (1, 2, 7, 64)),
        F.scaled_dot_product_attention,
        op="_attention_fp8_op",
        setup=_on_gpu,
    ),
    Kernel(
        "upsample_conv3x3",
        "upsample_conv3x3",
        lambda dt: _randn(dt, (1, 8, 5, 6), (4, 8, 3, 3), (4,)),
        "upsample_conv3x3_reference",
        fallbacks=("disabled",),
        op="_upsample_conv3x3_op",
        opcheck=lambda x, w, b: [(x, phase_weights(w), b), (x, phase_weights(w), None)],
        triton=False,
    ),
    Kernel(
        "linear_gelu",  # cuBLASLt's epilogue, CUDA only
        "linear_gelu",
        lambda dt: _randn(dt, (2, 5, 64), (48, 64), (48,)),
        "linear_gelu_reference",
        fallbacks=("disabled",),  # on CPU even under the interpreter: its file
        triton=False,
    ),
]


def _module(kernel):
    return importlib.import_module(f"qwen_turbo.kernels.{kernel.module}")


# the ops that run here (attention_fp8's runs cuDNN: its file's GPU tests compile it)
RUN_HERE = [
    pytest.param(k, id=k.fn, marks=needs_triton if k.triton else ()) for k in KERNELS if k.opcheck
]


def _bits(t):
    return t.view(torch.uint8) if t.dtype == FP8 else t


def _assert_same(out, expected):
    for a, b in zip(_tensors(out), _tensors(expected), strict=True):
        torch.testing.assert_close(_bits(a), _bits(b), rtol=0, atol=0)


def _grads(out, wrt):
    loss = sum(t.float().sum() for t in _tensors(out) if t.requires_grad and t.dtype != FP8)
    return torch.autograd.grad(loss, wrt)


def _op_ran(*args, **kwargs):
    raise AssertionError("the op ran")


def _fell_back(*args, **kwargs):
    raise AssertionError("fell back to the reference")


@pytest.mark.parametrize("kernel", RUN_HERE)
def test_op_passes_opcheck(kernel):
    op = getattr(_module(kernel), kernel.op).op
    for args in kernel.opcheck(*kernel.inputs(DTYPE)):
        torch.library.opcheck(op, args, test_utils=kernel.test_utils)


@pytest.mark.parametrize("kernel", RUN_HERE)
def test_compiles_to_one_graph(kernel, monkeypatch):
    """One graph, the op's bits, and no fallback (each logs: test_falls_back)."""
    module = _module(kernel)
    monkeypatch.setattr(module, "log_fallback_once", _fell_back)
    fn = getattr(module, kernel.fn)
    x, *rest = kernel.inputs(DTYPE)
    assert_compiles_full_graph(lambda x: kernel.step(fn, x, *rest), x)


@pytest.mark.parametrize(
    "kernel,why",
    [pytest.param(k, why, id=f"{k.fn}-{why}") for k in KERNELS for why in k.fallbacks],
)
def test_falls_back(kernel, why, request, monkeypatch, fresh_log):
    """The reference's result (and gradients), contiguous, the op not run, logged once."""
    fixture, reason = FALLBACKS[why]
    module = _module(kernel)
    reference = kernel.reference
    if isinstance(reference, str):
        reference = getattr(module, reference)
    if why == "import":
        module = request.getfixturevalue(fixture)(kernel.module)
        assert not module.HAS_TRITON and not hasattr(module, kernel.op)
    else:
        if fixture:
            request.getfixturevalue(fixture)
        if kernel.op:
            monkeypatch.setattr(module, kernel.op, _op_ran, raising=False)  # none without Triton
    kernel.setup(monkeypatch, module)
    if why == "disabled":
        monkeypatch.setenv("QWEN_TURBO_DISABLE_KERNELS", "1")
    args = kernel.inputs(torch.float64 if why == "float64" else DTYPE)
    if why == "grad":
        args[kernel.grad].requires_grad_()
    fn = getattr(module, kernel.fn)
    for _ in range(2):
        out = fn(*args)
    expected = reference(*args)
    _assert_same(out, expected)
    assert all(t.is_contiguous() for t in _tensors(out))
    messages = [r.getMessage() for r in fresh_log.records]
    messages = [m for m in messages if ": using the PyTorch reference: " in m]
    assert len(messages) == 1, messages  # once, and for this op only
    assert messages[0].startswith(f"{kernel.log}:") and reason in messages[0], messages
    if why == "grad":
        wrt = args[kernel.grad]
        _assert_same(_grads(out, wrt), _grads(expected, wrt))


@pytest.mark.parametrize(
    "kernel",
    [pytest.param(k, id=k.fn) for k in KERNELS if {"disabled", "float64"} <= set(k.fallbacks)],
)
def test_fallback_logged_once_per_reason(kernel, monkeypatch, fresh_log):
    """The env switch is checked first: float64 inputs log nothing more while it is on;
    off, they log their own reason, once."""
    module = _module(kernel)
    kernel.setup(monkeypatch, module)
    fn, op = getattr(module, kernel.fn), kernel.log
    args, args64 = kernel.inputs(DTYPE), kernel.inputs(torch.float64)
    monkeypatch.setenv("QWEN_TURBO_DISABLE_KERNELS", "1")
    for a in (args, args, args64):
        fn(*a)
    assert len(fallback_messages(fresh_log, op)) == 1
    monkeypatch.delenv("QWEN_TURBO_DISABLE_KERNELS")
    for _ in range(2):
        fn(*args64)
    messages = fallback_messages(fresh_log, op)
    assert len(messages) == 2 and "torch.float64" in messages[1], messages
