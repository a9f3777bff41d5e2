"""KSampler against the CUDA Graph Sampler on Qwen-Image with random full-size weights.

Both run in one process on the same MODEL, seed and conditioning (256 text tokens). The first
graph-sampler run includes the capture; "steady" is the median of --repeats later runs. The
GPU-busy share is the union of kernel intervals over one run's wall time (torch.profiler).
Prints the GPU, torch version, a table, and JSON on the last line.

    COMFYUI_PATH=~/comfy/ComfyUI python benchmarks/sampler.py --sizes 512 1024 --steps 4

With --cache easycache|lazycache, ComfyUI's caching node at its defaults goes in front of both
samplers: each size then also gives the uncached KSampler and graph-sampler times (the graph
gain without caching), the steps skipped, and how far the cached latent and its decoded image
(random Qwen-Image VAE) are from the uncached ones.
"""

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: tests.harness
from tests.harness.comfyui import setup_comfy  # noqa: E402

CAPTURE = ["model forward", "whole CFG step", "off"]
LUMINA2 = dict(
    patch_size=2,
    in_channels=16,
    dim=2304,
    cap_feat_dim=2304,
    n_heads=24,
    n_kv_heads=8,
    qk_norm=True,
    axes_dims=[32, 32, 32],
    axes_lens=[300, 512, 512],
)


def build_model(arch: str, layers: int):
    """A random DiT built on the GPU, then loaded through ComfyUI's detection.

    qwen: Qwen-Image (60 layers in the real model). lumina2: Lumina-2 / Next-DiT, the
    family of NewBie (26 layers).
    """
    import comfy.ops
    import comfy.sd
    import torch
    from comfy_extras.nodes_model_advanced import ModelSamplingAuraFlow

    g = torch.Generator(device="cuda").manual_seed(0)
    ops = comfy.ops.disable_weight_init
    with torch.device("cuda"):
        if arch == "qwen":
            from comfy.ldm.qwen_image.model import QwenImageTransformer2DModel

            m = QwenImageTransformer2DModel(num_layers=layers, dtype=torch.bfloat16, operations=ops)
        else:
            from comfy.ldm.lumina.model import NextDiT

            m = NextDiT(**LUMINA2, n_layers=layers, dtype=torch.bfloat16, operations=ops)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.ndim > 1:
                p.normal_(0, p[0].numel() ** -0.5, generator=g)
            elif name.endswith("weight"):
                p.normal_(1, 0.1, generator=g)
            else:
                p.normal_(0, 0.02, generator=g)
    sd = {k: v.to("cpu") for k, v in m.state_dict().items()}
    del m
    torch.cuda.empty_cache()
    model = comfy.sd.load_diffusion_model_state_dict(sd)
    return ModelSamplingAuraFlow().patch_aura(model, 3.1)[0]


def random_lora(model, blocks: int = 4):
    """A clone carrying small random weight deltas, applied as ComfyUI applies LoRA diffs."""
    import torch

    g = torch.Generator().manual_seed(3)
    sd = model.model_state_dict()
    keys = [k for k in sd if ".img_mlp." in k and k.endswith("weight")][: 2 * blocks]
    lora = model.clone()
    lora.add_patches({k: (torch.randn(sd[k].shape, generator=g) * 1e-3,) for k in keys})
    return lora


