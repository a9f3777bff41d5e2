"""8-bit attention (the Triton int8/fp8 kernel, cuDNN's fp8 SDPA) against cuDNN and flash SDPA.

(1, 24, L, 128) bfloat16 with L = (size / 16)^2 + 256, the image tokens of a size^2 image
plus 256 text tokens: 7145 at 1328^2, 24905 at 2512^2; (B, L, H, D) in memory, the layout
the DiT's projections write. "cudnn fp8" rows need the cuDNN frontend and a Hopper GPU.
Each result is checked against
float32 SDPA first (relative L2), then timed with CUDA events (median of --repeats after a
warm-up). "quant+attn" is the whole `attention_8bit` call; "attn only" the kernel on
already-quantized inputs; "quant only" the statistics and quantization passes. An outlier
input (3 channels x100 in q, 3 others x100 in k) and a huge one (q, k 1e3, v 1e4) check
accuracy and finiteness. Prints the GPU, torch version, a table, and JSON on the last line.

    python benchmarks/attention_8bit.py [--sizes 1328 2512] [--repeats 20]
"""

import argparse
import json
import statistics
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vae_decode import load_pack  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1328, 2512], help="image side")
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--repeats", type=int, default=20)
    a = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("benchmarks/attention_8bit.py times CUDA kernels and needs a CUDA GPU; none found")
    load_pack()
    from qwen_turbo.kernels import attention_8bit as mod
    from qwen_turbo.kernels import attention_fp8 as fp8

    probe = torch.empty(1, 1, 1, 128, dtype=torch.bfloat16, device="cuda")
    reason = mod.attention_8bit_reason(probe)
    if reason is not None:
        sys.exit(f"the 8-bit attention kernel cannot run here: {reason}")
    with torch.inference_mode():
        run(a, torch, mod, fp8)


def run(a, torch, mod, fp8):
    import triton
    from torch.nn import functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def timed(fn):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(a.repeats):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e))
        return statistics.median(times)

    def sdpa(backend):
        def call(q, k, v):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v)

        return call

    def rel(out, exact):
        return ((out.float() - exact).norm() / exact.norm()).item()

    def exact(q, k, v):  # float32 SDPA (memory-efficient backend), the accuracy reference
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float())

    def one_size(size, rows, configs):
        seq = (size // 16) ** 2 + 256
        flops = mod.attention_flops(1, a.heads, seq, seq, 128)
        joint = (1, seq, a.heads, 128)
        q, k, v = (torch.randn(joint, generator=g, device="cuda", dtype=torch.bfloat16)
                   .transpose(1, 2) for _ in range(3))  # fmt: skip
        ref = exact(q, k, v)
        out = torch.empty_like(q)
        variants = {
            "cudnn sdpa": (sdpa(SDPBackend.CUDNN_ATTENTION), None),
            "flash sdpa": (sdpa(SDPBackend.FLASH_ATTENTION), None),
        }
        for pv_fp8, tag in ((True, "fp8 pv"), (False, "bf16 pv")):
            qnt = mod._quantize(q, k, v, pv_fp8)
            variants[f"8bit {tag} quant+attn"] = (partial(mod.attention_8bit, pv_fp8=pv_fp8), None)
            variants[f"8bit {tag} attn only"] = (None, partial(mod._attend, qnt, out))
            variants[f"8bit {tag} quant only"] = (None, partial(mod._quantize, q, k, v, pv_fp8))
        reason = fp8.attention_fp8_reason(q, k, v)
        plan = fp8._plan(q, k) if reason is None else reason
        if isinstance(plan, str):
            print(f"no cudnn fp8 rows: {plan}")
        else:
            qkv8, scales, _ = fp8.quantize(q, k, v)
            o8 = torch.empty(joint, dtype=fp8.FP8, device="cuda")
            variants["cudnn fp8 quant+attn"] = (fp8.attention_fp8, None)
            variants["cudnn fp8 attn only"] = (None, partial(plan.run, *qkv8, scales, o8))
            variants["cudnn fp8 quant only"] = (None, partial(fp8.quantize, q, k, v))
        for name, (call, bare) in variants.items():
            err = rel(call(q, k, v), ref) if call else None
            ms = timed(bare if bare else partial(call, q, k, v))
            row = {"L": seq, "case": name, "ms": round(ms, 3),
                   "rel_l2": None if err is None else round(err, 5)}  # fmt: skip
            if "quant only" not in name:
                row["tflops"] = round(flops / ms / 1e9, 1)
            rows.append(row)
            if name.startswith("8bit") and name.endswith("quant+attn"):
                configs[f"{name} L={seq}"] = str(mod._attention_8bit_tuned.best_config)
        del ref
        # Hard inputs: outlier channels (logits kept O(1)), and values near float16's range.
        qo, ko = q.clone(), k.clone()
        qo[..., :3] *= 100
        ko[..., 5:8] *= 100
        for name, (qi, ki, vi) in {
            "outliers (q ch 0-2, k ch 5-7 x100)": (qo / 10, ko / 10, v),
            "huge (q, k x1e3, v x1e4)": (q * 1e3, k * 1e3, v * 1e4),
        }.items():
            cudnn = sdpa(SDPBackend.CUDNN_ATTENTION)(qi, ki, vi)
            ref = exact(qi, ki, vi)
            for case, fn in (("8bit fp8 pv", mod.attention_8bit), ("cudnn fp8", fp8.attention_fp8)):
                out8 = fn(qi, ki, vi)
                rows.append({"L": seq, "case": f"{case} {name}",
                             "finite": bool(out8.isfinite().all()),
                             "rel_l2": round(rel(out8, ref), 5),
                             "cudnn_rel_l2": round(rel(cudnn, ref), 5)})  # fmt: skip
            del ref

    rows, configs = [], {}
    g = torch.Generator(device="cuda").manual_seed(0)
    for size in a.sizes:
        one_size(size, rows, configs)
        torch.cuda.empty_cache()

    gpu = torch.cuda.get_device_name()
    print(f"GPU: {gpu}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"{'L':>6}  {'case':<50} {'ms':>8} {'TFLOP/s':>8} {'rel L2':>8}  other")
    for r in rows:
        other = {k: v for k, v in r.items() if k not in ("L", "case", "ms", "tflops", "rel_l2")}
        ms = f"{r['ms']:8.3f}" if "ms" in r else f"{'':8}"
        tf = f"{r['tflops']:8.1f}" if "tflops" in r else f"{'':8}"
        err = f"{r['rel_l2']:8.5f}" if r.get("rel_l2") is not None else f"{'':8}"
        print(f"{r['L']:>6}  {r['case']:<50} {ms} {tf} {err}  {other or ''}")
    for name, config in configs.items():
        print(f"autotuned {name}: {config}")
    print(json.dumps({"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
                      "configs": configs, "rows": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
