"""The CUDA backend of the graph runners: capture with a warm-up on a side stream."""

import contextlib
import contextvars
from collections.abc import Callable

import torch

# Set while CudaGraphs captures a call, its warm-up included: the block graphs stand aside.
_capturing = contextvars.ContextVar("qwen_turbo_capturing_call", default=False)


def capturing_call() -> bool:
    """Whether a graph runner is capturing the call that runs now (or warming it up)."""
    return _capturing.get()


def side_stream(device: int) -> torch.cuda.Stream:
    """The one capture stream of `device`: cuBLAS keeps a workspace (32 MiB on Hopper) for
    every stream it has seen, so a new stream per capture would leak one per capture."""
    return CudaGraphs._side.setdefault(device, torch.cuda.Stream(device))


class CudaGraphs:
    """The real backend: torch.cuda.CUDAGraph with a warm-up on a side stream (`side_stream`)."""

    _side: dict[int, torch.cuda.Stream] = {}

    @staticmethod
    def supports(x: torch.Tensor) -> str | None:
        if not x.is_cuda:
            return f"tensors on {x.device.type}"
        if torch.cuda.is_current_stream_capturing():
            return "already inside a capture"
        return None

    @staticmethod
    def capture(
        run: Callable[[], torch.Tensor], mode: str = "thread_local"
    ) -> tuple[Callable[[], None], torch.Tensor, int, torch.Tensor]:
        """(replay, the graph's output, the bytes its pool took, the warm-up's output).
        The warm-up (lazy init, cuBLAS/cuDNN workspaces and autotuning) computes the call
        eagerly, so its output serves the capturing call: no replay of the same step.
        `mode`: CUDA's capture error mode; "relaxed" lets the captured Python query free
        memory (ComfyUI's cond batching does, every step)."""
        side = side_stream(torch.cuda.current_device())
        token = _capturing.set(True)
        try:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                first = run()
            torch.cuda.current_stream().wait_stream(side)
            if isinstance(first, torch.Tensor):
                first.record_stream(torch.cuda.current_stream())
            torch.cuda.synchronize()
            before = torch.cuda.memory_reserved()
            graph, pool = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
            try:
                with torch.cuda.graph(graph, pool=pool, capture_error_mode=mode):
                    out = run()
            except BaseException:
                end_failed_capture(pool)
                raise
        finally:
            _capturing.reset(token)
        nbytes = pool_bytes(pool)
        if nbytes is None:
            nbytes = torch.cuda.memory_reserved() - before
        return graph.replay, out, nbytes, first


def end_failed_capture(pool) -> None:
    """After a capture into `pool` (its handle) that failed, once its `capture_end` was called:
    the allocator no longer routing this stream's allocations to the pool. torch's
    `capture_end` raises before it tells the allocator where the capture was invalidated
    (another unsafe call, a failed allocation), and every later capture then failed with
    "already recording to mempool_id", every later allocation of the stream going to a dead
    pool. The handle is the caller's, known whatever state the failed capture left."""
    with contextlib.suppress(Exception):  # raises where capture_end got that far
        torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), pool)


def pool_bytes(*pools) -> int | None:
    """What the segments of graphs' memory pools hold; None where the allocator lists none
    (cudaMallocAsync). The growth of reserved memory over a capture is no measure: where
    memory is short, the allocator frees cached blocks to make the pool."""
    try:
        segments = torch.cuda.memory_snapshot()
    except RuntimeError:
        return None
    ids = {tuple(pool) for pool in pools}
    return sum(s["total_size"] for s in segments if tuple(s.get("segment_pool_id", ())) in ids)
