"""Rank 0's side of the worker pool: the workers started as plain subprocesses, their pipes
(`Link`), the process group met in a private FileStore, and the operations sent to them."""

import atexit
import contextlib
import json
import logging
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from . import wire
from .recipe import patched_weight
from .split import Call, _bytes, _layout, _unpack, communicator_env, communicator_scope, run_share

log = logging.getLogger(__name__)

PACK = __name__.rsplit(".runtime.", 1)[0]
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = timedelta(minutes=10)
START_TIMEOUT = 300.0  # seconds for a worker to import torch and ComfyUI
PENDING_BYTES = 1 << 30  # weights in flight at once while broadcasting (driver-side copies)

# A worker's first lines: the parent's sys.path, the pack registered under the parent's
# module name (ComfyUI names custom nodes by path), then `worker_main`.
BOOTSTRAP = """
import importlib, importlib.util, json, sys
cfg = json.loads(sys.argv[1])
sys.path[:] = cfg["path"]
spec = importlib.util.spec_from_file_location(
    cfg["pack"], cfg["init"], submodule_search_locations=[cfg["root"]])
sys.modules[cfg["pack"]] = importlib.util.module_from_spec(spec)
importlib.import_module(cfg["pack"] + ".runtime.multigpu.worker").worker_main(cfg)
"""


class MultiGPUError(RuntimeError):
    """A worker failed; the pool was shut down and the next run starts a fresh one."""


class Pool:
    """Rank 0 (this process, on devices[0]) and one worker process per further device."""

    def __init__(self, devices: tuple[str, ...], backend: str):
        self.devices, self.backend = devices, backend
        self.device = torch.device(devices[0])
        self.world = len(devices)
        self.recipe = self.weights = self.procs = None
        self.links: list[Link] = []
        self.groups: dict = {}
        self.folder = tempfile.mkdtemp(prefix="qwen-turbo-multigpu-")  # mode 0700
        self.store_path = os.path.join(self.folder, "store")
        self.store = dist.FileStore(self.store_path)
        try:
            self._start()
        except BaseException:
            self.close(kill=True)
            raise

    def _start(self) -> None:
        import comfy.model_management as mm
        from comfy.cli_args import args

        if dist.is_initialized():
            raise MultiGPUError(
                "torch.distributed is already initialized in this process (by another node "
                "pack?); Multi-GPU needs its own process group"
            )
        env = dict(os.environ, **communicator_env())
        self.procs = []
        for rank, device in enumerate(self.devices[1:], 1):
            ops_r, ops_w = os.pipe()
            answers_r, answers_w = os.pipe()
            cfg = {"path": sys.path, "pack": PACK, "root": str(ROOT),
                   "init": str(ROOT / "__init__.py"), "rank": rank, "world": self.world,
                   "device": device, "backend": self.backend, "store": self.store_path,
                   "answers": answers_w}  # fmt: skip
            cmd = [sys.executable, "-c", BOOTSTRAP, json.dumps(cfg)]
            try:
                self.procs.append(subprocess.Popen(cmd, env=env, stdin=ops_r,
                                                   pass_fds=(answers_w,)))  # fmt: skip
            finally:
                os.close(ops_r)
                os.close(answers_w)
            self.links.append(Link(ops_w, answers_r))
        self.post({"op": "args", "args": vars(args)}, starting=True)
        deadline = time.monotonic() + START_TIMEOUT
        for rank, link in enumerate(self.links, 1):
            while not link.read().ready:
                self._check(starting=True)
                mm.throw_exception_if_processing_interrupted()  # Cancel stops the wait
                if time.monotonic() > deadline:
                    raise MultiGPUError(f"the worker on {self.devices[rank]} did not start "
                                        f"in {START_TIMEOUT:.0f} s")  # fmt: skip
                link.wait(0.05)
        extra = {"device_id": self.device} if self.backend == "nccl" else {}
        with communicator_scope():
            dist.init_process_group(
                self.backend,
                store=dist.PrefixStore("pg", self.store),
                rank=0,
                world_size=self.world,
                timeout=TIMEOUT,
                **extra,
            )
        log.info("Multi-GPU: workers started on %s (%s)", ", ".join(self.devices[1:]),
                 self.backend)  # fmt: skip

    def _check(self, starting: bool = False) -> None:
        """Raise MultiGPUError naming a worker that has exited, with its error if it sent one."""
        for rank, proc in enumerate(self.procs or (), 1):
            code = proc.poll()
            if code is None:
                continue
            error = self.links[rank - 1].read().error
            what = "failed to start" if starting else "failed"
            hint = (
                f" Each GPU holds a whole copy of the DiT: free memory on {self.devices[rank]} "
                "or use fewer GPUs (the node's `gpus`)."
                if error and "out of memory" in error.lower() else ""
            )  # fmt: skip
            raise MultiGPUError(
                f"Multi-GPU: the worker on {self.devices[rank]} {what} (exit code {code})"
                + (f": {error}" if error else "")
                + f". The workers were stopped; the next run starts them again.{hint}"
            )

    def _wait(self, works) -> None:
        """Wait for collectives, watching the workers: a dead one raises instead of a hang."""
        while not all(w.is_completed() for w in works):
            self._check()
            time.sleep(0.0002)
        for w in works:
            w.wait()

    def post(self, header: dict, starting: bool = False) -> None:
        """Send an operation to every worker (a worker gone raises MultiGPUError)."""
        line = wire.dumps(header)
        for link, proc in zip(self.links, self.procs, strict=True):
            try:
                link.send(line)
            except OSError:  # its pipe is closed: the worker is exiting
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(10)
                self._check(starting)
                raise

    def load(self, blob: dict, signature, dm, patcher) -> None:
        """Build the model on the workers (when `blob` is new) and broadcast its weights."""
        sd = dm.state_dict()
        metas = [(name, tuple(t.shape), t.dtype) for name, t in sd.items()]
        self.post({"op": "load", "recipe": None if blob == self.recipe else blob, "metas": metas})
        pending, size = [], 0
        for name, t in sd.items():
            key = "diffusion_model." + name
            if key in patcher.patches and key not in patcher.backup:
                t = patched_weight(patcher, key, self.device)
            t = t.to(self.device).contiguous()
            if t.numel():
                pending.append(dist.broadcast(_bytes(t), 0, async_op=True))
                size += t.numel() * t.element_size()
            if size > PENDING_BYTES:
                self._wait(pending)
                pending, size = [], 0
        self._wait(pending)
        self.recipe, self.weights = blob, signature

    def run(self, call: Call, executor) -> torch.Tensor:
        """`call` on every rank: rank 0's share through `executor` (the wrappers inside this
        one, then the diffusion model), the workers' by broadcast; the outputs all_gathered."""
        metas = [(tuple(t.shape), t.dtype) for t in call.tensors]
        self.post({"op": "call", "spec": call.spec, "metas": metas, "groups": call.groups,
                   "size": call.size, "attention": call.attention, "fused": call.fused,
                   "blocks": call.blocks, "out": call.out})  # fmt: skip
        offsets, total = _layout(metas)
        flat = torch.zeros(total, dtype=torch.uint8, device=self.device)
        for o, t in zip(offsets, call.tensors, strict=True):
            if t.numel():
                flat[o : o + t.numel() * t.element_size()] = _bytes(t.to(self.device).contiguous())
        self._wait([dist.broadcast(flat, 0, async_op=True)])
        out = run_share(call, _unpack(flat, metas), call.options, 0, self.groups, executor)
        parts = [torch.empty_like(out) for _ in range(self.world)]
        self._wait([dist.all_gather([_bytes(p) for p in parts], _bytes(out), async_op=True)])
        return torch.cat(parts[:: call.size][: call.groups])

    def close(self, kill: bool = False) -> None:
        """Stop the workers (asked to, unless `kill` or one is gone: then killed, since the
        others may wait in a collective) and leave the process group."""
        ask = bool(self.procs) and not kill and all(p.poll() is None for p in self.procs)
        if ask:
            with contextlib.suppress(OSError, MultiGPUError):  # one may exit meanwhile
                self.post({"op": "stop"})
        for p in self.procs or ():
            if ask:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(10)
            if p.poll() is None:
                p.kill()
            p.wait()
        if dist.is_initialized():
            abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
            if kill and self.backend == "nccl" and abort is not None:
                abort()  # NCCL kernels may wait on a dead peer: abort rather than destroy
            else:
                dist.destroy_process_group()
        for link in self.links:
            link.close()
        self.procs, self.links = None, []
        shutil.rmtree(self.folder, ignore_errors=True)


