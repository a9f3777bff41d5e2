"""The Optimized Loader's fidelity probe on random full-size weights with outlier channels.

Random Qwen-Image weights (60 layers unless --layers), and the same with outlier channels in
the attention of --blocks (tests/harness/models.with_outliers: q and k gains 100 times the
median on 4 channels). For each, the bundled workflows' model (fp8_e4m3fn_fast, fused blocks,
fp8_cudnn) is probed (`probe.measure`, timed at its first call in the process), and one forward
at --size is compared (relative L2) with stock's (UNETLoader, bf16 weights): all lossy, with
the probe's blocks kept on the safe path, and fp8 storage with bf16 compute (sdpa). Then the
cached result is applied to a fresh load, timed. Prints a table and JSON on the last line.

    python benchmarks/fidelity_probe.py --blocks 7 31 52
"""

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: tests.harness
from dit_forward import load  # noqa: E402

from tests.harness.comfyui import setup_comfy  # noqa: E402

LOSSY, BF16_COMPUTE, STOCK = "fp8_fast fused fp8_cudnn", "fp8 fused sdpa", "stock bf16"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=60, help="60 = the real model")
    p.add_argument("--blocks", type=int, nargs="+", default=[7, 31, 52])
    p.add_argument("--size", type=int, default=1328)
    p.add_argument("--threshold", type=float)
    a = p.parse_args()
    setup_comfy(highvram=True)
    import comfy.model_management as mm
    import folder_paths
    import torch

    from qwen_turbo.cli import bench
    from qwen_turbo.runtime.dit import loader, probe
    from qwen_turbo.runtime.dit.attention import OVERRIDE
    from tests.harness.models import with_outliers

    if not torch.cuda.is_available():
        sys.exit("This benchmark needs a CUDA GPU.")
    threshold = a.threshold or loader.DEFAULT_THRESHOLD
    folder_paths.set_user_directory(tempfile.mkdtemp())  # the probe's cache, empty
    device = torch.device("cuda")
    clean = bench.qwen_dit_state_dict(a.layers, "cuda")
    injected = with_outliers(clean, a.blocks)

    def loaded(variant, sd):
        patcher = load(variant, sd)
        mm.load_models_gpu([patcher], force_full_load=True)
        return patcher

    def forward(patcher):
        return bench.forward_fn(patcher, a.size)().float()

    def unload():
        mm.unload_all_models()
        gc.collect()
        torch.cuda.empty_cache()

    rows = []
    for name, sd in (("random", clean), ("outliers", injected)):
        model = loaded(STOCK, sd)
        ref = forward(model)
        del model
        unload()
        model = loaded(BF16_COMPUTE, sd)
        bf16 = bench.rel_l2(forward(model), ref)
        del model
        unload()
        model = loaded(LOSSY, sd)
        override = model.model_options["transformer_options"][OVERRIDE]
        lossy = bench.rel_l2(forward(model), ref)
        torch.cuda.synchronize()
        result = probe.measure(model.model, device, override, threshold)
        mixed = bench.rel_l2(forward(model), ref)
        path = Path(tempfile.mkdtemp()) / f"{name}.safetensors"
        path.write_bytes((2).to_bytes(8, "little") + b"{}")
        key = probe.cache_key(path, LOSSY)
        loader.fidelity_cache().put(key, result)
        del model, override
        unload()
        fresh = load(LOSSY, sd)
        t0 = time.perf_counter()
        cached = loader.fidelity_cache().get(key)
        probe.apply(fresh.model, cached.kept)
        cached_s = time.perf_counter() - t0
        assert fresh.model.qwen_turbo.safe_blocks == set(result.kept)
        del fresh
        unload()
        rows.append({
            "weights": name, "injected": a.blocks if name == "outliers" else [],
            "kept": result.kept, "probe_s": round(result.seconds, 3),
            "cached_s": round(cached_s, 4), "summary": result.summary(),
            "block_error_median": round(sorted(result.errors)[len(result.errors) // 2], 4),
            "block_error_max_not_injected": round(max(
                e for i, e in enumerate(result.errors)
                if name == "random" or i not in a.blocks), 4),
            "forward_rel_l2": {"bf16 compute": bf16, "lossy": lossy, "probed": mixed},
            "probed_vs_bf16_compute": round(mixed / bf16, 3),
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, {a.layers} layers, "
          f"{a.size}², threshold {threshold}, outliers in blocks {a.blocks}")  # fmt: skip
    print(f"{'weights':9} {'kept':>16} {'probe s':>8} {'cached s':>9} {'bf16 comp':>10} "
          f"{'lossy':>8} {'probed':>8} {'probed/bf16':>11}")  # fmt: skip
    for r in rows:
        e = r["forward_rel_l2"]
        print(f"{r['weights']:9} {str(r['kept']):>16} {r['probe_s']:8.3f} {r['cached_s']:9.4f} "
              f"{e['bf16 compute']:10.4f} {e['lossy']:8.4f} {e['probed']:8.4f} "
              f"{r['probed_vs_bf16_compute']:11.3f}")  # fmt: skip
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": a.layers}
    print(json.dumps({**meta, "size": a.size, "threshold": threshold, "rows": rows}))


if __name__ == "__main__":
    main()
