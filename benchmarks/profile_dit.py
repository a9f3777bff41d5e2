"""Where one Qwen-Image DiT forward spends its GPU time: stock vs the Optimized Loader.

Random full-width weights (--layers of 60), one forward at --size under torch.profiler;
prints the kernels grouped into attention / GEMM / other with their share, the top kernels,
and JSON on the last line.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from vae_decode import setup_comfy  # noqa: E402


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
    a = p.parse_args()
    setup_comfy(highvram=True)
    import comfy.model_management as mm
    import comfy.sd
    import torch
    from torch.profiler import ProfilerActivity, profile

    from qwen_turbo.runtime import qwen_dit, qwen_loader
    from qwen_turbo.runtime.bench import forward_fn, qwen_dit_state_dict

    sd = qwen_dit_state_dict(a.layers, "cuda")
    result = {}
    for variant in ("stock", "bf16 fused", "fp8_fast fused"):
        if variant == "stock":
            patcher = comfy.sd.load_diffusion_model_state_dict(dict(sd))
        else:
            weights = "bf16" if variant.startswith("bf16") else "fp8_e4m3fn_fast"
            patcher = qwen_loader.build(dict(sd), qwen_dit.read_config(sd), weights)
            qwen_loader.add_fused_blocks(patcher)
        mm.load_models_gpu([patcher], force_full_load=True)
        run = forward_fn(patcher, a.size)
        run()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        kernels = {}
        for e in prof.key_averages():
            if e.device_time_total > 0 and e.device_type == torch.autograd.DeviceType.CUDA:
                kernels[e.key] = (e.device_time_total / 1e3, e.count)
        total = sum(ms for ms, _ in kernels.values())
        groups = {}
        for name, (ms, _) in kernels.items():
            groups[group(name)] = groups.get(group(name), 0) + ms
        print(f"\n{variant}: {total:.1f} ms of kernels, {a.layers} layers at {a.size}^2")
        for g, ms in sorted(groups.items(), key=lambda x: -x[1]):
            print(f"  {g:10} {ms:8.1f} ms {100 * ms / total:5.1f}%")
        top = sorted(kernels.items(), key=lambda x: -x[1][0])[: a.top]
        for name, (ms, n) in top:
            print(f"  {ms:8.2f} ms {n:5d}x  {name[:110]}")
        result[variant] = {"total_ms": total, "groups": groups,
                           "top": [[n[:110], ms, c] for n, (ms, c) in top]}  # fmt: skip
        del patcher
        mm.unload_all_models()
        torch.cuda.empty_cache()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