class Link:
    """Rank 0's ends of one worker's pipes: operations go out as lines of `wire`, and the
    worker's answers ({"ready": true}, {"error": text}) come back."""

    def __init__(self, ops: int, answers: int):
        self.ops = os.fdopen(ops, "wb")
        self.answers = answers
        os.set_blocking(answers, False)
        self.buffer = b""
        self.ready, self.error = False, None

    def send(self, line: bytes) -> None:
        self.ops.write(line)
        self.ops.flush()

    def wait(self, seconds: float) -> None:
        """Until an answer may have come, at most `seconds`."""
        select.select([self.answers], [], [], seconds)

    def read(self) -> "Link":
        """Take in what the worker has answered so far."""
        while True:
            try:
                chunk = os.read(self.answers, 1 << 16)
            except (BlockingIOError, OSError):
                break
            if not chunk:
                break
            self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        for line in lines:
            try:
                answer = wire.loads(line)
            except ValueError as e:
                log.warning("Multi-GPU: dropped a worker's answer that is not plain data (%s)", e)
                continue
            self.ready = self.ready or answer.get("ready") is True
            if isinstance(answer.get("error"), str):
                self.error = answer["error"]
        return self

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.ops.close()
        with contextlib.suppress(OSError):
            os.close(self.answers)


_pool: Pool | None = None


def pool(devices: tuple[str, ...], backend: str) -> Pool:
    """The running pool for these devices, or a fresh one (any other pool is stopped)."""
    global _pool
    if _pool is not None and (_pool.devices, _pool.backend) == (devices, backend):
        return _pool
    shutdown()
    atexit.unregister(shutdown)  # once
    atexit.register(shutdown)
    _pool = Pool(devices, backend)
    return _pool


def shutdown(kill: bool = False) -> None:
    """Stop the workers, if any."""
    global _pool
    if _pool is not None:
        p, _pool = _pool, None
        p.close(kill)


def running() -> "Pool | None":
    """The pool that is running, if any."""
    return _pool
