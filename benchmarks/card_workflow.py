"""A bundled workflow through ComfyUI's executor on a simulated card: stock nodes and the pack's.

Both run in one process. A card of N GiB is simulated by filling the GPU until
`torch.cuda.mem_get_info` reports N - 1 GiB free (what a 24 GB card leaves a desktop user),
which is what ComfyUI and the pack read; `set_per_process_memory_fraction` would not show in
it. Random full-size weights are written as the files the workflow names, the DiT in the layout
of Comfy-Org's repackaged `qwen_image_2512_fp8_e4m3fn.safetensors` (every matrix in
float8_e4m3fn, vectors in bf16), or for Edit-2511 of its `fp8mixed` file (block matrices in fp8
with a scale each, the rest bf16, the `__index_timestep_zero__` marker); the LoRA is random at
rank 64 on every linear of the blocks. The text encoder is replaced by seeded random
conditioning (tests/testing_nodes), 256 tokens; for Edit, 256 (64 for the empty negative) plus
196 vision tokens per picture, the reference latents VAE-encoded inside that node as
TextEncodeQwenImageEditPlus does. `--text-encoder real` runs ComfyUI's CLIPLoader and text
encode nodes instead, on random weights in the layout of Comfy-Org's
`qwen_2.5_vl_7b_fp8_scaled.safetensors`. A NewBie-image workflow (DualCLIPLoader of type
"newbie") gets NewBie-image-Exp0.1's files instead: its NextDiT in bf16, Gemma 3 4B and Jina
CLIP v2 in bf16 (each with a small trained sentencepiece model), the Flux VAE; its test
conditioning is Gemma-wide (2560) with Jina's pooled vector (1024). LoadImage reads a random
2048x1536 PNG written into the input folder. `--ram N` leaves N GiB of host RAM available (a
ballast process holds the rest), as the card is simulated by filling the GPU.

"pack" is the bundled workflow as shipped. "stock" is the same graph with stock nodes:
UNETLoader (default dtype), KSampler, VAEDecode, VAEEncode, no VAE patches; "stock+fp8_fast"
(on request) the same with UNETLoader's fp8_e4m3fn_fast, stock's fastest. "pack+VAEDecode"
(on request) is the pack's graph with ComfyUI's VAEDecode in place of VAE Tiling,
"pack+KSampler" (on request) with KSampler in place of the CUDA Graph Sampler. Each runs
first with nothing loaded or captured (the files in the OS cache), then with a new sampler seed
(the conditioning and encodes cached, as in ComfyUI), then (`--new-prompts`) with a new prompt.
Each row gives the host memory: resident size at its peak, anonymous (not file-backed) at the
end, and page-locked. Prints a table and JSON on the last line.

    COMFYUI_PATH=~/comfy/ComfyUI-v0.33 python benchmarks/card_workflow.py --cards 24 16
    ... --workflow qwen_image_edit_2511_2512px --cards 24 0
    ... --cards 0 --batch 1 2 4 --size 1328   (peaks per batch against ComfyUI's estimate)
    ... --workflow qwen_image_2512_hires_2512px --cards 24 16 12 --steps 4   (completion, peaks)
    ... --dynamic-vram --text-encoder real --cards 24 --ram 32 --new-prompts 1 --variants pack
"""

import argparse
import contextlib
import gc
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo: tests.harness
from tests.harness.comfyui import ROOT, setup_comfy  # noqa: E402

GiB = 2**30
PICTURE = (1536, 2048)  # (height, width) of LoadImage's random picture


def write_models(root: Path, api: dict) -> None:
    """Random weights under the file names `api` loads (kept between runs of this script)."""
    import torch
    from safetensors.torch import save_file

    from qwen_turbo.cli import bench
    from qwen_turbo.runtime.dit import config, convert

    names = {k: v for n in api.values() for k, v in n["inputs"].items() if k.endswith("_name")}
    if is_newbie(api):
        return write_newbie_models(root, api)
    dit = root / "diffusion_models" / names["unet_name"]
    lora = root / "loras" / names["lora_name"] if "lora_name" in names else None
    if not dit.exists() or (lora and not lora.exists()):
        sd = bench.qwen_dit_state_dict(60, "cuda")
        if lora and not lora.exists():
            lora.parent.mkdir(parents=True, exist_ok=True)
            save_file(bench.random_lora(sd), str(lora))
        if not dit.exists():
            if "2511" in dit.name:  # Comfy-Org's Edit-2511 file: fp8mixed, the marker key
                from tests.harness.models import to_fp8mixed

                sd[config.TIMESTEP_ZERO] = torch.tensor([])
                sd = to_fp8mixed(convert.to_scaled_fp8(sd))
            else:
                sd = bench.repackaged_fp8(sd)
            dit.parent.mkdir(parents=True, exist_ok=True)
            save_file({k: t.cpu() for k, t in sd.items()}, str(dit))
        del sd
    if "clip_name" in names and not (te := root / "text_encoders" / names["clip_name"]).exists():
        write_text_encoder(te)
    vae = root / "vae" / names["vae_name"]
    if not vae.exists():
        vae.parent.mkdir(parents=True, exist_ok=True)
        save_file(bench.random_state_dict(bench.qwen_vae_module(), seed=0), str(vae))
    torch.cuda.empty_cache()
    os.sync()  # written back, clean, as downloaded files are