def gpu_busy(fn) -> dict[str, float]:
    """Share of time with at least one kernel running: over fn's whole wall time ("whole"),
    over the span from its first kernel to its last ("kernel_span"), and, with graphs, from
    the first graph launch to the last kernel ("from_first_replay": the step loop without the
    sampler's set-up and the capture)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - t0) * 1e6
    events = prof.events()
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    launches = [e.time_range.start for e in events if e.name == "cudaGraphLaunch"]

    def busy_after(start):
        busy, end = 0.0, start
        for s, e in spans:
            if e > end:
                busy += e - max(s, end)
                end = e
        return busy, end - start

    busy, _ = busy_after(float("-inf"))
    last = max(e for _, e in spans)
    out = {"whole": busy / wall_us, "kernel_span": busy / (last - spans[0][0])}
    if launches:
        busy, span = busy_after(min(launches))
        out["from_first_replay"] = busy / span
    return {k: round(v, 4) for k, v in out.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 1328])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--cfg", type=float, default=1.0)
    p.add_argument("--layers", type=int, default=60, help="60 = the real model")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--busy-size", type=int, default=1024)
    p.add_argument("--arch", choices=["qwen", "lumina2"], default="qwen")
    p.add_argument(
        "--soak",
        type=int,
        default=0,
        help="N back-to-back runs alternating "
        "512/768 and a LoRA, printing memory after each (instead of the table)",
    )
    p.add_argument("--soak-capture", choices=CAPTURE, default="model forward")
    p.add_argument("--modes", nargs="+", choices=CAPTURE[:2], default=["model forward"],
                   help="capture modes to compare with KSampler")  # fmt: skip
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model first, as TorchCompileModel does")  # fmt: skip
    p.add_argument("--soak-lora", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--cache", choices=["none", "easycache", "lazycache"], default="none",
                   help="ComfyUI's caching node, at its defaults, in front of both")  # fmt: skip
    p.add_argument("--reuse-threshold", type=float, default=None,
                   help="the caching node's reuse_threshold instead of its default")  # fmt: skip
    a = p.parse_args()
    setup_comfy()
    import torch

    with torch.inference_mode():
        run(a)


def run(a):
    import comfy.model_management as mm
    import torch

    from qwen_turbo.nodes.graph_sampler import CUDAGraphSampler
    from qwen_turbo.runtime import memory
    from qwen_turbo.runtime.graphs.cache import cache_for

    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    model = build_model(a.arch, a.layers)
    if a.compile:
        from comfy_api.torch_helpers import set_torch_compile_wrapper

        set_torch_compile_wrapper(model, backend="inductor")
    width = 3584 if a.arch == "qwen" else 2304
    g = torch.Generator().manual_seed(1)
    extra = {} if a.arch == "qwen" else {"attention_mask": torch.ones((1, 256), dtype=torch.long)}
    pos = [[torch.randn((1, 256, width), generator=g), dict(extra)]]
    neg = [[torch.randn((1, 256, width), generator=g), dict(extra)]]
    rows = []

    def sampler(capture, latent, m=model, positive=pos):
        def go():
            out = CUDAGraphSampler.execute(
                m, 0, a.steps, a.cfg, "euler", "simple", positive, neg, latent, 1.0, capture
            )
            return out.result[0]["samples"]

        return go

    if a.soak:
        lora = random_lora(model)
        for i in range(a.soak):
            size = (512, 768)[i % 2]
            m = (model, lora)[(i // 2) % 2] if a.soak_lora else model
            latent = {"samples": torch.zeros((1, 16, size // 8, size // 8))}
            sampler(a.soak_capture, latent, m)()
            torch.cuda.synchronize()
            stats = cache_for(model.model).stats
            rows.append({"run": i, "size": size, "lora": m is lora,
                         "allocated_gib": round(torch.cuda.memory_allocated() / 2**30, 3),
                         "reserved_gib": round(torch.cuda.memory_reserved() / 2**30, 3),
                         "graphs": len(cache_for(model.model).graphs),
                         "captured": stats.captured, "replayed": stats.replayed,
                         "eager": stats.eager})  # fmt: skip
            print(rows[-1])
        print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                          "arch": a.arch, "layers": a.layers, "capture": a.soak_capture,
                          "lora": a.soak_lora, "soak": rows}))  # fmt: skip
        return

    def timed(fn):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        return out, (time.perf_counter() - t) * 1e3

    def rel_l2(out, ref):
        return float(f"{((out.float() - ref.float()).norm() / ref.float().norm()).item():.3g}")

    other = [[torch.randn((1, 256, width), generator=g), dict(extra)]]  # a second prompt
    if a.cache != "none":
        caching(a, model, (pos, neg), timed, rel_l2)
        return
    for size in a.sizes:
        latent = {"samples": torch.zeros((1, 16, size // 8, size // 8))}
        stock = sampler("off", latent)
        first, _ = timed(stock)  # warm-up: loads the model, cuDNN/cuBLAS heuristics
        ref, _ = timed(stock)
        t_stock = statistics.median(timed(stock)[1] for _ in range(a.repeats))
        ref_other = sampler("off", latent, positive=other)()
        # KSampler's first run in a process against its later ones (on ComfyUI v0.33 they
        # differ: its first call takes other kernels)
        row = {"size": size, "ksampler_ms": round(t_stock, 1),
               "ksampler_first_rel_l2": rel_l2(first, ref)}  # fmt: skip
        if size == a.busy_size:
            row["ksampler_gpu_busy"] = gpu_busy(stock)
        for mode in a.modes:
            stats = cache_for(model.model).stats  # new after free_graphs
            ours, before = sampler(mode, latent), copy.deepcopy(stats)
            out, first = timed(ours)  # includes the capture
            t_ours = statistics.median(timed(ours)[1] for _ in range(a.repeats))
            # the same graphs with another prompt of the same shape
            err_other = rel_l2(sampler(mode, latent, positive=other)(), ref_other)
            r = {"graph_first_ms": round(first, 1), "graph_ms": round(t_ours, 1),
                 "speedup": round(t_stock / t_ours, 3), "rel_l2": rel_l2(out, ref),
                 "rel_l2_other_prompt": err_other,
                 "captured": stats.captured - before.captured,
                 "replayed": stats.replayed - before.replayed,
                 "eager": stats.eager - before.eager,
                 "reasons": {k: n for k, n in stats.reasons.items()
                             if n > before.reasons.get(k, 0)}}  # fmt: skip
            if size == a.busy_size:
                r["gpu_busy"] = gpu_busy(ours)
            row[mode] = r
        rows.append(row)
        memory.release(model.model)
        mm.soft_empty_cache()

    alloc = torch.cuda.get_allocator_backend()
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  allocator {alloc}  "
          f"{a.arch} {a.layers} layers, bf16, {a.steps} steps, cfg {a.cfg}"
          f"{', compiled' if a.compile else ''}")  # fmt: skip
    print(f"{'size':>6} {'capture':>15} {'KSampler ms':>12} {'graph 1st ms':>13} {'graph ms':>9} "
          f"{'speedup':>8} {'rel L2':>9} {'busy K/G':>16}")  # fmt: skip
    for r in rows:
        for mode in a.modes:
            m = r[mode]
            k_busy, g_busy = r.get("ksampler_gpu_busy", {}), m.get("gpu_busy", {})
            busy = f"{k_busy.get('kernel_span', 0):.3f}/{g_busy.get('from_first_replay', 0):.3f}"
            print(f"{r['size']:>6} {mode:>15} {r['ksampler_ms']:>12} {m['graph_first_ms']:>13} "
                  f"{m['graph_ms']:>9} {m['speedup']:>8} {m['rel_l2']:>9} {busy:>16}")  # fmt: skip
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "allocator": alloc}
    meta.update(layers=a.layers, steps=a.steps, cfg=a.cfg, compile=a.compile,
                env=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))  # fmt: skip
    print(json.dumps({**meta, "rows": rows}))


def with_caching_node(model, name: str, reuse_threshold: float | None = None):
    """`model` through ComfyUI's EasyCache or LazyCache node, at the node's defaults but for
    `reuse_threshold` where given."""
    from comfy_extras import nodes_easycache

    node = {"easycache": nodes_easycache.EasyCacheNode, "lazycache": nodes_easycache.LazyCacheNode}
    node = node[name]
    inputs = {i.id: i.default for i in node.define_schema().inputs if i.id != "model"}
    if reuse_threshold is not None:
        inputs["reuse_threshold"] = reuse_threshold
    return node.execute(model, **inputs).result[0]


def caching(a, model, cond, timed, rel_l2):
    """Per size: KSampler and the graph sampler (--modes[0]) without and with the caching
    node, each timed on its second run; the badge's status of the cached graph run; the cached
    latents' and images' distance from the uncached ones."""
    import comfy.model_management as mm
    import comfy.sd
    import torch

    import nodes
    from qwen_turbo.runtime import memory
    from qwen_turbo.runtime.graphs.capture import CudaGraphs
    from qwen_turbo.runtime.graphs.sampling import sample_with_graphs
    from tests.harness import models

    cached = with_caching_node(model, a.cache, a.reuse_threshold)
    vae = comfy.sd.VAE(sd=models.random_state_dict(models.qwen_vae_module(), 0),
                       dtype=torch.bfloat16)  # fmt: skip
    whole_step = a.modes[0] == "whole CFG step"
    rows = []
    for size in a.sizes:
        latent = {"samples": torch.zeros((1, 16, size // 8, size // 8))}
        args = (0, a.steps, a.cfg, "euler", "simple", *cond, latent)
        row, outs, status = {"size": size}, {}, {}

        def run(m, tag, who, args=args, status=status):
            if who == "ksampler":
                return nodes.common_ksampler(m, *args)[0]["samples"]
            latent, status[tag] = sample_with_graphs(m, whole_step, CudaGraphs, *args)
            return latent["samples"]

        for m, tag in ((model, "plain"), (cached, a.cache)):
            for who in ("ksampler", "graph"):
                _, t_first = timed(lambda m=m, tag=tag, who=who: run(m, tag, who))
                outs[tag, who], t = timed(lambda m=m, tag=tag, who=who: run(m, tag, who))
                row[f"{tag}_{who}_first_ms"] = round(t_first, 1)
                row[f"{tag}_{who}_ms"] = round(t, 1)
        row["status"] = status[a.cache]
        for tag in ("plain", a.cache):
            row[f"{tag}_graph_gain"] = round(row[f"{tag}_ksampler_ms"] / row[f"{tag}_graph_ms"], 3)
            row[f"{tag}_graph_rel_l2"] = rel_l2(outs[tag, "graph"], outs[tag, "ksampler"])
        row["cached_latent_rel_l2"] = rel_l2(outs[a.cache, "ksampler"], outs["plain", "ksampler"])
        images = [vae.decode(outs[tag, "ksampler"]) for tag in ("plain", a.cache)]
        row["cached_image_rel_l2"] = rel_l2(images[1], images[0])
        rows.append(row)
        print(row, flush=True)
        memory.release(model.model)
        mm.soft_empty_cache()
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  {a.layers} layers, "
          f"{a.steps} steps, cfg {a.cfg}, {a.cache} (reuse_threshold "
          f"{a.reuse_threshold or 'default'}), graphs: {a.modes[0]}")  # fmt: skip
    print(f"{'size':>6} {'KSampler':>10} {'graphs':>8} {'gain':>6} {'KS+cache':>10} "
          f"{'graphs+cache':>13} {'gain':>6}  status")  # fmt: skip
    for r in rows:
        c = a.cache
        print(f"{r['size']:>6} {r['plain_ksampler_ms']:>10} {r['plain_graph_ms']:>8} "
              f"{r['plain_graph_gain']:>6} {r[f'{c}_ksampler_ms']:>10} "
              f"{r[f'{c}_graph_ms']:>13} {r[f'{c}_graph_gain']:>6}  {r['status']}")  # fmt: skip
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cache": a.cache,
            "reuse_threshold": a.reuse_threshold, "mode": a.modes[0], "layers": a.layers,
            "steps": a.steps, "cfg": a.cfg}  # fmt: skip
    print(json.dumps({**meta, "rows": rows}))


if __name__ == "__main__":
    main()
