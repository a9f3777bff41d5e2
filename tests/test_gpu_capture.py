"""A capture that fails leaves the next capture, and every later allocation, as before it.

torch's `capture_end` raises before it tells the caching allocator the capture ended where the
capture was invalidated (on a 24 GiB card: comfy-aimdo evicting a text encoder's pages from
inside the capture's allocation). The allocator then routed the stream's allocations to the
dead graph's pool, and every later capture failed with "already recording to mempool_id":
the CUDA Graph Sampler ran out of memory at the next new prompt and ComfyUI's KSampler rerun
too. Both backends (the sampler's call graphs and the block graphs) are checked.
"""

import pytest
import torch

from qwen_turbo.runtime.graphs.blocks import CudaBlockCapture
from qwen_turbo.runtime.graphs.capture import CudaGraphs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _invalidating(x: torch.Tensor):
    """A capture's body that allocates, then does what a capture may not (a device-wide
    synchronize), as comfy-aimdo's eviction did."""

    def run():
        y = x * 2
        torch.cuda.synchronize()
        return y

    return run


@pytest.mark.parametrize("backend", ["call graphs", "block graphs"])
def test_a_failed_capture_leaves_the_next_capture_and_allocations_working(backend):
    x = torch.randn(1024, 1024, device="cuda")
    blocks = CudaBlockCapture()

    def capture(run):
        if backend == "call graphs":
            replay, out, _, _ = CudaGraphs.capture(run)
            return replay, out
        holder = {}

        def body():
            holder["out"] = run()

        return blocks.capture(body, 0), holder

    with pytest.raises(Exception, match="capture|not permitted"):
        capture(_invalidating(x))
    assert not torch.cuda.is_current_stream_capturing()
    before = torch.cuda.memory_allocated()
    y = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # the default pool's again
    assert torch.cuda.memory_allocated() == before + y.numel()
    del y
    replay, out = capture(lambda: x + 1)
    x.add_(1)
    replay()
    torch.cuda.synchronize()
    result = out if backend == "call graphs" else out["out"]
    torch.testing.assert_close(result, x + 1, rtol=0, atol=0)
