"""Triton compiles one after another, on threads or on processes: the specializations that
first_run_compiles.py pickled, compiled for sm_90 into the current TRITON_CACHE_DIR (use a new
one per run). Prints the wall time and the summed compile times.

    TRITON_CACHE_DIR=/tmp/new python benchmarks/parallel_compile.py /tmp/specs.pkl threads 8
"""

import importlib
import pickle
import sys
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: tests.harness
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.compiler import compile as triton_compile  # noqa: E402

from tests.harness import pack  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
specs = pickle.loads(Path(sys.argv[1]).read_bytes())


def one(i: int) -> float:
    module, name, signature, constexprs, options, attrs = specs[i]
    fn = getattr(importlib.import_module(module), name)
    t = time.perf_counter()
    triton_compile(ASTSource(fn, signature, constexprs, attrs), target=TARGET, options=options)
    return time.perf_counter() - t


def main():
    pack.load()
    mode, n = sys.argv[2], int(sys.argv[3])  # serial | threads | procs, and how many
    t = time.perf_counter()
    if mode == "serial":
        each = [one(i) for i in range(len(specs))]
    else:
        pool = (ThreadPoolExecutor if mode == "threads" else ProcessPoolExecutor)(n)
        each = list(pool.map(one, range(len(specs))))
    print(f"PARCOMPILE {mode} {n}: {len(specs)} kernels in {time.perf_counter() - t:.2f} s "
          f"(sum {sum(each):.2f} s)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
