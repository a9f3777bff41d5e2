"""VAE decode: ComfyUI's VAEDecode and VAEDecodeTiled against VAE Tiling, in one process.

Random full-size weights of the Qwen-Image (Wan 2.1) VAE, or of the SD AutoencoderKL.
Prints the GPU, torch version, a table, and JSON on the last line.

    COMFYUI_PATH=~/comfy/ComfyUI python benchmarks/vae_decode.py --size 2512 --budgets 4 0
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: tests.harness
from tests.harness.comfyui import setup_comfy  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", choices=["qwen", "sd"], default="qwen")
    p.add_argument("--size", type=int, default=2512, help="image side in pixels")
    p.add_argument("--budgets", type=float, nargs="+", default=[4.0, 0.0], help="GiB, 0 = auto")
    p.add_argument("--stock-untiled", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    setup_comfy()
    import torch

    with torch.inference_mode():  # as ComfyUI's executor runs nodes
        run(a)


def run(a):
    import comfy.model_management as mm
    import torch

    import nodes
    from qwen_turbo.runtime.vae.tiled import decode
    from tests.harness import models

    cuda = torch.cuda.is_available()
    dev_name = torch.cuda.get_device_name() if cuda else "cpu"
    module = models.qwen_vae_module() if a.arch == "qwen" else models.sd_vae_module()
    dtype = torch.bfloat16 if cuda else torch.float32
    import comfy.sd

    weights = models.random_state_dict(module, 0)
    vae = comfy.sd.VAE(sd=weights, dtype=dtype)
    h = a.size // 8
    shape = (1, 16, 1, h, h) if a.arch == "qwen" else (1, 4, h, h)
    g = torch.Generator().manual_seed(0)
    latent = torch.randn(shape, generator=g)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def measure(fn):
        fn()  # warm-up, loads the VAE
        times, peak = [], 0
        for _ in range(a.repeats):
            mm.soft_empty_cache()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() if cuda else 0
            sync()
            t = time.perf_counter()
            out = fn()
            sync()
            times.append(time.perf_counter() - t)
            if cuda:
                peak = max(peak, torch.cuda.max_memory_allocated() - base)
        return out, statistics.median(times) * 1e3, peak / 2**30, base / 2**30

    def stock_decode():
        return nodes.VAEDecode().decode(vae, {"samples": latent})[0]

    def stock_tiled():  # the node's defaults: 512-px tiles, 64-px overlap
        return nodes.VAEDecodeTiled().decode(vae, {"samples": latent}, 512, 64, 64, 8)[0]

    from qwen_turbo.nodes.vae_patches import FusedNormPatch, TextureUpsample

    cases = []
    patched = TextureUpsample.execute(FusedNormPatch.execute(vae).result[0]).result[0]
    for b in a.budgets:
        label = f"VAE Tiling, budget {b:g} GiB" if b else "VAE Tiling, auto budget"
        cases.append((label, lambda b=b, v=vae: decode(v, latent, 0, b)))
        cases.append((label + " + patches", lambda b=b, v=patched: decode(v, latent, 0, b)))
    cases.append(("ComfyUI VAEDecodeTiled 512/64", stock_tiled))
    if a.stock_untiled:
        cases.append(("ComfyUI VAEDecode", stock_decode))
    rows, outs = [], {}
    for label, fn in cases:
        try:
            out, ms, peak, base = measure(fn)
        except torch.OutOfMemoryError:
            rows.append({"case": label, "error": "out of memory"})
            mm.soft_empty_cache()
            continue
        outs[label] = out.reshape(-1, *out.shape[-3:]).float().cpu()
        rows.append({"case": label, "ms": round(ms, 1), "peak_gib": round(peak, 2),
                     "resident_before_gib": round(base, 2)})  # fmt: skip
        del out

    # fp32 reference: the same weights in fp32, decoded by VAE Tiling (exact in fp32)
    del vae, patched
    mm.unload_all_models()
    mm.soft_empty_cache()
    vae = comfy.sd.VAE(sd=weights, dtype=torch.float32)
    ref32 = decode(vae, latent).reshape(-1, *outs[cases[0][0]].shape[1:]).float().cpu()
    stock = outs.get("ComfyUI VAEDecode")
    for r in rows:
        if "error" not in r:
            o = outs[r["case"]]
            r["max_abs_vs_fp32"] = round((o - ref32).abs().max().item(), 5)
            if stock is not None:
                r["max_abs_vs_stock"] = round((o - stock).abs().max().item(), 5)

    print(f"GPU: {dev_name}  torch {torch.__version__}  arch {a.arch}  {a.size}x{a.size}  {dtype}")
    print(f"{'case':42} {'ms':>8} {'peak GiB':>9} {'|d| vs stock':>12} {'|d| vs fp32':>12}")
    for r in rows:
        if "error" in r:
            print(f"{r['case']:42} {r['error']}")
            continue
        vs_stock = r.get("max_abs_vs_stock", float("nan"))
        print(f"{r['case']:42} {r['ms']:8.1f} {r['peak_gib']:9.2f} {vs_stock:12.5f} "
              f"{r['max_abs_vs_fp32']:12.5f}")  # fmt: skip
    meta = {"gpu": dev_name, "torch": torch.__version__, "arch": a.arch, "size": a.size}
    print(json.dumps({**meta, "dtype": str(dtype), "rows": rows}))


if __name__ == "__main__":
    main()
