"""Where one Qwen-Image DiT forward spends its GPU time: stock vs the Optimized Loader.

Random full-width weights (--layers of 60), one forward at --size under torch.profiler for
each of --variants (dit_forward.py's names); prints the kernels grouped into attention / GEMM /
other with their share, the top kernels, the forward's wall time (how busy the GPU was), and
JSON on the last line.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: tests.harness
from dit_forward import VARIANTS, load  # noqa: E402

from tests.harness.comfyui import setup_comfy  # noqa: E402


def group(name: str) -> str:
    n = name.lower()
    if any(k in n for k in ("fmha", "flash", "attention", "cudnn", "sdpa")):
        return "attention"
    if any(k in n for k in ("gemm", "sm90_xmma", "cutlass", "nvjet", "matmul", "scaled_mm")):
        return "gemm"
    return "other"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=2512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS),
                   default=["stock bf16", "bf16 fused sdpa", "fp8_fast fused sdpa"])  # fmt: skip
    a = p.parse_args()
    setup_comfy(highvram=True)
    import comfy.model_management as mm
    import torch
    from torch.profiler import ProfilerActivity, profile

    from qwen_turbo.cli.bench import forward_fn, qwen_dit_state_dict

    sd = qwen_dit_state_dict(a.layers, "cuda")
    result = {}
    for variant in a.variants:
        patcher = load(variant, sd)
        mm.load_models_gpu([patcher], force_full_load=True)
        run = forward_fn(patcher, a.size)
        run()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            run()
            end.record()
            torch.cuda.synchronize()
        wall = start.elapsed_time(end)
        kernels = {}
        for e in prof.key_averages():
            if e.device_time_total > 0 and e.device_type == torch.autograd.DeviceType.CUDA:
                kernels[e.key] = (e.device_time_total / 1e3, e.count)
        total = sum(ms for ms, _ in kernels.values())
        groups = {}
        for name, (ms, _) in kernels.items():
            groups[group(name)] = groups.get(group(name), 0) + ms
        print(
            f"\n{variant}: {total:.1f} ms of kernels in {wall:.1f} ms "
            f"({100 * total / wall:.0f}% busy), {a.layers} layers at {a.size}^2"
        )
        for g, ms in sorted(groups.items(), key=lambda x: -x[1]):
            print(f"  {g:10} {ms:8.1f} ms {100 * ms / total:5.1f}%")
        top = sorted(kernels.items(), key=lambda x: -x[1][0])[: a.top]
        for name, (ms, n) in top:
            print(f"  {ms:8.2f} ms {n:5d}x  {name[:110]}")
        result[variant] = {"total_ms": total, "wall_ms": wall, "groups": groups,
                           "top": [[n[:110], ms, c] for n, (ms, c) in top]}  # fmt: skip
        del patcher
        mm.unload_all_models()
        torch.cuda.empty_cache()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
