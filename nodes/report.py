"""What a node did, for the frontend badge (js/qwen_turbo.js): wall time, peak VRAM and, for
the sampler, the CUDA graph status, sent as a PromptServer message after the node runs."""

import sys
import time
from contextlib import contextmanager

import torch

EVENT = "qwen_turbo.node_stats"


def send(node_id, data: dict) -> None:
    """Send to the prompt's client when a ComfyUI server runs this process (not the CLI)."""
    server = sys.modules.get("server")
    instance = getattr(getattr(server, "PromptServer", None), "instance", None)
    if instance is None or node_id is None:
        return
    instance.send_sync(EVENT, {"node": str(node_id), **data}, instance.client_id)


@contextmanager
def measured(node):
    """Time the block and its peak CUDA memory, and send them for the V3 node class `node`
    (nothing is sent when it runs outside the executor); the yielded dict takes extra fields."""
    node_id = node.hidden.unique_id if node.hidden is not None else None
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    extra: dict = {}
    yield extra
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    send(node_id, {"seconds": round(time.perf_counter() - t0, 3), "peak_vram_gib": peak, **extra})
