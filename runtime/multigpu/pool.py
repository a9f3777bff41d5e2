"""Rank 0's side of the worker pool: the workers started as plain subprocesses, their pipes
(`watch.Link`) and their watch (`watch.Watch`), the process group met in a private
FileStore, and the operations sent to them, each with a deadline."""

import atexit
import contextlib
import json
import logging
import os
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
from .watch import Link, MultiGPUError, Watch

log = logging.getLogger(__name__)

PACK = __name__.rsplit(".runtime.", 1)[0]
ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = timedelta(minutes=10)  # NCCL's own watchdog: the watch's deadlines come first
START_TIMEOUT = 300.0  # seconds for a worker to import torch and ComfyUI
PENDING_BYTES = 1 << 30  # weights in flight at once while broadcasting (driver-side copies)
# A model call's deadline: CALL_FACTOR times the last call of its shapes (and plan), plus
# CALL_FLOOR_S; a first call of its shapes may compile kernels and build attention plans.
CALL_FLOOR_S, CALL_FACTOR, FIRST_CALL_S = 10.0, 4.0, 180.0
LOAD_FLOOR_S, LOAD_BYTES_PER_S = 60.0, 2e8  # sending the weights: 20 GB in 160 s at most
GRACE_S = 1.0  # for a worker's failure to show once rank 0's collective has failed
# ("module:function", [arguments]) each worker calls once ComfyUI is set up, before its
# first operation; none in ComfyUI (the tests put CPU stand-ins here)
WORKER_SETUP: list[tuple[str, list]] = []

# A worker's first lines: its stack written on SIGUSR1 (rank 0 asks a stalled one), the
# parent's sys.path, the pack registered under the parent's module name (ComfyUI names custom
# nodes by path), then `worker_main`.
BOOTSTRAP = """
import faulthandler, signal
faulthandler.register(signal.SIGUSR1, all_threads=True)
import importlib, importlib.util, json, sys
cfg = json.loads(sys.argv[1])
sys.path[:] = cfg["path"]
spec = importlib.util.spec_from_file_location(
    cfg["pack"], cfg["init"], submodule_search_locations=[cfg["root"]])
sys.modules[cfg["pack"]] = importlib.util.module_from_spec(spec)
importlib.import_module(cfg["pack"] + ".runtime.multigpu.worker").worker_main(cfg)
"""


