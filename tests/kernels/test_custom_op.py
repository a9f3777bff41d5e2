"""kernels/_triton.custom_op: eager calls run the function itself, torch.compile traces the op."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from qwen_turbo.kernels._triton import custom_op


@custom_op("qwen_turbo_test::double")
def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@double.register_fake
def _(x):
    return torch.empty_like(x)


class _Ops(TorchDispatchMode):
    """Records the name of every op dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_eager_call_skips_the_dispatcher():
    x = torch.randn(5)
    with _Ops() as ops:
        out = double(x)
    torch.testing.assert_close(out, x * 2, rtol=0, atol=0)
    assert not any("qwen_turbo_test" in name for name in ops.names), ops.names
    with _Ops() as ops:
        double.op(x)  # the registered op, as torch.compile sees it
    assert any("qwen_turbo_test.double" in name for name in ops.names), ops.names


def test_torch_compile_traces_the_op():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    x = torch.randn(5)
    torch._dynamo.reset()
    out = torch.compile(lambda x: double(x) + 1, backend=backend, fullgraph=True)(x)
    torch.testing.assert_close(out, x * 2 + 1, rtol=0, atol=0)
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert torch.ops.qwen_turbo_test.double.default in targets, targets
