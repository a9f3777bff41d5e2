"""The pack's Triton kernels compiled ahead of their first launch, on background threads.

A machine's first run compiles every kernel variant it launches, one after another, inside
the first sampling step: 28 variants and 9.0 s on an H100 for the bundled 2512^2 turbo workflow
(benchmarks/RESULTS.md). `start()` compiles the launches listed in `warmup.json`, recorded
from the bundled workflows by `record()`, on a pool of threads, while ComfyUI loads the model
(Triton's compiler releases the GIL for much of its work: those 28 took 6.6 s of wall time on 8
threads against 12.7 s one after another, module imports included). Each
goes through Triton's own `warmup` (its binder, options and caches), so the first real launch
of that variant finds it compiled; its C launcher, which Triton otherwise builds with the host's
C compiler at the first launch (about 0.3 s a signature, on the thread that launches), is
built into Triton's cache as well. A variant not listed, or one that fails to compile here (an
older GPU), is compiled at its launch as before.

An entry: [module, kernel, args, kwargs]; a tensor argument is {"dtype": ..., "aligned": ...}
(its data pointer a multiple of 16 or not), any other argument its value.
"""

import contextlib
import importlib
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ._triton import HAS_TRITON, INTERPRET, disabled

log = logging.getLogger(__name__)
MANIFEST = Path(__file__).with_name("warmup.json")
# (device index, kernel modules or None) -> its warm-up thread
_started: dict[tuple, threading.Thread] = {}

if HAS_TRITON:
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction, MockTensor

    class _Pointer(MockTensor):
        """A tensor argument as Triton specializes it: dtype and 16-byte alignment."""

        def __init__(self, dtype: torch.dtype, aligned: bool):
            super().__init__(dtype)
            self.aligned = aligned

        def data_ptr(self):
            return 0 if self.aligned else 2


def _arg(a) -> object:
    if isinstance(a, torch.Tensor):
        return {"dtype": str(a.dtype).removeprefix("torch."), "aligned": a.data_ptr() % 16 == 0}
    return a


def _value(a) -> object:
    if isinstance(a, dict):
        return _Pointer(getattr(torch, a["dtype"]), a["aligned"])
    return a


def kernel(module: str, name: str):
    """The JITFunction `name` of the pack's kernels module `module` (e.g. "fp8_linear")."""
    return getattr(importlib.import_module(f"{__package__}.{module}"), name)


@contextlib.contextmanager
def record():
    """Yields the list of entries for every launch of the pack's kernels inside the block,
    each once (a benchmark tool: it wraps Triton's launcher for the block's duration)."""
    entries: list = []
    seen: set[str] = set()
    run = JITFunction.run
    package = __package__ + "."

    def recorded(self, *args, grid, warmup, **kwargs):
        module = self.fn.__module__
        if not warmup and module.startswith(package):
            entry = [module.removeprefix(package), self.fn.__name__,
                     [_arg(a) for a in args], {k: _arg(v) for k, v in kwargs.items()}]  # fmt: skip
            key = json.dumps(entry)
            if key not in seen:
                seen.add(key)
                entries.append(entry)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    JITFunction.run = recorded
    try:
        yield entries
    finally:
        JITFunction.run = run


def save(entries: list, path: Path = MANIFEST) -> int:
    """Adds `entries` to the manifest at `path` (each once, one a line); returns its length."""
    old = json.loads(path.read_text()) if path.exists() else []
    lines = list(dict.fromkeys(json.dumps(e) for e in old + entries))
    path.write_text("[\n" + ",\n".join(lines) + "\n]\n")
    return len(lines)


def _compile(device: int, entry) -> bool:
    module, name, args, kwargs = entry
    try:
        with torch.cuda.device(device):
            compiled = kernel(module, name).warmup(
                *map(_value, args), grid=(1,), **{k: _value(v) for k, v in kwargs.items()}
            )
            # host code only: the kernel's load onto the GPU waits for its first launch, so
            # no CUDA graph capture on the main thread meets a module load from here
            driver.active.launcher_cls(compiled.src, compiled.metadata)
        return True
    except Exception as e:  # an entry this GPU or Triton can't build: compiled at launch instead
        log.debug("warm-up of %s.%s skipped: %s", module, name, e)
        return False


def _warm(device: int, entries: list, threads: int) -> None:
    t0 = time.perf_counter()
    with torch.cuda.device(device):  # per-device caches made once, not by racing threads
        for module, name in {(e[0], e[1]) for e in entries}:
            with contextlib.suppress(Exception):
                kernel(module, name).device_caches[device]
    with ThreadPoolExecutor(threads, thread_name_prefix="qwen-turbo-warmup") as pool:
        done = sum(pool.map(lambda e: _compile(device, e), entries))
    log.info(
        "compiled %d of %d kernel variants ahead in %.1f s (%d threads)",
        done, len(entries), time.perf_counter() - t0, threads,
    )  # fmt: skip


def start(device: torch.device, modules=None, manifest: Path = MANIFEST) -> threading.Thread | None:
    """Compiles the manifest's kernels for `device` on background threads, once per device and
    set of kernel `modules` (only their launches: a DiT's or a VAE's; all where None); returns
    the thread (join it to wait), or None where there is nothing to do."""
    if not HAS_TRITON or INTERPRET or disabled() or device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, None if modules is None else frozenset(modules))
    if key not in _started:
        entries = selected(manifest, modules)
        if not entries:
            return None
        threads = max(1, min(8, (os.cpu_count() or 2) - 1))
        _started[key] = threading.Thread(
            target=_warm, args=(index, entries, threads), name="qwen-turbo-warmup", daemon=True
        )
        _started[key].start()
    return _started[key]


def selected(manifest: Path, modules=None) -> list:
    """The manifest's entries of the kernel `modules` (all where None)."""
    return [e for e in json.loads(manifest.read_text()) if modules is None or e[0] in modules]
