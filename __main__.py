"""python -m qwen_turbo {bench,run}: see the speed-up on this GPU, or run a bundled workflow
headless. Run from the folder holding the pack (ComfyUI/custom_nodes)."""

import argparse
import json
import sys
from pathlib import Path


def workflow_problem(path: Path) -> str | None:
    """Why `path` cannot be run as a workflow (one line), or None when it is UI-format JSON."""
    if not path.is_file():
        return "no such file" if not path.exists() else "not a file"
    try:
        ui = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        return "not JSON (a binary file); a workflow is ComfyUI's UI-format .json"
    except json.JSONDecodeError as e:
        return f"not JSON ({e.msg} at line {e.lineno}, column {e.colno})"
    except OSError as e:
        return e.strerror
    if (
        isinstance(ui, dict)
        and ui
        and all(isinstance(n, dict) and "class_type" in n for n in ui.values())
    ):
        return "an API-format prompt; run takes the UI format (Workflow -> Save, not Export (API))"
    if not isinstance(ui, dict) or not isinstance(ui.get("nodes"), list):
        return 'JSON, but not a ComfyUI workflow (no "nodes" list)'
    return None


def bench_rows(size: int, layers: int) -> list[dict]:
    """The bench table: DiT forward (stock vs pack) and VAE decode (stock vs pack)."""
    import comfy.model_management as mm
    import comfy.sd
    import torch

    from .kernels.fp8_linear import fp8_gemm_reason
    from .nodes.vae_patches import FusedNormPatch, TextureUpsample
    from .nodes.vae_tiling import VAEDecodeTiled
    from .runtime.bench import NARROW, forward_fn, qwen_dit_state_dict, qwen_vae, rel_l2, timed
    from .runtime.dit import loader
    from .runtime.dit.config import read_config

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    config = {} if cuda else NARROW
    sd = qwen_dit_state_dict(layers, device, **config)
    rows = []
    weights = "bf16" if not cuda or fp8_gemm_reason(torch.device(device)) else "fp8_e4m3fn_fast"
    if cuda:
        stock = comfy.sd.load_diffusion_model_state_dict(dict(sd))
    else:  # UNETLoader cannot load the narrow width: the stock block, unfused
        stock = loader.build(dict(sd), read_config(sd), "bf16")
    mm.load_models_gpu([stock])
    ms_stock, ref = timed(forward_fn(stock, size))
    del stock
    mm.unload_all_models()
    pack = loader.build(dict(sd), read_config(sd), weights)
    loader.add_fused_blocks(pack)
    loader.set_attention(pack, "sdpa")
    mm.load_models_gpu([pack])
    ms_pack, out = timed(forward_fn(pack, size))
    rows.append({"what": f"DiT forward, {layers} layers", "stock_ms": ms_stock,
                 "pack_ms": ms_pack, "pack": f"Optimized Loader {weights}, fused, sdpa",
                 "rel_l2": rel_l2(out, ref)})  # fmt: skip
    del pack, sd
    mm.unload_all_models()

    vae = qwen_vae(device)
    latent = torch.randn(
        (1, 16, 1, size // 8, size // 8), generator=torch.Generator().manual_seed(2)
    )

    def stock_decode():
        with torch.inference_mode():
            return vae.decode(latent)

    patched = TextureUpsample.execute(FusedNormPatch.execute(vae).result[0]).result[0]

    def pack_decode():
        with torch.inference_mode():
            return VAEDecodeTiled.execute({"samples": latent}, patched).result[0]

    results = {}
    for name, fn in (("stock", stock_decode), ("pack", pack_decode)):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        results[name] = (
            timed(fn, repeats=2),
            torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        )
    (ms_s, img_s), gib_s = results["stock"]
    (ms_p, img_p), gib_p = results["pack"]
    rows.append({"what": "VAE decode", "stock_ms": ms_s, "pack_ms": ms_p,
                 "pack": "Fused GroupNorm Patch + Texture Upsample + VAE Tiling",
                 "rel_l2": rel_l2(img_p, img_s),
                 "stock_peak_gib": gib_s, "pack_peak_gib": gib_p})  # fmt: skip
    return rows


def bench(size: int, layers: int) -> None:
    import torch

    if size % 16:
        raise SystemExit(
            f"size {size} is not a multiple of 16; use {size // 16 * 16} or {size // 16 * 16 + 16}"
        )
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        scaling = f" (a full forward takes about 60/{layers} times the DiT figures)"
        print(f"{name}, torch {torch.__version__}: {size}x{size}, DiT with {layers} of 60 layers"
              + ("" if layers == 60 else scaling))  # fmt: skip
    else:
        size, layers = min(size, 256), min(layers, 2)
        print("No CUDA GPU: running a small CPU demonstration instead (a narrow 2-layer DiT and "
              f"the real VAE at {size}x{size}); the speed-ups need a GPU.")  # fmt: skip
    rows = bench_rows(size, layers)
    print(f"{'':28} {'stock ms':>10} {'pack ms':>10} {'speed-up':>9} {'rel L2':>9}  pack path")
    for r in rows:
        print(f"{r['what']:28} {r['stock_ms']:10.1f} {r['pack_ms']:10.1f} "
              f"{r['stock_ms'] / r['pack_ms']:8.2f}x {r['rel_l2']:9.2e}  {r['pack']}")  # fmt: skip
    print(json.dumps({"size": size, "layers": layers, "torch": torch.__version__, "rows": rows}))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m qwen_turbo", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser(
        "bench",
        help="stock vs pack on random full-size weights: one DiT forward and one VAE decode",
        description="Random full-size Qwen-Image weights (nothing to download): one DiT forward "
        "and one VAE decode, stock ComfyUI and this pack side by side. Without CUDA it runs a "
        "small CPU demonstration.",
    )
    b.add_argument("--size", type=int, default=1328, help="image side in pixels (multiple of 16)")
    b.add_argument("--layers", type=int, default=60,
                   help="DiT layers (60 = the real model; fewer fit smaller GPUs)")  # fmt: skip
    r = sub.add_parser(
        "run",
        help="run a workflow (UI JSON) through ComfyUI's executor and save the PNG",
        description="Runs a workflow through ComfyUI's executor with a progress bar, saves the "
        "images and prints per-node timings. Missing model files are listed with where to "
        "put them and where to download them.",
    )
    r.add_argument("workflow", type=Path, help="e.g. workflows/qwen_image_2512_turbo_2512px.json")
    r.add_argument("--prompt", help="replaces the positive prompt")
    r.add_argument("--seed", type=int, help="replaces every sampler's seed")
    r.add_argument("--out", type=Path, help="output folder (default: ComfyUI's output/)")
    a = p.parse_args(argv)

    if a.command == "run" and (problem := workflow_problem(a.workflow)):
        print(f"{p.prog} run: error: {a.workflow}: {problem}", file=sys.stderr)
        return 2

    from .runtime import headless

    if a.command == "run":
        headless.start_comfyui(a.out)
        return headless.run(a.workflow, a.prompt, a.seed)
    headless.start_comfyui()
    bench(a.size, a.layers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
