"""Qwen-Image-Edit sampling, stock nodes against the pack's, random full-size weights.

Stock UNETLoader against the Optimized Loader, KSampler against the CUDA Graph Sampler, in
one process. The conds are what TextEncodeQwenImageEditPlus makes: text with each picture's
vision tokens (--text-tokens plus 196 per picture, a 392² picture in Qwen2.5-VL) and one
reference latent per picture at about 1 MP (1024², then 1184x880). The output latent is
--sizes² (the VAE encode of the picture to edit: at denoise 1 only its size counts).
--variant 2511 adds Edit-2511's marker key: references modulated at timestep 0 (hosts with
index_timestep_zero). Each loader is loaded from the same state dict, run for every size and
reference count, and unloaded; its KSampler run after a warm-up is the reference for its
graph modes (rel L2 0 = exact), and stock KSampler's for the loaders (the fused kernels' and
fp8's rounding).
Prints the GPU, torch version, a table, and JSON on the last line.

    COMFYUI_PATH=~/comfy/ComfyUI-v0.33 python benchmarks/edit.py --sizes 1328 2512 --refs 1 2
"""

import argparse
import copy
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: tests.harness
from dit_forward import VARIANTS, load  # noqa: E402
from sampler import CAPTURE  # noqa: E402

from tests.harness.comfyui import setup_comfy  # noqa: E402

# (height, width) in pixels of each reference picture, as TextEncodeQwenImageEditPlus scales
# it: about 1 MP, multiples of 8
REFERENCES = [(1024, 1024), (880, 1184)]
VISION_TOKENS = 196  # per picture: a 392² picture, 14 px patches merged 2x2
STOCK = "stock bf16"


