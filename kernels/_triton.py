"""Whether the pack's Triton kernels can run, decided once at import; never raises. Also
`custom_op`, the pack's way of registering its kernels' ops, and `fast_launch`, its way of
launching them."""

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


def _direct_reason() -> str | None:
    """Why `fast_launch` cannot call compiled launchers directly, or None."""
    if not HAS_TRITON:
        return UNAVAILABLE
    if INTERPRET:
        return "Triton's interpreter runs the kernels"
    if os.environ.get("QWEN_TURBO_TRITON_JIT_LAUNCH", "") not in ("", "0"):
        return "QWEN_TURBO_TRITON_JIT_LAUNCH is set"
    version = tuple(int(v) for v in triton.__version__.split(".")[:2] if v.isdigit())
    # 3.4-3.6 pass the launcher every parameter (earlier and later ones: other arguments)
    if not (3, 4) <= version < (3, 7) or not hasattr(triton, "knobs"):
        return f"Triton {triton.__version__}'s launcher takes other arguments than 3.4-3.6's"
    return None


DIRECT_UNAVAILABLE = _direct_reason()
if HAS_TRITON and not INTERPRET and DIRECT_UNAVAILABLE is not None:
    log.info("Triton kernels launch through Triton's own launcher: %s", DIRECT_UNAVAILABLE)
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


I32, I64 = 1 << 31, 1 << 63


def _spec(a) -> object:
    """What of one argument Triton specializes a kernel on (`native_specialize_impl`), or a
    finer key: a tensor's dtype and 16-byte alignment; an int's type (i32, i64, u64), whether
    it is 1 and whether a multiple of 16; the type of a bool, float or None."""
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if type(a) is int:
        return a == 1, a % 16 == 0, -I32 <= a < I32, a < I64
    if a is None or type(a) in (bool, float):
        return type(a)
    raise TypeError(f"no launch key for {type(a).__name__}")


def _hooked(hook) -> bool:
    """Whether a launch hook is set: a function, or a HookChain (Triton 3.5+) holding one."""
    return hook is not None and bool(getattr(hook, "calls", True))


class FastLaunch:
    """A `triton.jit` kernel launched as Triton's are (`kernel[grid](*args, **meta)`), through
    the compiled kernel's launcher once Triton has compiled it for the arguments' key
    (`_spec`: finer than Triton's own specialization). That skips `JITFunction.run`'s binding,
    cache lookup and launch metadata, which the eager DiT pays about 30 times a block
    (`benchmarks/host_time.py --jit-launch` compares the two). Misses, launch hooks (profilers) and
    callable grids take Triton's own path, and every launch once a launcher has refused its
    arguments (a Triton whose launcher parses others). Other attributes are the kernel's
    (`warmup`, `device_caches`)."""

    # why a compiled launcher refused its arguments; then every launch goes through Triton
    refused: str | None = None

    def __init__(self, jit):
        self.jit = jit
        self.params = [(p.name, p.is_constexpr, p.default) for p in jit.params]
        self.kernels: dict = {}
        # how many leading parameters are not constexprs (their args keyed by `_spec` alone)
        self.runtime = next((i for i, (_, c, _) in enumerate(self.params) if c), len(self.params))

    def __getattr__(self, name):
        return getattr(self.jit, name)

    def __getitem__(self, grid):
        return lambda *args, **meta: self.launch(grid, args, meta)

    def _key(self, args, meta) -> tuple:
        """The launch's key (constexprs given by position: their values); TypeError where an
        argument has none."""
        if len(args) <= self.runtime:
            specs = tuple(map(_spec, args))
        else:
            specs = tuple(
                a if c else _spec(a) for a, (_, c, _) in zip(args, self.params, strict=False)
            )
        return torch.cuda.current_device(), specs, tuple(meta.items())

    def launch(self, grid, args, meta):
        hooks = triton.knobs.runtime
        if callable(grid) or FastLaunch.refused is not None:
            return self.jit[grid](*args, **meta)
        if _hooked(hooks.launch_enter_hook) or _hooked(hooks.launch_exit_hook):
            return self.jit[grid](*args, **meta)
        try:
            key = self._key(args, meta)
            hit = self.kernels.get(key)
        except TypeError:  # an argument without a key, or an unhashable value
            return self.jit[grid](*args, **meta)
        if hit is None:
            compiled = self.jit[grid](*args, **meta)
            if compiled is None or any(not c and n in meta for n, c, _ in self.params):
                return compiled  # a runtime argument given by name: Triton's path each time
            # the launcher takes every parameter in order, constexprs included, as run() passes
            tail = tuple(meta.get(n, d) for n, _, d in self.params[len(args) :])
            self.kernels[key] = (compiled.run, compiled.function, compiled.packed_metadata, tail)
            return compiled
        run, function, metadata, tail = hit
        stream = torch._C._cuda_getCurrentRawStream(key[0])
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        try:
            run(grid[0], g1, g2, stream, function, metadata, None, None, None, *args, *tail)
        except TypeError as e:  # arguments this Triton's launcher does not parse: nothing ran
            FastLaunch.refused = str(e)
            log.warning("Triton kernels launch through Triton's own launcher from now on: %s "
                        "refused the direct call (%s)", self.jit.__name__, e)  # fmt: skip
            return self.jit[grid](*args, **meta)
        return None


def fast_launch(fn):
    """`fn` (a `triton.jit` kernel) as a `FastLaunch`, or itself where Triton's launcher cannot
    be called directly (`DIRECT_UNAVAILABLE`)."""
    return fn if DIRECT_UNAVAILABLE is not None else FastLaunch(fn)


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
