"""One Qwen-Image DiT forward: stock UNETLoader model against the Optimized Loader's, one process.

Random full-size weights (60 layers unless --layers), batch 1, 256 text tokens. Each variant
is loaded from the same state dict, run at each size (warm-up, then the median of CUDA-event
timings), compared with the stock output (relative L2), and unloaded before the next. With
--graph each forward is also captured in a CUDA graph and its replays timed (the GPU's time
alone, without the host's launch cost), and eager/graph printed (1.0: the host is hidden).
With --sample-steps N it also times an N-step euler/simple CFG-1 KSampler run at the largest
size with a random LoRA, stock against --sample-variant (+ CUDA Graph Sampler).
Each row gives the roofline: the forward's FLOPs counted from the shapes (cli/bench.
forward_flops: GEMMs and attention), the TFLOP/s achieved (eager), and that as a share of
the GPU's dense fp8 and bf16 peaks where the GPU is listed (cli/bench.PEAKS).
Prints a table and JSON on the last line.

    python benchmarks/dit_forward.py --sizes 1024 1328 1664x928 2512 --graph
"""

import argparse
import gc
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: tests.harness
from sampler import random_lora  # noqa: E402

from tests.harness.comfyui import setup_comfy  # noqa: E402

# name: (loader, weight_dtype, attention, fused, compile)
VARIANTS = {
    "stock bf16": ("stock", "default", None, None, None),
    "stock fp8_e4m3fn_fast": ("stock", "fp8_e4m3fn_fast", None, None, None),
    "bf16 sdpa": ("pack", "bf16", "sdpa", False, "off"),
    "bf16 fused sdpa": ("pack", "bf16", "sdpa", True, "off"),
    "bf16 fused sdpa compile": ("pack", "bf16", "sdpa", True, "regional"),
    "fp8 fused sdpa": ("pack", "fp8_e4m3fn", "sdpa", True, "off"),
    "fp8_fast fused sdpa": ("pack", "fp8_e4m3fn_fast", "sdpa", True, "off"),
    "fp8_fast fused sdpa, fp8 GEMV": ("pack", "fp8_e4m3fn_fast", "sdpa", True, "off"),
    "bf16 fused fp8_cudnn": ("pack", "bf16", "fp8_cudnn", True, "off"),
    "fp8_fast fused fp8_cudnn": ("pack", "fp8_e4m3fn_fast", "fp8_cudnn", True, "off"),
    # the Optimized Loader's model as it loads: the fused blocks replay graphs when eager
    "fp8_fast fused fp8_cudnn, block graphs": ("pack", "fp8_e4m3fn_fast", "fp8_cudnn", True, "off"),
    # fp8: FlashAttention-3's kernel where it is installed on Hopper (the workflows' setting)
    "fp8_fast fused fp8": ("pack", "fp8_e4m3fn_fast", "fp8", True, "off"),
    "fp8_fast fused fp8, block graphs": ("pack", "fp8_e4m3fn_fast", "fp8", True, "off"),
}


def load(variant, sd):
    import comfy.sd

    from qwen_turbo.runtime.dit import config, fp8, loader

    kind, dtype, attention, fused, compile_ = VARIANTS[variant]
    if kind == "stock":
        options = {}
        if dtype == "fp8_e4m3fn_fast":
            import torch

            options = {"dtype": torch.float8_e4m3fn, "fp8_optimizations": True}
        return comfy.sd.load_diffusion_model_state_dict(dict(sd), model_options=options)
    fp8.GEMV_ROWS = 0 if variant.endswith("fp8 GEMV") else 16
    patcher = loader.build(dict(sd), config.read_config(sd), dtype)
    if fused:
        loader.add_fused_blocks(patcher)
        if variant.endswith("block graphs"):
            loader.add_block_graphs(patcher)
    loader.set_attention(patcher, attention)
    if compile_ == "regional":
        loader.compile_blocks(patcher)
    return patcher


def parse_size(text: str) -> tuple[int, int]:
    """'1328' (a square) or '1664x928' (width x height) -> (width, height)."""
    w, _, h = text.partition("x")
    return int(w), int(h or w)


