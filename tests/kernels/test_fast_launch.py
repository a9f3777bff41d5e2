"""kernels/_triton.FastLaunch: the compiled launcher called directly, keyed finer than Triton
specializes, with Triton's own path for misses, hooks and Triton versions not checked."""

import itertools

import pytest
import torch

from qwen_turbo.kernels import _triton
from tests.kernels.common import needs_cuda

triton = pytest.importorskip("triton")
tl = triton.language


def test_the_key_is_finer_than_tritons_specialization():
    """Arguments with one key always get one specialization from Triton (else a launch could
    run a kernel compiled for another alignment or integer type)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    base = torch.empty(64)
    ints = [0, 1, 2, 15, 16, 17, 32, 48, -1, -16, -17, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16,
            -(2**31), -(2**31) - 16, 2**40 + 3, 2**63 - 16, 2**63, 2**64 - 16]  # fmt: skip
    args = [*ints, True, False, 0.5, 16.0, None, *(base[i:] for i in range(6)),
            *(base.to(d)[i:] for d in (torch.bfloat16, torch.uint8) for i in range(9))]  # fmt: skip
    seen: dict = {}
    for a in args:
        triton_spec = native_specialize_impl(CUDABackend, a, False, True, True)
        seen.setdefault(_triton._spec(a), set()).add(triton_spec)
    assert all(len(specs) == 1 for specs in seen.values()), seen
    assert len(seen) > 10  # the keys do tell arguments apart
    with pytest.raises(TypeError):
        _triton._spec("a string")


def test_a_launch_hook_is_seen_as_set_only_when_it_is():
    assert not _triton._hooked(None)
    assert _triton._hooked(lambda metadata: None)
    chain = getattr(triton.knobs, "HookChain", None)
    if chain is not None:  # Triton 3.5+: the knob is a chain, empty unless a profiler adds one
        hooks = chain()
        assert not _triton._hooked(hooks)
        hooks.add(lambda metadata: None)
        assert _triton._hooked(hooks)


@pytest.mark.parametrize("version", ["3.3.1", "3.7.0", "4.0.0"])
def test_triton_versions_not_checked_launch_through_triton(monkeypatch, version):
    monkeypatch.setattr(_triton, "INTERPRET", False)
    monkeypatch.setattr(triton, "__version__", version)
    assert version in _triton._direct_reason()


def test_the_environment_can_turn_direct_launches_off(monkeypatch):
    monkeypatch.setattr(_triton, "INTERPRET", False)
    monkeypatch.setenv("QWEN_TURBO_TRITON_JIT_LAUNCH", "1")
    assert "QWEN_TURBO_TRITON_JIT_LAUNCH" in _triton._direct_reason()


def test_the_interpreter_launches_through_triton(monkeypatch):
    monkeypatch.setattr(_triton, "INTERPRET", True)
    assert "interpreter" in _triton._direct_reason()
    fn = object()
    monkeypatch.setattr(_triton, "DIRECT_UNAVAILABLE", "interpreter")
    assert _triton.fast_launch(fn) is fn


class _StandIn:
    """What FastLaunch uses of a `triton.jit` kernel: its parameters, `kernel[grid](...)`
    (Triton's own path, recorded), and the compiled kernel that call returns (its launcher
    recorded). For the launch logic on machines without a GPU; the GPU test below launches
    a real kernel."""

    __name__ = "_stand_in_kernel"

    def __init__(self):
        import inspect

        names = [("x_ptr", False), ("n", False), ("a", False), ("BLOCK", True), ("FLAG", True)]
        self.params = [
            type("Param", (), {"name": n, "is_constexpr": c,
                               "default": False if n == "FLAG" else inspect.Parameter.empty})()
            for n, c in names
        ]  # fmt: skip
        self.jit_calls, self.direct = [], []
        stand_in = self

        class Compiled:
            function, packed_metadata = "function", "metadata"

            @staticmethod
            def run(*args):
                stand_in.direct.append(args)

        self.compiled = Compiled

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.jit_calls.append((grid, args, meta))
            return self.compiled

        return launch


@pytest.fixture
def stand_in(monkeypatch):
    if not hasattr(triton, "knobs"):
        pytest.skip(f"Triton {triton.__version__} has no knobs (FastLaunch is off there)")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)
    return _triton.FastLaunch(_StandIn())


def test_a_launch_seen_before_goes_to_the_compiled_launcher_with_every_parameter(stand_in):
    jit = stand_in.jit
    x = torch.empty(64)
    stand_in[(3, 2)](x, 100, 0.5, BLOCK=64)  # compiled through Triton's path
    stand_in[(5,)](x, 200, 0.25, BLOCK=64)  # same key: n is neither 1 nor a multiple of 16
    assert len(jit.jit_calls) == 1
    # grid padded to three, the stream, then every parameter in order: FLAG's default last
    assert jit.direct == [(5, 1, 1, 1234, "function", "metadata", None, None, None,
                           x, 200, 0.25, 64, False)]  # fmt: skip


@pytest.mark.parametrize(
    "change",
    [
        lambda t: ((t[1:], 100, 0.5), {"BLOCK": 64}),  # x no longer 16-byte aligned
        lambda t: ((t, 96, 0.5), {"BLOCK": 64}),  # n a multiple of 16
        lambda t: ((t, 1, 0.5), {"BLOCK": 64}),  # n == 1: a constexpr to Triton
        lambda t: ((t, 2**31, 0.5), {"BLOCK": 64}),  # n an i64
        lambda t: ((t.half(), 100, 0.5), {"BLOCK": 64}),  # another dtype
        lambda t: ((t, 100, 0.5), {"BLOCK": 128}),  # another constexpr
        lambda t: ((t, 100, 0.5), {"BLOCK": 64, "num_warps": 8}),  # another option
        lambda t: ((t, 100, 0.5, 64, True), {}),  # constexprs by position, another value
    ],
)
def test_what_triton_specializes_on_takes_triton_s_path_again(stand_in, change):
    x = torch.empty(64)
    stand_in[(1,)](x, 100, 0.5, BLOCK=64)
    args, meta = change(x)
    stand_in[(1,)](*args, **meta)
    assert len(stand_in.jit.jit_calls) == 2 and not stand_in.jit.direct


@pytest.mark.parametrize(
    "how",
    ["runtime argument by name", "callable grid", "argument without a key", "launch hook"],
)
def test_launches_fastlaunch_cannot_key_take_triton_s_path_every_time(stand_in, monkeypatch, how):
    x = torch.empty(64)
    grid, args, meta = (1,), (x, 100, 0.5), {"BLOCK": 64}
    if how == "runtime argument by name":
        args, meta = (x, 100), {"a": 0.5, "BLOCK": 64}
    elif how == "callable grid":
        grid = lambda meta: (1,)  # noqa: E731
    elif how == "argument without a key":
        args = (x, 100, "0.5")
    else:
        monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", lambda metadata: None)
    for _ in range(3):
        stand_in[grid](*args, **meta)
    assert len(stand_in.jit.jit_calls) == 3 and not stand_in.jit.direct


def test_a_launcher_that_refuses_its_arguments_sends_every_launch_through_triton(
    stand_in, monkeypatch, caplog
):
    """A Triton whose launcher parses other arguments than 3.4-3.6's raises before launching:
    that launch and all later ones go through Triton's own path, with a warning."""
    monkeypatch.setattr(_triton.FastLaunch, "refused", None)
    jit = stand_in.jit

    def refuse(*args):
        raise TypeError("function takes exactly 14 arguments (13 given)")

    monkeypatch.setattr(jit.compiled, "run", staticmethod(refuse))
    x = torch.empty(64)
    with caplog.at_level("WARNING", logger=_triton.__name__):
        for _ in range(3):
            stand_in[(1,)](x, 100, 0.5, BLOCK=64)
    assert len(jit.jit_calls) == 3
    assert "refused the direct call" in caplog.text
    assert _triton.FastLaunch.refused is not None


