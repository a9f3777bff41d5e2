"""What the Multi-GPU tests install in the worker processes as in their own
(`multigpu.pool.WORKER_SETUP` names these functions): fp8 attention on CPU, and a fault in
one rank's model call. Imported as a module of the pack (`qwen_turbo.tests...`: a worker's
`tests` would be ComfyUI's), with no more imports than a worker has."""

import functools
import os
import signal
import sys
import time

import torch.nn.functional as F


def attention_fp8_on_cpu(q, k, v, smooth_v=True, amax_group="", kernel="auto"):
    """`kernels.attention_fp8.attention_fp8` with only its GPU kernel stood in: q, k, v
    (B, H, L, D) quantized by the pack's own passes (`quantize`, through Triton's interpreter,
    its amaxes all-reduced over the process group named `amax_group`), attention on the fp8
    values in float32, v's channel means added back; in q's dtype."""
    from ..kernels import attention_fp8 as mod

    dtype = q.dtype
    (q8, k8, v8), scales, v_mean = mod.quantize(q, k, v, smooth_v, amax_group)
    q, k, v = (x.float() * scales[i] for i, x in ((mod.DQ, q8), (mod.DK, k8), (mod.DV, v8)))
    return (F.scaled_dot_product_attention(q, k, v) + v_mean[:, :, None]).to(dtype)


def fp8_on_cpu() -> None:
    """The quantized attention backends ("fp8", "fp8_cudnn") through `attention_fp8_on_cpu`."""
    from ..runtime.dit import attention

    for name, core in attention.QUANTIZED.items():
        attention.QUANTIZED[name] = functools.partial(attention_fp8_on_cpu, **core.keywords)


def fault(kind: str, rank: int, call: int) -> None:
    """Rank `rank`, in its `call`-th model call (counted from the worker's start), raises
    ("raise"), is killed ("kill": SIGKILL) or stalls ("stall") as the model's forward starts:
    its peers are in the call, rank 0 in a collective with it or waiting for its share."""
    from ..runtime.multigpu import worker

    run_share, calls = worker.run_share, [0]

    def counted(c, tensors, options, r, cache, forward):
        calls[0] += 1
        if r == rank and calls[0] == call:
            forward = functools.partial(_fail, kind, rank, forward)
        return run_share(c, tensors, options, r, cache, forward)

    worker.run_share = counted


def _fail(kind: str, rank: int, forward, *args, **kwargs):
    print(f"fault: rank {rank} {kind}s mid-call", file=sys.stderr, flush=True)
    if kind == "raise":
        raise RuntimeError(f"injected fault on rank {rank}")
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    _stall()
    return forward(*args, **kwargs)


def _stall():
    time.sleep(3600)
