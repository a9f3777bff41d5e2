"""One NewBie-image DiT forward (Lumina-2's NextDiT, 36 blocks): stock UNETLoader's model
against the Optimized Loader's, in one process.

Random full-size weights in the released file's layout (bf16), batch 2 (cond and uncond),
NewBie's text features (Gemma-3-4B width, 300 tokens) and pooled CLIP vector. Each variant is
loaded from the same state dict, whole on the GPU, run at each size (warm-up, then the median
of CUDA-event timings), compared with the first variant's output (relative L2), and unloaded
before the next; `graph` is the same forward replayed from one CUDA graph (the GPU's time
without the host's launch cost: what the CUDA Graph Sampler runs). Prints a table and JSON
on the last line.

    python benchmarks/newbie_forward.py --sizes 1024 2048
"""

import argparse
import gc
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: tests.harness
from tests.harness.comfyui import setup_comfy  # noqa: E402

# name: (loader, weight_dtype, attention, fused)
VARIANTS = {
    "stock bf16": ("stock", "default", None, None),
    "stock fp8_e4m3fn_fast": ("stock", "fp8_e4m3fn_fast", None, None),
    "fp8_fast sdpa": ("pack", "fp8_e4m3fn_fast", "sdpa", False),
    "fp8_fast fused auto": ("pack", "fp8_e4m3fn_fast", "auto", True),
    "fp8_fast fused sdpa": ("pack", "fp8_e4m3fn_fast", "sdpa", True),
    "fp8_fast fused fp8_cudnn": ("pack", "fp8_e4m3fn_fast", "fp8_cudnn", True),
    "fp8_fast fused fp8": ("pack", "fp8_e4m3fn_fast", "fp8", True),
}
TOKENS = 300  # a NewBie XML prompt after its system line, in Gemma tokens


def state_dict(device: str):
    import torch

    from qwen_turbo.cli import bench
    from tests.harness import models

    module = models.newbie_dit_module(36)
    return bench.random_state_dict(module, seed=0, dtype=torch.bfloat16, device=device)


def load(variant: str, sd):
    import comfy.sd
    import torch

    from qwen_turbo.runtime.dit import loader, nextdit

    kind, dtype, attention, fused = VARIANTS[variant]
    if kind == "stock":
        options = {}
        if dtype == "fp8_e4m3fn_fast":
            options = {"dtype": torch.float8_e4m3fn, "fp8_optimizations": True}
        return comfy.sd.load_diffusion_model_state_dict(dict(sd), model_options=options)
    patcher = loader.build(dict(sd), nextdit.read_config(sd), dtype)
    if fused:
        loader.add_fused_blocks(patcher)
    loader.set_attention(patcher, attention)
    return patcher


def forward_fn(patcher, side: int):
    import torch

    device = patcher.load_device
    g = torch.Generator(device).manual_seed(1)
    dm = patcher.model.diffusion_model
    x = torch.randn((2, 16, side // 8, side // 8), device=device, generator=g)
    ctx = torch.randn((2, TOKENS, dm.cap_embedder[1].weight.shape[1]), device=device, generator=g)
    pooled = torch.randn((2, dm.clip_text_dim), device=device, generator=g)
    sigma = torch.tensor([0.6, 0.6], device=device)
    opts = dict(patcher.model_options.get("transformer_options", {}), wrappers=patcher.wrappers)

    def run():
        with torch.inference_mode():
            return patcher.model.apply_model(
                x, sigma, c_crossattn=ctx, num_tokens=TOKENS, clip_text_pooled=pooled,
                transformer_options=opts,
            )  # fmt: skip

    return run


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    setup_comfy(highvram=True)
    import comfy.model_management as mm
    import torch

    from qwen_turbo.cli import bench

    if not torch.cuda.is_available():
        sys.exit("This benchmark needs a CUDA GPU.")
    sd = state_dict("cuda")
    rows, ref = [], {}
    for variant in a.variants:
        patcher = load(variant, sd)
        mm.load_models_gpu([patcher], force_full_load=True)
        for side in a.sizes:
            torch.cuda.reset_peak_memory_stats()
            run = forward_fn(patcher, side)
            ms, out = bench.timed(run, a.repeats, warmups=2)
            ref.setdefault(side, out.float())
            graph_ms, _ = bench.graph_timed(run, a.repeats)
            peak = torch.cuda.max_memory_allocated() / 2**30
            rows.append({"variant": variant, "size": side, "ms": round(ms, 2),
                         "graph_ms": round(graph_ms, 2), "rel_l2": bench.rel_l2(out, ref[side]),
                         "peak_gib": round(peak, 2)})  # fmt: skip
        del patcher, out
        mm.unload_all_models()
        gc.collect()
        torch.cuda.empty_cache()
    first = {r["size"]: r for r in rows if r["variant"] == a.variants[0]}
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, NewBie 36 blocks, "
          f"batch 2, {TOKENS} text tokens")  # fmt: skip
    print(f"{'variant':28} {'size':>5} {'ms':>8} {'ratio':>6} {'graph ms':>9} {'ratio':>6} "
          f"{'rel L2':>9} {'peak':>7}")  # fmt: skip
    for r in rows:
        f = first[r["size"]]
        r["vs_first"] = round(r["ms"] / f["ms"], 3)
        r["graph_vs_first"] = round(r["graph_ms"] / f["graph_ms"], 3)
        print(f"{r['variant']:28} {r['size']:5} {r['ms']:8.2f} {r['vs_first']:6.3f} "
              f"{r['graph_ms']:9.2f} {r['graph_vs_first']:6.3f} {r['rel_l2']:9.2e} "
              f"{r['peak_gib']:6.2f}G")  # fmt: skip
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "forward": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
