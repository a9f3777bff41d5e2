"""How long the fp8 attention plan takes for each sequence length, in order: built by cuDNN, or
loaded from the pack's plan cache on disk.

Each argument is a length (a plan of shape (1, 24, L, L, 128) on the main thread) or tL (the
same on another thread). A machine's first plan compiles cuDNN's kernels; the CUDA driver
caches them (CUDA_CACHE_PATH), so use a new one per process for a new machine's first plan.
Plans are built unless QWEN_TURBO_CUDNN_CACHE names a folder: then each is loaded from it
where an earlier process kept it, else built and kept (the line says which). Then each plan
runs once, its output checked finite.

    CUDA_CACHE_PATH=/tmp/cc-new python benchmarks/cudnn_plan_cache.py t1025 24905
    QWEN_TURBO_CUDNN_CACHE=/tmp/plans python benchmarks/cudnn_plan_cache.py 7145   (twice)
"""

import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: tests.harness
from tests.harness import pack  # noqa: E402


def main():
    os.environ.setdefault("QWEN_TURBO_CUDNN_CACHE", "0")
    pack.load()
    import cudnn
    import torch

    from qwen_turbo.kernels import attention_fp8

    handle = cudnn.create_handle()

    def build(length: int, where: str) -> None:
        t = time.perf_counter()
        plan = attention_fp8._Plan(handle, 0, 1, 24, length, length, 128)
        seconds = time.perf_counter() - t
        x = torch.randn(1, length, 24, 128, device="cuda").to(attention_fp8.FP8)
        out = torch.empty_like(x)
        scales = torch.tensor([1, 1, 1, 1, 448, 1 / 448], device="cuda")
        plan.run(x, x, x, scales, out)
        finite = out.float().isfinite().all().item()
        how = "loaded" if plan.loaded else "built"
        print(f"  plan {length} ({where}): {how} in {seconds:.3f} s, output finite: {finite}")

    for arg in sys.argv[1:]:
        if arg.startswith("t"):
            thread = threading.Thread(target=build, args=(int(arg[1:]), "thread"))
            thread.start()
            thread.join()
        else:
            build(int(arg), "main")


if __name__ == "__main__":
    main()