def write_text_encoder(path: Path) -> None:
    """Random weights in the layout of Comfy-Org's `qwen_2.5_vl_7b_fp8_scaled.safetensors`:
    ComfyUI's Qwen2.5-VL 7B, the language model's matrices (not its embedding) in float8_e4m3fn
    with a float32 `scale_weight` each, the vision tower and the rest in bf16, and the
    `scaled_fp8` marker by which both hosts read the format."""
    import comfy.ops
    import comfy.text_encoders.llama as llama
    import torch
    from safetensors.torch import save_file

    from qwen_turbo.cli import bench

    with bench.weights_at_construction():
        module = llama.Qwen25_7BVLI({}, torch.bfloat16, "meta", comfy.ops.disable_weight_init)
    gen = torch.Generator("cuda").manual_seed(7)
    sd = {"scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn)}
    for k, p in module.state_dict().items():
        if p.ndim == 1 and ("norm" in k or ".ln_" in k):  # RMSNorm gains
            sd[k] = torch.ones(p.shape, dtype=torch.bfloat16)
            continue
        t = torch.randn(p.shape, generator=gen, device="cuda")
        if p.ndim == 2 and "embed_tokens" not in k and not k.startswith("visual."):
            sd[k] = t.to(torch.float8_e4m3fn).cpu()
            sd[k[: -len("weight")] + "scale_weight"] = torch.tensor(0.02)
        else:
            sd[k] = (t * 0.02).to(torch.bfloat16).cpu()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(path))


def is_newbie(api: dict) -> bool:
    """Whether `api` is a NewBie-image workflow: its DualCLIPLoader's type is "newbie", or
    (`prompts` without the text encoder) its test conditioning has a pooled vector."""
    return any((n["class_type"] == "DualCLIPLoader" and n["inputs"].get("type") == "newbie")
               or (n["class_type"] == "QwenTurboTestConditioning" and n["inputs"].get("pooled"))
               for n in api.values())  # fmt: skip


def write_newbie_models(root: Path, api: dict) -> None:
    """NewBie-image-Exp0.1's files, random, where missing: the DiT (`unet_name`), Gemma 3 4B
    and Jina CLIP v2 (`clip_name1`, `clip_name2`, told apart by name; none where the test
    conditioning stands in for them) and the Flux VAE."""
    import torch

    names = {k: v for n in api.values() for k, v in n["inputs"].items()
             if k.endswith("_name") or k in ("clip_name1", "clip_name2")}  # fmt: skip
    dit = root / "diffusion_models" / names["unet_name"]
    if not dit.exists():
        write_newbie_dit(dit)
    for clip in (names[k] for k in ("clip_name1", "clip_name2") if k in names):
        path = root / "text_encoders" / clip
        if not path.exists():
            (write_jina if "jina" in clip.lower() else write_gemma)(path)
    vae = root / "vae" / names["vae_name"]
    if not vae.exists():
        write_flux_vae(vae)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    os.sync()  # written back, clean, as downloaded files are


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def write_newbie_dit(path: Path, n_layers: int = 36) -> None:
    """Random weights in the layout of NewBie-image-Exp0.1's released bf16 file: ComfyUI's
    NextDiT (width 2304, 36 blocks, 24 query and 8 key/value heads, Gemma's 2560-wide text,
    Jina's 1024-wide pooled vector), ComfyUI's key names, every tensor in bf16."""
    import comfy.ops
    import torch
    from comfy.ldm.lumina.model import NextDiT
    from safetensors.torch import save_file

    from qwen_turbo.cli import bench

    with bench.weights_at_construction():
        module = NextDiT(dim=2304, n_layers=n_layers, n_refiner_layers=2, n_heads=24,
                         n_kv_heads=8, qk_norm=True, cap_feat_dim=2560, axes_dims=[32, 32, 32],
                         axes_lens=[300, 512, 512], ffn_dim_multiplier=4.0, in_channels=16,
                         clip_text_dim=1024, device="meta",
                         operations=comfy.ops.disable_weight_init)  # fmt: skip
    sd = bench.random_state_dict(module, seed=0, dtype=torch.bfloat16, device=_device())
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: t.cpu() for k, t in sd.items()}, str(path))