def label(wh: tuple[int, int]) -> str:
    return str(wh[0]) if wh[0] == wh[1] else f"{wh[0]}x{wh[1]}"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=parse_size, nargs="+", default=[(1328, 1328), (2512, 2512)],
                   help="sides, or WIDTHxHEIGHT")  # fmt: skip
    p.add_argument("--layers", type=int, default=60, help="60 = the real model")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--graph", action="store_true", help="also time CUDA-graph replays")
    p.add_argument("--sample-steps", type=int, default=0, help="also time a sampling run")
    p.add_argument("--sample-variant", default="fp8_fast fused sdpa", choices=list(VARIANTS))
    a = p.parse_args()
    setup_comfy(highvram=True)  # weights stay on the GPU between variants: no host copies
    import comfy.model_management as mm
    import torch

    from qwen_turbo.cli import bench

    if not torch.cuda.is_available():
        sys.exit("This benchmark needs a CUDA GPU.")
    sd = bench.qwen_dit_state_dict(a.layers, "cuda")
    peaks = bench.peaks(torch.cuda.get_device_name())
    rows, ref = [], {}
    for variant in a.variants:
        patcher = load(variant, sd)
        mm.load_models_gpu([patcher], force_full_load=True)
        weights = sum(t.numel() * t.element_size() for t in patcher.model.state_dict().values())
        for size in a.sizes:
            torch.cuda.reset_peak_memory_stats()
            run = bench.forward_fn(patcher, size)
            ms, out = bench.timed(run, a.repeats, warmups=2)  # block graphs capture at the 2nd
            out = out.float()
            if variant == a.variants[0]:
                ref[size] = out
            err = bench.rel_l2(out, ref[size])
            gemm, attention = bench.forward_flops(a.layers, *size)
            tflops = (gemm + attention) / ms / 1e9
            rows.append({
                "variant": variant, "size": label(size), "ms": round(ms, 1),
                "gemm_tflop": round(gemm / 1e12, 2), "attention_tflop": round(attention / 1e12, 2),
                "tflops": round(tflops, 1),
                "of_fp8_peak": round(tflops / peaks[1], 3) if peaks else None,
                "of_bf16_peak": round(tflops / peaks[0], 3) if peaks else None,
                "vs_first": None, "rel_l2": err, "finite": bool(out.isfinite().all()),
                "weights_gib": round(weights / 2**30, 2),
                "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            })  # fmt: skip
            if a.graph:
                graph_ms, graph_out = bench.graph_timed(run, a.repeats)
                rows[-1].update(
                    graph_ms=round(graph_ms, 1), graph_rel_l2=bench.rel_l2(graph_out, ref[size]),
                    eager_vs_graph=round(ms / graph_ms, 3),  # the host's share: 1.0 = none
                )  # fmt: skip
                del graph_out
        del patcher, out
        mm.unload_all_models()
        gc.collect()
        torch.cuda.empty_cache()
    first = {r["size"]: r for r in rows if r["variant"] == a.variants[0]}
    for r in rows:
        r["vs_first"] = round(r["ms"] / first[r["size"]]["ms"], 3)
        if a.graph:
            r["graph_vs_first"] = round(r["graph_ms"] / first[r["size"]]["graph_ms"], 3)
    print(
        f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, {a.layers} layers"
        + (f", dense peaks {peaks[1]} (fp8) / {peaks[0]} (bf16) TFLOP/s" if peaks else "")
    )
    head = ("variant", "size", "ms", "ratio", "rel L2", "weights", "peak", "TFLOP", "TFLOP/s",
            "fp8%", "bf16%")  # fmt: skip
    print("{:26} {:>8} {:>8} {:>6} {:>9} {:>8} {:>7} {:>7} {:>7} {:>5} {:>5}".format(*head))
    for r in rows:
        share = (f"{100 * r['of_fp8_peak']:5.1f} {100 * r['of_bf16_peak']:5.1f}" if peaks
                 else f"{'':5} {'':5}")  # fmt: skip
        print(
            f"{r['variant']:26} {r['size']:>8} {r['ms']:8.1f} {r['vs_first']:6.3f} "
            f"{r['rel_l2']:9.2e} {r['weights_gib']:7.2f}G {r['peak_gib']:6.2f}G "
            f"{r['gemm_tflop'] + r['attention_tflop']:7.1f} {r['tflops']:7.1f} {share}"
            + ("" if r["finite"] else "  NON-FINITE")
            + (f"  graph {r['graph_ms']:.1f} ({r['graph_vs_first']:.3f}, {r['graph_rel_l2']:.2e}),"
               f" eager/graph {r['eager_vs_graph']:.3f}" if a.graph else "")
        )  # fmt: skip
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "layers": a.layers, "forward": rows}  # fmt: skip
    if a.sample_steps:
        result["sampling"] = sample(sd, a.sizes[-1][0], a.sample_steps, a.sample_variant)
    print(json.dumps(result))


def sample(sd, size, steps, variant):
    """N-step euler/simple CFG 1 with a random LoRA, stock KSampler on the stock model against
    the CUDA Graph Sampler on the Optimized Loader's `variant` model."""
    import time

    import comfy.model_management as mm
    import torch
    from comfy_extras.nodes_model_advanced import ModelSamplingAuraFlow

    import nodes as comfy_nodes
    from qwen_turbo.runtime.graphs.cache import cache_for
    from qwen_turbo.runtime.graphs.sampling import with_cuda_graphs

    g = torch.Generator().manual_seed(2)
    cond = [[torch.randn((1, 256, 3584), generator=g), {}]]
    latent = {"samples": torch.zeros((1, 16, 1, size // 8, size // 8))}
    out = {}
    for name, loaded in (("stock", "stock bf16"), ("pack", variant)):
        model = ModelSamplingAuraFlow().patch_aura(load(loaded, sd), 3.1)[0]
        lora = random_lora(model)
        if name == "pack":  # the CUDA Graph Sampler's default mode
            lora = with_cuda_graphs(lora, whole_step=True)
        times = []
        for _ in range(2):  # first run loads, captures, autotunes
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.inference_mode():  # as ComfyUI's executor runs nodes
                comfy_nodes.common_ksampler(
                    lora, 0, steps, 1.0, "euler", "simple", cond, cond, latent
                )
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        out[name] = {"first_s": round(times[0], 2), "second_s": round(times[1], 2)}
        if name == "pack":
            stats = cache_for(lora.model).stats
            out[name].update(captured=stats.captured, replayed=stats.replayed,
                             eager=stats.eager, reasons=dict(stats.reasons))  # fmt: skip
        del model, lora
        mm.unload_all_models()
        gc.collect()
        torch.cuda.empty_cache()
    print(f"sampling {steps} steps at {size}^2, {variant} (s, second run): {out}")
    return out


if __name__ == "__main__":
    main()
