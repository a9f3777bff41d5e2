"""card_workflow.py with the first run's Triton compiles and cuDNN fp8 plan builds timed.

Takes card_workflow.py's arguments; prints the compiles per kernel and the plans at exit. With
SPECS=path, also pickles each compile's specialization there, for parallel_compile.py. Use a
new TRITON_CACHE_DIR for a new install's first run.

    TRITON_CACHE_DIR=/tmp/empty SPECS=/tmp/specs.pkl python benchmarks/first_run_compiles.py \
        --cards 24 --variants stock pack
"""

import atexit
import collections
import os
import pickle
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import card_workflow  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402
from vae_decode import load_pack  # noqa: E402

compiles, plans, specs = [], [], []
_compile = JITFunction._do_compile


def _timed_compile(self, key, signature, device, constexprs, options, attrs, warmup):
    t = time.perf_counter()
    kernel = _compile(self, key, signature, device, constexprs, options, attrs, warmup)
    compiles.append((self.fn.__qualname__, time.perf_counter() - t))
    specs.append((self.fn.__module__, self.fn.__qualname__, signature, constexprs,
                  options.__dict__, attrs))  # fmt: skip
    return kernel


def report():
    print(f"TRITON compiles: {len(compiles)}, {sum(s for _, s in compiles):.2f} s", flush=True)
    by = collections.Counter()
    for name, s in compiles:
        by[name] += s
    for name, s in by.most_common():
        print(f"  {name:40s} {s:6.2f} s")
    print(f"CUDNN plans: {[(k, round(s, 2)) for k, s in plans]}", flush=True)
    if os.environ.get("SPECS") and specs:
        Path(os.environ["SPECS"]).write_bytes(pickle.dumps(specs))


def main():
    JITFunction._do_compile = _timed_compile
    atexit.register(report)
    load_pack()
    import qwen_turbo.kernels.attention_fp8 as af

    build = af._Plan.__init__

    def timed_plan(self, handle, *key):
        t = time.perf_counter()
        build(self, handle, *key)
        plans.append((key, time.perf_counter() - t))

    af._Plan.__init__ = timed_plan
    card_workflow.main()


if __name__ == "__main__":
    main()
