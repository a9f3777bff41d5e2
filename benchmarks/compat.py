"""KSampler against the CUDA Graph Sampler with each node of the README's table "CUDA Graph
Sampler with other nodes", on Qwen-Image with random full-size weights.

Per node: the node's own function on loader → ModelSamplingAuraFlow (tests/harness/
compat_nodes.py; the caching nodes at their defaults), then KSampler and the graph sampler in
each --modes, with the same seed, size, steps and CFG 4 (the CFG-function nodes act only above
1). Each path runs once to warm up (graphs are captured there), then --repeats timed runs
(median, wall clock between CUDA syncs). Per node and mode: KSampler s / graphs s (below 1 =
slower), the final latent's relative L2 against KSampler's, and the path the badge reports.
The graphs are freed and the model unloaded between nodes. Prints the GPU, torch and ComfyUI
versions, a table, and JSON on the last line.

    COMFYUI_PATH=~/comfy/ComfyUI python benchmarks/compat.py --layers 16 --repeats 2

--tiny checks the logic on CPU: the tests' narrow 2-layer DiT, the graph sampler with the tests'
stand-in backend (a replay reruns the recorded ops without their Python, as a CUDA graph does);
its times mean nothing.
"""

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: tests.harness
from sampler import CAPTURE, build_model, with_caching_node  # noqa: E402

from tests.harness.comfyui import setup_comfy  # noqa: E402

COMPILE_TOLERANCE = 1e-3  # TorchCompileModel: inductor may order the sums otherwise


def appliers(a, text_width: int) -> dict:
    """Node name → function(model) → the model through that node, in the README's order."""
    import folder_paths
    import torch

    from tests.harness import models
    from tests.harness.compat_nodes import apply_node, diffsynth

    def lora(m):
        if a.tiny:
            file = models.narrow_lora_file()
        else:  # rank 4 on every block's image MLP and q projection
            dit = models.qwen_dit_module(a.layers)
            file = models._lora_file(f"qwen_image_{a.layers}layer_lora_random", dit, seed=0)
        folder_paths.add_model_folder_path("loras", str(file.parent))
        return apply_node(None, "LoraLoaderModelOnly", m, lora_name=file.name, strength_model=1.0)

    empty = [[torch.randn((1, a.tokens, text_width), generator=torch.Generator().manual_seed(9)),
              {}]]  # fmt: skip
    slg = dict(start_percent=0.3, end_percent=0.7, double_layers="1", single_layers="")
    out = {
        "ModelSamplingAuraFlow": lambda m: m,  # the base every other row goes through
        "LoraLoaderModelOnly": lora,
        "LazyCache": lambda m: with_caching_node(m, "lazycache"),
        "TorchCompileModel": lambda m: apply_node(
            "nodes_torch_compile", "TorchCompileModel", m, backend="inductor"
        ),
        "CFGNorm": lambda m: apply_node("nodes_cfg", "CFGNorm", m, strength=0.5),
        "CFGZeroStar": lambda m: apply_node("nodes_cfg", "CFGZeroStar", m),
        "Mahiro": lambda m: apply_node("nodes_mahiro", "Mahiro", m),
        "APG": lambda m: apply_node(
            "nodes_apg", "APG", m, eta=0.5, norm_threshold=1.0, momentum=-0.5
        ),
        "TCFG": lambda m: apply_node("nodes_tcfg", "TCFG", m),
        "RenormCFG": lambda m: apply_node(
            "nodes_lumina2", "RenormCFG", m, cfg_trunc=0.5, renorm_cfg=1.0
        ),
        "PerpNeg": lambda m: apply_node(
            "nodes_perpneg", "PerpNeg", m, empty_conditioning=empty, neg_scale=1.5
        ),
        "SkipLayerGuidanceDiT": lambda m: apply_node(
            "nodes_slg", "SkipLayerGuidanceDiT", m, scale=3.0, **slg
        ),
        "SkipLayerGuidanceDiTSimple": lambda m: apply_node(
            "nodes_slg", "SkipLayerGuidanceDiTSimple", m, **slg
        ),
        "EasyCache": lambda m: with_caching_node(m, "easycache"),
        "QwenImageDiffsynthControlnet": lambda m: diffsynth(
            m, a.size, a.size, torch.float32 if a.tiny else torch.bfloat16
        ),
    }
    if not a.with_compile:
        del out["TorchCompileModel"]
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=60, help="60 = the real model")
    p.add_argument("--size", type=int, default=None, help="image side (default 1328; --tiny 64)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--cfg", type=float, default=4.0)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per path after a warm-up")
    p.add_argument("--modes", nargs="+", choices=CAPTURE[:2], default=CAPTURE[:2],
                   help="the graph sampler's capture modes")  # fmt: skip
    p.add_argument("--nodes", nargs="+", default=None, help="only these rows (node names)")
    p.add_argument("--with-compile", action="store_true",
                   help="add TorchCompileModel (inductor compiles: minutes)")  # fmt: skip
    p.add_argument("--tiny", action="store_true",
                   help="CPU, the tests' narrow DiT and stand-in graph backend")  # fmt: skip
    a = p.parse_args()
    a.size = a.size or (64 if a.tiny else 1328)
    a.tokens = 8 if a.tiny else 256
    a.layers = 2 if a.tiny else a.layers
    if a.tiny:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # the pack's kernels import on CPU
    setup_comfy(**({"cpu": True} if a.tiny else {}))
    import torch

    with torch.inference_mode():  # as ComfyUI's executor runs nodes
        run(a)


