"""ComfyUI's SaveImage against Save Image (fast PNG), in one process, on the same pictures:
seconds per picture (the median of --repeats), file size, and whether the decoded pixels
match. Pictures: "noise" (what random weights decode to) and "smooth" (gradients with mild
noise, as photographs compress); a table, then one JSON line.

    python benchmarks/save_image.py --sizes 2512 1328
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: tests.harness
from tests.harness.comfyui import setup_comfy  # noqa: E402


def picture(kind: str, size: int) -> torch.Tensor:
    g = np.random.default_rng(size)
    if kind == "noise":
        return torch.from_numpy(g.random((1, size, size, 3), dtype=np.float32))
    y, x = np.mgrid[0:size, 0:size].astype(np.float32)
    base = np.sin(x / 90) * 0.25 + np.cos(y / 130) * 0.2 + 0.5
    rgb = np.stack([base, base * 0.8, 1 - base], -1) + g.normal(0, 0.02, (size, size, 3))
    return torch.from_numpy(np.clip(rgb, 0, 1).astype(np.float32))[None]


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sizes", type=int, nargs="+", default=[2512, 1328])
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    setup_comfy()
    import folder_paths
    from PIL import Image

    import nodes
    from qwen_turbo.nodes import save_image
    from qwen_turbo.runtime import png

    out = Path(tempfile.mkdtemp())
    folder_paths.output_directory = str(out)
    prompt, extra = {"1": {"class_type": "KSampler", "inputs": {}}}, {"workflow": {"nodes": []}}
    rows = []
    for size in a.sizes:
        for kind in ("noise", "smooth"):
            images = picture(kind, size)
            stock = nodes.SaveImage().save_images
            s = timed(lambda: stock(images, "stock", prompt, extra), a.repeats)  # noqa: B023
            f = timed(lambda: save_image.save(images, "fast", prompt, extra), a.repeats)  # noqa: B023
            a_file, b_file = (sorted(out.glob(f"{n}_*.png"))[-1] for n in ("stock", "fast"))
            same = np.array_equal(np.asarray(Image.open(a_file)), np.asarray(Image.open(b_file)))
            mb = [round(p.stat().st_size / 1e6, 2) for p in (a_file, b_file)]
            rows.append({"size": size, "picture": kind, "stock_s": round(s, 3),
                         "fast_s": round(f, 3), "speedup": round(s / f, 2),
                         "stock_mb": mb[0], "fast_mb": mb[1], "same_pixels": same})  # fmt: skip
    print(f"{'size':>5} {'picture':8} {'SaveImage':>10} {'fast':>8} {'speedup':>8} {'MB':>12} same")
    for r in rows:
        mb = f"{r['stock_mb']}/{r['fast_mb']}"
        print(f"{r['size']:>5} {r['picture']:8} {r['stock_s']:>9.3f}s {r['fast_s']:>7.3f}s "
              f"{r['speedup']:>7.2f}x {mb:>12} {r['same_pixels']}")  # fmt: skip
    info = {"cpus": os.cpu_count(), "threads": png.THREADS, "torch": torch.__version__}
    print(json.dumps({**info, "repeats": a.repeats, "rows": rows}))


if __name__ == "__main__":
    main()
