"""The CUDA Graph Sampler's NaN guard: what it costs per run, and what an injected NaN gives.

The Optimized Loader's model as the bundled workflows load it (fp8_e4m3fn_fast, fused blocks,
fp8_cudnn attention), random full-size weights (60 layers unless --layers), 256 text tokens.
At each size the node runs --steps euler/simple steps with the guard and without it
(alternating, the median of --repeats later runs after a first that captures; --capture,
the workflows' whole CFG step unless set). Then block 0's
output is made NaN off the safe path (tests/harness/models.nan_in_block): the node's latent is
compared with that of KSampler run throughout on the safe path (fp8 GEMMs in bf16 compute,
ComfyUI's attention), run twice to tell whether that path repeats itself bit for bit. The
process's first run of the safe path comes before the NaN (at the first size), as its result
differs from later runs' (`first_safe_path_rel_l2`). Prints a table and JSON on the last line.

    python benchmarks/nan_guard.py --sizes 1328 2512 --steps 8
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: tests.harness
from dit_forward import load  # noqa: E402

from tests.harness.comfyui import setup_comfy  # noqa: E402

VARIANT = "fp8_fast fused fp8_cudnn"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1328, 2512])
    p.add_argument("--layers", type=int, default=60, help="60 = the real model")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--cfg", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--capture", default="whole CFG step", help="the sampler's capture mode")
    a = p.parse_args()
    setup_comfy(highvram=True)
    import comfy.model_management as mm
    import torch
    from comfy_extras.nodes_model_advanced import ModelSamplingAuraFlow

    import nodes as comfy_nodes
    from qwen_turbo.cli import bench
    from qwen_turbo.nodes import report
    from qwen_turbo.nodes.graph_sampler import CUDAGraphSampler
    from qwen_turbo.runtime.dit import fp8
    from qwen_turbo.runtime.dit.attention import OVERRIDE
    from qwen_turbo.runtime.graphs import guard, sampling
    from tests.harness.models import nan_in_block

    if not torch.cuda.is_available():
        sys.exit("This benchmark needs a CUDA GPU.")
    sd = bench.qwen_dit_state_dict(a.layers, "cuda")
    model = ModelSamplingAuraFlow().patch_aura(load(VARIANT, sd), 3.1)[0]
    del sd
    mm.load_models_gpu([model], force_full_load=True)
    g = torch.Generator().manual_seed(1)
    pos, neg = ([[torch.randn((1, 256, 3584), generator=g), {}]] for _ in range(2))
    with_guard = guard.guarded
    badges = []
    report.send = lambda node_id, data: badges.append(data)

    def node(latent, on=True):
        # without the guard: one that is never installed
        guard.guarded = with_guard if on else lambda m: (m, guard.FiniteGuard())
        try:
            with torch.inference_mode():
                out = CUDAGraphSampler.execute(model, 0, a.steps, a.cfg, "euler", "simple",
                                               pos, neg, latent, 1.0, a.capture)  # fmt: skip
        finally:
            guard.guarded = with_guard
        return out.result[0]["samples"]

    def safe_path(latent):
        """KSampler's latent on the safe path: fp8 GEMMs in bf16 compute, ComfyUI's attention."""
        safe = model.clone()
        safe.model_options["transformer_options"].pop(OVERRIDE, None)
        with fp8.safe_compute(), torch.inference_mode():
            return comfy_nodes.common_ksampler(safe, 0, a.steps, a.cfg, "euler", "simple", pos,
                                               neg, latent)[0]["samples"]  # fmt: skip

    def timed(fn):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t

    rows = []
    for size in a.sizes:
        latent = {"samples": torch.zeros((1, 16, 1, size // 8, size // 8))}
        first = {k: timed(lambda k=k, x=latent: node(x, k)) for k in (True, False)}
        times = {True: [], False: []}
        for _ in range(a.repeats):
            for guarded in (False, True):
                times[guarded].append(timed(lambda k=guarded, x=latent: node(x, k)))
        t_guard, t_none = (statistics.median(times[k]) for k in (True, False))
        # graphs captured without the hook would replay without it: fresh ones, then gone
        sampling.memory.release(model.model)
        first_safe = safe_path(latent) if not rows else None
        with nan_in_block(model, 0):
            out = node(latent)
        badge = badges[-1].get("graphs")
        sampling.memory.release(model.model)
        want, again = safe_path(latent), safe_path(latent)
        lossy = node(latent)
        rows.append({
            "size": size, "first_s": {"guard": round(first[True], 3),
                                      "no_guard": round(first[False], 3)},
            "guard_s": round(t_guard, 3), "no_guard_s": round(t_none, 3),
            "overhead": round(t_guard / t_none - 1, 4),
            "nan_equal_safe_path": bool(torch.equal(out, want)),
            "safe_path_repeats": bool(torch.equal(again, want)),  # KSampler's, run twice
            "first_safe_path_rel_l2": (bench.rel_l2(first_safe.float(), want.float())
                                       if first_safe is not None else None),  # fmt: skip
            "nan_rel_l2_to_safe_path": bench.rel_l2(out.float(), want.float()),
            "safe_path_rel_l2_to_lossy": bench.rel_l2(want.float(), lossy.float()),
            "badge": badge,
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
        sampling.memory.release(model.model)
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, {a.layers} layers, "
          f"{VARIANT}, {a.steps} steps, cfg {a.cfg}")  # fmt: skip
    print(f"{'size':>6} {'guard s':>8} {'none s':>8} {'overhead':>9} {'NaN = safe path':>16}")
    for r in rows:
        print(f"{r['size']:>6} {r['guard_s']:8.3f} {r['no_guard_s']:8.3f} "
              f"{100 * r['overhead']:8.2f}% {str(r['nan_equal_safe_path']):>16}")  # fmt: skip
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": a.layers}
    print(json.dumps({**meta, "steps": a.steps, "cfg": a.cfg, "rows": rows}))


if __name__ == "__main__":
    main()
