"""Whether one Qwen-Image DiT forward is bound by the host: the host's time to issue it
against the GPU's time to run it, stock against the Optimized Loader's variants.

Random full-width weights, --layers of 60 (few enough that one forward's launches fit in the
GPU's launch queue: 8 at most for the fused variants), one forward at --size. "host" is
the wall time of issuing the forward while a spin kernel holds the GPU, so the host never
waits on it (--tries of them; with --jit-launch, each followed by one through Triton's own
launcher). "eager" is CUDA-event time of the plain forward. "graph" is
the forward replayed from a CUDA graph. With --sample, where the host's time goes: a thread
samples the issuing thread's Python stack every 0.1 ms (no tracing, so the profile's own cost
does not weigh on small functions; calls that let go of the GIL wait for it and weigh a little
more) and the functions most often on it are printed (inclusive share, and the share with that
function on top). Prints a table and JSON on the last line.
"""

import argparse
import collections
import contextlib
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: tests.harness
from dit_forward import VARIANTS, load  # noqa: E402

from tests.harness.comfyui import setup_comfy  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=1328)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tries", type=int, default=5)
    default = ["stock bf16", "fp8_fast fused sdpa", "fp8_fast fused fp8_cudnn"]
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=default)
    p.add_argument("--jit-launch", action="store_true",
                   help="also issue each try with Triton's own launcher (FastLaunch off), "
                        "interleaved: host_jit_ms")  # fmt: skip
    p.add_argument("--sample", type=int, default=0, metavar="N",
                   help="sample the stack over N issued forwards; print the top 25")  # fmt: skip
    a = p.parse_args()
    setup_comfy(highvram=True)
    import comfy.model_management as mm
    import torch

    from qwen_turbo.cli.bench import forward_fn, graph_timed, qwen_dit_state_dict, timed

    sd = qwen_dit_state_dict(a.layers, "cuda")
    rows = []
    for variant in a.variants:
        patcher = load(variant, sd)
        mm.load_models_gpu([patcher], force_full_load=True)
        run = forward_fn(patcher, a.size)
        eager, _ = timed(run, a.tries)
        host, host_jit = [], []
        for _ in range(a.tries):
            host.append(issue(run))
            if a.jit_launch:
                with jit_launches():
                    host_jit.append(issue(run))
        graph, _ = graph_timed(run, a.tries)
        rows.append({"variant": variant, "host_ms": sorted(host), "eager_ms": round(eager, 1),
                     "graph_ms": round(graph, 1)})  # fmt: skip
        if a.jit_launch:
            rows[-1]["host_jit_ms"] = sorted(host_jit)
            lo, hi, mid = min(host_jit), max(host_jit), statistics.median(host_jit)
            print(f"{variant:28} host, Triton's launcher {lo:6.1f}-{hi:6.1f} ms, median {mid:6.1f}")
        if a.sample:
            rows[-1]["stack"] = stack_sample(run, a.sample)
        print(f"{variant:28} host {min(host):6.1f}-{max(host):6.1f} ms, median "
              f"{statistics.median(host):6.1f}  eager {eager:6.1f} ms  graph {graph:6.1f} ms",
              flush=True)  # fmt: skip
        del patcher
        mm.unload_all_models()
        torch.cuda.empty_cache()
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "size": a.size, "layers": a.layers, "rows": rows}))  # fmt: skip


def issue(run) -> float:
    """ms the host takes to issue `run`, the GPU held meanwhile by a spin kernel."""
    import torch

    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # cycles: about 1 s, longer than issuing takes
    t0 = time.perf_counter()
    run()
    dt = round((time.perf_counter() - t0) * 1e3, 1)
    torch.cuda.synchronize()
    return dt


@contextlib.contextmanager
def jit_launches():
    """The pack's kernels launched through Triton's own launcher inside the block."""
    from qwen_turbo.kernels._triton import FastLaunch

    launch = FastLaunch.launch
    FastLaunch.launch = lambda self, grid, args, meta: self.jit[grid](*args, **meta)
    try:
        yield
    finally:
        FastLaunch.launch = launch


def stack_sample(run, forwards: int, top: int = 25) -> dict:
    """The functions most often on the stack ("inclusive") and on its top, with their shares of
    the host's time issuing `forwards` runs (the GPU held by a spin kernel before each), from
    stack samples every 0.1 ms."""
    import torch

    main, done = threading.get_ident(), threading.Event()
    on_stack, on_top = collections.Counter(), collections.Counter()
    issuing = threading.Event()
    samples = 0

    def name(f) -> str:
        return f"{Path(f.f_code.co_filename).name}:{f.f_code.co_name}"

    def sampler():
        nonlocal samples
        while not done.is_set():
            time.sleep(1e-4)
            f = sys._current_frames().get(main) if issuing.is_set() else None
            if f is None:
                continue
            samples += 1
            on_top[name(f)] += 1
            seen = set()
            while f is not None:
                seen.add(name(f))
                f = f.f_back
            on_stack.update(seen)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)  # let the sampler in between the issuing thread's bytecodes
    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    try:
        for _ in range(forwards):
            torch.cuda.synchronize()
            torch.cuda._sleep(2_000_000_000)
            issuing.set()
            run()
            issuing.clear()
            torch.cuda.synchronize()
    finally:
        done.set()
        thread.join()
        sys.setswitchinterval(interval)
    out = {"samples": samples}
    for kind, counts in (("inclusive", on_stack), ("on top", on_top)):
        out[kind] = {k: round(v / samples, 3) for k, v in counts.most_common(top)}
        print(f"  {kind}, of {samples} samples:")
        for k, v in out[kind].items():
            print(f"  {100 * v:5.1f}%  {k}")
    return out


if __name__ == "__main__":
    main()
