"""Model calls run in lockstep: each on its own thread, one thread at a time, each running to
the end of its next transformer block before the next call takes its turn. The calls of a step
then run block i one after another, and the weight streamer (`streaming`) copies block i's
offloaded weights to the GPU once for all of them. A call runs the ops it would run alone, on
the same stream and in the same order, so its output is bit-identical. Pure torch."""

import contextlib
import contextvars
import threading
from collections.abc import Callable

import torch

# (the Lockstep, this call's turn) in a lockstep call's thread
_current = contextvars.ContextVar("qwen_turbo_lockstep", default=None)


class Lockstep:
    def __init__(self, n: int):
        self.cond = threading.Condition()
        self.running = list(range(n))  # the calls not yet done, in turn order
        self.turn: int | None = 0
        self.shared: dict = {}  # what the calls share, by its owner (the streamer's copies)

    def _pass(self, k: int, done: bool) -> None:
        """Hand the turn on from call k (holding `cond`)."""
        at = self.running.index(k)
        if done:
            self.running.pop(at)
            self.turn = self.running[at % len(self.running)] if self.running else None
        else:
            self.turn = self.running[(at + 1) % len(self.running)]
        self.cond.notify_all()

    def _wait(self, k: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.turn == k)


def current() -> Lockstep | None:
    """The Lockstep this thread's call runs in, if any."""
    entry = _current.get()
    return entry[0] if entry else None


def block_end() -> None:
    """In a lockstep call: let the other calls run to the end of this block too."""
    entry = _current.get()
    if entry is None:
        return
    lockstep, k = entry
    with lockstep.cond:
        lockstep._pass(k, done=False)
        lockstep.cond.wait_for(lambda: lockstep.turn == k)


def _torch_state() -> Callable[[], contextlib.ExitStack]:
    """The caller's thread-local torch state (inference mode, grad mode, CUDA device and
    stream), to enter on another thread."""
    inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    stream = torch.cuda.current_stream() if cuda else None

    def enter() -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        if inference:
            stack.enter_context(torch.inference_mode())
        stack.enter_context(torch.set_grad_enabled(grad))
        if stream is not None:
            stack.enter_context(torch.cuda.device(stream.device))
            stack.enter_context(torch.cuda.stream(stream))
        return stack

    return enter


def run(calls: list[tuple[Callable, contextvars.Context]]) -> list:
    """The results of `calls` ((fn, the context it runs in), run in a copy of it), run in
    lockstep in this order. An error in one call stops none of the others; the first is
    raised once all have ended."""
    if len(calls) == 1:
        fn, context = calls[0]
        return [context.copy().run(fn)]
    lockstep = Lockstep(len(calls))
    results, errors = [None] * len(calls), []
    state = _torch_state()

    def call(k: int, fn: Callable) -> None:
        _current.set((lockstep, k))
        with state():
            results[k] = fn()

    def thread(k: int, fn: Callable, context: contextvars.Context) -> None:
        lockstep._wait(k)
        try:
            context.run(call, k, fn)
        except BaseException as e:
            errors.append(e)
        finally:
            with lockstep.cond:
                lockstep._pass(k, done=True)

    threads = [
        threading.Thread(target=thread, args=(k, fn, context.copy()), daemon=True,
                         name=f"qwen-turbo-lockstep-{k}")
        for k, (fn, context) in enumerate(calls)
    ]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results
