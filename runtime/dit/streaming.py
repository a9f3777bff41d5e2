"""Weights left on the host, streamed: while transformer block i computes, the offloaded weights
of block i + 1 cross to the GPU on a copy stream. Pure torch; never imports ComfyUI.

ComfyUI's partial load ("lowvram") leaves the modules that do not fit on the offload device and
marks them (`prev_comfy_cast_weights`); its ops then copy each weight when its layer runs, on
the compute stream, so the GPU waits for every copy. Here a layer that can take a copy made
ahead (`staged`, the pack's fp8 Linear) gets it from a copy stream that runs one block ahead.
Copies overlap compute only from page-locked memory (a copy from pageable memory also blocks
the host, so nothing runs ahead): weights the host pinned (ComfyUI v0.33 pins what it offloads,
up to its limit and not always) are used as they are; others (v0.3.64, and the LoRA factors
everywhere) are page-locked where they lie (cudaHostRegister, as v0.33 pins: no copy, no second
buffer), or where that fails get a pinned copy. Either is kept while the tensor stays the same.

The copies land in two slabs, block i's in slab i % 2 at the same offsets at every call, so
a block's staged weights keep their addresses from call to call and a CUDA graph of the block
can replay (`graphs.blocks`). The slabs stay between calls; `runtime.memory` holds them under
the model ("stream"), so ComfyUI's requests for room free them. Where a slab would not fit in
free memory, or runs out of it, that block's layers take ComfyUI's own per-layer copies:
slower, never a failure.

Calls run in lockstep (`BlockStreamer.in_lockstep`: cond and uncond where ComfyUI cannot batch
them) take turns at each block, so each block's copies cross once for all of them.

`Uploader` speeds up the other copies, the weights a load moves to the GPU for good.
"""

import bisect
import contextlib
import contextvars
import copy
import ctypes
import itertools
import logging
import mmap
import threading
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from .. import host, log_once, memory
from ..memory import room

log = logging.getLogger(__name__)


def to_device(obj, device: torch.device, copies: list, source: Callable):
    """`obj` with its tensors replaced by new ones on `device`, allocated on the current
    stream and not yet written: (new, source(tensor)) pairs go to `copies`. Tensors in tuples
    and lists, and in objects holding `weights` (ComfyUI's LoRA weight adapters)."""
    if isinstance(obj, torch.Tensor):
        new = torch.empty_like(obj, device=device)
        copies.append((new, source(obj)))
        return new
    if type(obj) in (tuple, list):
        return type(obj)(to_device(v, device, copies, source) for v in obj)
    if hasattr(obj, "weights"):
        moved = copy.copy(obj)
        moved.weights = to_device(obj.weights, device, copies, source)
        return moved
    return obj


def lora_patches(layer, device: torch.device, copies: list, source: Callable) -> list | None:
    """The layer's lowvram LoRA patches (`weight_function` entries holding `key` and
    `patches`, as ComfyUI's LowVramPatch does) on `device`, in order; None where it has
    none. ComfyUI leaves them on the host, so each call would copy them on the compute
    stream."""
    if not layer.weight_function:
        return None
    return [
        to_device(p.patches[p.key], device, copies, source)
        if hasattr(p, "key") and hasattr(p, "patches") else None
        for p in layer.weight_function
    ]  # fmt: skip


def offloaded(module: torch.nn.Module) -> bool:
    """Whether ComfyUI's partial load left this module's weights on the offload device (it
    sets and deletes this plain attribute; read from the instance's dict, as a miss through
    nn.Module's __getattr__ costs an exception)."""
    return "prev_comfy_cast_weights" in module.__dict__


