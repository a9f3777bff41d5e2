"""The fidelity probe: the Optimized Loader's lossy compute (fp8 GEMMs with quantized activations,
fp8 attention) measured on the user's own weights, block by block, against the safe path (bf16
compute, exact attention: SDPA without cuDNN's backend, whose first call would build a graph
that only the probe needs).

One forward at a small size with fixed inputs runs on the safe path; as each transformer block
finishes, it runs again lossy on a copy of its inputs. A block whose own
contribution (its output less its input) differs by more than the threshold (relative L2)
computes on the safe path from then on. The result is cached per file (its name, size and
header) and setting, so that a later load applies it without running anything.
"""

import hashlib
import inspect
import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from . import fp8
from .attention import OVERRIDE, unbuilt_override

log = logging.getLogger(__name__)
STREAMS = ("encoder_hidden_states", "hidden_states")  # a block returns them in this order
SIDE = 512  # px: a 64x64 latent, 1,024 image tokens
TEXT_TOKENS = 64
SIGMA = 0.6


@dataclass
class Fidelity:
    errors: list[float]  # per block: its lossy contribution's relative L2 error
    kept: list[int]  # the blocks that compute on the safe path
    seconds: float  # what the probe took where it ran

    def summary(self) -> str:
        """What the badge and the log say: 'fp8: 2.1% vs bf16 per block (max 3.4%); 3 of 60
        blocks kept bf16'."""
        median, worst = statistics.median(self.errors), max(self.errors)
        kept = f"{len(self.kept)} of {len(self.errors)} blocks kept bf16"
        return f"fp8: {100 * median:.1f}% vs bf16 per block (max {100 * worst:.1f}%); {kept}"


