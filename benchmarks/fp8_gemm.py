"""The DiT's fp8 GEMMs at their real shapes: the pack's fp8 Linear against torch's other GEMMs.

Rows M: the image tokens at 1328² (6,889) and 2512² (24,649); (K, N): q, k, v and the output
projection (3072, 3072), the three of q, k, v as one (3072, 9216), the MLP's (3072, 12288)
and (12288, 3072). Variants, each timed alone (CUDA events, median of --repeats after a
warm-up), with the kernels that ran (torch.profiler):
- `fp8_linear`: the row quantization, then `torch._scaled_mm` with the per-row and per-column
  scales (`rowwise` alone); `fp8_linear_unscaled`: the row quantization, then the GEMM with
  one scale per operand (`tensorwise` alone), the Optimized Loader's path in its fused
  blocks, whose next kernel applies the row scales and the bias as it reads the output;
- `quantize_rows`: that quantization alone; `bf16`: F.linear in bf16.
TFLOP/s and the share of the GPU's dense peaks (cli/bench.PEAKS). Prints a table and JSON.

    python benchmarks/fp8_gemm.py
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: tests.harness
from tests.harness import pack  # noqa: E402

SHAPES = {"qkv one": (3072, 3072), "qkv fused": (3072, 9216), "fc1": (3072, 12288),
          "fc2": (12288, 3072)}  # fmt: skip
ROWS = {"1328": 83 * 83, "2512": 157 * 157}


def timed(fn, repeats: int) -> float:
    import torch

    fn()
    times = []
    for _ in range(repeats):
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def kernel_of(fn) -> str:
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.key for e in prof.key_averages() if e.device_type.name == "CUDA"]
    return " + ".join(n[:60] for n in names)


def variants(m: int, k: int, n: int) -> dict:
    """name -> a call of that GEMM on fresh random (m, k) activations and an (n, k) weight."""
    import torch
    import torch.nn.functional as F

    from qwen_turbo.kernels.fp8_linear import (
        FP8,
        fp8_linear,
        fp8_linear_unscaled,
        quantize_rows,
    )

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") / k**0.5).to(FP8)
    scale_w = torch.full((1, n), 0.02, device="cuda")
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    xq, sx = quantize_rows(x)
    one = torch.ones((), device="cuda")
    x8, wb, bf16 = x.to(FP8), w.to(torch.bfloat16), torch.bfloat16
    return {
        "fp8_linear": lambda: fp8_linear(x, w, scale_w, bias),
        "fp8_linear_unscaled": lambda: fp8_linear_unscaled(x, w, scale_w[:, :1], bias),
        "quantize_rows": lambda: quantize_rows(x),
        "rowwise": lambda: torch._scaled_mm(xq, w.t(), scale_a=sx, scale_b=scale_w, bias=bias,
                                            out_dtype=bf16),
        "tensorwise": lambda: torch._scaled_mm(x8, w.t(), scale_a=one, scale_b=one, bias=bias,
                                               out_dtype=bf16),
        "bf16": lambda: F.linear(x, wb, bias),
    }  # fmt: skip


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=20)
    a = p.parse_args()
    pack.register()
    import torch

    from qwen_turbo.cli.bench import peaks

    gpu = torch.cuda.get_device_name()
    bf16_peak, fp8_peak = peaks(gpu) or (float("nan"), float("nan"))
    rows, table = [], []
    for size, m in ROWS.items():
        for shape, (k, n) in SHAPES.items():
            for name, fn in variants(m, k, n).items():
                ms = timed(fn, a.repeats)
                # the quantization alone has no GEMM FLOPs: its rows give 0
                tflops = 0.0 if name == "quantize_rows" else 2 * m * k * n / ms / 1e9
                share = tflops / (bf16_peak if name == "bf16" else fp8_peak)
                kernel = kernel_of(fn)
                rows.append({"size": size, "shape": shape, "m": m, "k": k, "n": n,
                             "variant": name, "ms": round(ms, 4), "tflops": round(tflops, 1),
                             "of_peak": round(share, 3), "kernel": kernel})  # fmt: skip
                table.append(f"| {size} | {shape} ({m}×{k}×{n}) | {name} | {ms:.3f} | "
                             f"{tflops:.0f} | {100 * share:.1f}% | {kernel[:70]} |")  # fmt: skip
        torch.cuda.empty_cache()
    print(f"{gpu}, torch {torch.__version__}")
    print("| size | GEMM (M×K×N) | variant | ms | TFLOP/s | of peak | kernels |")
    print("|---|---|---|---:|---:|---:|---|")
    print("\n".join(table))
    print(json.dumps({"gpu": gpu, "torch": torch.__version__, "rows": rows}))


if __name__ == "__main__":
    main()
