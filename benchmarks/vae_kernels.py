"""VAE kernels and patched decodes against ComfyUI's own modules, in one process.

Checks each result against the stock one first, then times with CUDA events (median of
--repeats after a warm-up). Prints the GPU, torch version, a table, and JSON on the last line.

    COMFYUI_PATH=~/comfy/ComfyUI python benchmarks/vae_kernels.py
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: tests.harness
from tests.harness.comfyui import setup_comfy  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--decode-size", type=int, default=2512)
    p.add_argument("--flux-size", type=int, default=2048)
    a = p.parse_args()
    setup_comfy()
    import torch

    with torch.inference_mode():  # as ComfyUI's executor runs nodes
        run(a)


def run(a):
    import comfy.model_management as mm
    import comfy.sd
    import torch
    import torch.nn.functional as F
    from comfy.ldm.wan.vae import RMS_norm

    import nodes
    from qwen_turbo.kernels.channel_rms_norm_silu import channel_rms_norm_silu
    from qwen_turbo.kernels.group_norm_silu import group_norm_silu
    from qwen_turbo.kernels.upsample_conv3x3 import phase_weights, upsample_conv3x3
    from qwen_turbo.nodes.vae_patches import FusedNormPatch, TextureUpsample
    from qwen_turbo.runtime.vae.tiled import decode as tiled_decode
    from tests.harness import models

    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    import logging

    class CountFallbacks(logging.Handler):  # ComfyUI's silent switch to seamed tiling on OOM
        hits = 0

        def emit(self, record):
            if "retrying with tiled" in record.getMessage():
                CountFallbacks.hits += 1

    logging.getLogger().addHandler(CountFallbacks())
    dev, bf16 = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []

    def timed(fn, repeats=a.repeats):
        fn()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        times = []
        for _ in range(repeats):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e))
        return statistics.median(times), (torch.cuda.max_memory_allocated() - base) / 2**30

    def compare(name, stock, ours, target=None, floor_bytes=None, repeats=a.repeats):
        CountFallbacks.hits = 0
        ref = stock().float()
        torch.cuda.empty_cache()
        out = ours().float()
        err = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
        del ref, out
        torch.cuda.empty_cache()
        t_stock, m_stock = timed(stock, repeats)
        torch.cuda.empty_cache()
        t_ours, m_ours = timed(ours, repeats)
        row = {"case": name, "stock_ms": round(t_stock, 3), "ours_ms": round(t_ours, 3),
               "speedup": round(t_stock / t_ours, 2), "stock_peak_gib": round(m_stock, 2),
               "ours_peak_gib": round(m_ours, 2), "max_rel_err": round(err, 5)}  # fmt: skip
        if floor_bytes:
            x = torch.empty(floor_bytes // 2, dtype=bf16, device=dev)
            t_copy, _ = timed(lambda: x.clone())  # reads and writes floor_bytes / 2 each
            row["floor_ms"] = round(t_copy, 3)
            row["x_floor"] = round(t_ours / t_copy, 2)
            del x
        if target:
            row["target"] = target
        if CountFallbacks.hits:
            row["comfy_oom_tiled_fallbacks"] = CountFallbacks.hits
        rows.append(row)
        torch.cuda.empty_cache()

    # channel RMS norm + SiLU on the Wan decoder's last-stage tensor
    x = torch.randn((1, 96, 1, 2512, 2512), generator=g, device=dev, dtype=bf16)
    norm = RMS_norm(96, images=False).to(dev, bf16)
    with torch.no_grad():
        norm.gamma.normal_(1.0, 0.1, generator=g)
    compare(
        "rms_norm_silu 1x96x1x2512x2512", lambda x=x: F.silu(norm(x)),
        lambda x=x: channel_rms_norm_silu(x, norm.gamma, None, True), ">=3x, <=1.6x floor",
        floor_bytes=2 * x.numel() * 2,
    )  # fmt: skip
    del x

    for shape in [(1, 128, 2048, 2048), (1, 512, 256, 256)]:
        x = torch.randn(shape, generator=g, device=dev, dtype=bf16) * 3 + 1
        w = torch.randn(shape[1], generator=g, device=dev, dtype=bf16)
        b = torch.randn(shape[1], generator=g, device=dev, dtype=bf16)
        compare(
            "group_norm_silu " + "x".join(map(str, shape)),
            lambda x=x, w=w, b=b: F.silu(F.group_norm(x, 32, w, b, 1e-6)),
            lambda x=x, w=w, b=b: group_norm_silu(x, 32, w, b, 1e-6, True), ">=2x",
        )  # fmt: skip
        del x

    for c_in, c_out, h in [(384, 192, 314), (384, 192, 628), (192, 96, 1256)]:
        x = torch.randn((1, c_in, h, h), generator=g, device=dev, dtype=bf16)
        w = torch.randn((c_out, c_in, 3, 3), generator=g, device=dev, dtype=bf16) / 40
        b = torch.randn(c_out, generator=g, device=dev, dtype=bf16)
        w4 = phase_weights(w)
        compare(
            f"upsample_conv3x3 {c_in}->{c_out} {h}->{2 * h}",
            lambda x=x, w=w, b=b: F.conv2d(
                F.interpolate(x, scale_factor=2.0, mode="nearest-exact"), w, b, padding=1),
            lambda x=x, w=w, b=b, w4=w4: upsample_conv3x3(x, w, b, w4), ">=1.5x, lower peak",
        )  # fmt: skip
        del x

    # whole decodes: stock vs both patches, and VAE Tiling without vs with them. The fp32
    # reference uses the same bf16-rounded weights in fp32, through VAE Tiling (exact).
    def whole(name, module, latent, target, budget=None):
        weights = models.random_state_dict(module, 0, bf16)
        vae = comfy.sd.VAE(sd=weights, dtype=bf16)
        patched = TextureUpsample.execute(FusedNormPatch.execute(vae).result[0]).result[0]

        def run(v):
            if budget is None:
                return lambda: nodes.VAEDecode().decode(v, {"samples": latent})[0]
            return lambda: tiled_decode(v, latent, 0, budget)

        compare(name, run(vae), run(patched), target, repeats=3)
        stock, ours = run(vae)().float(), run(patched)().float()
        del vae, patched
        mm.unload_all_models()
        mm.soft_empty_cache()
        vae32 = comfy.sd.VAE(sd={k: v.float() for k, v in weights.items()}, dtype=torch.float32)
        ref = tiled_decode(vae32, latent).float().reshape(stock.shape)
        rows[-1].update(
            max_abs_vs_stock=round((ours - stock).abs().max().item(), 5),
            stock_max_abs_vs_fp32=round((stock - ref).abs().max().item(), 5),
            ours_max_abs_vs_fp32=round((ours - ref).abs().max().item(), 5),
        )
        del vae32
        mm.unload_all_models()
        mm.soft_empty_cache()

    h = a.decode_size // 8
    z = torch.randn((1, 16, 1, h, h), generator=torch.Generator().manual_seed(0))
    qwen = models.qwen_vae_module()
    whole(f"Qwen VAE decode {a.decode_size}^2, VAEDecode", qwen, z, ">=1.4x, <=2/255")
    whole(f"Qwen VAE decode {a.decode_size}^2, VAE Tiling 3.5 GiB", qwen, z, "faster", 3.5)
    h = a.flux_size // 8
    z = torch.randn((1, 16, h, h), generator=torch.Generator().manual_seed(0))
    whole(f"Flux-arch VAE decode {a.flux_size}^2, VAEDecode", models.sd_vae_module(16), z, ">=1.3x")

    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  bf16")
    cols = ["stock_ms", "ours_ms", "speedup", "stock_peak_gib", "ours_peak_gib", "max_rel_err"]
    print(f"{'case':48}" + "".join(f"{c:>15}" for c in cols) + "  target")
    for r in rows:
        extra = f"  floor {r['floor_ms']} ms ({r['x_floor']}x)" if "floor_ms" in r else ""
        if "ours_max_abs_vs_fp32" in r:
            extra = (f"  |d| vs stock {r['max_abs_vs_stock']}, vs fp32: stock "
                     f"{r['stock_max_abs_vs_fp32']}, ours {r['ours_max_abs_vs_fp32']}")  # fmt: skip
        print(f"{r['case']:48}" + "".join(f"{r[c]:>15}" for c in cols) + "  "
              + r.get("target", "") + extra)  # fmt: skip
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "rows": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