def edit_conds(n_refs: int, text_tokens: int, seed: int = 1):
    """(positive, negative) as TextEncodeQwenImageEditPlus makes them: the edit instruction and
    an empty one, each with the pictures' vision tokens and reference latents."""
    import node_helpers
    import torch

    g = torch.Generator().manual_seed(seed)
    refs = [torch.randn((1, 16, 1, h // 8, w // 8), generator=g) for h, w in REFERENCES[:n_refs]]
    out = []
    for tokens in (text_tokens, 64):  # the negative: the system template only
        text = torch.randn((1, tokens + VISION_TOKENS * n_refs, 3584), generator=g)
        out.append(node_helpers.conditioning_set_values(
            [[text, {}]], {"reference_latents": refs}, append=True
        ))  # fmt: skip
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1328, 2512])
    p.add_argument("--refs", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--cfg", type=float, default=1.0, help="1 = the Lightning LoRA's setting")
    p.add_argument("--text-tokens", type=int, default=256)
    p.add_argument("--layers", type=int, default=60, help="60 = the real model")
    p.add_argument("--variant", choices=["2509", "2511"], default="2509")
    p.add_argument("--loaders", nargs="+", default=[STOCK, "fp8_fast fused fp8_cudnn"],
                   choices=list(VARIANTS), help="the first one is the reference")  # fmt: skip
    p.add_argument("--modes", nargs="+", choices=CAPTURE[:2], default=CAPTURE[:2],
                   help="CUDA Graph Sampler capture modes, beside 'off' (= KSampler)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()
    setup_comfy(highvram=True)  # weights stay on the GPU between runs
    import torch

    if not torch.cuda.is_available():
        sys.exit("This benchmark needs a CUDA GPU.")
    with torch.inference_mode():  # as ComfyUI's executor runs nodes
        run(a)


def run(a):
    import comfy.model_management as mm
    import torch
    from comfy_extras.nodes_model_advanced import ModelSamplingAuraFlow

    from qwen_turbo.cli import bench
    from qwen_turbo.nodes.graph_sampler import CUDAGraphSampler
    from qwen_turbo.runtime import memory
    from qwen_turbo.runtime.dit import config
    from qwen_turbo.runtime.graphs.cache import cache_for

    sd = {k: v.cpu() for k, v in bench.qwen_dit_state_dict(a.layers, "cuda").items()}
    torch.cuda.empty_cache()
    if a.variant == "2511":
        sd[config.TIMESTEP_ZERO] = torch.tensor([])

    def timed(fn):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        return out, (time.perf_counter() - t) * 1e3

    modes = ["off", *a.modes]
    rows, stock_ref = [], {}
    for loader in a.loaders:
        model = ModelSamplingAuraFlow().patch_aura(load(loader, sd), 3.1)[0]
        method = getattr(model.model.diffusion_model, "default_ref_method", "index")
        for size in a.sizes:
            latent = {"samples": torch.zeros((1, 16, 1, size // 8, size // 8))}
            for n_refs in a.refs:
                args = (model, 0, a.steps, a.cfg, "euler", "simple",
                        *edit_conds(n_refs, a.text_tokens), latent, 1.0)  # fmt: skip

                def sampler(capture, args=args):
                    return lambda: CUDAGraphSampler.execute(*args, capture).result[0]["samples"]

                key = (size, n_refs)
                timed(sampler("off"))  # warm-up: loads the model; KSampler's first run differs
                ref, _ = timed(sampler("off"))
                stock_ref.setdefault(key, ref)
                row = {"loader": loader, "size": size, "refs": n_refs, "ref_method": method}
                for mode in modes:
                    stats = cache_for(model.model).stats
                    before = copy.deepcopy(stats)
                    out, first = timed(sampler(mode))  # a graph mode's includes the capture
                    peak = torch.cuda.max_memory_allocated() / 2**30
                    ms = statistics.median(timed(sampler(mode))[1] for _ in range(a.repeats))
                    row[mode] = {
                        "first_ms": round(first, 1), "ms": round(ms, 1),
                        "peak_gib": round(peak, 2),
                        "rel_l2": bench.rel_l2(out, ref), "rel_l2_stock": bench.rel_l2(
                            out, stock_ref[key]),
                        "captured": stats.captured - before.captured,
                        "replayed": stats.replayed - before.replayed,
                        "eager": stats.eager - before.eager,
                        "reasons": {k: n for k, n in stats.reasons.items()
                                    if n > before.reasons.get(k, 0)},
                    }  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
                memory.release(model.model)
        del model, args
        mm.unload_all_models()
        gc.collect()
        torch.cuda.empty_cache()

    base = {(r["size"], r["refs"]): r["off"]["ms"] for r in rows if r["loader"] == a.loaders[0]}
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, {a.layers} layers, "
          f"Edit-{a.variant}, {a.steps} steps, CFG {a.cfg}, euler/simple")  # fmt: skip
    head = ("loader", "size", "refs", "sampler", "1st ms", "ms", "vs base", "rel L2", "vs stock",
            "peak GiB", "graphs")  # fmt: skip
    print("{:26} {:>5} {:>4} {:>15} {:>9} {:>9} {:>7} {:>9} {:>9} {:>8}  {}".format(*head))
    for r in rows:
        for mode in modes:
            m = r[mode]
            graphs = f"c{m['captured']} r{m['replayed']} e{m['eager']}" if mode != "off" else ""
            print(f"{r['loader']:26} {r['size']:5d} {r['refs']:4d} {mode:>15} "
                  f"{m['first_ms']:9.1f} {m['ms']:9.1f} "
                  f"{base[(r['size'], r['refs'])] / m['ms']:7.3f} {m['rel_l2']:9.2e} "
                  f"{m['rel_l2_stock']:9.2e} {m['peak_gib']:8.2f}  {graphs}")  # fmt: skip
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "layers": a.layers, "variant": a.variant, "steps": a.steps, "cfg": a.cfg,
            "text_tokens": a.text_tokens, "base": f"{a.loaders[0]} KSampler"}  # fmt: skip
    print(json.dumps({**meta, "rows": rows}))


if __name__ == "__main__":
    main()
