"""Whether one Qwen-Image DiT forward is bound by the host: the host's time to issue it
against the GPU's time to run it, stock against the Optimized Loader's variants.

Random full-width weights, --layers of 60 (few enough that one forward's launches fit in the
GPU's launch queue: 8 at most for the fused variants), one forward at --size. "host" is
the wall time of issuing the forward while a spin kernel holds the GPU, so the host never
waits on it (--tries of them). "eager" is CUDA-event time of the plain forward. "graph" is
the forward replayed from a CUDA graph. Prints a table and JSON on the last line.
"""

import argparse
import json
import sys
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
        host = []
        for _ in range(a.tries):
            torch.cuda.synchronize()
            torch.cuda._sleep(2_000_000_000)  # cycles: about 1 s, longer than issuing takes
            t0 = time.perf_counter()
            run()
            host.append(round((time.perf_counter() - t0) * 1e3, 1))
            torch.cuda.synchronize()
        graph, _ = graph_timed(run, a.tries)
        rows.append({"variant": variant, "host_ms": sorted(host), "eager_ms": round(eager, 1),
                     "graph_ms": round(graph, 1)})  # fmt: skip
        print(f"{variant:28} host {min(host):6.1f}-{max(host):6.1f} ms  eager {eager:6.1f} ms  "
              f"graph {graph:6.1f} ms", flush=True)  # fmt: skip
        del patcher
        mm.unload_all_models()
        torch.cuda.empty_cache()
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "size": a.size, "layers": a.layers, "rows": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
