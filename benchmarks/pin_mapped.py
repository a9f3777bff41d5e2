"""Page-locking weights that lie in a file mapping (ComfyUI v0.33's comfy-aimdo leaves the state
dict as views of one), as the Optimized Loader must before it streams offloaded weights.

Each variant maps the file afresh (in the OS cache, as after the first run of a session), takes
DiT-sized pieces at an 8-byte-aligned offset (as safetensors lays them out), and makes each
piece page-locked:
  clone      torch's clone of the piece, then cudaHostRegister of the
             clone (ComfyUI's `pin_memory`)
  huge       one anonymous mapping with transparent huge pages asked for (MADV_HUGEPAGE), each
             piece copied into it on --threads threads, then one cudaHostRegister of it
  copies     the loader's way under dynamic VRAM: copies made on --threads threads
             (`streaming.copies_ahead`, in one mapping asked for huge pages) ahead of the main
             thread, which registers each in order
  threaded   each piece copied and registered on one of --threads threads
  file       no copy: one cudaHostRegister of the file mapping's span, read-only
             (cudaHostRegisterReadOnly); the mapping private and read-only. Not run by
             default: on an H100 machine (kernel 6.18, Firecracker) it did not return within
             150 s
With --gil-busy N, N threads of this process run Python meanwhile (as the kernel warm-up's
compiles do during a first run's load). Then each variant's pieces cross to the GPU with
non-blocking copies: a page-locked source moves at the link's speed, a pageable one at a
fraction of it. Prints a table and JSON.

    python benchmarks/pin_mapped.py --gib 9.5
"""

import argparse
import ctypes
import json
import mmap
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: tests.harness
import mapped_load  # noqa: E402
from mapped_load import GiB, write_file  # noqa: E402

HEADER = 4104  # the first piece's offset: 8-byte aligned, not page aligned
MADV_HUGEPAGE = 14
PORTABLE, READ_ONLY = 1, 8


def pieces(size: int) -> list[tuple[int, int]]:
    """(offset, bytes) of each weight, the first at HEADER."""
    return [(offset + HEADER, n) for offset, n in mapped_load.pieces(size - HEADER)]


def register(ptr: int, n: int, flags: int) -> int:
    import torch

    return int(torch.cuda.cudart().cudaHostRegister(ptr, n, flags))


def unregister(ptr: int) -> None:
    import torch

    torch.cuda.cudart().cudaHostUnregister(ptr)


def anonymous(n: int) -> tuple[mmap.mmap, int]:
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    address = ctypes.addressof(ctypes.c_char.from_buffer(m))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise(address, n, MADV_HUGEPAGE)
    return m, address


def run(path: Path, variant: str, threads: int) -> dict:
    import torch

    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
    everything = torch.frombuffer(memoryview(m), dtype=torch.uint8)  # read-only: warns
    address = everything.data_ptr()
    spans = pieces(len(m))
    moved = sum(n for _, n in spans)
    keep, registered, rc = [], [], 0
    t0 = time.perf_counter()
    if variant == "clone":
        for offset, n in spans:
            c = everything[offset : offset + n].clone()
            rc = rc or register(c.data_ptr(), n, PORTABLE)
            registered.append(c.data_ptr())
            keep.append(c)
    elif variant == "huge":
        buf, base = anonymous(moved)
        dst = torch.frombuffer(buf, dtype=torch.uint8)
        at, jobs = 0, []
        for offset, n in spans:
            jobs.append((at, offset, n))
            keep.append(dst[at : at + n])
            at += n

        def move(job):
            at, offset, n = job
            ctypes.memmove(base + at, address + offset, n)

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(move, jobs))
        rc = register(base, moved, PORTABLE)
        registered.append(base)
    elif variant == "copies":
        from qwen_turbo.runtime.dit import streaming

        streaming.FILL_THREADS = threads
        views = [everything[o : o + n] for o, n in spans]
        for c in streaming.copies_ahead(views):
            rc = rc or register(c.data_ptr(), c.nbytes, PORTABLE)
            registered.append(c.data_ptr())
            keep.append(c)
    elif variant == "threaded":

        def pin(span):
            offset, n = span
            c = torch.empty(n, dtype=torch.uint8)
            ctypes.memmove(c.data_ptr(), address + offset, n)
            return c, register(c.data_ptr(), n, PORTABLE)

        with ThreadPoolExecutor(threads) as pool:
            for c, code in pool.map(pin, spans):
                rc = rc or code
                registered.append(c.data_ptr())
                keep.append(c)
    elif variant == "file":
        start = address + spans[0][0]
        start -= start % mmap.PAGESIZE
        end = address + spans[-1][0] + spans[-1][1]
        rc = register(start, end - start, PORTABLE | READ_ONLY)
        registered.append(start)
        keep = [everything[o : o + n] for o, n in spans]
    seconds = time.perf_counter() - t0
    pinned = all(t.is_pinned() for t in keep)
    # the crossing: 2 GiB of pieces, non-blocking, one synchronize
    sample, total = [], 0
    for t in keep:
        if total >= 2 * GiB:
            break
        sample.append(t)
        total += t.nbytes
    out = [torch.empty(t.nbytes, dtype=torch.uint8, device="cuda") for t in sample]
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    for o, t in zip(out, sample, strict=True):
        o.copy_(t, non_blocking=True)
    torch.cuda.synchronize()
    cross = time.perf_counter() - t1
    o0, n0 = spans[0]
    assert torch.equal(out[0].cpu(), everything[o0 : o0 + n0])
    for ptr in registered if rc == 0 else []:
        unregister(ptr)
    del out, keep, everything
    return {"variant": variant, "threads": threads, "gib": round(moved / GiB, 2), "rc": rc,
            "pinned": pinned, "seconds": round(seconds, 2),
            "cross_gb_per_s": round(total / cross / 1e9, 1)}  # fmt: skip


def spin() -> None:
    """Python, endlessly: a thread that wants the GIL whenever it lacks it."""
    n = 0
    while True:
        n = (n + 1) % 1000


def main():
    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=9.5)
    p.add_argument("--path", default="/tmp/qwen-turbo-models/pin_mapped.bin")
    p.add_argument("--variants", nargs="+", default=["clone", "huge"])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 4])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--gil-busy", type=int, default=0, help="threads running Python meanwhile")
    a = p.parse_args()
    for _ in range(a.gil_busy):
        threading.Thread(target=spin, daemon=True).start()
    path = Path(a.path)
    t = time.perf_counter()
    write_file(path, a.gib)
    print(f"file ready in {time.perf_counter() - t:.1f} s", flush=True)
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    thp = thp.read_text().strip() if thp.exists() else "?"
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, kernel "
          f"{os.uname().release}, THP {thp}, {a.gil_busy} threads running Python")  # fmt: skip
    print(f"{'variant':8s} {'threads':>7s} {'GiB':>6s} {'rc':>4s} {'pinned':>6s} {'pin':>7s} "
          f"{'cross GB/s':>10s}")  # fmt: skip
    rows = []
    for _ in range(a.repeats):
        for v in a.variants:
            for n in a.threads if v in ("huge", "copies", "threaded") else [1]:
                rows.append(r := run(path, v, n))
                print(f"{v:8s} {n:7d} {r['gib']:6.2f} {r['rc']:4d} {str(r['pinned']):>6s} "
                      f"{r['seconds']:6.2f}s {r['cross_gb_per_s']:10.1f}", flush=True)  # fmt: skip
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
