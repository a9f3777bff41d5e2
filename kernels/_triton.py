"""Whether the pack's Triton kernels can run, decided once at import; never raises. Also
`custom_op`, the pack's way of registering its kernels' ops."""

import functools
import logging
import os

import torch

log = logging.getLogger(__name__)

try:
    import triton
    import triton.language as tl
except ImportError as e:  # no Triton: every op uses its eager reference
    triton = tl = None
    UNAVAILABLE = f"Triton is not installed ({e})"
else:
    UNAVAILABLE = None

HAS_TRITON = triton is not None
# TRITON_INTERPRET=1 runs the kernels on CPU tensors through Triton's interpreter (tests).
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_logged: set[tuple[str, str]] = set()
# The dtypes every kernel takes (x's; some ops also hold other inputs to them).
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def disabled() -> bool:
    """QWEN_TURBO_DISABLE_KERNELS=1 turns every kernel off (read per call, for tests)."""
    return os.environ.get("QWEN_TURBO_DISABLE_KERNELS", "") not in ("", "0")


def unsupported(x: torch.Tensor) -> str | None:
    """Why the Triton path cannot take `x`, or None when it can."""
    if disabled():
        return "disabled by QWEN_TURBO_DISABLE_KERNELS"
    if not HAS_TRITON:
        return UNAVAILABLE
    if not (x.is_cuda or (INTERPRET and x.device.type == "cpu")):
        return f"tensors on {x.device.type} are not supported"
    return None


def common_reason(x: torch.Tensor) -> str | None:
    """The checks every dispatcher makes first: `unsupported(x)`, then x's dtype."""
    reason = unsupported(x)
    if reason is not None:
        return reason
    if x.dtype not in DTYPES:
        return f"dtype {x.dtype} is not supported (bfloat16, float16, float32)"
    return None


def grad_reason(*tensors: torch.Tensor | None) -> str | None:
    """The check every dispatcher makes last: the kernels have no backward (None skipped)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return "inputs require grad and the kernel has no backward"
    return None


def log_fallback_once(op: str, reason: str) -> None:
    """Log a fallback once per (op, reason); silent while torch.compile traces."""
    if (op, reason) in _logged or torch.compiler.is_compiling():
        return
    _logged.add((op, reason))
    log.info("%s: using the PyTorch reference: %s", op, reason)


def custom_op(name: str, mutates_args: tuple[str, ...] = ()):
    """`torch.library.custom_op(name)`, called straight through outside torch.compile.

    torch.compile traces the registered op (one node, its fake rule, no graph break). Eager
    calls skip the dispatcher and its host time: the fused DiT's eager forward at 1328^2 is
    bound by the host (`benchmarks/host_time.py`). The op is `.op` (for
    `torch.library.opcheck`); `.register_fake` registers on it.
    """

    def register(fn):
        op = torch.library.custom_op(name, mutates_args=mutates_args)(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            return op(*args, **kwargs) if torch.compiler.is_compiling() else fn(*args, **kwargs)

        call.op = op
        call.register_fake = op.register_fake
        return call

    return register
