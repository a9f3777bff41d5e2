"""Random full-size models and timing helpers (no downloads), and the table of
`python -m qwen_turbo bench`. Call after ComfyUI is importable."""

import contextlib
import json
import sys

import torch

# A narrow Qwen-Image DiT (CPU demonstration, tests): 4 heads of 32, text width 64.
NARROW = dict(
    attention_head_dim=32, num_attention_heads=4, joint_attention_dim=64, axes_dims_rope=(4, 14, 14)
)


def random_state_dict(module: torch.nn.Module, seed: int, dtype=torch.float32, device="cpu"):
    """Weights with unit-variance activations: W ~ N(0, 1/fan_in), norm gains ~ N(1, 0.1),
    biases ~ N(0, 0.05). `module` may live on the meta device."""
    g = torch.Generator(device).manual_seed(seed)
    sd = {}
    for name, p in module.state_dict(keep_vars=True).items():
        t = torch.randn(p.shape, generator=g, device=device)
        if p.ndim > 1:
            t = t / p[0].numel() ** 0.5
        elif name.endswith(("gamma", "weight")):  # 1-D weights are norm gains
            t = 1.0 + 0.1 * t
        else:
            t = 0.05 * t
        sd[name] = t.to(dtype).contiguous()
    return sd


@contextlib.contextmanager
def weights_at_construction():
    """ComfyUI's layers made with their weights, whose shapes random_state_dict reads: with
    dynamic VRAM on (v0.33), its Linear and Conv make a weight only when they load one."""
    memory = sys.modules.get("comfy.memory_management")
    lazy = getattr(memory, "aimdo_enabled", False)
    if lazy:
        memory.aimdo_enabled = False
    try:
        yield
    finally:
        if lazy:
            memory.aimdo_enabled = True


def qwen_dit_state_dict(layers: int, device: str, dtype=torch.bfloat16, **config):
    """A random Qwen-Image DiT (full width unless `config` says otherwise), ComfyUI key names."""
    import comfy.ops
    from comfy.ldm.qwen_image.model import QwenImageTransformer2DModel

    with weights_at_construction():
        m = QwenImageTransformer2DModel(
            num_layers=layers, device="meta", operations=comfy.ops.disable_weight_init, **config
        )
    return random_state_dict(m, seed=0, dtype=dtype, device=device)


def repackaged_fp8(sd: dict) -> dict:
    """`sd` in the layout of Comfy-Org's repackaged fp8_e4m3fn files, on the host: every
    matrix in float8_e4m3fn, vectors as they are."""
    return {k: (t.to(torch.float8_e4m3fn) if t.ndim > 1 else t).cpu() for k, t in sd.items()}


def random_lora(sd: dict, rank: int = 64) -> dict:
    """A LoRA (bf16, ComfyUI's lora_up/lora_down names) on every linear of the DiT's blocks,
    as the Lightning LoRA is."""
    lora, g = {}, torch.Generator().manual_seed(1)
    for k, t in sd.items():
        if t.ndim == 2 and k.startswith("transformer_blocks."):
            key = "diffusion_model." + k[: -len(".weight")]
            up = torch.randn(t.shape[0], rank, generator=g) * 0.02
            lora[key + ".lora_up.weight"] = up.to(torch.bfloat16)
            down = torch.randn(rank, t.shape[1], generator=g) / t.shape[1] ** 0.5
            lora[key + ".lora_down.weight"] = down.to(torch.bfloat16)
    return lora


def qwen_vae_module():
    """The Qwen-Image VAE: ComfyUI's Wan 2.1 VAE at full width (dim 96, z 16), on meta."""
    from comfy.ldm.wan.vae import WanVAE

    with torch.device("meta"), weights_at_construction():
        return WanVAE(dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                      attn_scales=[], temperal_downsample=[False, True, True])  # fmt: skip


def qwen_vae(device: str):
    """ComfyUI's VAE object for a random full-width Qwen-Image (Wan 2.1) VAE."""
    import comfy.sd

    return comfy.sd.VAE(sd=random_state_dict(qwen_vae_module(), seed=0, device=device))


