"""Stand-ins for the CUDA graph backend (`runtime.graphs.capture.CudaGraphs`) that run on CPU:
capture once, replay into the same output buffer from the static inputs; `TracedBlocks`, the
same for the block graphs. `cached`: a model through a step-caching node."""

import comfy.model_management
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class FakeGraphs:
    """A replay reruns the captured function (its Python included); the pool holds 100 bytes."""

    calls = 0

    @staticmethod
    def supports(x):
        return None

    @classmethod
    def capture(cls, run, mode="global"):
        cls.calls += 1
        out = run()
        return (lambda: out.copy_(run())), out, 100, out.clone()


class FailingGraphs(FakeGraphs):
    @classmethod
    def capture(cls, run, mode="global"):
        cls.calls += 1
        raise RuntimeError("operation not permitted when stream is capturing")


aten = torch.ops.aten
ALLOCATIONS = (aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty,
               aten.new_empty_strided)  # fmt: skip


class Recorder(TorchDispatchMode):
    """Records the aten ops run under it, with the tensors they read and wrote."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append((func, args, kwargs or {}, out))
        return out

    @torch.no_grad()  # as a CUDA graph's kernels, which autograd never sees
    def replay(self):
        """Run the ops again on the same tensors, writing into the tensors they wrote; an
        allocation leaves its tensor as it is (a graph's memory is fixed, and no kernel
        writes it)."""
        for func, args, kwargs, out in self.ops:
            if func.overloadpacket in ALLOCATIONS:
                continue
            new = func(*args, **kwargs)
            for dst, src in zip(tree_leaves(out), tree_leaves(new), strict=True):
                if isinstance(dst, torch.Tensor) and dst is not src:
                    dst.copy_(src)


class TracedGraphs(FakeGraphs):
    """Replays the aten ops recorded at capture into the same tensors, as a CUDA graph replays
    its kernels on the same memory: the Python that issued them (its decisions and its state
    updates) runs at capture only."""

    @classmethod
    def capture(cls, run, mode="global"):
        cls.calls += 1
        first = run()  # warm-up, as CudaGraphs does: the capturing call's output
        with torch.no_grad(), Recorder() as recorder:
            out = run()
        return recorder.replay, out, 100, first


class OutOfMemoryGraphs(FakeGraphs):
    """Captures, then runs out of memory at the first replay (a graph pool that left a step
    too little room)."""

    @classmethod
    def capture(cls, run, mode="global"):
        _, out, nbytes, first = super().capture(run, mode)

        def replay():
            raise comfy.model_management.OOM_EXCEPTION("CUDA out of memory. Tried to allocate")

        return replay, out, nbytes, first


class CountingGraphs(TracedGraphs):
    replays = 0

    @classmethod
    def capture(cls, run, mode="global"):
        replay, out, nbytes, first = super().capture(run, mode)

        def counted():
            cls.replays += 1
            replay()

        return counted, out, nbytes, first


class TracedBlocks:
    """A stand-in for the block graphs' backend (`runtime.graphs.blocks.CudaBlockCapture`):
    captures by recording `run`'s ops (running it once); a replay runs them again."""

    def __init__(self, oom=False):
        self.captures = 0
        self.oom = oom

    @staticmethod
    def supports(x):
        return True

    def capture(self, run, need):
        self.captures += 1
        if self.oom:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate")
        with torch.no_grad(), Recorder() as recorder:
            run()
        return recorder.replay

    def pool_bytes(self):
        return 100

    def reset(self):
        pass


def cached(node, model):
    """`model` through a step-caching node (EasyCache, LazyCache) whose threshold skips most
    steps."""
    return node.execute(model, 3.0, 0.0, 1.0, False).result[0]
