"""Rank 0's watch over its workers (`Watch`): a thread reads each worker's answers and its
output (passed on to this process's stderr, the last lines kept), polls the processes, and
keeps the deadline of the operation under way. On a failure (a worker gone, an error
answered, the deadline passed) it kills the workers and aborts the NCCL communicators, so
that whatever rank 0 waits in returns or raises (a gloo collective raises once its peers
are gone, an NCCL kernel ends once aborted), and keeps the error, naming the rank with its
last lines, for rank 0 to raise."""

import collections
import contextlib
import logging
import os
import select
import signal
import sys
import threading
import time
from dataclasses import dataclass

from . import wire

log = logging.getLogger(__name__)

POLL_S = 0.05
SETTLE_S = 0.2  # after a first worker fails, for the failures it causes to show too
DUMP_S = 0.5  # for a stalled worker's stack (faulthandler, on SIGUSR1) to come through
LINES = 12  # of a worker's output in an error


class MultiGPUError(RuntimeError):
    """A worker failed; the pool was shut down and the next run starts a fresh one."""


class Link:
    """Rank 0's ends of one worker's pipes: operations go out as lines of `wire`; its answers
    ({"ready": true}, {"error": text, "at": time}) and its output (stdout and stderr) come
    back, read by the watch's thread only."""

    def __init__(self, ops: int, answers: int, output: int):
        self.ops = os.fdopen(ops, "wb")
        self.fds = [answers, output]
        self.rest = {answers: b"", output: b""}
        for fd in self.fds:
            os.set_blocking(fd, False)
        self.lines: collections.deque[str] = collections.deque(maxlen=200)
        self.ready, self.error, self.at = False, None, None

    def send(self, line: bytes) -> None:
        self.ops.write(line)
        self.ops.flush()

    def _lines(self, fd: int) -> list[bytes]:
        while fd in self.fds:
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                break
            except OSError:
                chunk = b""
            if not chunk:  # the worker's end is closed: it has exited
                self.fds.remove(fd)
                self.rest[fd] += b"\n"
            self.rest[fd] += chunk
        *lines, self.rest[fd] = self.rest[fd].split(b"\n")
        return lines

    def read(self, prefix: str) -> None:
        """Take in what the worker has answered and written so far; its output goes on to
        this process's stderr, each line after `prefix`."""
        answers, output = self.rest
        for line in self._lines(answers):
            try:
                answer = wire.loads(line) if line else {}
            except ValueError as e:
                log.warning("Multi-GPU: dropped a worker's answer that is not plain data (%s)", e)
                continue
            self.ready = self.ready or answer.get("ready") is True
            if isinstance(answer.get("error"), str) and self.error is None:
                self.error, self.at = answer["error"], answer.get("at")
        for line in self._lines(output):
            text = line.decode(errors="replace").rstrip()
            if text:
                self.lines.append(text)
                with contextlib.suppress(OSError, ValueError):
                    sys.stderr.write(f"{prefix}{text}\n")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.ops.close()
        for fd in self.rest:
            with contextlib.suppress(OSError):
                os.close(fd)


@dataclass
class Deadline:
    at: float  # time.monotonic()
    what: str  # "the model call"
    why: str  # how long it was given, and why that long


