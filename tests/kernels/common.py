"""Helpers the kernel tests share: markers, the float64 tolerance rule, fallback logs."""

import pytest
import torch

from qwen_turbo.kernels import _triton

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
LOGGER = _triton.__name__
needs_triton = pytest.mark.skipif(not _triton.HAS_TRITON, reason="Triton is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def ulps(n, dtype, exact):
    """n ulps of `dtype` at the largest magnitude of `exact`."""
    return n * torch.finfo(dtype).eps * exact.abs().max().item()


def assert_error_rule(out, exact, eager, atol):
    """Flash-attention's rule: the kernel's max error against `exact` is at most twice the
    error of the same-dtype eager result, plus `atol`. Errors are taken in exact's dtype:
    float64, or float32 standing in for it on the GPU."""
    err = (out.to(exact.dtype) - exact).abs().max().item()
    err_eager = (eager.to(exact.dtype) - exact).abs().max().item()
    assert err <= 2 * err_eager + atol, (err, err_eager, atol)


def rotations(shape, seed=0):
    """A table of random 2x2 rotations of any shape (..., n, 2, 2), as RoPE's freqs."""
    angle = torch.randn(shape[:-2], generator=torch.Generator().manual_seed(seed))
    rot = torch.stack([angle.cos(), -angle.sin(), angle.sin(), angle.cos()], dim=-1)
    return rot.reshape(shape)


def fallback_messages(caplog, op):
    """The fallback messages logged for `op` ("<op>: using the PyTorch reference: ...")."""
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"{op}:")]


def assert_logged_once(caplog, op, reason):
    messages = fallback_messages(caplog, op)
    assert len(messages) == 1 and reason in messages[0], messages


def assert_cuda_graph_replays(run, x, dim):
    """Capture run() in a CUDA graph (warmed up on a side stream first, so that compiling
    happens outside the capture); after x is flipped along `dim` in place, a replay must
    give what a fresh call gives, and differ from the first result."""
    expected = run()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # warm up: compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    x.copy_(x.flip(dim))
    graph.replay()
    torch.testing.assert_close(captured, run(), rtol=0, atol=0)
    assert not torch.equal(captured, expected)


def assert_compiles_full_graph(step, x):
    """torch.compile(step) traces as one graph (no breaks at the op) and gives step's bits."""
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), step(x), rtol=0, atol=0)
