"""Copying weights from a file mapping to the GPU, as ComfyUI v0.33's dynamic VRAM leaves them.

With comfy-aimdo the state dict's tensors are views of a mapping of the model file; ComfyUI's
ModelPatcher.load then copies each weight with `.to(device)` and synchronizes per module. Each
variant maps the file afresh (in the OS cache, as after the first run of a session):
  pageable      `.to("cuda")` per weight, a synchronize after each (ModelPatcher.load)
  populated     the mapping's page tables filled first (madvise MADV_POPULATE_READ), then
                the same copies; the populate's own time is counted
  alongside     the populate on another thread, ahead of the same copies
  staged        the Optimized Loader's copy (runtime/dit/streaming.Uploader): each
                weight copied into a page-locked buffer by a few threads, then to the GPU
                from there; a synchronize after each
  aimdo         each weight read from the file straight to the GPU by comfy-aimdo's file
                reader (`read_file_to_device`, what v0.33's dynamic loading uses); a
                synchronize after each. Needs comfy-aimdo.
Weights are sized as the DiT's fp8 matrices (four 3072x3072 and two 3072x12288 per block).
With --busy N, N processes keep as many cores busy meanwhile (as the Optimized Loader's
kernel warm-up does during a first run's load).
Prints a table and JSON on the last line.

    python benchmarks/mapped_load.py --gib 19
"""

import argparse
import atexit
import ctypes
import json
import mmap
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: tests.harness
from tests.harness import pack  # noqa: E402

GiB = 2**30
MADV_POPULATE_READ = 22  # Linux 5.14
PAGE = mmap.PAGESIZE
BLOCK = [3072 * 3072] * 4 + [3072 * 12288] * 2  # bytes of one block's fp8 matrices


def write_file(path: Path, gib: float) -> None:
    import torch

    if path.exists() and path.stat().st_size >= gib * GiB:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        left = int(gib * GiB)
        while left:
            n = min(left, GiB)
            f.write(torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda").cpu().numpy())
            left -= n


def pieces(size: int) -> list[tuple[int, int]]:
    """(offset, bytes) of each weight in a file of `size` bytes."""
    out, offset, i = [], 0, 0
    while offset + BLOCK[i % len(BLOCK)] <= size:
        out.append((offset, BLOCK[i % len(BLOCK)]))
        offset += BLOCK[i % len(BLOCK)]
        i += 1
    return out


def populate(address: int, spans: list[tuple[int, int]]) -> bool:
    """Fills the page tables of each span of the mapping at `address`; False if refused."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for offset, n in spans:
        start = (address + offset) // PAGE * PAGE
        if libc.madvise(start, address + offset + n - start, MADV_POPULATE_READ) != 0:
            return False
    return True


def run(path: Path, variant: str) -> dict:
    import torch

    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(m))
    spans = pieces(len(m))
    everything = torch.frombuffer(m, dtype=torch.uint8)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    ok, helper = True, None
    if variant == "populated":
        ok = populate(address, spans)
    elif variant == "alongside":
        helper = threading.Thread(target=populate, args=(address, spans))
        helper.start()
    t1 = time.perf_counter()
    out = []
    if variant == "aimdo":
        import comfy_aimdo.control

        comfy_aimdo.control.init()  # before host_buffer's import, which binds its library
        comfy_aimdo.control.init_devices([torch.cuda.current_device()])
        import comfy_aimdo.host_buffer

        fd = os.open(path, os.O_RDONLY)
        t0 = t1 = time.perf_counter()  # the reader's setup is not the copies'
    if variant == "staged":
        from qwen_turbo.runtime.dit.streaming import Uploader

        uploader = Uploader(max(BLOCK))
    for offset, n in spans:
        if variant == "aimdo":
            out.append(torch.empty(n, dtype=torch.uint8, device="cuda"))
            comfy_aimdo.host_buffer.read_file_to_device(
                fd, offset, n, 0, out[-1].data_ptr(), 0, mark_cold=False
            )
        elif variant == "staged":
            out.append(uploader.to(everything[offset : offset + n], torch.device("cuda")))
        else:
            out.append(everything[offset : offset + n].to("cuda"))
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    if variant == "aimdo":
        os.close(fd)
    if variant == "staged":
        uploader.close()
    if helper:
        helper.join()
    moved = sum(n for _, n in spans)
    assert torch.equal(out[-1].cpu(), everything[spans[-1][0] : sum(spans[-1])])
    del out, everything
    return {"variant": variant, "gib": round(moved / GiB, 2), "populate_ok": ok,
            "populate_s": round(t1 - t0, 2), "seconds": round(seconds, 2),
            "gb_per_s": round(moved / seconds / 1e9, 2)}  # fmt: skip


def main():
    import torch

    pack.load()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=19)
    p.add_argument("--path", default="/tmp/qwen-turbo-models/mapped_load.bin")
    p.add_argument(
        "--variants", nargs="+", default=["pageable", "populated", "alongside", "staged", "aimdo"]
    )
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--busy", type=int, default=0, help="processes spinning meanwhile")
    p.add_argument("--fill-threads", type=int, help="the Uploader's threads (staged)")
    a = p.parse_args()
    if a.fill_threads:
        import qwen_turbo.runtime.dit.streaming as ws

        ws.FILL_THREADS = a.fill_threads
    path = Path(a.path)
    write_file(path, a.gib)
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.busy)]
    atexit.register(lambda: [s.kill() for s in spin])
    gpu, kernel = torch.cuda.get_device_name(), os.uname().release
    print(
        f"{gpu}, torch {torch.__version__}, kernel {kernel}, {a.busy} cores busy, "
        f"fill threads {a.fill_threads or 'default'}"
    )
    print(f"{'variant':10s} {'GiB':>6s} {'populate':>9s} {'total':>7s} {'GB/s':>6s}")
    rows = []
    for v in [v for _ in range(a.repeats) for v in a.variants]:
        rows.append(r := run(path, v))
        refused = "" if r["populate_ok"] else "  (populate refused)"
        print(f"{r['variant']:10s} {r['gib']:6.2f} {r['populate_s']:8.2f}s {r['seconds']:6.2f}s "
              f"{r['gb_per_s']:6.2f}{refused}")  # fmt: skip
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