def new_slab(nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


SLAB_ALIGN = 512  # each staged tensor's offset in a slab (any dtype's alignment, and more)


def aligned(nbytes: int) -> int:
    return -(-nbytes // SLAB_ALIGN) * SLAB_ALIGN


REGISTER_MIN = 1 << 20  # smaller tensors may share pages with others: pinned copies


class Registered:
    """A host tensor page-locked where it lies, until this object goes (which must happen
    before the tensor can be freed: it holds the tensor)."""

    def __init__(self, t: torch.Tensor):
        self.t = t

    @classmethod
    def of(cls, t: torch.Tensor) -> "Registered | None":
        """`t` registered, or None where the driver refuses (memory shared with another
        registration, say)."""
        if t.nbytes < REGISTER_MIN or not torch.cuda.is_available() or not t.is_contiguous():
            return None
        if torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.nbytes, 0) == 0:
            return cls(t)
        discard_error()
        return None

    def __del__(self):
        with contextlib.suppress(AttributeError, RuntimeError, TypeError):  # at shutdown
            code = torch.cuda.cudart().cudaHostUnregister(self.t.data_ptr())
            if code != 0:  # another owner unregistered it: nothing is left locked
                log_once(log, logging.INFO, f"weight streaming: unregistering host weights "
                         f"gave CUDA error {int(code)}")  # fmt: skip
                discard_error()


def discard_error() -> None:
    """Clear the error a failed CUDA runtime call (host page-locking) leaves behind: the next
    kernel launch's check would raise it, in whatever op comes next ('invalid argument' in a
    block's F.silu). A launch reads and clears it; none is made inside a capture."""
    if torch.cuda.is_current_stream_capturing():
        return
    with contextlib.suppress(RuntimeError):
        torch.empty(1, device="cuda").zero_()


class Cancelled(Exception):
    """Raised in a call run in lockstep, at its next block, once another of them has failed."""


class Turns:
    """Calls on threads of their own that run one at a time: each hands over at the start of
    each block to the next call still running."""

    def __init__(self, n: int):
        self.lock = threading.Condition()
        self.turn = 0
        self.running = [True] * n
        self.failed = False

    def _pass(self, me: int) -> None:
        n = len(self.running)
        self.turn = next((j % n for j in range(me + 1, me + n) if self.running[j % n]), me)
        self.lock.notify_all()

    def wait(self, me: int) -> None:
        """Until it is `me`'s turn; Cancelled where another call has failed."""
        with self.lock:
            self.lock.wait_for(lambda: self.turn == me)
        if self.failed:
            raise Cancelled

    def hand_over(self, me: int) -> None:
        with self.lock:
            self._pass(me)
        self.wait(me)

    def finish(self, me: int, failed: bool) -> None:
        with self.lock:
            self.running[me] = False
            self.failed |= failed
            self._pass(me)

    def others(self) -> int:
        """How many calls run besides the one whose turn it is."""
        return sum(self.running) - 1


# (streamer, its Turns, this call's index) in a call that `BlockStreamer.in_lockstep` runs
_lockstep = contextvars.ContextVar("qwen_turbo_lockstep", default=None)


def lockstep_call() -> int | None:
    """The index of the call in lockstep that runs now; None outside a lockstep."""
    lockstep = _lockstep.get()
    return None if lockstep is None else lockstep[2]


def with_torch_state(fn: Callable) -> Callable:
    """`fn`, to run on another thread under this one's grad or inference mode and current CUDA
    stream (all three are per thread)."""
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    stream = torch.cuda.current_stream() if torch.cuda.is_initialized() else None

    def run(*args):
        with contextlib.ExitStack() as stack:
            mode = torch.inference_mode() if inference else torch.set_grad_enabled(grad)
            stack.enter_context(mode)
            if stream is not None:
                stack.enter_context(torch.cuda.device(stream.device))
                stack.enter_context(torch.cuda.stream(stream))
            return fn(*args)

    return run


class BlockStreamer:
    """Copies ahead the offloaded weights of a model's blocks, run in order.

    `blocks[i]`'s layers with a `staged` attribute are the ones streamed; `forward(i, inner)`
    is block i's forward with the copies around it. A copy made ahead serves only until the
    block it is for has run (in every call of a lockstep); between model calls only the two
    slabs stay on the GPU (`owner`: the model `runtime.memory` holds them under).
    """

    def __init__(self, blocks, owner=None):
        self.owner = None if owner is None else weakref.ref(owner)  # memory holds slabs under it
        self.layers = [[m for m in b.modules() if hasattr(m, "staged")] for b in blocks]
        # page-lock pageable sources; off once pinning fails or where ComfyUI's is turned off
        self.page_lock = not host.pinning_disabled()
        self.ahead: dict[int, tuple[torch.cuda.Event | None, list]] = {}
        # block -> (its staged weights, how many calls in lockstep have still to run it)
        self.shared: dict[int, tuple[list, int]] = {}
        self.streams: dict[torch.device, torch.cuda.Stream] = {}
        self.slabs: dict[tuple[torch.device, int], torch.Tensor] = {}  # (device, parity)
        self.copies = 0  # blocks staged, for tests and the log
        self.no_room = 0  # blocks left to ComfyUI's copies for want of memory
        # after(i, output, kwargs, call): sees block i's output while its copies are staged;
        # call(**changes) runs the block again there (the fidelity probe's lossy rerun)
        self.after: Callable | None = None

    def streams_now(self) -> bool:
        """Whether some block's layers are offloaded now."""
        return any(offloaded(m) for layers in self.layers for m in layers)

    def _pinned(self, t: torch.Tensor, old: dict, new: dict) -> torch.Tensor:
        """`t`, page-locked where this host left it pageable: registered where it lies, else a
        pinned copy. What an earlier call made (`old`, by id) serves while `t` is the same
        tensor; what this call uses goes to `new`."""
        if not self.page_lock or t.device.type != "cpu":
            return t
        hit = old.get(id(t))
        if hit is None or hit[0] is not t:
            # host pinning is asked per call: the host unpins its tensors as it pleases
            hit = None if t.is_pinned() else self._page_lock(t)
            if hit is None:
                return t
        new[id(t)] = hit
        return t if isinstance(hit[1], Registered) else hit[1]

    def _page_lock(self, t: torch.Tensor) -> tuple | None:
        """(t, its registration or a pinned copy), or None once pinning fails."""
        registered = Registered.of(t)
        if registered is None and t.nbytes >= REGISTER_MIN:
            log_once(log, logging.INFO, "weight streaming: host weights that cannot be "
                     "page-locked where they lie get pinned copies")  # fmt: skip
        try:
            return (t, registered) if registered else (t, t.pin_memory())
        except RuntimeError as e:  # out of page-locked memory: copy from pageable
            log_once(log, logging.WARNING, f"weight streaming: host memory not pinned ({e})")
            self.page_lock = False
            return None

    def _stage(self, i: int, device: torch.device) -> tuple[list, list]:
        """([(layer, its weight, (weight, bias, LoRA patches) on `device`)], [(new,
        source)]) for block i's offloaded layers: the tensors on `device` not yet written
        (weights and biases in slab i % 2, the LoRA patches allocated on the current stream),
        the copies still to make; ([], []) where they do not fit."""
        layers = [m for m in self.layers[i] if offloaded(m)]
        if not layers:
            return [], []
        try:
            slab = self._slab(i, device)
            if slab is None:
                return self._left_to_comfyui()
            staged, copies, at = [], [], 0
            for m in layers:
                old, new = m.__dict__.get("_pinned", {}), {}

                def source(t, old=old, new=new):
                    return self._pinned(t, old, new)

                tensors = []
                for t in (m.weight, m.bias):
                    if t is not None and t.is_contiguous():
                        view = slab[at : at + t.nbytes].view(t.dtype).view(t.shape)
                        copies.append((view, source(t)))
                        at += aligned(t.nbytes)
                        t = view
                    else:
                        t = to_device(t, device, copies, source)
                    tensors.append(t)
                staged.append((m, m.weight, (*tensors, lora_patches(m, device, copies, source))))
                m._pinned = new
        except torch.OutOfMemoryError:
            return self._left_to_comfyui()
        return staged, copies

    def _block_bytes(self, i: int) -> int:
        """The bytes block i's offloaded weights and biases take in a slab."""
        return sum(aligned(t.nbytes) for m in self.layers[i] if offloaded(m)
                   for t in (m.weight, m.bias) if t is not None)  # fmt: skip

    def _slab(self, i: int, device: torch.device) -> torch.Tensor | None:
        """Slab i % 2 on `device`: block i's weights lie at the same offsets in it at every
        call, so a block's staged weights keep their addresses (and a block graph of it its
        key). Made as large as the largest block of its parity needs; None where that does
        not fit in free memory."""
        key = (device, i % 2)
        need = self._block_bytes(i)
        slab = self.slabs.get(key)
        if slab is not None and slab.nbytes >= need:
            return slab
        need = max(self._block_bytes(j) for j in range(i % 2, len(self.layers), 2))
        self.slabs.pop(key, None)
        if need > room(device):
            return None
        self.slabs[key] = slab = new_slab(need, device)
        if self.owner is not None and self.owner() is not None:
            memory.register(self.owner(), self, "stream")
        return slab

    # memory.Holder: the slabs
    def held_bytes(self) -> int:
        """0: the slabs are tensors in use, which ComfyUI counts as used already (it asks the
        model for room, and `drop` frees them first)."""
        return 0

    def drop(self) -> None:
        """Free the slabs (made again at the next call that streams); the copies in flight
        are waited for first, as their memory goes back to the compute stream's pool."""
        self._drop_ahead()
        self.shared.clear()
        self.slabs.clear()

    clear = drop

    def _left_to_comfyui(self) -> tuple[list, list]:
        self.no_room += 1
        log_once(log, logging.INFO, "weight streaming: no room for a block's copies; "
                 "ComfyUI copies those layers itself")  # fmt: skip
        return [], []

    def _prefetch(self, i: int, device: torch.device) -> None:
        """Start block i's copies on the copy stream. Their memory comes from the compute
        stream's pool, as the activations' does, so no second stream's cache holds memory
        near the card's limit; the copy stream waits until the compute stream is done with
        what that memory held before."""
        staged, copies = self._stage(i, device)
        if device.type != "cuda" or not copies:
            for new, src in copies:
                new.copy_(src)
            self.ahead[i] = (None, staged)
            return
        stream = self.streams.get(device)
        if stream is None:
            stream = self.streams[device] = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))  # the memory is free to write
        with torch.cuda.stream(stream):
            for new, src in copies:
                new.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        self.ahead[i] = (event, staged)

    def _drop_ahead(self) -> None:
        """Forget the copies made ahead, once written: their memory goes back to the compute
        stream's pool, which does not wait for the copy stream."""
        for event, _ in self.ahead.values():
            if event is not None:
                event.synchronize()
        self.ahead.clear()

    def _take(self, i: int, device: torch.device) -> list:
        """Block i's staged weights, made ready for the current stream."""
        if i not in self.ahead:
            self._prefetch(i, device)
        event, staged = self.ahead.pop(i)
        if event is not None:
            torch.cuda.current_stream(device).wait_event(event)
        return staged

    def forward(self, i: int, inner: Callable) -> Callable:
        """Block i's forward (`inner`, the hidden states first) with its offloaded weights
        staged, and block i + 1's copied meanwhile."""

        def forward(hidden_states, *args, **kwargs):
            lockstep = _lockstep.get()
            if lockstep is not None and lockstep[0] is self:
                lockstep[1].hand_over(lockstep[2])  # the other calls run up to this block
            elif i == 0:
                self._drop_ahead()  # left by a call that did not run every block
                if self.slabs and not self.streams_now():  # loaded whole since
                    self.drop()
            streamed = False
            for m in self.layers[i]:
                if offloaded(m):
                    streamed = True
                else:  # loaded: a pinned copy from before goes
                    m.__dict__.pop("_pinned", None)
            if not streamed:
                return self._run(i, inner, hidden_states, args, kwargs)
            staged = self._staged(i, hidden_states.device, lockstep)
            try:
                for m, _, tensors in staged:  # plain attributes: past nn.Module's __setattr__
                    m.__dict__["staged"] = tensors
                return self._run(i, inner, hidden_states, args, kwargs)
            except BaseException:
                self._drop_ahead()  # an interrupted call leaves no copies behind
                raise
            finally:
                for m, *_ in staged:
                    m.__dict__["staged"] = None

        forward.__wrapped__ = inner  # for inspect.unwrap: what this block runs
        return forward

    def _staged(self, i: int, device: torch.device, lockstep) -> list:
        """Block i's staged weights: those a call in lockstep took for it before, or taken now
        (and block i + 1's copies started), then kept for the calls in lockstep still to run
        block i. A layer reloaded since its copy was made is left out: it takes ComfyUI's."""
        if i in self.shared:
            staged, left = self.shared.pop(i)
            if left > 1:
                self.shared[i] = (staged, left - 1)
            return [s for s in staged if s[0].weight is s[1]]
        staged = self._take(i, device)
        if i + 1 < len(self.layers):
            self._prefetch(i + 1, device)
        others = lockstep[1].others() if lockstep is not None and lockstep[0] is self else 0
        if others:
            self.shared[i] = (staged, others)
        staged = [s for s in staged if s[0].weight is s[1]]
        if staged and not self.copies:
            log_once(log, logging.INFO, "weight streaming: offloaded weights copied ahead")
        self.copies += bool(staged)
        return staged

    def in_lockstep(self, calls: list[Callable]) -> list:
        """[call() for call in calls], each on a thread of its own (the first on this one) with
        this thread's torch state and context, one at a time, handing over at the start of
        each block: block i's copies serve every call, so the offloaded weights cross once for
        all of them. Where a call raises, the others stop at their next block and its error
        is raised here."""
        turns = Turns(len(calls))
        results, errors = [None] * len(calls), [None] * len(calls)

        def run(k: int) -> None:
            token = _lockstep.set((self, turns, k))
            try:
                if k:
                    turns.wait(k)
                results[k] = calls[k]()
            except BaseException as e:  # raised on the caller's thread below
                errors[k] = e
            finally:
                _lockstep.reset(token)
                turns.finish(k, errors[k] is not None)

        self._drop_ahead()
        threads = [
            threading.Thread(target=contextvars.copy_context().run, daemon=True,
                             args=(with_torch_state(run), k), name="qwen-turbo-lockstep")
            for k in range(1, len(calls))
        ]  # fmt: skip
        for t in threads:
            t.start()
        run(0)
        for t in threads:
            t.join()
        self.shared.clear()  # kept for a call that stopped early
        self._drop_ahead()
        failed = [e for e in errors if e is not None]
        errors.clear()  # each error's frames hold `errors`: a cycle, kept until a collection
        if not failed:
            return results
        error = next((e for e in failed if not isinstance(e, Cancelled)), failed[0])
        del failed
        try:
            raise error
        finally:
            del error  # so is this frame

    def _run(self, i: int, inner: Callable, hidden_states, args, kwargs):
        out = inner(hidden_states, *args, **kwargs)
        if self.after is not None:

            def call(**changes):
                kw = {**kwargs, **changes}
                return inner(kw.pop("hidden_states", hidden_states), *args, **kw)

            self.after(i, out, kwargs, call)
        return out