def _rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The relative L2 error, left on the device (read once at the end: no sync per block)."""
    a, b = a.float(), b.float()
    return (a - b).norm() / b.norm().clamp_min(1e-12)


def _inputs(model, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Fixed inputs from a seeded generator: a latent, a timestep, and the model's conds (text
    features; NewBie's pooled CLIP vector as well)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    dm = model.diffusion_model
    side = SIDE // 8
    if hasattr(dm, "txt_in"):  # Qwen-Image: video-shaped latents
        x = torch.randn((1, 16, 1, side, side), generator=g)
        conds = {
            "c_crossattn": torch.randn((1, TEXT_TOKENS, dm.txt_in.weight.shape[1]), generator=g)
        }
    else:  # NextDiT (NewBie / Lumina-2)
        x = torch.randn((1, dm.in_channels, side, side), generator=g)
        conds = {"c_crossattn": torch.randn((1, TEXT_TOKENS, dm.cap_embedder[1].weight.shape[1]),
                                            generator=g), "num_tokens": TEXT_TOKENS}  # fmt: skip
        if getattr(dm, "clip_text_pooled_proj", None) is not None:
            conds["clip_text_pooled"] = torch.randn((1, dm.clip_text_dim), generator=g)
    conds = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in conds.items()}
    return x.to(device), torch.tensor([SIGMA], device=device), conds


def streams(block_kwargs: dict) -> tuple[str, ...]:
    """The hidden states a block takes and returns, in the order it returns them: Qwen-Image's
    text and image streams, or NextDiT's one (its first argument: `hidden_states` here, as the
    streamer names it)."""
    return STREAMS if "encoder_hidden_states" in block_kwargs else ("hidden_states",)


def measure(model, device, override, threshold: float) -> Fidelity:
    """Probe `model` (ComfyUI's BaseModel, its weights where ComfyUI loaded them, run on
    `device`) whose lossy path uses attention `override` (None: ComfyUI's attention). One
    forward on the safe path; each block, as it finishes, runs again lossy on a copy of its
    inputs, so no more than one block's inputs are held. Where the model streams offloaded
    weights (`LoaderState.streamer`), the rerun runs while the block's copies are on the GPU,
    so they cross once; elsewhere it runs the block's forward below the streamer's, whose
    offloaded layers take ComfyUI's copies."""
    t0 = time.perf_counter()
    blocks = getattr(model.diffusion_model, model.qwen_turbo.blocks)
    x, sigma, conds = _inputs(model, device)
    lossy = {OVERRIDE: override} if override is not None else {}
    inputs, errors = {}, []

    def before(module, args, kwargs):
        given = {**kwargs, "hidden_states": args[0]} if args else kwargs
        inputs.update({k: given[k].clone() for k in streams(given)})

    def rerun(i, out, kwargs, call):
        options = {**kwargs["transformer_options"], **lossy, "block_index": len(errors)}
        names = streams({**kwargs, "hidden_states": None})
        with fp8.safe_compute(False):
            got = call(**{k: inputs[k].clone() for k in names}, transformer_options=options)
        got, out = (got, out) if isinstance(got, tuple) else ((got,), (out,))
        pairs = zip(got, out, names, strict=True)
        errors.append(torch.stack([_rel(g - inputs[k], o - inputs[k]) for g, o, k in pairs]).max())

    def after(module, args, kwargs, out):
        forward = inspect.unwrap(module.forward)

        def call(hidden_states=None, **changes):
            if not args:  # called by keywords (Qwen-Image)
                return forward(**{**kwargs, "hidden_states": hidden_states, **changes})
            return forward(hidden_states, *args[1:], **{**kwargs, **changes})

        rerun(None, out, kwargs, call)

    streamer = getattr(getattr(model, "qwen_turbo", None), "streamer", None)
    handles = [b.register_forward_pre_hook(before, with_kwargs=True) for b in blocks]
    if streamer is None:
        handles += [b.register_forward_hook(after, with_kwargs=True) for b in blocks]
    else:
        streamer.after = rerun
    try:
        with torch.inference_mode(), fp8.safe_compute():
            options = {OVERRIDE: unbuilt_override()}
            model.apply_model(x, sigma, transformer_options=options, **conds)
    finally:
        for h in handles:
            h.remove()
        if streamer is not None:
            streamer.after = None
    errors = torch.stack(errors).tolist() if errors else []
    kept = [i for i, e in enumerate(errors) if e > threshold]
    apply(model, kept)
    return Fidelity(errors, kept, time.perf_counter() - t0)


def apply(model, kept) -> None:
    """Blocks `kept` compute on the safe path: their fp8 layers in bf16 (`Fp8FastLinear.
    bf16_compute`), their attention ComfyUI's (the loader's override reads `safe_blocks`)."""
    state = model.qwen_turbo
    state.safe_blocks.clear()
    state.safe_blocks.update(kept)
    for i, block in enumerate(getattr(model.diffusion_model, state.blocks)):
        for m in block.modules():
            if isinstance(m, fp8.Fp8FastLinear):
                m.bf16_compute = i in state.safe_blocks


def cache_key(path: Path, setting: str) -> str:
    """The file's name, size and safetensors header (or a folder's file list), and `setting`."""
    h = hashlib.sha256(setting.encode())
    files = sorted(path.rglob("*.safetensors")) if path.is_dir() else [path]
    for f in files:
        h.update(f"{f.name}:{f.stat().st_size}".encode())
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            h.update(fh.read(min(n, 1 << 24)))
    return h.hexdigest()


class Cache:
    """Probe results by key, in a JSON file."""

    def __init__(self, path: Path):
        self.path = path

    def _read(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def get(self, key: str) -> Fidelity | None:
        entry = self._read().get(key)
        try:
            return Fidelity(**entry, seconds=0.0) if entry else None
        except TypeError:  # written by another version
            return None

    def put(self, key: str, result: Fidelity) -> None:
        entries = self._read()
        entries[key] = {k: v for k, v in asdict(result).items() if k != "seconds"}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(entries))
        except OSError as e:
            log.warning("Optimized Loader: fidelity probe result not cached (%s)", e)