class Watch:
    """The thread watching `procs` (ranks 1..) through their `links`."""

    def __init__(self, devices, procs, links, backend: str):
        self.devices, self.procs, self.links, self.backend = devices, procs, links, backend
        self.started = False  # the process group is up
        self.closing = False  # the workers are asked to stop: their exits are no failure
        self.deadline: Deadline | None = None
        self.error: MultiGPUError | None = None
        self.failed = threading.Event()
        self._stop = threading.Event()
        self._first = self._dumped = None  # when a failure showed, when stacks were asked for
        self._thread = threading.Thread(target=self._run, name="Multi-GPU watch", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def armed(self, seconds: float, what: str, why: str):
        """A deadline for the operation run inside."""
        self._dumped = None
        self.deadline = Deadline(time.monotonic() + seconds, what, why)
        try:
            yield
        finally:
            self.deadline = None

    def failure(self, wait: float = 0.0) -> MultiGPUError | None:
        """The error found, waiting up to `wait` s for one."""
        self.failed.wait(wait)
        return self.error

    def stop(self) -> None:
        """Stop the thread, once what the (exited) workers wrote is read."""
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.is_set():
            fds = [fd for link in self.links for fd in link.fds]
            try:
                select.select(fds, [], [], POLL_S) if fds else self._stop.wait(POLL_S)
                self._poll()
            except Exception:  # never leave the pool unwatched silently
                log.exception("Multi-GPU: the workers' watch failed")
                if self.error is None:
                    self._fail("Multi-GPU: the workers' watch failed; see the log above")
                self._stop.wait(POLL_S)
        self._read()

    def _read(self) -> None:
        for rank, link in enumerate(self.links, 1):
            link.read(f"[Multi-GPU rank {rank}] ")

    def _poll(self) -> None:
        self._read()
        if self.error is not None or self.closing:
            return
        now, deadline = time.monotonic(), self.deadline
        if any(p.poll() is not None for p in self.procs) or any(k.error for k in self.links):
            self._first = self._first or now
            if now - self._first >= SETTLE_S:
                self._fail(self._failed_worker())
        elif deadline is not None and now > deadline.at:
            if self._dumped is None:  # ask for their stacks first (faulthandler)
                self._dumped = now
                for p in self.procs:
                    with contextlib.suppress(OSError, AttributeError):
                        p.send_signal(signal.SIGUSR1)
            elif now - self._dumped >= DUMP_S:
                self._fail(self._stalled(deadline))

    def _failed_worker(self) -> str:
        """The error for the first worker that failed: one gone without a word (killed),
        else the one that answered its error first (the others' errors follow from it)."""
        ranks = range(1, len(self.procs) + 1)
        silent = [r for r in ranks if self.procs[r - 1].poll() is not None
                  and self.links[r - 1].error is None]  # fmt: skip
        answered = sorted((r for r in ranks if self.links[r - 1].error is not None),
                          key=lambda r: self.links[r - 1].at or 0.0)  # fmt: skip
        rank = (silent or answered)[0]
        link, code = self.links[rank - 1], self.procs[rank - 1].poll()
        device = self.devices[rank]
        hint = (
            f" Each GPU holds a whole copy of the DiT: free memory on {device} or use fewer "
            "GPUs (the node's `gpus`)."
            if link.error and "out of memory" in link.error.lower() else ""
        )  # fmt: skip
        return (
            f"Multi-GPU: the worker on {device} (rank {rank}) "
            + ("failed" if self.started else "failed to start")
            + (f" (exit code {code})" if code is not None else "")
            + (f": {link.error}" if link.error else "")
            + f". The workers were stopped; the next run starts them again.{hint}"
            + _tail(f"Rank {rank}'s last lines of output", list(link.lines)[-LINES:])
        )

    def _stalled(self, d: Deadline) -> str:
        text = (
            f"Multi-GPU: {d.what} did not finish in {d.why}, waiting on the workers on "
            f"{', '.join(self.devices[1:])}. The workers were stopped; the next run starts "
            "them again."
        )
        for rank, link in enumerate(self.links, 1):
            text += _tail(f"Where rank {rank} was", _innermost(list(link.lines)))
        return text

    def _fail(self, message: str) -> None:
        """Keep the error, then free rank 0 from whatever it waits in."""
        self.error = MultiGPUError(message)
        for p in self.procs:
            with contextlib.suppress(OSError):
                p.kill()
        self.failed.set()
        if self.backend == "nccl" and self.started:
            abort_communicators()


def _tail(title: str, lines: list[str]) -> str:
    return f"\n{title}:\n" + "\n".join(f"  {line}" for line in lines) if lines else ""


def _innermost(lines: list[str], frames: int = 6) -> list[str]:
    """The innermost frames of the worker's main thread in the last stacks faulthandler wrote
    among `lines` (each thread's, the most recent call first), else the last lines."""
    starts = [i for i, line in enumerate(lines) if "most recent call first" in line]
    stacks = [lines[i + 1 : j] for i, j in zip(starts, [*starts[1:], len(lines)], strict=True)]
    main = [s for s in stacks if any("worker_main" in line for line in s)] or stacks
    return [line.strip() for line in main[-1][:frames]] if main else lines[-LINES:]


def abort_communicators() -> None:
    """Abort every NCCL communicator of this process's groups (safe from any thread; the
    Python-side state is left for `destroy`): a kernel waiting on a dead peer ends."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    groups = list(c10d._world.pg_names)
    world = dist.GroupMember.WORLD
    try:
        backend = world._get_backend(torch.device("cuda")) if world is not None else None
    except RuntimeError:
        backend = None
    batched = backend is not None and hasattr(backend, "_group_start")
    if batched:  # all at once, as torch aborts them: one at a time can deadlock
        backend._group_start()
    for group in groups:
        with contextlib.suppress(Exception):
            group.abort()
    if batched:
        backend._group_end()
