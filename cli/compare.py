"""`python -m qwen_turbo compare`: a workflow run with stock nodes and with the pack's, same
seed and prompt, so a team can judge the pack on its own weights and GPU: both pictures, an
amplified difference, PSNR, SSIM and each side's time. Call `headless.start_comfyui` first."""

import json
from pathlib import Path

import numpy as np

from . import headless
from .stock import SAVES, STOCK, stock_graph

AMPLIFY = 8  # the difference picture: |stock - pack| times this
FOLDER = "qwen_turbo_compare"  # under ComfyUI's output folder


def _tensors(a: np.ndarray, b: np.ndarray):
    """Two 8-bit pictures (H, W, C) as float64 (1, C, H, W) tensors."""
    import torch

    return (torch.tensor(x, dtype=torch.float64).permute(2, 0, 1)[None] for x in (a, b))


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """Peak signal-to-noise ratio of two 8-bit pictures (H, W, C), dB (inf where identical):
    kornia's, which ComfyUI's requirements list."""
    from kornia.metrics import psnr as kornia_psnr

    return float(kornia_psnr(*_tensors(a, b), max_val=255.0))


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    """Structural similarity of two 8-bit pictures (H, W, C), kornia's (Wang et al. 2004, an
    11x11 Gaussian window of sigma 1.5), averaged over pixels and channels."""
    from kornia.metrics import ssim as kornia_ssim

    return float(kornia_ssim(*_tensors(a, b), window_size=11, max_val=255.0).mean())


def difference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a - b| times AMPLIFY, as an 8-bit picture."""
    d = np.abs(a.astype(np.int16) - b.astype(np.int16)) * AMPLIFY
    return np.clip(d, 0, 255).astype(np.uint8)


def _run(api: dict, side: str):
    """One side from nothing loaded: (saved files by save node, seconds), or None on an error."""
    import comfy.model_management as mm

    for node in api.values():
        if node["class_type"] in SAVES:
            node["inputs"]["filename_prefix"] = f"{FOLDER}/{side}"
    mm.unload_all_models()
    mm.soft_empty_cache()
    executor, _, total = headless.execute(api)
    if executor is None or not executor.success:
        return None
    return headless.saved_images(executor), total


def compare(workflow: Path, prompt: str | None, seed: int | None) -> int:
    """Run both sides and report; 0 on success, 2 for missing files, no pack node or no kornia,
    1 on an error in a run."""
    try:
        import kornia.metrics  # noqa: F401
    except ImportError:
        print("compare needs kornia for PSNR and SSIM (ComfyUI's requirements list it): "
              "pip install kornia", flush=True)  # fmt: skip
        return 2
    api = headless.load_workflow(workflow)
    if api is None:
        return 2
    return compare_graph(api, workflow.name, prompt, seed)


def compare_graph(api: dict, name: str, prompt: str | None, seed: int | None) -> int:
    """`compare` on the API-format graph of workflow `name`."""
    from PIL import Image

    if not any(n["class_type"] in STOCK for n in api.values()):
        print(f"{name} has no Qwen Turbo node to compare with stock", flush=True)
        return 2
    headless.set_prompt_and_seed(api, prompt, seed)
    runs = {}
    for side, graph in (("stock", stock_graph(api)), ("pack", api)):
        runs[side] = _run(graph, side)
        if runs[side] is None:
            print(f"compare: the {side} run failed (its error is above)", flush=True)
            return 1
    (stock, stock_s), (pack, pack_s) = runs["stock"], runs["pack"]
    rows = []
    for node, files in stock.items():
        for i, (a_path, b_path) in enumerate(zip(files, pack.get(node, []), strict=False)):
            a = np.asarray(Image.open(a_path).convert("RGB"))
            b = np.asarray(Image.open(b_path).convert("RGB"))
            if a.shape != b.shape:
                error = f"sizes {a.shape} / {b.shape}"
                rows.append({"node": node, "picture": i, "stock": str(a_path),
                             "pack": str(b_path), "error": error})  # fmt: skip
                continue
            diff = a_path.with_name(f"diff_{node}_{i}.png")
            Image.fromarray(difference(a, b)).save(diff)
            rows.append({"node": node, "picture": i, "psnr_db": round(psnr(a, b), 2),
                         "ssim": round(ssim(a, b), 4), "stock": str(a_path),
                         "pack": str(b_path), "difference": str(diff)})  # fmt: skip
    print(f"{'node':>6} {'picture':>7} {'PSNR dB':>8} {'SSIM':>7}  files (difference x{AMPLIFY})")
    for r in rows:
        figures = f"{r['psnr_db']:8.2f} {r['ssim']:7.4f}" if "ssim" in r else f"{r['error']:>16}"
        print(f"{r['node']:>6} {r['picture']:7} {figures}  {r['stock']}, {r['pack']}"
              + (f", {r['difference']}" if "difference" in r else ""))  # fmt: skip
    print(f"time, each from nothing loaded: stock {stock_s:.2f} s, pack {pack_s:.2f} s "
          f"({stock_s / pack_s:.2f}x)")  # fmt: skip
    print(json.dumps({"workflow": name, "stock_s": round(stock_s, 2),
                      "pack_s": round(pack_s, 2), "pictures": rows}))  # fmt: skip
    return 0
