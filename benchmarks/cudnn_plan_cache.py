"""How long cuDNN takes to build the fp8 attention plan for each sequence length, in order.

Each argument is a length (a plan of shape (1, 24, L, L, 128) on the main thread) or tL (the
same on another thread). A machine's first plan compiles cuDNN's kernels; the CUDA driver
caches them (CUDA_CACHE_PATH), so use a new one per process for a new machine's first plan.

    CUDA_CACHE_PATH=/tmp/cc-new python benchmarks/cudnn_plan_cache.py t1025 24905
"""

import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: tests.harness
from tests.harness import pack  # noqa: E402


def main():
    pack.load()
    import cudnn

    from qwen_turbo.kernels import attention_fp8

    handle = cudnn.create_handle()

    def build(length: int, where: str) -> None:
        t = time.perf_counter()
        attention_fp8._Plan(handle, 1, 24, length, length, 128)
        print(f"  plan {length} ({where}): {time.perf_counter() - t:.2f} s", flush=True)

    for arg in sys.argv[1:]:
        if arg.startswith("t"):
            thread = threading.Thread(target=build, args=(int(arg[1:]), "thread"))
            thread.start()
            thread.join()
        else:
            build(int(arg), "main")


if __name__ == "__main__":
    main()
