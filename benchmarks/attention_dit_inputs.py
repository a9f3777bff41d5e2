"""Attention backends on the DiT's own attention inputs: error against float32 SDPA.

Runs one forward of the Optimized Loader's bf16 fused model (random full-size weights, as
`dit_forward.py`) at --size, keeps the q, k, v of the chosen layers, and runs each backend
on them: cuDNN bf16 SDPA, cuDNN fp8 with and without v smoothing.
Also prints how much of v's norm is its per-channel mean over the tokens, and the spread of
the scores (first 2048 queries). Prints a table and JSON on the last line.

    python benchmarks/attention_dit_inputs.py [--size 2512] [--layers-kept 0 1 20 40 59]
"""

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: tests.harness
from tests.harness.comfyui import setup_comfy  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=2512)
    p.add_argument("--layers-kept", type=int, nargs="+", default=[0, 1, 20, 40, 59])
    a = p.parse_args()
    setup_comfy(highvram=True)
    import comfy.model_management as mm
    import torch
    import torch.nn.functional as F

    from qwen_turbo.cli.bench import forward_fn, qwen_dit_state_dict
    from qwen_turbo.kernels.attention_fp8 import attention_fp8
    from qwen_turbo.runtime.dit import config, loader
    from qwen_turbo.runtime.dit.attention import attention_override

    if not torch.cuda.is_available():
        sys.exit("This benchmark needs a CUDA GPU.")
    sd = qwen_dit_state_dict(60, "cuda")
    patcher = loader.build(dict(sd), config.read_config(sd), "bf16")
    loader.add_fused_blocks(patcher)
    sdpa, kept, layer = attention_override("sdpa"), {}, [0]

    def keep(func, *args, **kwargs):  # the fused block calls it with (B, H, L, D) views
        if layer[0] in a.layers_kept:
            kept[layer[0]] = [t.clone() for t in args[:3]]
        layer[0] += 1
        return sdpa(func, *args, **kwargs)

    patcher.model_options["transformer_options"]["optimized_attention_override"] = keep
    mm.load_models_gpu([patcher], force_full_load=True)
    forward_fn(patcher, a.size)()
    del patcher, sd
    mm.unload_all_models()
    torch.cuda.empty_cache()

    backends = {
        "cudnn bf16": F.scaled_dot_product_attention,
        "cudnn fp8": lambda q, k, v: attention_fp8(q, k, v, kernel="cudnn"),
        "cudnn fp8, v not smoothed": lambda q, k, v: attention_fp8(
            q, k, v, smooth_v=False, kernel="cudnn"
        ),
    }
    rows = []
    with torch.inference_mode():
        for i, (q, k, v) in kept.items():
            exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
            s = q[:, :, :2048].float() @ k.float().mT / math.sqrt(q.shape[-1])
            v_mean = v.float().mean(2, keepdim=True)
            row = {"layer": i, "L": q.shape[2], "score_std": round(s.std().item(), 3),
                   "v_mean_share": round((v_mean.norm() * math.sqrt(v.shape[2])
                                          / v.float().norm()).item(), 3)}  # fmt: skip
            del s
            for name, fn in backends.items():
                out = fn(q, k, v).float()
                row[name] = round(((out - exact).norm() / exact.norm()).item(), 5)
            rows.append(row)
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, {a.size}^2")
    print(f"{'layer':>5} {'score std':>9} {'v mean':>7} " + " ".join(f"{n:>26}" for n in backends))
    for r in rows:
        errs = " ".join(f"{r[n]:26.2e}" for n in backends)
        print(f"{r['layer']:5d} {r['score_std']:9.3f} {r['v_mean_share']:7.3f} {errs}")
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "size": a.size, "rows": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