def file_backed(tensors) -> set[int]:
    """The data pointers of `tensors` that lie in a mapping of a file (Linux's
    /proc/self/maps; an empty set elsewhere). Keeping such a tensor costs no memory of its
    own: its pages are the OS's file cache (unless written, which loaded weights are not)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return set()
    spans: list[list[int]] = []
    for line in lines:
        fields = line.split(maxsplit=5)
        path = fields[5] if len(fields) == 6 else ""
        # a file's path; not memfd or /dev/shm (memory of their own) nor a deleted file
        if not path.startswith("/") or path.startswith(("/memfd:", "/dev/")) or "(deleted)" in path:
            continue
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if spans and spans[-1][1] == start:
            spans[-1][1] = end  # one mapping split in parts
        else:
            spans.append([start, end])
    starts = [start for start, _ in spans]
    backed = set()
    for t in tensors:
        i = bisect.bisect_right(starts, t.data_ptr()) - 1
        if i >= 0 and t.data_ptr() + t.nbytes <= spans[i][1]:
            backed.add(t.data_ptr())
    return backed


PAGE = mmap.PAGESIZE
MADV_PAGEOUT = 21  # Linux 5.4+: reclaim these pages now (clean file pages are dropped)
# The file cache of weights now on the GPU is kept only where the host has this much room
# beside it: a text encoder and a VAE, streamed from their own files, need their pages cached.
PAGE_CACHE_ROOM = 16 << 30


def page_out(tensors: list[torch.Tensor], model_bytes: int) -> int:
    """Where host RAM is short (less available than the model's bytes and PAGE_CACHE_ROOM),
    ask the OS to drop the pages of `tensors` (views of the model's file mapping whose data
    is elsewhere now): their file cache would push out that of the files read next. Whole
    pages inside each tensor only; a later read takes them from the file again. The bytes
    asked."""
    import psutil

    if not tensors or psutil.virtual_memory().available >= model_bytes + PAGE_CACHE_ROOM:
        return 0
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError, TypeError):  # no C library to load (Windows)
        return 0
    asked = 0
    for t in tensors:
        start = -(-t.data_ptr() // PAGE) * PAGE
        end = (t.data_ptr() + t.nbytes) // PAGE * PAGE
        if end > start and madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start),
                                   MADV_PAGEOUT) == 0:  # fmt: skip
            asked += end - start
    return asked


STAGE_MIN = 1 << 20  # smaller tensors gain too little from staging to pay its setup
STAGE_MAX = 1 << 28  # larger ones (none in Qwen-Image's DiT) keep the buffer small
# Threads filling the buffer. torch's CPU copy takes every core, and with 6 of 16 busy (as a
# first run's kernel warm-up keeps them) it fell to 2.3 GB/s, below `.to()`'s 5.6-6.7.
FILL_THREADS = 4
HUGE_PAGE = 2 << 20
# a private anonymous mapping: a shared one lies in shmem, which gets no huge pages by default
PRIVATE = {"flags": mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS} if hasattr(mmap, "MAP_ANONYMOUS") else {}


def copies_ahead(tensors: list[torch.Tensor]) -> Iterator[torch.Tensor]:
    """Copies of host `tensors`, made on FILL_THREADS threads (ctypes' memmove lets go of the
    GIL) ahead of the caller, which takes them in order.

    The plain ones lie in one private anonymous mapping asked for huge pages: a 2 MiB page
    faults in, and is page-locked, where 512 small ones would be (a mapping per copy did not
    gain; benchmarks/RESULTS.md 7.1). Each starts a page of its own (ComfyUI page-locks each
    on its own) and a storage of its own (torch tells a tensor pinned by its storage's
    start), and its pages go back to the OS when it goes."""
    plain = [t.is_contiguous() and type(t.detach()) is torch.Tensor and t.nbytes for t in tensors]
    sizes = [-(-t.nbytes // PAGE) * PAGE if p else 0 for t, p in zip(tensors, plain, strict=True)]
    arena = None
    if getattr(mmap.mmap, "madvise", None) is not None:  # else (Windows) a copy each, freed with it
        # a multiple of the huge page: the kernel then places the mapping on a huge page's start
        arena = mmap.mmap(-1, -(-max(sum(sizes), 1) // HUGE_PAGE) * HUGE_PAGE, **PRIVATE)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            arena.madvise(mmap.MADV_HUGEPAGE)
    starts = list(itertools.accumulate(sizes, initial=0))

    def one(i: int) -> torch.Tensor:
        t = tensors[i].detach()
        if not plain[i]:
            return t.clone()
        if arena is None:
            out = torch.empty(t.nbytes, dtype=torch.uint8)
        else:
            pages = memoryview(arena)[starts[i] : starts[i] + t.nbytes]
            free = weakref.finalize(pages, arena.madvise, mmap.MADV_DONTNEED, starts[i], sizes[i])
            free.atexit = False
            out = torch.frombuffer(pages, dtype=torch.uint8)
        ctypes.memmove(out.data_ptr(), t.data_ptr(), t.nbytes)
        return out.view(t.dtype).view(t.shape)

    with ThreadPoolExecutor(FILL_THREADS, thread_name_prefix="qwen-turbo-pin") as pool:
        yield from pool.map(one, range(len(tensors)))


class Uploader:
    """Host tensors copied to the GPU through one page-locked buffer: a few threads copy each
    into it, then it crosses from there. From pageable memory (both hosts load weights as
    views of a file mapping) `.to()` moves 5-7 GB/s on an H100; see benchmarks/mapped_load.py
    for this one's. Close it (or use it in a `with`) to stop its threads."""

    def __init__(self, nbytes: int):
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.done: torch.cuda.Event | None = None  # the buffer's last transfer
        self.pool = ThreadPoolExecutor(FILL_THREADS, thread_name_prefix="qwen-turbo-upload")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        self.pool.shutdown()

    @staticmethod
    def stages(t: torch.Tensor) -> bool:
        """Whether a copy of `t` goes through the buffer: a plain, contiguous, pageable host
        tensor of a size worth it."""
        return (
            t.device.type == "cpu"
            and STAGE_MIN <= t.nbytes <= STAGE_MAX
            and type(t.data) is torch.Tensor  # not a tensor subclass (quantized layouts)
            and t.is_contiguous()
            and not t.is_pinned()
        )

    @classmethod
    def for_tensors(cls, tensors) -> "Uploader | None":
        """An uploader for `tensors`, or None where none is staged or pinning fails."""
        sizes = [t.nbytes for t in tensors if cls.stages(t)]
        if not sizes:
            return None
        try:
            return cls(max(sizes))
        except RuntimeError as e:  # out of page-locked memory
            log_once(log, logging.WARNING, f"weight upload: no page-locked buffer ({e})")
            return None

    def takes(self, t: torch.Tensor) -> bool:
        return self.stages(t) and t.nbytes <= self.buffer.nbytes

    def _fill(self, t: torch.Tensor) -> None:
        """`t`'s bytes into the buffer, in page-aligned parts, one per thread (ctypes' memmove
        lets go of the GIL)."""
        n, src, dst = t.nbytes, t.data_ptr(), self.buffer.data_ptr()
        part = -(-n // FILL_THREADS)  # a thread's share, rounded up to whole pages
        part = -(-part // 4096) * 4096

        def move(at: int) -> None:
            ctypes.memmove(dst + at, src + at, min(part, n - at))

        list(self.pool.map(move, range(0, n, part)))

    def to(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A copy of `t` on `device`, a CUDA device, queued on its current stream."""
        if self.done is not None:
            self.done.synchronize()
        self._fill(t)
        out = torch.empty(t.shape, dtype=t.dtype, device=device)
        staged = self.buffer[: t.nbytes].view(t.dtype).view(t.shape)
        stream = torch.cuda.current_stream(out.device)
        with torch.cuda.stream(stream):
            out.copy_(staged, non_blocking=True)
        self.done = torch.cuda.Event()
        self.done.record(stream)
        return out
