"""Multi-GPU node: the Optimized Loader's model sampled on 1 GPU against N, in one process.

The single-GPU side samples the Optimized Loader's model on GPU 0, the other the Multi-GPU
node's on --gpus GPUs; random full-size weights (60 layers unless --layers) in the repackaged
fp8 file's layout (bf16 or fp32 for the fp32 variant), 256 text tokens.

Two cases, as issue 17 sets them:
- guided: CFG 4, cond and uncond batched, --guided-mode (auto, the node's default: the batch
  over CFG groups, sequence parallel within each); runs of --guided-steps steps, timed per
  step and extrapolated to 50 steps (the table says so);
- turbo: CFG 1, --turbo-steps (4) steps, --turbo-mode (auto: sequence parallel).
--profile adds rank 0's GPU time per kernel for one more run of each case.
Each side runs once untimed first (on the multi-GPU side: the workers' start and the weight
broadcast, reported as first_s), then --repeats timed runs (median). rel_l2: the multi-GPU
latent against the single-GPU one. GPU memory in use per device is read from NVML at the end.
Prints a table, and JSON on the last line.

    COMFYUI_PATH=~/comfy/ComfyUI python benchmarks/multigpu.py --gpus 2 --size 2512
"""

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: tests.harness
from dit_forward import VARIANTS, load  # noqa: E402

from tests.harness.comfyui import setup_comfy  # noqa: E402

# "fp32 fused sdpa": ComfyUI's float32 (--force-fp32), where a split should change the
# result by float32 rounding only (bf16 changes with the batch size the GEMMs see)
PACK_VARIANTS = [v for v, spec in VARIANTS.items() if spec[0] == "pack"] + ["fp32 fused sdpa"]


def build(variant, sd):
    from qwen_turbo.runtime.dit import config, loader

    if variant != "fp32 fused sdpa":
        return load(variant, sd)
    patcher = loader.build(dict(sd), config.read_config(sd), "auto")
    loader.add_fused_blocks(patcher)
    loader.set_attention(patcher, "sdpa")
    return patcher