def write_gemma(path: Path) -> None:
    """Random weights in the layout of Comfy-Org's `gemma_3_4b_it_bf16.safetensors`: the
    language model ComfyUI builds for NewBie (lumina2.Gemma3_4BModel: `model.*`, bf16; its
    RMSNorms add 1 to their weight, so zeros), and a small sentencepiece model with Gemma's
    special ids (pad 0, eos 1, bos 2, unk 3) as `spiece_model`."""
    import comfy.text_encoders.lumina2 as lumina2
    import torch

    from qwen_turbo.cli import bench

    with bench.weights_at_construction():
        te = lumina2.Gemma3_4BModel(device="meta", dtype=torch.bfloat16)
    _save_text_encoder(path, te.transformer, norm=0.0, ids={"pad_id": 0, "eos_id": 1,
                                                           "bos_id": 2, "unk_id": 3})  # fmt: skip


def write_jina(path: Path) -> None:
    """Random weights in the layout of Comfy-Org's `jina_clip_v2_bf16.safetensors`: the text
    tower ComfyUI builds for NewBie (jina_clip_2.JinaClip2TextModel: `model.*`, bf16;
    LayerNorm gains ones), and a small sentencepiece model with XLM-RoBERTa's special ids
    (bos 0, pad 1, eos 2, unk 3) as `spiece_model`."""
    import comfy.text_encoders.jina_clip_2 as jina
    import torch

    from qwen_turbo.cli import bench

    with bench.weights_at_construction():
        te = jina.JinaClip2TextModel(device="meta", dtype=torch.bfloat16)
    _save_text_encoder(path, te.transformer, norm=1.0, ids={"bos_id": 0, "pad_id": 1,
                                                           "eos_id": 2, "unk_id": 3})  # fmt: skip


def _save_text_encoder(path: Path, module, norm: float, ids: dict) -> None:
    """`module`'s state dict (on meta) as random bf16 tensors, as write_text_encoder makes
    them: norm gains `norm`, norm biases zero, the rest N(0, 0.02); plus `spiece_model`."""
    import torch
    from safetensors.torch import save_file

    device = _device()
    gen = torch.Generator(device).manual_seed(7)
    sd = {}
    for k, p in module.state_dict().items():
        if p.ndim == 1 and ("norm" in k or "_ln" in k):
            value = norm if k.endswith("weight") else 0.0
            sd[k] = torch.full(p.shape, value, dtype=torch.bfloat16)
        else:
            t = torch.randn(p.shape, generator=gen, device=device)
            sd[k] = (t * 0.02).to(torch.bfloat16).cpu()
            del t
    sd["spiece_model"] = spiece_model(ids)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(path))


WORDS = (  # the bundled NewBie workflows' prompt words, the session's, and more of their kind
    "you are an assistant designed to generate high quality low anime images with the highest "
    "degree of image text alignment based on xml format textual prompts prompt start "
    "character_1 gender 1girl 1boy appearance silver hair long short green blue red eyes "
    "clothing white raincoat yellow boots black dress action holding a transparent umbrella "
    "looking up general_tags style illustration detailed shading background rainy city "
    "street at dusk neon signs reflections on wet asphalt quality masterpiece best highres "
    "blurry worst jpeg artifacts watermark extra fingers fox in snow lighthouse cliff waves "
    "breaking below warm light windows gulls wind painted thick oil strokes old market night "
    "lanterns gold hang over stalls fruit fish spices people under umbrellas puddles mirror "
    "cat sleeps crate steam rises from noodle stand cobblestones shine distance tram crosses "
    "clock tower shows quarter past ten cinematic 35 mm film soft grain variation smile "
    "standing sitting forest sky clouds sunset ocean flowers school uniform portrait"
)


def spiece_model(ids: dict, vocab_size: int = 2000):
    """A small sentencepiece model (uint8 tensor of its bytes), trained here on synthetic
    prompts (English, tags, NewBie's XML) with the special ids `ids`: at most `vocab_size`
    pieces (about 700 from this text), byte fallback, so that every text gives ids inside
    the embeddings."""
    import io
    import random

    import sentencepiece
    import torch

    rng, words = random.Random(0), WORDS.split()
    tags = ["character_1", "gender", "appearance", "clothing", "action", "style", "background",
            "quality", "general_tags", "n"]  # fmt: skip
    lines = []
    for i in range(600):
        picked = rng.choices(words, k=rng.randint(4, 24))
        if i % 3 == 0:
            lines.append(", ".join(picked))
        elif i % 3 == 1:
            tag = rng.choice(tags)
            lines.append(f"<{tag}>{', '.join(picked)}</{tag}>")
        else:
            lines.append(" ".join(picked).capitalize() + ".")
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size,
        hard_vocab_limit=False, byte_fallback=True, character_coverage=1.0, num_threads=1,
        minloglevel=2, **ids,
    )  # fmt: skip
    return torch.frombuffer(bytearray(model.getvalue()), dtype=torch.uint8)


