"""Attention from maintained libraries against the pack's cuDNN fp8 attention, at the DiT's
shapes: q, k, v of (B, L, 24, 128) in bf16, no mask. For each length and variant: the first
call (compiles, plan builds), the median of 20 calls timed with CUDA events, TFLOP/s
(4·B·L²·H·D) and the relative L2 against float32 SDPA.

Variants: the pack's `attention_fp8` (quantize, cuDNN's fp8 graph, as the fused blocks call
it), torch's SDPA in bf16 (the backend torch picks), FlashAttention-4 (`flash-attn-4`, CuTe
DSL) in bf16 (its fp8 forward takes only compute capability 10.x), FlashAttention-3 (its op,
as the pack calls it) in bf16 and fp8, and flashinfer's FA3 fp8 prefill (`flashinfer-python`,
Hopper); the fp8 ones on the pack's quantized q, k, v less v's channel means, which are added
back to their bf16 output. The fp8 kernels are also timed alone, on inputs quantized
beforehand ("kernel" rows, no error given). A variant whose library is missing or
declines the GPU prints why. Prints a table, then one JSON line.

    python benchmarks/attention_libraries.py --lengths 7145 24905
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: tests.harness
import tests.harness  # noqa: E402,F401  registers the pack as qwen_turbo
from qwen_turbo.kernels import attention_fp8 as attention_fp8_module  # noqa: E402
from qwen_turbo.kernels.attention_fp8 import FP8, _plan, attention_fp8, quantize  # noqa: E402

HEADS, DIM = 24, 128


def fa4():
    """FlashAttention-4's forward over (B, L, H, D) tensors, or why it cannot run."""
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as e:
        return f"flash-attn-4 not importable: {type(e).__name__}: {e}"

    def run(q, k, v):
        out = flash_attn_func(q, k, v)
        return out[0] if isinstance(out, tuple) else out

    return run


def flashinfer_fa3():
    """flashinfer's FA3 fp8 prefill as `kernel(q8, k8, v8, scales)` over (B, L, H, D) fp8
    tensors and the pack's scales (per-tensor descales, given per head), or why it cannot run."""
    try:
        import flashinfer
    except Exception as e:
        return f"flashinfer not importable: {type(e).__name__}: {e}"

    def kernel(q8, k8, v8, scales):
        s = scales[:3, None].expand(3, q8.shape[2]).contiguous()
        return torch.stack([
            flashinfer.single_prefill_with_kv_cache(
                q8[i], k8[i], v8[i], scale_q=s[0], scale_k=s[1], scale_v=s[2],
                o_dtype=torch.bfloat16, backend="fa3")
            for i in range(q8.shape[0])
        ])  # fmt: skip

    return kernel


def flash_attn_3():
    """FlashAttention-3's forward op as the pack calls it (`attention_fp8.flash_attn_3`), as
    `run(q, k, v)` over (B, L, H, D) bf16 tensors, or why it cannot run."""
    if attention_fp8_module.flash_attn_3 is None:
        return f"flash-attn-3: {attention_fp8_module.FA3_MISSING}"

    def run(q, k, v):
        return attention_fp8_module.flash_attn_3(q, k, v, softmax_scale=DIM**-0.5, num_splits=1)[0]

    return run


def heads_first(*tensors):
    return [t.transpose(1, 2) for t in tensors]


def quantized(q, k, v):
    """The pack's quantize: (B, L, H, D) fp8 q, k, v less v's channel means, scales, means."""
    (q8, k8, v8), scales, v_mean = quantize(*heads_first(q, k, v))
    return heads_first(q8, k8, v8), scales, v_mean


def kernel_alone(kernel):
    """`kernel(q8, k8, v8, scales)` timed alone: inputs quantized at the first call."""
    inputs = {}

    def run(q, k, v):
        if q.data_ptr() not in inputs:
            inputs.clear()
            inputs[q.data_ptr()] = quantized(q, k, v)[:2]
        (q8, k8, v8), scales = inputs[q.data_ptr()]
        return kernel(q8, k8, v8, scales)

    run.unchecked = True
    return run


def cudnn_kernel(q8, k8, v8, scales):
    """cuDNN's fp8 graph alone, as `attention_fp8` runs it (fp8 O)."""
    plan = _plan(*heads_first(q8, k8))
    out = torch.empty_like(q8, dtype=FP8)
    plan.run(q8, k8, v8, scales, out)
    return out


def variants():
    """name -> a function of (B, L, H, D) q, k, v returning (B, L, H, D), or why not."""

    def pack(q, k, v):
        return attention_fp8(*heads_first(q, k, v), kernel="cudnn").transpose(1, 2)

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(*heads_first(q, k, v)).transpose(1, 2)

    found = {"pack fp8_cudnn": pack, "torch sdpa bf16": sdpa, "flash-attn-4 bf16": fa4(),
             "cudnn fp8 kernel": kernel_alone(cudnn_kernel)}  # fmt: skip
    fa3 = flash_attn_3()
    if isinstance(fa3, str):
        found |= {"flash-attn-3": fa3}
    else:

        def fa3_fp8(q8, k8, v8, scales):  # the pack's call
            return attention_fp8_module._flash_attn_3(*heads_first(q8, k8, v8), scales)

        found |= {"flash-attn-3 bf16": fa3, **fp8_rows("flash-attn-3 fp8", fa3_fp8)}
    fi = flashinfer_fa3()
    return found | (
        {"flashinfer fa3 fp8": fi} if isinstance(fi, str) else fp8_rows("flashinfer fa3 fp8", fi)
    )


def fp8_rows(name: str, kernel) -> dict:
    """A bf16-out fp8 `kernel` with the pack's passes around it (its quantize, then v's channel
    means added back), and alone."""

    def whole(q, k, v):
        (q8, k8, v8), scales, v_mean = quantized(q, k, v)
        return kernel(q8, k8, v8, scales) + v_mean.unsqueeze(1).to(torch.bfloat16)

    return {name: whole, f"{name} kernel": kernel_alone(kernel)}


def measure(fn, q, k, v, exact, repeats=20) -> dict:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn(q, k, v)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    rel = None if getattr(fn, "unchecked", False) else (out.double() - exact).norm() / exact.norm()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(q, k, v)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    ms = statistics.median(times)
    tflop = 4 * q.shape[0] * q.shape[1] * k.shape[1] * HEADS * DIM / 1e12
    return {"first_s": round(first, 3), "ms": round(ms, 3), "tflops": round(tflop / ms * 1e3, 1),
            "rel_l2": None if rel is None else float(f"{rel.item():.3e}")}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[7145, 24905])
    parser.add_argument("--batch", type=int, default=1, help="2: a CFG step's cond and uncond")
    args = parser.parse_args()
    rows = []
    for length in args.lengths:
        g = torch.Generator("cuda").manual_seed(length)
        q, k, v = (torch.randn(args.batch, length, HEADS, DIM, device="cuda", generator=g,
                               dtype=torch.bfloat16) for _ in range(3))  # fmt: skip
        exact = F.scaled_dot_product_attention(*heads_first(q.float(), k.float(), v.float()))
        exact = exact.transpose(1, 2).double()
        for name, fn in variants().items():
            row = {"batch": args.batch, "length": length, "variant": name}
            if isinstance(fn, str):
                row["error"] = fn
            else:
                try:
                    row |= measure(fn, q, k, v, exact)
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            rows.append(row)
            print(" ".join(f"{key}={value}" for key, value in row.items()), flush=True)
        del exact
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "rows": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
