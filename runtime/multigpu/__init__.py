"""One model call on several GPUs of one machine, over torch.distributed (NCCL on GPUs; gloo
on CPU, for the tests).

The ComfyUI process is rank 0 on its own device and drives; ranks 1..N-1 are worker
processes, one per extra device, started once and reused (`Pool`). A worker builds the same
diffusion model from its recipe (its class, `unet_config`, the ops classes its modules use)
and receives the weights from rank 0 by `broadcast` whenever their signature (the model
object, its LoRA patches) changes; it runs the pack's fused blocks and attention backend
where rank 0 does.

A call (`Driver`, a DIFFUSION_MODEL wrapper) is split two ways:
- CFG-parallel: the batch (cond and uncond, as ComfyUI batches them) over `groups` of ranks;
- sequence parallel (`SeqParallel`): within a group, the text and the image tokens over its
  ranks. Around attention an all-to-all turns (tokens/s, heads) into (tokens, heads/s) and
  back (Ulysses), where the ranks divide the heads; elsewhere each rank gathers every
  token's keys and values and attends with its own queries.
The outputs come back to rank 0 by all_gather. A quantized attention backend takes its
scales over all ranks of the call, so each rounds as one GPU with the whole call would.
Calls the workers cannot reproduce (another node's model patches or wrappers inside this
one, ControlNet inputs) run on rank 0 alone.

Operations are announced by a header of plain data (`wire`: JSON, nothing unpickled) on the
worker's stdin, a pipe only rank 0 holds, so an idle worker waits on the pipe rather than in
an NCCL collective that would time out; it answers (started, or its error) on a second pipe,
and its output comes to rank 0 on a third. A thread of rank 0 (`watch`) reads them and keeps
each operation's deadline (a model call's: 4x the last call of its shapes plus 10 s); when a
worker dies, answers an error or misses the deadline, it kills the workers and aborts the
NCCL communicators, so the call raises within seconds, naming the rank with its last lines.
The process group meets in a FileStore in a folder only this user can open, and its
communicators bind to the loopback interface: no socket of the pool listens beyond this
machine. Workers start as plain subprocesses: a multiprocessing spawn would re-run ComfyUI's
main.py in each of them (spawn re-imports `__main__`), custom nodes' prestartup scripts
included. ComfyUI's modules are imported inside functions: a worker imports this module
before it sets ComfyUI's flags.
"""

from .driver import KEY, MODES, Driver, Stats, cuda_devices, driver_of, parallel
from .pool import MultiGPUError, Pool, pool, running, shutdown
from .recipe import NotReplicable, attention_name, patched_weight
from .split import plan

__all__ = [
    "KEY", "MODES", "Driver", "MultiGPUError", "NotReplicable", "Pool", "Stats",
    "attention_name", "cuda_devices", "driver_of", "parallel", "patched_weight", "plan", "pool",
    "running", "shutdown",
]  # fmt: skip
