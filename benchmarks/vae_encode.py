"""VAE encode: ComfyUI's VAEEncode against VAE Tiling Encode, in one process.

Random full-size weights of the Qwen-Image (Wan 2.1) VAE, or of the SD AutoencoderKL, in
bf16 on the GPU; a smooth random picture per size. Each case is timed with CUDA events (the
median of --repeats after a warm-up that loads the VAE); its peak, from one more run, is the
most memory allocated above what was resident before it (the VAE's weights). Errors are the
relative L2 of the latent against ComfyUI's VAEEncode of the same weights in fp32 (where
that runs out of memory, VAE Tiling Encode in fp32, which is exact; the JSON says which).
Prints the GPU, torch version, a table, and JSON on the last line.

    COMFYUI_PATH=~/comfy/ComfyUI python benchmarks/vae_encode.py --sizes 2512 1328 --budgets 4 0
"""

import argparse
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: tests.harness
from tests.harness.comfyui import setup_comfy  # noqa: E402

STOCK_TILED = "Ran out of memory when regular VAE encoding"  # ComfyUI's own tiled fallback


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", choices=["qwen", "sd"], default="qwen")
    p.add_argument("--sizes", type=int, nargs="+", default=[2512, 1328], help="image sides")
    p.add_argument("--budgets", type=float, nargs="+", default=[4.0, 0.0], help="GiB, 0 = auto")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    setup_comfy()
    import torch

    with torch.inference_mode():  # as ComfyUI's executor runs nodes
        run(a)


class _Watch(logging.Handler):
    """Counts ComfyUI's warnings that its VAEEncode fell back to its own tiled encode."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record):
        self.count += STOCK_TILED in record.getMessage()


def _picture(size: int, seed: int = 0):
    """A smooth random picture (1, size, size, 3) in 0..1: noise at 1/16 size, upsampled."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand((1, 3, size // 16 + 1, size // 16 + 1), generator=g)
    px = F.interpolate(coarse, scale_factor=16, mode="bicubic")[..., :size, :size]
    return (px + 0.05 * torch.randn(px.shape, generator=g)).clamp(0, 1).movedim(1, -1)


def run(a):
    import comfy.model_management as mm
    import comfy.sd
    import torch

    import nodes
    from qwen_turbo.cli.bench import rel_l2, timed
    from qwen_turbo.nodes.vae_patches import FusedNormPatch
    from qwen_turbo.runtime.vae.tiled import encode
    from tests.harness import models

    cuda = torch.cuda.is_available()
    dev_name = torch.cuda.get_device_name() if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    module = models.qwen_vae_module() if a.arch == "qwen" else models.sd_vae_module()
    weights = models.random_state_dict(module, 0)
    watch = _Watch()
    logging.getLogger().addHandler(watch)

    def measure(fn):
        """(output, median ms, peak GiB above what was resident, whether stock fell back)."""
        fell_back = watch.count
        ms, out = timed(fn, a.repeats)  # after a warm-up, which loads the VAE
        peak = 0.0
        if cuda:  # one more run for its peak
            mm.soft_empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fn()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        return out, ms, peak, watch.count > fell_back

    rows = []
    for size in a.sizes:
        px = _picture(size)
        vae = comfy.sd.VAE(sd=weights, dtype=dtype)
        patched = FusedNormPatch.execute(vae).result[0]

        def stock(v, px=px):
            return nodes.VAEEncode().encode(v, px)[0]["samples"]

        def tiled(v, budget, px=px):
            return encode(v, px, 0, budget)

        cases = [
            ("ComfyUI VAEEncode", lambda v=vae: stock(v)),
            ("ComfyUI VAEEncode + Fused GroupNorm Patch", lambda v=patched: stock(v)),
        ]
        for b in a.budgets:
            label = (
                f"VAE Tiling Encode, budget {b:g} GiB" if b else "VAE Tiling Encode, auto budget"
            )
            cases.append((label, lambda v=vae, b=b: tiled(v, b)))
            cases.append((label + " + patch", lambda v=patched, b=b: tiled(v, b)))
        outs = {}
        for label, fn in cases:
            row = {"size": size, "case": label}
            try:
                out, ms, peak, fell_back = measure(fn)
            except torch.OutOfMemoryError:
                rows.append({**row, "error": "out of memory"})
                mm.soft_empty_cache()
                continue
            outs[label] = out.float().cpu()
            row.update(ms=round(ms, 1), peak_gib=round(peak, 2))
            if fell_back:
                row["note"] = "ComfyUI fell back to its own tiled encode"
            rows.append(row)
            del out

        # the fp32 reference: the same weights in fp32
        del vae, patched
        mm.unload_all_models()
        mm.soft_empty_cache()
        vae32 = comfy.sd.VAE(sd=weights, dtype=torch.float32)
        try:
            ref, ref_kind = nodes.VAEEncode().encode(vae32, px)[0]["samples"], "ComfyUI VAEEncode"
        except torch.OutOfMemoryError:
            mm.soft_empty_cache()
            ref, ref_kind = encode(vae32, px), "VAE Tiling Encode"
        ref = ref.float().cpu()
        del vae32
        mm.unload_all_models()
        mm.soft_empty_cache()
        for r in rows:
            if r["size"] == size and "error" not in r:
                r["rel_l2_vs_fp32"] = float(f"{rel_l2(outs[r['case']], ref):.3g}")
                r["fp32_reference"] = ref_kind

    print(f"GPU: {dev_name}  torch {torch.__version__}  arch {a.arch}  {dtype}")
    print(f"{'size':>5} {'case':50} {'ms':>8} {'peak GiB':>9} {'rel L2 vs fp32':>15}")
    for r in rows:
        if "error" in r:
            print(f"{r['size']:5} {r['case']:50} {r['error']}")
            continue
        print(f"{r['size']:5} {r['case']:50} {r['ms']:8.1f} {r['peak_gib']:9.2f} "
              f"{r['rel_l2_vs_fp32']:15.3g} {r.get('note', '')}")  # fmt: skip
    meta = {"gpu": dev_name, "torch": torch.__version__, "arch": a.arch, "dtype": str(dtype)}
    print(json.dumps({**meta, "rows": rows}))


if __name__ == "__main__":
    main()