def base_model(a):
    """(loader → ModelSamplingAuraFlow, graph backend)."""
    from comfy_extras.nodes_model_advanced import ModelSamplingAuraFlow

    from qwen_turbo.runtime import host
    from qwen_turbo.runtime.graphs.capture import CudaGraphs
    from tests.harness import models

    if a.tiny:  # as tests/test_graph_compat.py builds it
        from tests.harness.graphs import TracedGraphs

        return ModelSamplingAuraFlow().patch_aura(models.load_narrow_dit(), 3.1)[0], TracedGraphs
    import torch

    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU (or --tiny)"
    missing = host.missing("cuda_graphs")
    assert missing is None, f"the sampler runs as KSampler on this host: {missing}"
    return build_model("qwen", a.layers), CudaGraphs


def run(a):
    import comfy.model_management as mm
    import comfyui_version
    import pytest
    import torch

    import nodes
    from qwen_turbo.cli.bench import rel_l2
    from qwen_turbo.runtime import memory
    from qwen_turbo.runtime.graphs.sampling import sample_within_memory
    from tests.harness.compat_nodes import path_taken

    started = time.perf_counter()
    dit, backend = base_model(a)
    width = dit.model.diffusion_model.txt_norm.weight.shape[0]
    g = torch.Generator().manual_seed(1)
    pos, neg = ([[torch.randn((1, a.tokens, width), generator=g), {}]] for _ in range(2))
    latent = {"samples": torch.zeros((1, 16, a.size // 8, a.size // 8))}
    args = (0, a.steps, a.cfg, "euler", "simple", pos, neg, latent)
    cuda = torch.cuda.is_available() and not a.tiny

    def timed(fn):
        """fn's (latent, badge status) and its wall seconds between device syncs."""
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn()
        if cuda:
            torch.cuda.synchronize()
        return out, time.perf_counter() - t

    def measure(fn, warmups):
        """The first warm-up run (loads, captures) and its time, then --repeats timed runs."""
        first, t_first = timed(fn)
        for _ in range(warmups - 1):
            timed(fn)
        runs = [timed(fn) for _ in range(a.repeats)]
        return first, t_first, runs[-1][0], [round(t, 3) for _, t in runs]

    def ksampler(m):
        return nodes.common_ksampler(m, *args)[0]["samples"], ""

    def graphs(m, whole_step):
        out, status = sample_within_memory(m, whole_step, backend, *args)
        return out["samples"], status

    def path(status, whole_step):
        if status.startswith("off"):  # ran out of memory: KSampler
            return status
        try:
            return path_taken(status, whole_step)
        except (AssertionError, ValueError):
            return f"? ({status})"

    rows, skipped = [], {}
    table = appliers(a, width)
    unknown = set(a.nodes or ()) - set(table)
    assert not unknown, f"not in the table: {sorted(unknown)}; the rows are {list(table)}"
    for name, apply in table.items():
        if a.nodes and name not in a.nodes:
            continue
        try:
            model = apply(dit)
        except (pytest.skip.Exception, ImportError) as e:
            skipped[name] = str(e)
            print(f"{name}: skipped ({e})", flush=True)
            continue
        # compiled: one more warm-up, for dynamo's recompiles on guards a run trips late
        warmups = 2 if name == "TorchCompileModel" else 1
        (first, _), _, (ref, _), k_runs = measure(lambda m=model: ksampler(m), warmups)
        row = {"node": name, "ksampler_s": statistics.median(k_runs), "ksampler_runs_s": k_runs,
               "ksampler_repeat_rel_l2": rel_l2(first, ref), "modes": {}}  # fmt: skip
        for mode in a.modes:
            whole = mode == "whole CFG step"
            (_, st_first), t_first, (out, status), g_runs = measure(
                lambda m=model, w=whole: graphs(m, w), warmups
            )
            t = statistics.median(g_runs)
            err = rel_l2(out, ref)
            bit = torch.equal(out, ref)
            exact = bit or (name == "TorchCompileModel" and err <= COMPILE_TOLERANCE)
            row["modes"][mode] = {"graphs_s": t, "graphs_runs_s": g_runs,
                                  "graphs_first_s": round(t_first, 3),
                                  "speedup": round(row["ksampler_s"] / t, 3),
                                  "rel_l2": float(f"{err:.3g}"), "bit_identical": bit,
                                  "exact": exact, "path": path(status, whole),
                                  "status_first": st_first, "status": status}  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
        del model
        memory.release(dit.model)
        mm.unload_all_models()
        if name == "TorchCompileModel":
            torch._dynamo.reset()
        gc.collect()
        mm.soft_empty_cache()
    report(a, rows, skipped, comfyui_version, time.perf_counter() - started)


def report(a, rows, skipped, comfyui_version, elapsed):
    import torch

    gpu = "CPU (--tiny, stand-in graphs)" if a.tiny else torch.cuda.get_device_name()
    version = getattr(comfyui_version, "__version__", "?")
    print(f"\nGPU {gpu}, torch {torch.__version__}, ComfyUI {version}; {a.layers} layers, "
          f"{a.size}², {a.steps} steps, CFG {a.cfg}, euler/simple, median of {a.repeats}; "
          f"{elapsed:.0f} s in all")  # fmt: skip
    print(f"{'node':<29} {'KSampler s':>10} {'mode':<15} {'graphs s':>9} {'1st s':>7} "
          f"{'KS/graphs':>9} {'rel L2':>8}  path")  # fmt: skip
    misses = []
    for r in rows:
        for mode, m in r["modes"].items():
            err = "0 (bit)" if m["bit_identical"] else f"{m['rel_l2']:.2e}"
            print(f"{r['node']:<29} {r['ksampler_s']:>10.3f} {mode:<15} {m['graphs_s']:>9.3f} "
                  f"{m['graphs_first_s']:>7.2f} {m['speedup']:>9.3f} {err:>8}  "
                  f"{m['path']}")  # fmt: skip
            if m["speedup"] < 1 or not m["exact"]:
                misses.append(f"{r['node']} / {mode}")
    for name, why in skipped.items():
        print(f"{name}: skipped ({why})")
    print(f"slower than KSampler or not exact: {', '.join(misses) or 'none'}")
    print(json.dumps({"gpu": gpu, "torch": torch.__version__, "comfyui": version,
                      "layers": a.layers, "size": a.size, "steps": a.steps, "cfg": a.cfg,
                      "repeats": a.repeats, "tiny": a.tiny, "elapsed_s": round(elapsed, 1),
                      "misses": misses, "skipped": skipped, "rows": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
