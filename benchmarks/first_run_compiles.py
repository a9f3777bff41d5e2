"""card_workflow.py with the first run's Triton compiles and cuDNN fp8 plan builds timed.

Takes card_workflow.py's arguments; prints the compiles per kernel (and each on the main thread:
a launch `kernels/warmup.json` lacks) and the plans at exit. With
SPECS=path, also pickles each compile's specialization there, for parallel_compile.py. Use a
new TRITON_CACHE_DIR for a new install's first run. With TIMELINE=1, also prints where each
variant's first run spent its time: model loads, weight copies, LoRA merges, pinning,
synchronizes, graph capture, cuDNN plans, Triton's compiles, kernel loads and launcher builds,
on the main thread and on others.

    TRITON_CACHE_DIR=/tmp/empty SPECS=/tmp/specs.pkl python benchmarks/first_run_compiles.py \
        --cards 24 --variants stock pack
"""

import atexit
import collections
import os
import pickle
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: tests.harness
import card_workflow  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from tests.harness import pack  # noqa: E402

compiles, plans, specs = [], [], []
spans = []  # (name, on the main thread, start, seconds)
_compile = JITFunction._do_compile
TIMED = (
    "comfy.model_management.load_models_gpu",
    "comfy.model_patcher.ModelPatcher.partially_load",
    "comfy.model_patcher.ModelPatcher.load",
    "comfy.model_patcher.ModelPatcher.patch_weight_to_device",
    "comfy.model_management.cast_to_device",
    "comfy.lora.calculate_weight",
    "comfy.float.stochastic_rounding",
    "comfy.model_patcher.ModelPatcher.pin_weight_to_device",
    "qwen_turbo.runtime.dit.patcher.Patcher.pin_weight_to_device",
    "qwen_turbo.runtime.dit.patcher.Patcher._pin_copies",
    "qwen_turbo.runtime.dit.streaming.Uploader.to",
    "qwen_turbo.runtime.dit.probe.measure",
    "torch.cuda.synchronize",
    "torch.cuda.graphs.CUDAGraph.capture_begin",
    "torch.cuda.graphs.CUDAGraph.capture_end",
    "torch.cuda.graphs.CUDAGraph.replay",
    "triton.compiler.compiler.CompiledKernel._init_handles",
    "triton.runtime.build._build",
)


def span(name: str, t: float) -> float:
    """Records a span `name` from `t` to now, on this thread; returns its seconds."""
    seconds = time.perf_counter() - t
    spans.append((name, threading.current_thread() is threading.main_thread(), t, seconds))
    return seconds


def timed(name: str, fn):
    def call(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            span(name, t)

    return call


def install_timers():
    import importlib

    for path in TIMED:
        parts = path.split(".")
        for i in range(len(parts) - 1, 0, -1):
            try:
                owner = importlib.import_module(".".join(parts[:i]))
                break
            except ImportError:
                continue
        for attr in parts[i:-1]:
            owner = getattr(owner, attr)
        if hasattr(owner, parts[-1]):  # pinning is v0.33's
            name = ".".join(parts[-2:])
            setattr(owner, parts[-1], timed(name, getattr(owner, parts[-1])))


def timeline(run_once):
    """`run_once` with each prompt's first run's spans printed: count, total seconds on the
    main thread and on others, and when the first began and the last ended (run seconds)."""
    seen = set()

    def run(executor, server, api, seed, filler_bytes):
        if not seen:
            install_timers()
        first = id(api) not in seen
        seen.add(id(api))
        spans.clear()
        t0 = time.perf_counter()
        result = run_once(executor, server, api, seed, filler_bytes)
        if first:
            print(f"TIMELINE of the first run ({result['seconds']} s): name, thread, calls, "
                  "seconds, first start, last end")  # fmt: skip
            rows = collections.defaultdict(lambda: [0, 0.0, 1e9, 0.0])
            for name, main, t, s in spans:
                row = rows[(name, "main" if main else "other")]
                row[0] += 1
                row[1] += s
                row[2] = min(row[2], t - t0)
                row[3] = max(row[3], t + s - t0)
            for (name, thread), (n, s, begin, end) in sorted(rows.items(), key=lambda r: r[1][2]):
                print(f"  {name:36s} {thread:5s} {n:5d} {s:7.2f} s  {begin:6.2f} {end:6.2f}")
        return result

    return run


def _timed_compile(self, key, signature, device, constexprs, options, attrs, warmup):
    t = time.perf_counter()
    kernel = _compile(self, key, signature, device, constexprs, options, attrs, warmup)
    on_main = threading.current_thread() is threading.main_thread()
    compiles.append((self.fn.__qualname__, span("compile", t), on_main, signature, constexprs))
    specs.append((self.fn.__module__, self.fn.__qualname__, signature, constexprs,
                  options.__dict__, attrs))  # fmt: skip
    return kernel


def report():
    print(f"TRITON compiles: {len(compiles)}, {sum(c[1] for c in compiles):.2f} s", flush=True)
    by = collections.Counter()
    for name, s, *_ in compiles:
        by[name] += s
    for name, s in by.most_common():
        print(f"  {name:40s} {s:6.2f} s")
    for name, s, on_main, signature, constexprs in compiles:
        if on_main:  # not compiled ahead: a launch `kernels/warmup.json` lacks
            print(f"  on the main thread: {name} {s:.2f} s {signature} {constexprs}"[:400])
    print(f"CUDNN plans: {[(k, round(s, 2)) for k, s in plans]}", flush=True)
    if os.environ.get("SPECS") and specs:
        Path(os.environ["SPECS"]).write_bytes(pickle.dumps(specs))


def main():
    JITFunction._do_compile = _timed_compile
    atexit.register(report)
    pack.register()  # the kernels importable; card_workflow runs the pack once ComfyUI is set up
    import qwen_turbo.kernels.attention_fp8 as af

    build = af._Plan.__init__

    def timed_plan(self, handle, *key):
        t = time.perf_counter()
        build(self, handle, *key)
        plans.append((key, span("cudnn plan", t)))

    af._Plan.__init__ = timed_plan
    if os.environ.get("TIMELINE"):
        card_workflow.run_once = timeline(card_workflow.run_once)
    card_workflow.main()


if __name__ == "__main__":
    main()
