"""A partly loaded Qwen-Image DiT: forwards on a simulated card, stock against the pack, with
ComfyUI's per-layer copies and with the pack's weight streaming, in one process.

Random full-size weights in the layout of the repackaged `qwen_image_2512_fp8_e4m3fn` file
(matrices fp8_e4m3fn, vectors bf16); with --lora, a random rank-64 LoRA on every block linear,
as the Lightning LoRA is. A card of N GiB is the GPU filled until `mem_get_info` reports N - 1
GiB free; ComfyUI then decides what stays on the GPU as its samplers ask it to
(`sampler_helpers.prepare_sampling` for the latent). "whole" is the unfilled GPU. Variants:
stock (what UNETLoader loads from the file), pack (Optimized Loader fp8_e4m3fn_fast, fused
blocks, streaming), pack without streaming. The first forward after the load is timed on its
own (it pins host memory on hosts that do not), then the median of --repeats; rel L2 against
the pack's resident forward.

    COMFYUI_PATH=~/comfy/ComfyUI-v0.33 python benchmarks/offload.py --cards 0 16 12 --lora
"""

import argparse
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: tests.harness
from card_workflow import fill_to  # noqa: E402

from tests.harness.comfyui import setup_comfy  # noqa: E402

GiB = 2**30
VARIANTS = ["stock", "pack", "pack, no streaming"]


def fp8_file_state_dict(layers: int) -> dict:
    """Random weights as the repackaged fp8 file holds them, on the host."""
    import torch

    from qwen_turbo.cli import bench

    sd = bench.qwen_dit_state_dict(layers, "cuda")
    out = bench.repackaged_fp8(sd)
    del sd
    torch.cuda.empty_cache()
    return out


def load(variant: str, sd: dict, lora: dict | None):
    import comfy.sd

    from qwen_turbo.runtime.dit import config, loader

    if variant == "stock":
        patcher = comfy.sd.load_diffusion_model_state_dict(dict(sd))
    else:
        patcher = loader.build(dict(sd), config.read_config(sd), "fp8_e4m3fn_fast")
        loader.add_fused_blocks(patcher)
        if variant == "pack":
            loader.stream_offloaded_weights(patcher)
    if lora is not None:
        patcher, _ = comfy.sd.load_lora_for_models(patcher, None, lora, 1.0, 0)
    return patcher


def measure(patcher, size: int, repeats: int) -> dict:
    import comfy.sampler_helpers
    import torch

    from qwen_turbo.cli import bench

    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    t0 = time.perf_counter()
    with torch.inference_mode():
        _, conds, models = comfy.sampler_helpers.prepare_sampling(
            patcher, (1, 16, size // 8, size // 8), {}, patcher.model_options
        )
    torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    on_gpu = sum(t.nbytes for t in patcher.model.diffusion_model.state_dict().values() if t.is_cuda)
    run = bench.forward_fn(patcher, size)
    t0 = time.perf_counter()
    run()
    torch.cuda.synchronize()
    first_ms = (time.perf_counter() - t0) * 1e3
    ms, out = bench.timed(run, repeats)
    comfy.sampler_helpers.cleanup_models(conds, models)
    return {
        "load_s": round(load_s, 2), "first_ms": round(first_ms, 1), "ms": round(ms, 1),
        "resident_gib": round(on_gpu / GiB, 2), "lowvram": bool(patcher.model.model_lowvram),
        "peak_gib": round((torch.cuda.max_memory_allocated() - base) / GiB, 2),
        "alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries,
        "out": out.float(),
    }  # fmt: skip


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cards", type=float, nargs="+", default=[0, 16, 12], help="GiB; 0 = whole")
    p.add_argument("--size", type=int, default=2512)
    p.add_argument("--layers", type=int, default=60, help="60 = the real model")
    p.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    p.add_argument("--lora", action="store_true", help="a random rank-64 LoRA on every block")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--unload-gib", type=float, default=0,
                   help="then ask ComfyUI for this much room, as a decode does; rerun")  # fmt: skip
    a = p.parse_args()
    setup_comfy()
    import comfy.model_management as mm
    import torch

    from qwen_turbo.cli import bench

    if not torch.cuda.is_available():
        sys.exit("This benchmark needs a CUDA GPU.")
    sd = fp8_file_state_dict(a.layers)
    lora = bench.random_lora(sd) if a.lora else None
    rows, ref = [], None
    for card in a.cards:
        filler = fill_to(card - 1) if card else None
        free = torch.cuda.mem_get_info()[0] / GiB
        for variant in a.variants:
            patcher = load(variant, sd, lora)
            r = measure(patcher, a.size, a.repeats)
            out = r.pop("out")
            if ref is None:
                ref = out
            rows.append({"card_gib": card or None, "free_gib": round(free, 1),
                         "variant": variant, **r, "rel_l2": bench.rel_l2(out, ref)})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
            if a.unload_gib:
                device = mm.get_torch_device()
                mm.free_memory(mm.get_free_memory(device) + a.unload_gib * GiB, device)
                r = measure(patcher, a.size, a.repeats)
                err = bench.rel_l2(r.pop("out"), ref)
                rows.append({**rows[-1], **r, "variant": variant + ", after an unload",
                             "rel_l2": err})  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
            del patcher, out
            mm.unload_all_models()
            gc.collect()
            torch.cuda.empty_cache()
        del filler
        torch.cuda.empty_cache()
    import comfyui_version

    version = getattr(comfyui_version, "__version__", "?")
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, ComfyUI {version}, "
          f"{a.layers} layers, {a.size}², LoRA {'on' if a.lora else 'off'}")  # fmt: skip
    head = ("card", "variant", "on GPU", "load s", "first ms", "ms", "peak", "rel L2")
    print("{:>6} {:34} {:>7} {:>7} {:>9} {:>8} {:>6} {:>8}".format(*head))
    for r in rows:
        print(f"{r['card_gib'] or 'whole':>6} {r['variant']:34} {r['resident_gib']:6.1f}G "
              f"{r['load_s']:7.2f} {r['first_ms']:9.1f} {r['ms']:8.1f} {r['peak_gib']:5.1f}G "
              f"{r['rel_l2']:8.1e}")  # fmt: skip
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "comfyui": version, "layers": a.layers, "size": a.size,
                      "lora": a.lora, "rows": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