@triton.jit
def _axpb_kernel(x_ptr, out_ptr, n, b, a, BLOCK: tl.constexpr, SQUARE: tl.constexpr):
    """out = a * x + b (squared with SQUARE): a float32 `a`, an int `b`."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    y = a * x + b
    if SQUARE:
        y = y * y
    tl.store(out_ptr + offs, y, mask=offs < n)


def _reference(x, b, a, square):
    y = a * x.double() + b
    return (y * y if square else y).float()


@pytest.mark.gpu
@needs_cuda
def test_direct_launches_match_tritons_and_are_keyed_on_what_triton_specializes(monkeypatch):
    if _triton.DIRECT_UNAVAILABLE is not None:
        pytest.skip(_triton.DIRECT_UNAVAILABLE)
    kernel = _triton.FastLaunch(_axpb_kernel)
    g = torch.Generator("cuda").manual_seed(0)
    base = torch.randn(4100, device="cuda", generator=g)
    jit_launches = []
    run = type(_axpb_kernel).run

    def counted(self, *args, **kwargs):
        jit_launches.append(args)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(type(_axpb_kernel), "run", counted)
    # odd sizes, a misaligned view, ints that are 1 or multiples of 16, both constexprs
    cases = itertools.product((0, 1), (4099, 1000), (1, 16, 17), (False, True))
    for offset, n, b, square in cases:
        x = base[offset : offset + n]
        out = torch.full((n + 1,), float("nan"), device="cuda")[1:]  # misaligned, poisoned
        for _ in range(2):  # a miss, then a direct launch
            out.fill_(float("nan"))
            kernel[(triton.cdiv(n, 256),)](x, out, n, b, 0.5, BLOCK=256, SQUARE=square)
            torch.testing.assert_close(out, _reference(x, b, 0.5, square), rtol=1e-6, atol=1e-6)
    assert len(jit_launches) == len(kernel.kernels) > 8  # each key went through Triton once

    # constexprs given by position are keyed on their values
    x, out = base[:1000], torch.empty(1000, device="cuda")
    for square in (False, True, False, True):
        kernel[(4,)](x, out, 1000, 16, 0.5, 256, square)
        torch.testing.assert_close(out, _reference(x, 16, 0.5, square), rtol=1e-6, atol=1e-6)

    # inside a CUDA graph: the direct launch is captured and replays
    x, out = base[:1000].clone(), torch.empty(1000, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        kernel[(4,)](x, out, 1000, 16, 0.5, BLOCK=256, SQUARE=False)
    x.copy_(base[1000:2000])
    out.fill_(float("nan"))
    graph.replay()
    torch.testing.assert_close(out, _reference(x, 16, 0.5, False), rtol=1e-6, atol=1e-6)

    # a launch hook (a profiler's) sees every launch: Triton's own path
    before = len(jit_launches)
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", lambda *a: None)
    kernel[(4,)](x, out, 1000, 16, 0.5, BLOCK=256, SQUARE=False)
    assert len(jit_launches) == before + 1