def write_flux_vae(path: Path) -> None:
    """Random weights in the layout of the Flux VAE's `ae.safetensors` (NewBie's): ComfyUI's
    AutoencoderKL, 16 latent channels, `encoder.*` and `decoder.*` only (no quant convs),
    float32 as released."""
    import torch
    from safetensors.torch import save_file

    from qwen_turbo.cli import bench
    from tests.harness.models import sd_vae_module

    with bench.weights_at_construction():
        module = sd_vae_module(16)
    sd = bench.random_state_dict(module, seed=0, dtype=torch.float32)
    sd = {k: t for k, t in sd.items() if k.startswith(("encoder.", "decoder."))}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(path))


def write_pictures(folder: Path, api: dict) -> None:
    """A random PNG (PICTURE) under each name LoadImage reads, where missing."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    for node in api.values():
        path = folder / node["inputs"]["image"] if node["class_type"] == "LoadImage" else None
        if path and not path.exists():
            pixels = np.random.default_rng(0).integers(0, 256, (*PICTURE, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(path)


def prompts(workflow: Path, text_encoder: bool = False) -> dict:
    """{"pack": api, "stock": api, "stock+fp8_fast": api, "pack+VAEDecode": api, "pack+KSampler":
    api} for a bundled
    workflow. Without `text_encoder` the text encoding is replaced by seeded conditioning
    (Edit's by QwenTurboTestEditConditioning, which still VAE-encodes the reference pictures)."""
    import nodes
    from qwen_turbo.cli.stock import STOCK, stock_graph
    from qwen_turbo.cli.workflow import object_info, ui_to_api

    api = ui_to_api(json.loads(workflow.read_text()), object_info(nodes.NODE_CLASS_MAPPINGS))
    newbie = is_newbie(api)
    pack = {}
    for node_id, node in api.items():
        if text_encoder:
            pack[node_id] = node
            continue
        if node["class_type"] in ("CLIPLoader", "DualCLIPLoader"):
            continue
        if node["class_type"] == "CLIPTextEncode":  # NewBie's: Gemma's text, Jina's pooled
            cond = {"seed": int(node_id), "tokens": 256, "width": 2560 if newbie else 3584}
            node = {"class_type": "QwenTurboTestConditioning",
                    "inputs": {**cond, "pooled": 1024} if newbie else cond}  # fmt: skip
        if node["class_type"] == "TextEncodeQwenImageEditPlus":  # the empty negative: 64
            i = node["inputs"]
            cond = {
                "seed": int(node_id),
                "tokens": 256 if i["prompt"] else 64,
                "width": 3584,
                "vision_tokens": 196,
                "reference_side": 1024,
                **{k: v for k, v in i.items() if k in ("vae", "image1", "image2", "image3")},
            }
            node = {"class_type": "QwenTurboTestEditConditioning", "inputs": cond}
        pack[node_id] = node
    stock = stock_graph(pack)
    # the pack's graph with ComfyUI's own decode after the CUDA Graph Sampler
    mixed = _copy(pack)
    for node in mixed.values():
        if node["class_type"] == "QwenTurboVAEDecodeTiled":
            node["class_type"], node["inputs"] = (
                "VAEDecode",
                STOCK["QwenTurboVAEDecodeTiled"][1](node["inputs"]),
            )
    # the Optimized Loader under stock's KSampler: every model call eager
    ksampler = _copy(pack)
    for node in ksampler.values():
        if node["class_type"] == "QwenTurboCUDAGraphSampler":
            node["class_type"], node["inputs"] = (
                "KSampler",
                STOCK[node["class_type"]][1](node["inputs"]),
            )
    # stock's best option: UNETLoader's fp8_e4m3fn_fast
    fast = _copy(stock)
    for node in fast.values():
        if node["class_type"] == "UNETLoader":
            node["inputs"]["weight_dtype"] = "fp8_e4m3fn_fast"
    return {"pack": pack, "stock": stock, "stock+fp8_fast": fast, "pack+VAEDecode": mixed,
            "pack+KSampler": ksampler}  # fmt: skip


def _copy(api: dict) -> dict:
    """`api` with each node's inputs its own."""
    return {k: {"class_type": n["class_type"], "inputs": dict(n["inputs"])} for k, n in api.items()}


class Recorder:
    """The `server` PromptExecutor reports to: node timings and errors; the pack's badge
    messages (report.send) land in `badges`."""

    client_id = "card-benchmark"
    last_node_id = last_prompt_id = None

    def __init__(self):
        self.times, self.peaks, self.error, self._node, self._t0 = {}, {}, None, None, 0.0
        self.badges, self.rss = {}, {}

    def badge(self, node_id, data: dict) -> None:
        self.badges[node_id] = data

    def send_sync(self, event, data, sid=None):
        import torch

        now = time.perf_counter()
        if event in ("executing", "execution_error", "execution_success") and self._node:
            self.times[self._node] = self.times.get(self._node, 0) + now - self._t0
            if torch.cuda.is_available():  # the allocator's peak counts as the host allocates
                peak, held = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
                if peak >= self.peaks.get(self._node, (0, 0))[0]:
                    self.peaks[self._node] = peak, held
            self.rss[self._node] = host_memory()["rss"]
            self._node = None
        if event == "executing":
            self._node, self._t0 = data.get("node"), now
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
        if event == "execution_error":
            self.error = f"{data.get('node_type')}: {data.get('exception_message')}".strip()

    def progress(self, *args, **kwargs):
        pass

    def send_progress_text(self, *args, **kwargs):
        pass


def set_latent(api: dict, batch: int, size: int | None) -> None:
    """The empty latents' batch size, and their width and height where `size` is given."""
    for node in api.values():
        if node["class_type"].startswith("Empty") and "batch_size" in node["inputs"]:
            node["inputs"]["batch_size"] = batch
            if size:
                node["inputs"]["width"] = node["inputs"]["height"] = size


def set_steps(api: dict, steps: int) -> None:
    """Every sampler's steps (its denoise stays: the hires pass still runs a share of them)."""
    for node in api.values():
        if node["class_type"] in ("KSampler", "QwenTurboCUDAGraphSampler"):
            node["inputs"]["steps"] = steps


def latent_shape(api: dict) -> list[int]:
    """The shape of the latent the first sampler starts from: the empty latent's, or in an
    Edit workflow (no empty latent) that of the scaled picture the VAE encodes."""
    for node in api.values():
        i = node["inputs"]
        if node["class_type"].startswith("Empty"):
            return [i["batch_size"], 16, 1, i["height"] // 8, i["width"] // 8]
    scale = next(n["inputs"] for n in api.values() if n["class_type"] == "ImageScale")
    return [1, 16, 1, scale["height"] // 8, scale["width"] // 8]


def comfy_estimate_gib(api: dict) -> float | None:
    """ComfyUI's estimate (BaseModel.memory_required) of what one model call of the sampled
    latent needs on top of the weights, from the diffusion model loaded last."""
    import comfy.model_base
    import comfy.model_management as mm

    shape = latent_shape(api)
    for loaded in mm.current_loaded_models:
        model = getattr(loaded.model, "model", None)
        if isinstance(model, comfy.model_base.BaseModel):
            return round(model.memory_required(shape) / GiB, 2)
    return None


_runs = iter(range(1, 1 << 30))  # a new prompt id for each run


def run_once(executor, server, api: dict, seed: int | None, filler_bytes: int) -> dict:
    """One execution of `api` (with `seed` in its samplers, where given); peak_gib is None
    without CUDA."""
    import torch

    cuda = torch.cuda.is_available()
    for node in api.values():
        if seed is not None and "seed" in node["inputs"] and "steps" in node["inputs"]:
            node["inputs"]["seed"] = seed  # samplers, not conds
    server.times, server.peaks, server.error, server.badges, server.rss = {}, {}, None, {}, {}
    if cuda:
        torch.cuda.synchronize()
        retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    reset_host_peak()
    t0 = time.perf_counter()
    from qwen_turbo.cli.stock import SAVES

    outputs = [k for k, n in api.items() if n["class_type"] in SAVES]
    executor.execute(api, f"run-{next(_runs)}", {"client_id": server.client_id}, outputs)
    if cuda:
        torch.cuda.synchronize()
    total = time.perf_counter() - t0
    by_kind, peaks = {}, {}
    for node_id, s in server.times.items():
        kind = api[node_id]["class_type"]
        by_kind[kind] = round(by_kind.get(kind, 0) + s, 2)
    for node_id, (peak, held) in server.peaks.items():
        kind = api[node_id]["class_type"]
        if kind not in peaks or peak - filler_bytes > peaks[kind][0] * GiB:
            peaks[kind] = [round((peak - filler_bytes) / GiB, 2), round((peak - held) / GiB, 2)]
    return {
        "ok": executor.success, "error": server.error, "seconds": round(total, 2),
        "nodes": by_kind,
        "peak_gib": max((p for p, _ in peaks.values()), default=None),
        # per kind of node: [the most allocated during it, above the filler; that peak less
        # what stayed allocated after it (a sampler's activations, its model staying loaded)]
        "node_peak_gib": peaks,
        "host_gib": host_memory(),  # at the end of the run; "peak" over the run
        # per kind of node: the resident size when it finished
        "node_rss_gib": {api[k]["class_type"]: v for k, v in server.rss.items()},
        # the CUDA Graph Sampler's badge: captured, replayed, eager and why
        "graphs": [b["graphs"] for b in server.badges.values() if "graphs" in b],
        # the allocator freed its cache and retried (synchronizing): memory ran short
        "alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries
        if cuda else None,
        # at the end of the run: what torch has allocated (the filler in it), and each
        # loaded model's VRAM as ComfyUI counts it (MB)
        "allocated_gib": round(torch.cuda.memory_allocated() / GiB, 2) if cuda else None,
        "loaded_mb": loaded_models_mb(),
        # torch's reserved memory (its cache and the graphs' pools) and what the driver has
        # free: memory neither holds is comfy-aimdo's (the pages of models loading on demand)
        "reserved_gib": round(torch.cuda.memory_reserved() / GiB, 2) if cuda else None,
        "driver_free_gib": round(torch.cuda.mem_get_info()[0] / GiB, 2) if cuda else None,
    }  # fmt: skip


def loaded_models_mb() -> dict:
    """Each model ComfyUI has loaded, by its class's name: its VRAM as ComfyUI counts it."""
    import comfy.model_management as mm

    return {type(m.model.model).__name__: round(m.model.loaded_size() / 2**20)
            for m in mm.current_loaded_models if m.model is not None}  # fmt: skip


def host_memory() -> dict:
    """This process's host memory, GiB: resident (file-backed and anonymous), its peak since
    `reset_host_peak`, and page-locked memory (ComfyUI's registrations and torch's pinned
    allocations)."""
    import comfy.model_management as mm
    import torch

    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    kib = {k: int(status[k].split()[0]) for k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}
    pinned = getattr(mm, "TOTAL_PINNED_MEMORY", 0)
    if torch.cuda.is_available() and hasattr(torch.cuda, "host_memory_stats"):
        pinned += torch.cuda.host_memory_stats().get("allocated_bytes.all.current", 0)
    return {"rss": round(kib["VmRSS"] / 2**20, 2), "peak": round(kib["VmHWM"] / 2**20, 2),
            "anon": round(kib["RssAnon"] / 2**20, 2), "file": round(kib["RssFile"] / 2**20, 2),
            "pinned": round(pinned / GiB, 2)}  # fmt: skip


def reset_host_peak() -> None:
    """Start the peak resident size (VmHWM) afresh (Linux's clear_refs)."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def hold_ram(available_gib: float):
    """A process holding (touching) all the host's available memory but `available_gib`, as a
    smaller machine would have; None where less is available. Kill it to give it back."""
    import subprocess

    import psutil

    extra = psutil.virtual_memory().available - int(available_gib * GiB)
    if extra <= 0:
        return None
    code = ("import sys, numpy as np; a = np.empty(int(sys.argv[1]), np.uint8); "
            "a[::4096] = 1; print('held', flush=True); sys.stdin.read()")  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", code, str(extra)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout.readline().strip() == "held", "the RAM ballast did not start"
    return proc


def new_prompt(api: dict, n: int, text: str | None = None) -> None:
    """Each sampler's positive prompt changed (the n-th variation): its text (`text`, or a
    variation of the workflow's own), or the seed of the test conditioning that stands in for
    the text encoder."""
    for node in api.values():
        positive = node["inputs"].get("positive")
        if "steps" not in node["inputs"] or not isinstance(positive, list):
            continue
        inputs = api[positive[0]]["inputs"]
        for key in ("text", "prompt"):
            if key in inputs:
                inputs[key] = text or f"{inputs[key].split(' | ')[0]} | variation {n}"
        if "tokens" in inputs:
            inputs["seed"] = 1000 * n + int(positive[0])


def without_lora(api: dict) -> dict:
    """`api` with its LoRA nodes bypassed (what feeds them wired to what they fed)."""
    out = {k: {"class_type": n["class_type"], "inputs": dict(n["inputs"])} for k, n in api.items()}
    for node_id, node in list(out.items()):
        if node["class_type"] == "LoraLoaderModelOnly":
            del out[node_id]
            for other in out.values():
                for name, value in other["inputs"].items():
                    if value == [node_id, 0]:
                        other["inputs"][name] = node["inputs"]["model"]
    return out


def fill_to(free_gib: float):
    """A tensor holding all of the GPU's free memory but `free_gib`; None if less is free."""
    import torch

    free, _ = torch.cuda.mem_get_info()
    extra = free - int(free_gib * GiB)
    return torch.empty(extra, dtype=torch.uint8, device="cuda") if extra > 0 else None


def simulate_card(card_gib: float):
    """A card of `card_gib` GiB: the GPU filled until `card_gib` - 1 GiB stay free (what such a
    card leaves a desktop user), and its total reported as `card_gib` GiB to ComfyUI and the
    pack (`torch.cuda.mem_get_info`, and ComfyUI's `total_vram`, read at its start), so that
    every decision that reads the total (ComfyUI's reserve and low-VRAM choice, the pack's
    shares, error texts) is the card's. Returns the filler (None if less is free)."""
    import comfy.model_management as mm
    import torch

    filler = fill_to(card_gib - 1)
    real, total = torch.cuda.mem_get_info, int(card_gib * GiB)
    torch.cuda.mem_get_info = lambda device=None: (real(device)[0], total)
    mm.total_vram = total / 2**20
    return filler


def comfy_version() -> str:
    import comfyui_version

    return getattr(comfyui_version, "__version__", "?")


def init_dynamic_vram(start: bool) -> bool:
    """ComfyUI v0.33's main.py: comfy-aimdo's allocator hooks before torch starts CUDA
    (`start`), then its devices and the dynamic ModelPatcher (after). False where absent."""
    try:
        import comfy_aimdo.control as aimdo
    except ImportError:
        return False
    if start:
        for kwargs in ({"simple_vram_headroom": None, "nvml_pressure": True},
                       {"simple_vram_headroom": None}, {}):  # fmt: skip
            try:
                aimdo.init(**kwargs)
                return True
            except TypeError:
                continue
        return False
    import comfy.memory_management
    import comfy.model_management as mm
    import comfy.model_patcher

    if not hasattr(comfy.model_patcher, "ModelPatcherDynamic"):
        return False
    try:
        ok = aimdo.init_devices((d.index, 0) for d in mm.get_all_torch_devices())
    except TypeError:
        ok = aimdo.init_devices(d.index for d in mm.get_all_torch_devices())
    if ok:
        comfy.model_patcher.CoreModelPatcher = comfy.model_patcher.ModelPatcherDynamic
        comfy.memory_management.aimdo_enabled = True
    return bool(ok)


def start(models: Path, dynamic_vram: bool = False) -> bool:
    """ComfyUI in this process, as `main.py` sets it up (with comfy-aimdo's dynamic VRAM where
    `dynamic_vram` and present): its nodes, the pack's and the test nodes; model and input
    folders under `models`. Returns whether dynamic VRAM is on."""
    if dynamic_vram:
        from tests.harness.comfyui import find_comfyui

        sys.path.insert(0, str(find_comfyui()))
        dynamic_vram = init_dynamic_vram(start=True)
    setup_comfy()
    import asyncio

    import folder_paths

    import nodes
    import qwen_turbo
    from tests import testing_nodes

    asyncio.run(nodes.init_extra_nodes(init_custom_nodes=False, init_api_nodes=False))
    for pack in (qwen_turbo, testing_nodes):
        ext = asyncio.run(pack.comfy_entrypoint())
        for cls in asyncio.run(ext.get_node_list()):
            nodes.NODE_CLASS_MAPPINGS[cls.define_schema().node_id] = cls
    dynamic = dynamic_vram and init_dynamic_vram(start=False)
    folder_paths.set_output_directory("/tmp/qwen-turbo-out")
    (models / "input").mkdir(parents=True, exist_ok=True)  # LoadImage lists it
    folder_paths.set_input_directory(str(models / "input"))
    for kind in ("diffusion_models", "vae", "loras", "text_encoders"):
        folder_paths.folder_names_and_paths[kind] = ([str(models / kind)], {".safetensors"})
    folder_paths.filename_list_cache.clear()
    return bool(dynamic)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--workflow",
        default="qwen_image_2512_turbo_2512px",
        choices=sorted(f.stem for f in (ROOT / "workflows").glob("*.json")),
    )
    p.add_argument("--cards", type=float, nargs="+", default=[24, 16], help="GiB; 0 = whole")
    p.add_argument("--variants", nargs="+", default=["stock", "pack"])
    p.add_argument("--models", default="/tmp/qwen-turbo-models")
    p.add_argument("--dynamic-vram", action="store_true", help="v0.33: as main.py enables it")
    p.add_argument("--batch", type=int, nargs="+", default=[1], help="the latent's batch sizes")
    p.add_argument(
        "--size", type=int, help="the latent's width and height (default: the workflow's)"
    )
    p.add_argument(
        "--loader",
        nargs=3,
        metavar=("WEIGHT_DTYPE", "ATTENTION", "FUSED"),
        help="the Optimized Loader's settings in the pack variant (FUSED: on, off)",
    )
    p.add_argument("--capture", help="the CUDA Graph Sampler's capture mode in the pack variant")
    p.add_argument("--budget", type=float, help="VAE Tiling's vram_budget_gb in the pack variant")
    p.add_argument("--runs", type=int, default=2, help="runs per batch size (new seeds)")
    p.add_argument("--new-prompts", type=int, default=0, help="then runs with a new prompt")
    p.add_argument(
        "--text-encoder", choices=["real", "test"], default="test",
        help="real: CLIPLoader and the text encode nodes on random full-size Qwen2.5-VL 7B "
             "weights; test: seeded conditioning in their place",
    )  # fmt: skip
    p.add_argument(
        "--ram", type=float,
        help="GiB of host RAM left available (a ballast process holds the rest)",
    )  # fmt: skip
    p.add_argument(
        "--steps", type=int,
        help="every sampler's steps, in both variants (memory per step is unchanged; times "
             "are then not the workflow's)",
    )  # fmt: skip
    p.add_argument(
        "--record-kernels", metavar="PATH",
        help="write the Triton launches of these runs as a warm-up manifest (kernels/warmup.json)",
    )  # fmt: skip
    p.add_argument("--no-quality-guard", action="store_true",
                   help="the Optimized Loader's quality_guard off (no fidelity probe)")  # fmt: skip
    p.add_argument("--log", help="print ComfyUI's and the pack's log at this level (INFO)")
    a = p.parse_args()
    if a.log:
        import logging

        logging.basicConfig(level=a.log, format="%(relativeCreated)8d ms %(name)s: %(message)s",
                            force=True)  # fmt: skip
    models = Path(a.models)
    dynamic = start(models, a.dynamic_vram)
    import comfy.model_management as mm
    import execution

    from qwen_turbo.cli import headless
    from qwen_turbo.nodes import report

    variants = prompts(ROOT / "workflows" / f"{a.workflow}.json", a.text_encoder == "real")
    if a.loader:
        dtype, attention, fused = a.loader
        for node in variants["pack"].values():
            if node["class_type"] == "QwenTurboLoader":
                node["inputs"].update(weight_dtype=dtype, attention=attention,
                                      fused_kernels=fused == "on")  # fmt: skip
    for node in variants["pack"].values():
        if a.no_quality_guard and node["class_type"] == "QwenTurboLoader":
            node["inputs"]["quality_guard"] = False
        if a.capture and node["class_type"] == "QwenTurboCUDAGraphSampler":
            node["inputs"]["capture"] = a.capture
        if a.budget is not None and node["class_type"] == "QwenTurboVAEDecodeTiled":
            node["inputs"]["vram_budget_gb"] = a.budget
    if a.steps:
        for api in variants.values():
            set_steps(api, a.steps)
    write_models(models, variants["pack"])
    write_pictures(models / "input", variants["pack"])

    from qwen_turbo.kernels import warmup

    ballast = hold_ram(a.ram) if a.ram else None
    try:
        with warmup.record() if a.record_kernels else contextlib.nullcontext([]) as launched:
            rows = run_cards(a, variants, models, mm, execution, report, headless)
    finally:
        if ballast is not None:
            ballast.kill()
    if a.record_kernels:
        total = warmup.save(launched, Path(a.record_kernels))
        print(f"{len(launched)} kernel launches recorded; {a.record_kernels} lists {total}")
    print_rows(rows, dynamic, a.workflow + (f", {a.steps} steps" if a.steps else ""))


def run_cards(a, variants, models, mm, execution, report, headless) -> list[dict]:
    """Each card, variant, batch and run of `a`; the rows of the table."""
    import torch

    rows = []
    for card in a.cards:
        filler = simulate_card(card) if card else None
        filler_bytes = filler.numel() if filler is not None else 0
        free = torch.cuda.mem_get_info()[0] / GiB
        for variant in a.variants:
            server = Recorder()
            report.send = server.badge
            executor = headless._executor(execution, server)
            for b, batch in enumerate(a.batch):
                set_latent(variants[variant], batch, a.size)
                kinds = ["seed"] * a.runs + ["prompt"] * a.new_prompts
                for i, kind in enumerate(kinds):
                    if kind == "prompt":  # a text no earlier run of this process had
                        new_prompt(variants[variant], len(rows) + 1)
                    r = run_once(executor, server, variants[variant], i + 1, filler_bytes)
                    run = "first" if b == i == 0 else f"new {kind}"
                    estimate = comfy_estimate_gib(variants[variant])
                    rows.append({"card_gib": card or None, "free_gib": round(free, 1),
                                 "ram_gib": a.ram, "variant": variant, "batch": batch,
                                 "run": run, **r, "comfy_estimate_gib": estimate})  # fmt: skip
                    print(json.dumps(rows[-1]), flush=True)
            del executor, server
            mm.unload_all_models()
            mm.soft_empty_cache()
            gc.collect()
            torch.cuda.empty_cache()
        del filler
        torch.cuda.empty_cache()
    return rows


def print_rows(rows: list[dict], dynamic: bool, workflow: str) -> None:
    """The table, then the JSON on the last line."""
    import comfyui_version
    import torch

    version = getattr(comfyui_version, "__version__", "?")
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, ComfyUI {version}"
          f"{', dynamic VRAM' if dynamic else ''}, {workflow}")  # fmt: skip
    print(f"{'card':>6} {'RAM':>5} {'variant':7} {'batch':>5} {'run':10} {'ok':3} {'total s':>8} "
          f"{'peak GiB':>8} {'RSS peak':>8} {'anon':>6} {'pinned':>6}  nodes")  # fmt: skip
    for r in rows:
        slow = ", ".join(f"{k} {v}" for k, v in sorted(r["nodes"].items(), key=lambda x: -x[1])[:3])
        h = r["host_gib"]
        print(f"{r['card_gib'] or 'whole':>6} {r['ram_gib'] or 'all':>5} {r['variant']:7} "
              f"{r['batch']:5} {r['run']:10} {'yes' if r['ok'] else 'NO':3} {r['seconds']:8.2f} "
              f"{r['peak_gib'] or 0:8.2f} {h['peak']:8.2f} {h['anon']:6.2f} {h['pinned']:6.2f}  "
              f"{slow}" + (f"  ERROR {r['error']}" if r["error"] else ""))  # fmt: skip
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "comfyui": version, "dynamic_vram": dynamic, "workflow": workflow,
                      "rows": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