class Pool:
    """Rank 0 (this process, on devices[0]) and one worker process per further device."""

    def __init__(self, devices: tuple[str, ...], backend: str):
        self.devices, self.backend = devices, backend
        self.device = torch.device(devices[0])
        self.world = len(devices)
        self.recipe = self.weights = self.procs = self.watch = None
        self.links: list[Link] = []
        self.groups: dict = {}
        self.times: dict = {}  # a call's shapes and plan -> seconds its last call took
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
        env = dict(os.environ, **communicator_env(), PYTHONUNBUFFERED="1")
        self.procs = []
        for rank, device in enumerate(self.devices[1:], 1):
            (ops_r, ops_w), (answers_r, answers_w), (out_r, out_w) = (os.pipe() for _ in "abc")
            cfg = {"path": sys.path, "pack": PACK, "root": str(ROOT),
                   "init": str(ROOT / "__init__.py"), "rank": rank, "world": self.world,
                   "device": device, "backend": self.backend, "store": self.store_path,
                   "answers": answers_w, "setup": WORKER_SETUP}  # fmt: skip
            cmd = [sys.executable, "-c", BOOTSTRAP, json.dumps(cfg)]
            try:
                proc = subprocess.Popen(cmd, env=env, stdin=ops_r, stdout=out_w, stderr=out_w,
                                        pass_fds=(answers_w,))  # fmt: skip
                self.procs.append(proc)
            finally:
                for fd in (ops_r, answers_w, out_w):
                    os.close(fd)
            self.links.append(Link(ops_w, answers_r, out_r))
        self.watch = Watch(self.devices, self.procs, self.links, self.backend)
        with self.watch.armed(START_TIMEOUT, "starting the workers", f"{START_TIMEOUT:.0f} s"):
            self.post({"op": "args", "args": vars(args)})
            while not all(link.ready for link in self.links):
                self._check()
                mm.throw_exception_if_processing_interrupted()  # Cancel stops the wait
                self.watch.failed.wait(0.05)
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
            self.watch.started = True
        log.info("Multi-GPU: workers started on %s (%s)", ", ".join(self.devices[1:]),
                 self.backend)  # fmt: skip

    def failure(self, wait: float = 0.0) -> MultiGPUError | None:
        """The error of a worker that failed (or of a deadline passed), if any, waiting up
        to `wait` s for one to show (a worker's exit follows its peers' collectives' errors
        by a moment)."""
        return self.watch.failure(wait) if self.watch is not None else None

    def _check(self) -> None:
        """Raise the MultiGPUError of a worker that failed, if any."""
        if (error := self.failure()) is not None:
            raise error

    def _wait(self, works) -> None:
        """Wait for collectives, watching the workers: a failed one raises instead of a hang."""
        while not all(w.is_completed() for w in works):
            self._check()
            time.sleep(0.0002)
        for w in works:
            w.wait()

    def post(self, header: dict) -> None:
        """Send an operation to every worker (a worker gone raises MultiGPUError)."""
        self._check()
        line = wire.dumps(header)
        for link in self.links:
            try:
                link.send(line)
            except OSError as e:  # its pipe is closed: the worker is exiting
                if (failed := self.failure(GRACE_S)) is None:
                    raise
                raise failed from e

    def load(self, blob: dict, signature, dm, patcher) -> None:
        """Build the model on the workers (when `blob` is new) and broadcast its weights."""
        sd = dm.state_dict()
        metas = [(name, tuple(t.shape), t.dtype) for name, t in sd.items()]
        total = sum(t.numel() * t.element_size() for t in sd.values())
        seconds = LOAD_FLOOR_S + total / LOAD_BYTES_PER_S
        why = f"{seconds:.0f} s ({LOAD_FLOOR_S:.0f} s + {total / 1e9:.1f} GB at 0.2 GB/s)"
        with self.watch.armed(seconds, "sending the weights", why):
            self.post({"op": "load", "recipe": None if blob == self.recipe else blob,
                       "metas": metas})  # fmt: skip
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
        key = (call.groups, call.size, call.attention, call.fused, tuple(metas))
        last, start = self.times.get(key), time.monotonic()
        if last is None:
            seconds, why = FIRST_CALL_S, "a first call of its shapes"
        else:
            seconds = CALL_FLOOR_S + CALL_FACTOR * last
            why = f"{CALL_FLOOR_S:.0f} s + {CALL_FACTOR:.0f} x {last:.2f} s, its last call"
        with self.watch.armed(seconds, "the model call", f"{seconds:.1f} s ({why})"):
            self.post({"op": "call", "spec": call.spec, "metas": metas, "groups": call.groups,
                       "size": call.size, "attention": call.attention, "fused": call.fused,
                       "blocks": call.blocks, "out": call.out})  # fmt: skip
            offsets, total = _layout(metas)
            flat = torch.zeros(total, dtype=torch.uint8, device=self.device)
            for o, t in zip(offsets, call.tensors, strict=True):
                if t.numel():
                    chunk = _bytes(t.to(self.device).contiguous())
                    flat[o : o + t.numel() * t.element_size()] = chunk
            self._wait([dist.broadcast(flat, 0, async_op=True)])
            out = run_share(call, _unpack(flat, metas), call.options, 0, self.groups, executor)
            parts = [torch.empty_like(out) for _ in range(self.world)]
            self._wait([dist.all_gather([_bytes(p) for p in parts], _bytes(out), async_op=True)])
        self.times[key] = time.monotonic() - start
        return torch.cat(parts[:: call.size][: call.groups])

    def close(self, kill: bool = False) -> None:
        """Stop the workers (asked to, unless `kill` or one is gone: then killed, since the
        others may wait in a collective) and leave the process group."""
        kill = kill or self.failure() is not None
        ask = bool(self.procs) and not kill
        if self.watch is not None:
            self.watch.closing = True
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
        if self.watch is not None:
            self.watch.stop()
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