def sampler(model, steps, cfg, size, graph=False):
    """A KSampler run (the node's function; with `graph`, the CUDA Graph Sampler's, whole
    CFG steps) with fixed prompts and seed, as a callable."""
    import torch

    import nodes
    from qwen_turbo.nodes.graph_sampler import CUDAGraphSampler

    g = torch.Generator().manual_seed(2)
    pos, neg = ([[torch.randn((1, 256, 3584), generator=g), {}]] for _ in range(2))
    latent = {"samples": torch.zeros((1, 16, 1, size // 8, size // 8))}

    def run():
        args = (model, 0, steps, cfg, "euler", "simple", pos, neg, latent)
        with torch.inference_mode():  # as ComfyUI's executor runs nodes
            if graph:
                out = CUDAGraphSampler.execute(*args, 1.0, "whole CFG step").result
            else:
                out = nodes.common_ksampler(*args)
        torch.cuda.synchronize()
        return out[0]["samples"]

    return run


def timed(run, repeats):
    """(seconds of the untimed first run, median seconds of `repeats` runs, last output)."""
    t0 = time.perf_counter()
    out = run()
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times), out


def profile(run, top: int = 12) -> dict[str, float]:
    """One run of `run` under torch's profiler: rank 0's GPU time (ms) per kernel, the `top`
    kernels, NCCL's kernels together, and the run's wall time."""
    import torch
    from torch.profiler import ProfilerActivity

    t0 = time.perf_counter()
    try:
        with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            run()
        wall = time.perf_counter() - t0
        times = {e.key: e.device_time_total / 1e3 for e in p.key_averages()
                 if e.device_time_total > 0 and e.device_type.name == "CUDA"}  # fmt: skip
    except Exception as e:  # the timed rows stand without it
        return {f"profile failed: {type(e).__name__}: {e}"[:90]: 0.0}
    out = dict(sorted(times.items(), key=lambda kv: -kv[1])[:top])
    out["all NCCL kernels"] = sum(ms for k, ms in times.items() if "nccl" in k.lower())
    out["all kernels"] = sum(times.values())
    out["wall (profiled)"] = wall * 1e3
    return {k[:90]: round(v, 1) for k, v in out.items()}


def memory_gib(gpus):
    """GPU memory in use per device (NVML: every process's, the workers' included)."""
    import torch

    try:
        return [round(torch.cuda.device_memory_used(i) / 2**30, 2) for i in range(gpus)]
    except Exception as e:  # no NVML binding
        return f"unavailable: {type(e).__name__}: {e}"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--size", type=int, default=2512)
    p.add_argument("--layers", type=int, default=60, help="60 = the real model")
    p.add_argument("--variant", default="fp8_fast fused sdpa", choices=PACK_VARIANTS)
    p.add_argument("--guided-steps", type=int, default=4, help="timed, extrapolated to 50")
    p.add_argument("--guided-mode", default="auto", help="the node's default")
    p.add_argument("--turbo-steps", type=int, default=4)
    p.add_argument("--turbo-mode", default="auto")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--sampler", choices=["ksampler", "graph"], default="ksampler",
                   help="graph: the CUDA Graph Sampler, whole CFG steps, on both")  # fmt: skip
    p.add_argument("--profile", action="store_true",
                   help="one more multi-GPU run per case under torch's profiler: rank 0's "
                   "kernels by GPU time, NCCL's among them")  # fmt: skip
    a = p.parse_args()
    fp32 = a.variant.startswith("fp32")
    setup_comfy(highvram=True, force_fp32=fp32)  # the DiT stays on GPU 0 between runs
    import comfy.model_management as mm
    import torch
    from comfy_extras.nodes_model_advanced import ModelSamplingAuraFlow

    from qwen_turbo.cli import bench
    from qwen_turbo.nodes.multigpu import MultiGPU
    from qwen_turbo.runtime import memory, multigpu

    if torch.cuda.device_count() < a.gpus:
        sys.exit(f"This benchmark needs {a.gpus} CUDA GPUs; {torch.cuda.device_count()} found.")
    sd = bench.qwen_dit_state_dict(a.layers, "cuda", torch.float32 if fp32 else torch.bfloat16)
    if not fp32:  # the repackaged fp8 file's layout, on the host: no bf16 copy on the GPU
        sd = bench.repackaged_fp8(sd)
        torch.cuda.empty_cache()
    model = ModelSamplingAuraFlow().patch_aura(build(a.variant, sd), 3.1)[0]
    del sd
    gc.collect()
    torch.cuda.empty_cache()
    cases = [("guided", 4.0, a.guided_steps, a.guided_mode),
             ("turbo", 1.0, a.turbo_steps, a.turbo_mode)]  # fmt: skip
    rows = []
    for name, cfg, steps, mode in cases:
        multi = MultiGPU.execute(model=model, gpus=a.gpus, mode=mode).result[0]
        graph = a.sampler == "graph"
        one_first, one_s, ref = timed(sampler(model, steps, cfg, a.size, graph), a.repeats)
        memory.release(model.model)  # the graph memory of the single-GPU runs
        torch.cuda.reset_peak_memory_stats()
        multi_first, multi_s, out = timed(sampler(multi, steps, cfg, a.size, graph), a.repeats)
        stats = multigpu.driver_of(multi).stats
        kernels = profile(sampler(multi, steps, cfg, a.size, graph)) if a.profile else None
        row = {"case": name, "mode": mode, "cfg": cfg, "steps": steps,
               "single_s": round(one_s, 3), "multi_s": round(multi_s, 3),
               "speedup": round(one_s / multi_s, 3), "rel_l2": bench.rel_l2(out, ref),
               "single_first_s": round(one_first, 2), "multi_first_s": round(multi_first, 2),
               "gpu0_peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
               "calls": {f"{g}x{s}": n for (g, s), n in stats.calls.items()},
               "local": dict(stats.local)}  # fmt: skip
        if kernels is not None:
            row["rank0_kernels_ms"] = kernels
        if name == "guided":  # per-step time x 50, not a 50-step run
            row["single_50_steps_s_extrapolated"] = round(one_s / steps * 50, 1)
            row["multi_50_steps_s_extrapolated"] = round(multi_s / steps * 50, 1)
        rows.append(row)
    in_use = memory_gib(a.gpus)
    multigpu.shutdown()
    mm.unload_all_models()

    print(f"GPU {torch.cuda.get_device_name()} x{a.gpus}, torch {torch.__version__}, "
          f"{a.layers} layers, {a.variant}, {a.size}^2, 256 text tokens, {a.sampler}")  # fmt: skip
    print(f"{'case':7} {'mode':18} {'cfg':>4} {'steps':>5} {'1 GPU s':>8} {'N GPU s':>8} "
          f"{'speedup':>7} {'rel L2':>9} {'first s (1/N)':>14}")  # fmt: skip
    for r in rows:
        first = f"{r['single_first_s']:.1f}/{r['multi_first_s']:.1f}"
        print(f"{r['case']:7} {r['mode']:18} {r['cfg']:4.1f} {r['steps']:5d} {r['single_s']:8.2f} "
              f"{r['multi_s']:8.2f} {r['speedup']:7.3f} {r['rel_l2']:9.2e} {first:>14}  "
              f"calls {r['calls']}")  # fmt: skip
        for kernel, ms in r.get("rank0_kernels_ms", {}).items():
            print(f"        rank 0 {ms:9.1f} ms  {kernel}")
        if "single_50_steps_s_extrapolated" in r:
            print(f"        50 steps, extrapolated from {r['steps']}: "
                  f"{r['single_50_steps_s_extrapolated']} s on 1 GPU, "
                  f"{r['multi_50_steps_s_extrapolated']} s on {a.gpus}")  # fmt: skip
    print(f"GPU memory in use (GiB, NVML, after the runs): {in_use}")
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "gpus": a.gpus,
                      "torch": torch.__version__, "layers": a.layers, "variant": a.variant,
                      "size": a.size, "sampler": a.sampler, "rows": rows,
                      "memory_gib": in_use}))  # fmt: skip


if __name__ == "__main__":
    main()
