"""A worker process (ranks 1..N-1): ComfyUI's flags set as in the parent, then operations
read from stdin until "stop" or its end. Its stdout and stderr go to rank 0's watch, which
passes them on to ComfyUI's console."""

import contextlib
import importlib
import logging
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

from ..dit.attention import attention_override
from . import wire
from .pool import TIMEOUT
from .recipe import build, set_fused
from .split import Call, _bytes, _layout, _unpack, run_share

log = logging.getLogger(__name__)

# The fields of each operation a worker takes (its first is "args": ComfyUI's flags).
OPS = {
    "args": ("args",),
    "load": ("recipe", "metas"),
    "call": ("spec", "metas", "groups", "size", "attention", "fused", "blocks", "out"),
    "stop": (),
}


def receive(stream) -> dict | None:
    """The next operation on `stream` (a worker's stdin), or None at its end (rank 0 gone).
    A line that is not an operation of `OPS` with its fields is dropped with a log line."""
    while line := stream.readline():
        try:
            op = wire.loads(line)
            fields = OPS.get(op.get("op")) if isinstance(op.get("op"), str) else None
            if fields is None or any(f not in op for f in fields):
                raise ValueError(f"not an operation: {str(op)[:200]}")
        except ValueError as e:
            log.warning("Multi-GPU worker: dropped a control message (%s)", e)
            continue
        return op
    return None


class Worker:
    def __init__(self, ops, rank: int, device: torch.device):
        self.ops, self.rank, self.device = ops, rank, device
        self.dm = None
        self.fused = None
        self.overrides: dict = {}
        self.groups: dict = {}

    def loop(self) -> None:
        while (header := receive(self.ops)) is not None and header["op"] != "stop":
            if header["op"] != "args":
                getattr(self, header["op"])(header)

    def load(self, header: dict) -> None:
        if header["recipe"] is not None:
            self.dm = self.fused = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self.dm = build(header["recipe"])
        current = self.dm.state_dict()
        new, works = {}, []
        for name, shape, dtype in header["metas"]:
            t = current.get(name)
            if t is None or t.is_meta or tuple(t.shape) != shape or t.dtype != dtype:
                t = torch.empty(shape, dtype=dtype, device=self.device)
            if t.numel():
                works.append(dist.broadcast(_bytes(t), 0, async_op=True))
            new[name] = t
        for w in works:
            w.wait()
        self.dm.load_state_dict(new, strict=True, assign=True)
        left = [n for n, t in [*self.dm.named_parameters(), *self.dm.named_buffers()] if t.is_meta]
        if left:
            raise RuntimeError(f"no weights came for {left[:3]}")

    def call(self, header: dict) -> None:
        metas = header["metas"]
        flat = torch.empty(_layout(metas)[1], dtype=torch.uint8, device=self.device)
        dist.broadcast(flat, 0)
        if self.fused != header["fused"]:
            set_fused(self.dm, header["fused"])
            self.fused = header["fused"]
        options = {}
        if header["attention"] is not None:
            name = header["attention"]
            options["optimized_attention_override"] = self.overrides.setdefault(
                name, attention_override(name)
            )
        fields = ("spec", "groups", "size", "attention", "fused", "blocks", "out")
        call = Call(tensors=None, options=options, **{k: header[k] for k in fields})
        with torch.inference_mode():
            out = run_share(call, _unpack(flat, metas), options, self.rank, self.groups,
                            self.dm._forward)  # fmt: skip
            parts = [torch.empty_like(out) for _ in range(dist.get_world_size())]
            dist.all_gather([_bytes(p) for p in parts], _bytes(out))


def worker_main(cfg: dict) -> None:
    """A worker process: ComfyUI's modules set up as in the parent (and `cfg["setup"]`'s
    functions called), then operations until "stop" or the end of stdin. An error is
    answered for rank 0 to report, and the process exits."""
    rank, device = cfg["rank"], torch.device(cfg["device"])
    answers = os.fdopen(cfg["answers"], "wb")

    def answer(message: dict) -> None:
        with contextlib.suppress(OSError):  # rank 0 may be gone already
            answers.write(wire.dumps(message))
            answers.flush()

    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:  # CPU ranks (tests) share the cores
            torch.set_num_threads(max(1, torch.get_num_threads() // cfg["world"]))
        from comfy.cli_args import args

        first = receive(sys.stdin.buffer)
        if first is None or first["op"] != "args":
            sys.exit(0)
        vars(args).update(first["args"])
        args.cpu = device.type == "cpu"
        args.disable_dynamic_vram = True  # plain resident modules; no VRAM manager here
        import comfy.model_management  # noqa: F401  (set up for this device)

        for name, arguments in cfg["setup"]:  # named by rank 0's process (pool.WORKER_SETUP)
            module, _, function = name.partition(":")
            getattr(importlib.import_module(module), function)(*arguments)
        answer({"ready": True})
        extra = {"device_id": device} if cfg["backend"] == "nccl" else {}
        store = dist.PrefixStore("pg", dist.FileStore(cfg["store"]))
        dist.init_process_group(cfg["backend"], store=store, rank=rank, world_size=cfg["world"],
                                timeout=TIMEOUT, **extra)  # fmt: skip
        Worker(sys.stdin.buffer, rank, device).loop()
        dist.destroy_process_group()
    except Exception as e:
        traceback.print_exc()
        answer({"error": f"{type(e).__name__}: {e}"[:2000], "at": time.time()})
        sys.stderr.flush()
        os._exit(1)  # not sys.exit: a process group's teardown may wait on peers mid-call