def forward_fn(patcher, size: int | tuple[int, int], tokens: int = 256):
    """A closure running one forward through BaseModel.apply_model, as samplers call it, at
    `size` (a side, or width and height)."""
    w, h = (size, size) if isinstance(size, int) else size
    device = patcher.load_device
    g = torch.Generator(device).manual_seed(1)
    width = patcher.model.diffusion_model.txt_in.weight.shape[1]
    x = torch.randn((1, 16, 1, h // 8, w // 8), device=device, generator=g)
    ctx = torch.randn((1, tokens, width), device=device, generator=g)
    sigma = torch.tensor([0.6], device=device)
    opts = dict(patcher.model_options.get("transformer_options", {}), wrappers=patcher.wrappers)

    def run():
        with torch.inference_mode():
            return patcher.model.apply_model(x, sigma, c_crossattn=ctx, transformer_options=opts)

    return run


# Dense peaks, TFLOP/s (bf16, fp8), by the name torch gives the GPU (NVIDIA's data sheets).
PEAKS = {
    "H100 80GB HBM3": (989.4, 1978.9),  # SXM
    "H100 PCIe": (756.5, 1513.0),
    "H100 NVL": (835.5, 1671.0),
    "H200": (989.4, 1978.9),
}


def peaks(gpu: str) -> tuple[float, float] | None:
    """(bf16, fp8) dense TFLOP/s of the GPU named `gpu`, or None where not listed."""
    return next((v for k, v in PEAKS.items() if k in gpu), None)


def forward_flops(layers: int, width: int, height: int, text_tokens: int = 256,
                  dim: int = 3072) -> tuple[float, float]:  # fmt: skip
    """(GEMM, attention) FLOPs of one Qwen-Image DiT forward, counted from the shapes: per
    block and token, QKV, output and MLP (4x) projections of both streams, 24·dim² in all;
    joint attention over image and text tokens, 4·tokens²·dim. The embeddings, modulation
    and final layer (under 1%) are left out."""
    tokens = (width // 16) * (height // 16) + text_tokens
    return layers * 24.0 * tokens * dim**2, layers * 4.0 * tokens**2 * dim


def timed(fn, repeats: int = 3, warmups: int = 1):
    """(median ms, last result) after `warmups` calls; CUDA events on the GPU."""
    for _ in range(warmups):
        fn()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            out = fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            import time

            t0 = time.perf_counter()
            out = fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2], out


def graph_timed(fn, repeats: int = 3):
    """(median ms, output) of replaying `fn` captured in one CUDA graph: the GPU's time for it,
    without the host's launch cost. CUDA only."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # lazy setup (plans, autotuning) happens outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    times = []
    for _ in range(repeats):
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    out = out.clone()
    del graph
    return sorted(times)[len(times) // 2], out


def rel_l2(a, b) -> float:
    """Relative L2 error of a against b, in float32."""
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def bench_rows(size: int, layers: int) -> list[dict]:
    """The bench table: DiT forward (stock vs pack) and VAE decode (stock vs pack)."""
    import comfy.model_management as mm
    import comfy.sd
    import torch

    from ..kernels.fp8_linear import fp8_gemm_reason
    from ..nodes.vae_patches import FusedNormPatch, TextureUpsample
    from ..nodes.vae_tiling import VAEDecodeTiled
    from ..runtime.dit import loader
    from ..runtime.dit.config import read_config

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    config = {} if cuda else NARROW
    sd = qwen_dit_state_dict(layers, device, **config)
    rows = []
    weights = "bf16" if not cuda or fp8_gemm_reason(torch.device(device)) else "fp8_e4m3fn_fast"
    if cuda:
        stock = comfy.sd.load_diffusion_model_state_dict(dict(sd))
    else:  # UNETLoader cannot load the narrow width: the stock block, unfused
        stock = loader.build(dict(sd), read_config(sd), "bf16")
    mm.load_models_gpu([stock])
    ms_stock, ref = timed(forward_fn(stock, size))
    del stock
    mm.unload_all_models()
    for attention in ("sdpa", "fp8") if cuda else ("sdpa",):
        pack = loader.build(dict(sd), read_config(sd), weights)
        loader.add_fused_blocks(pack)
        loader.set_attention(pack, attention)
        mm.load_models_gpu([pack])
        ms_pack, out = timed(forward_fn(pack, size))
        what = ", the bundled workflows' path" if attention == "fp8" else ""
        rows.append({"what": f"DiT forward, {layers} layers", "stock_ms": ms_stock,
                     "pack_ms": ms_pack, "pack": f"Optimized Loader {weights}, fused, "
                     f"{attention}{what}", "rel_l2": rel_l2(out, ref)})  # fmt: skip
        del pack, out
        mm.unload_all_models()
    del sd

    vae = qwen_vae(device)
    latent = torch.randn(
        (1, 16, 1, size // 8, size // 8), generator=torch.Generator().manual_seed(2)
    )

    def stock_decode():
        with torch.inference_mode():
            return vae.decode(latent)

    patched = TextureUpsample.execute(FusedNormPatch.execute(vae).result[0]).result[0]

    def pack_decode():
        with torch.inference_mode():
            return VAEDecodeTiled.execute({"samples": latent}, patched).result[0]

    results = {}
    for name, fn in (("stock", stock_decode), ("pack", pack_decode)):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        results[name] = (
            timed(fn, repeats=2),
            torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        )
    (ms_s, img_s), gib_s = results["stock"]
    (ms_p, img_p), gib_p = results["pack"]
    rows.append({"what": "VAE decode", "stock_ms": ms_s, "pack_ms": ms_p,
                 "pack": "Fused GroupNorm Patch + Texture Upsample + VAE Tiling",
                 "rel_l2": rel_l2(img_p, img_s),
                 "stock_peak_gib": gib_s, "pack_peak_gib": gib_p})  # fmt: skip
    return rows


def bench(size: int, layers: int) -> None:
    import torch

    if size % 16:
        raise SystemExit(
            f"size {size} is not a multiple of 16; use {size // 16 * 16} or {size // 16 * 16 + 16}"
        )
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        scaling = f" (a full forward takes about 60/{layers} times the DiT figures)"
        print(f"{name}, torch {torch.__version__}: {size}x{size}, DiT with {layers} of 60 layers"
              + ("" if layers == 60 else scaling))  # fmt: skip
    else:
        size, layers = min(size, 256), min(layers, 2)
        print("No CUDA GPU: running a small CPU demonstration instead (a narrow 2-layer DiT and "
              f"the real VAE at {size}x{size}); the speed-ups need a GPU.")  # fmt: skip
    rows = bench_rows(size, layers)
    print(f"{'':28} {'stock ms':>10} {'pack ms':>10} {'speed-up':>9} {'rel L2':>9}  pack path")
    for r in rows:
        print(f"{r['what']:28} {r['stock_ms']:10.1f} {r['pack_ms']:10.1f} "
              f"{r['stock_ms'] / r['pack_ms']:8.2f}x {r['rel_l2']:9.2e}  {r['pack']}")  # fmt: skip
    print(json.dumps({"size": size, "layers": layers, "torch": torch.__version__, "rows": rows}))
