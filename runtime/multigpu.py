"""One model call on several GPUs of one machine, over torch.distributed (NCCL on GPUs; gloo
on CPU, for the tests).

The ComfyUI process is rank 0 on its own device and drives; ranks 1..N-1 are worker
processes, one per extra device, started once and reused (`Pool`). A worker builds the same
diffusion model from its recipe (its class, `unet_config`, the ops classes its modules use)
and receives the weights from rank 0 by `broadcast` whenever their signature (the model
object, its LoRA patches) changes; it runs the pack's fused blocks and attention backend
where rank 0 does.

A call (`Driver`, a DIFFUSION_MODEL wrapper) is split two ways:
- CFG-parallel: the batch (cond and uncond, as ComfyUI batches them) over `groups` of ranks;
- sequence parallel (`SeqParallel`): within a group, the text and the image tokens over its
  ranks. Around attention an all-to-all turns (tokens/s, heads) into (tokens, heads/s) and
  back (Ulysses), where the ranks divide the heads; elsewhere each rank gathers every
  token's keys and values and attends with its own queries.
The outputs come back to rank 0 by all_gather. A quantized attention backend takes its
scales over all ranks of the call, so each rounds as one GPU with the whole call would.
Calls the workers cannot reproduce (another node's model patches or wrappers inside this
one, ControlNet inputs) run on rank 0 alone.

Operations are announced by a header of plain data (`wire`: JSON, nothing unpickled) on the
worker's stdin, a pipe only rank 0 holds, so an idle worker waits on the pipe rather than in
an NCCL collective that would time out; it answers (started, or its error) on a second pipe.
The process group meets in a FileStore in a folder only this user can open, and its
communicators bind to the loopback interface: no socket of the pool listens beyond this
machine. Workers start as plain subprocesses: a multiprocessing spawn would re-run ComfyUI's
main.py in each of them (spawn re-imports `__main__`), custom nodes' prestartup scripts
included. ComfyUI's modules are imported inside functions: a worker imports this module
before it sets ComfyUI's flags.
"""

import atexit
import contextlib
import functools
import inspect
import json
import logging
import math
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from . import log_once, qwen_dit, wire
from .attention import QUANTIZED, attention_override
from .cuda_graphs import own
from .wire import Slot

log = logging.getLogger(__name__)

KEY = "qwen_turbo_multigpu"
MODES = ["auto", "cfg-parallel", "sequence-parallel", "both"]
PACK = __name__[: -len(".runtime.multigpu")]
ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = timedelta(minutes=10)
START_TIMEOUT = 300.0  # seconds for a worker to import torch and ComfyUI
PENDING_BYTES = 1 << 30  # weights in flight at once while broadcasting (driver-side copies)
FUSED = f"{qwen_dit.fused_block_forward.__name__}.<locals>.forward"

# The fields of each operation a worker takes (its first is "args": ComfyUI's flags).
OPS = {
    "args": ("args",),
    "load": ("recipe", "metas"),
    "call": ("spec", "metas", "groups", "size", "attention", "fused", "blocks", "out"),
    "stop": (),
}

# A worker's first lines: the parent's sys.path, the pack registered under the parent's
# module name (ComfyUI names custom nodes by path), then `worker_main`.
BOOTSTRAP = """
import importlib, importlib.util, json, sys
cfg = json.loads(sys.argv[1])
sys.path[:] = cfg["path"]
spec = importlib.util.spec_from_file_location(
    cfg["pack"], cfg["init"], submodule_search_locations=[cfg["root"]])
sys.modules[cfg["pack"]] = importlib.util.module_from_spec(spec)
importlib.import_module(cfg["pack"] + ".runtime.multigpu").worker_main(cfg)
"""


class NotReplicable(Exception):
    """Why a call runs on rank 0 alone: the workers could not compute the same thing."""


class MultiGPUError(RuntimeError):
    """A worker failed; the pool was shut down and the next run starts a fresh one."""


# --- what a worker rebuilds ----------------------------------------------------------------


def attention_name(override) -> str | None:
    """The backend of an `attention.attention_override(name)` function (workers rebuild the
    pack's overrides by name); None for any other callable."""
    name = getattr(override, "backend", None)
    return name if own(override) and isinstance(name, str) else None


@functools.cache
def _op_names() -> frozenset[str]:
    import comfy.ops

    base = comfy.ops.disable_weight_init
    return frozenset(n for n in dir(base) if isinstance(getattr(base, n), type))


def recipe(base) -> dict:
    """What a worker builds `base.diffusion_model` from, as plain data (`wire`): the class,
    `unet_config` and, per op name (Linear, LayerNorm, ...), the ops class its modules use.
    Raises NotReplicable when one of them is not importable by name."""
    dm = base.diffusion_model
    ops: dict[str, type] = {}
    for m in dm.modules():
        if hasattr(m, "comfy_cast_weights"):
            name = next((c.__name__ for c in type(m).__mro__ if c.__name__ in _op_names()), None)
            if name is not None and ops.setdefault(name, type(m)) is not type(m):
                raise NotReplicable(f"two {name} classes in one model ({type(m).__qualname__})")
    r = {"cls": type(dm), "config": dict(base.model_config.unet_config), "ops": ops}
    try:
        wire.encode(r)
    except TypeError as e:
        raise NotReplicable(f"the model's classes cannot be rebuilt in a worker ({e})") from None
    return r


def build(r: dict) -> torch.nn.Module:
    """The diffusion model of a `recipe`, on the meta device (weights come by broadcast)."""
    ops = type("ops", (), dict(r["ops"]))
    return r["cls"](**r["config"], device="meta", operations=ops)


def fused_blocks(patcher, dm) -> bool:
    """Whether the pack's fused forward is on every block (False: on none). Raises
    NotReplicable for any other object patch inside the diffusion model."""
    fused = 0
    for key, obj in patcher.object_patches.items():
        if not key.startswith("diffusion_model."):
            continue
        block = re.fullmatch(r"diffusion_model\.transformer_blocks\.\d+\.forward", key)
        obj = inspect.unwrap(obj)  # the weight streamer's wrapper (workers load every weight)
        if block and getattr(obj, "__qualname__", "") == FUSED and own(obj):
            fused += 1
        elif not (block and inspect.ismethod(obj) and type(obj.__self__).forward is obj.__func__):
            raise NotReplicable(f"object patch on {key!r}")
    if fused not in (0, len(dm.transformer_blocks)):
        raise NotReplicable("the fused forward on some blocks only")
    return fused > 0


def set_fused(dm, on: bool) -> None:
    from comfy.ldm.qwen_image.model import optimized_attention_masked

    for block in dm.transformer_blocks:
        if on:
            block.forward = qwen_dit.fused_block_forward(block, optimized_attention_masked)
        else:
            block.__dict__.pop("forward", None)


def patched_weight(patcher, key: str, device) -> torch.Tensor:
    """The weight at `key` as a full load patches it (LoRA in float32, rounded back to the
    storage dtype with ComfyUI's seed), for weights that `patcher` patches on the fly
    (lowvram, dynamic VRAM) instead of in place."""
    import comfy.float
    import comfy.lora
    import comfy.model_patcher as mp
    import comfy.utils

    weight, set_func, convert_func = mp.get_key_weight(patcher.model, key)
    temp = weight.to(device=device, dtype=torch.float32, copy=True)
    if convert_func is not None:
        temp = convert_func(temp, inplace=True)
    out = comfy.lora.calculate_weight(patcher.patches[key], temp, key)
    to_seed = getattr(comfy.utils, "string_to_seed", None) or mp.string_to_seed  # v0.3: there
    seed = to_seed(key)
    if set_func is None:
        return comfy.float.stochastic_rounding(out, weight.dtype, seed=seed)
    return set_func(out, seed=seed, return_weight=True)


# --- moving tensors --------------------------------------------------------------------------


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor as a flat uint8 view: every dtype crosses every backend."""
    return t.view(-1).view(torch.uint8)


def _strip(obj, tensors: list, options):
    if obj is options:
        return Slot(-1)
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return Slot(len(tensors) - 1)
    if type(obj) in (list, tuple):
        return type(obj)(_strip(o, tensors, options) for o in obj)
    if type(obj) is dict:
        return {k: _strip(v, tensors, options) for k, v in obj.items()}
    return obj


def _fill(obj, tensors: list, options):
    if isinstance(obj, Slot):
        return options if obj.i < 0 else tensors[obj.i]
    if type(obj) in (list, tuple):
        return type(obj)(_fill(o, tensors, options) for o in obj)
    if type(obj) is dict:
        return {k: _fill(v, tensors, options) for k, v in obj.items()}
    return obj


def _share(t: torch.Tensor, batch: int, groups: int, group: int) -> torch.Tensor:
    """Group `group`'s rows of a batched tensor (first dim == batch); others whole."""
    if t.ndim == 0 or t.shape[0] != batch or groups == 1:
        return t
    n = batch // groups
    return t[group * n : (group + 1) * n]


def _layout(metas) -> tuple[list[int], int]:
    """Byte offsets (16-aligned, so each chunk views as its dtype) and the total."""
    offsets, total = [], 0
    for shape, dtype in metas:
        offsets.append(total)
        total += -(-math.prod(shape) * dtype.itemsize // 16) * 16
    return offsets, total


def _unpack(flat: torch.Tensor, metas) -> list[torch.Tensor]:
    offsets, _ = _layout(metas)
    return [flat[o : o + math.prod(s) * d.itemsize].view(d).view(s)
            for o, (s, d) in zip(offsets, metas, strict=True)]  # fmt: skip


def _sp_group(cache: dict, groups: int, size: int, rank: int):
    """The process group of `rank`'s sequence-parallel group; every rank creates every group
    of a plan, in the same order, the first time it meets the plan (new_group's rule)."""
    if groups == 1 and size == dist.get_world_size():
        return None  # the whole world
    if (groups, size) not in cache:
        cache[groups, size] = [_new_group(range(j * size, (j + 1) * size)) for j in range(groups)]
    return cache[groups, size][rank // size] if rank < groups * size else None


def _call_group(cache: dict, groups: int, size: int):
    """The process group of the ranks that take part in a call of this plan; made, where it
    is not the whole world, as `_sp_group` makes its groups."""
    if groups * size == dist.get_world_size():
        return dist.group.WORLD
    if ("call", groups, size) not in cache:
        cache["call", groups, size] = _new_group(range(groups * size))
    return cache["call", groups, size]


def loopback() -> str:
    """The name of the interface holding 127.0.0.1 ("lo" on Linux)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == "127.0.0.1" for a in addrs):
            return name
    return "lo"


@functools.cache
def communicator_env() -> dict[str, str]:
    """What the pool's communicators read from the environment: their sockets on loopback
    (NCCL's bootstrap, gloo's pairs), NVLink multicast off (NCCL_NVLS_ENABLE)."""
    lo = loopback()
    return {"NCCL_SOCKET_IFNAME": lo, "GLOO_SOCKET_IFNAME": lo, "NCCL_NVLS_ENABLE": "0"}


@contextlib.contextmanager
def communicator_scope():
    """`communicator_env` in os.environ while communicators are made in this process (rank 0
    is ComfyUI's: every other pack's environment is left as it was)."""
    env = communicator_env()
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _new_group(ranks):
    with communicator_scope():
        return dist.new_group(list(ranks))


# --- sequence parallel -----------------------------------------------------------------------


class SeqParallel:
    """Sequence parallel on one rank for one model call. The rank keeps its chunk of the text
    and of the image tokens (ceil(n/s) each, zero-padded at the end) through every block,
    with those tokens' RoPE rows. Attention gathers every token for heads/s of the heads
    (Ulysses), or, where s does not divide the heads, every token's keys and values for all
    heads; either way the padded tokens are left out of the keys, and the rank gets back its
    chunk's tokens for all heads.

    Hooks: ComfyUI's block replacement (`patches_replace["dit"]`, splitting before the first
    block and gathering the image tokens after the last) and `optimized_attention_override`
    (around whatever override the call already had)."""

    def __init__(self, group, size: int, rank: int):
        self.group, self.size, self.rank = group, size, rank

    def options(self, options: dict, blocks: int) -> dict:
        replace = dict(options.get("patches_replace", {}))
        dit = dict(replace.get("dit", {}))
        for i in range(blocks):
            dit["double_block", i] = functools.partial(self._block, i, blocks)
        replace["dit"] = dit
        inner = options.get("optimized_attention_override")
        attention = functools.partial(self._attention, inner)
        return {**options, "patches_replace": replace, "optimized_attention_override": attention}

    def _chunk(self, t, start: int, n: int, size: int, dim: int) -> torch.Tensor:
        """Rows start + [rank*size, (rank+1)*size) of t along dim, within [start, start+n),
        zero-padded to `size`."""
        lo = min(start + self.rank * size, start + n)
        part = t.narrow(dim, lo, min(size, start + n - lo))
        if part.shape[dim] == size:
            return part
        pad = list(part.shape)
        pad[dim] = size - part.shape[dim]
        return torch.cat([part, part.new_zeros(pad)], dim)

    def _start(self, img, txt, pe) -> None:
        self.n_txt, self.n_img = txt.shape[1], img.shape[1]
        s = self.size
        self.t_loc, self.i_loc = -(-self.n_txt // s), -(-self.n_img // s)
        dim = 1 if pe.shape[1] == self.n_txt + self.n_img else 2  # v0.3's layout, newer hosts'
        txt_pe = self._chunk(pe, 0, self.n_txt, self.t_loc, dim)
        self.pe = torch.cat([txt_pe, self._chunk(pe, self.n_txt, self.n_img, self.i_loc, dim)], dim)
        # real tokens among the gathered s * (t_loc + i_loc), rank by rank
        q, r = torch.arange(self.t_loc + self.i_loc), torch.arange(s)[:, None]
        valid = torch.where(q < self.t_loc, r * self.t_loc + q < self.n_txt,
                            r * self.i_loc + q - self.t_loc < self.n_img).flatten()  # fmt: skip
        self.index = None if bool(valid.all()) else valid.nonzero()[:, 0].to(img.device)

    def _block(self, i: int, blocks: int, args: dict, extra: dict) -> dict:
        if i == 0:
            self._start(args["img"], args["txt"], args["pe"])
            args = {**args, "img": self._chunk(args["img"], 0, self.n_img, self.i_loc, 1),
                    "txt": self._chunk(args["txt"], 0, self.n_txt, self.t_loc, 1)}  # fmt: skip
        out = extra["original_block"]({**args, "pe": self.pe})
        if i == blocks - 1:
            img = out["img"].contiguous()
            parts = [torch.empty_like(img) for _ in range(self.size)]
            dist.all_gather([_bytes(p) for p in parts], _bytes(img), group=self.group)
            out = {**out, "img": torch.cat(parts, 1)[:, : self.n_img]}
        return out

    def _all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """x: (s, ...) contiguous; chunk j goes to rank j, chunk i comes from rank i."""
        y = torch.empty_like(x)
        dist.all_to_all_single(_bytes(y), _bytes(x), group=self.group)
        return y

    def _real(self, y: torch.Tensor) -> torch.Tensor:
        """(B, s * (t_loc + i_loc), ...) gathered rank by rank -> its real tokens."""
        return y if self.index is None else y.index_select(1, self.index)

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        """(B, L_loc, H, D) of this rank's tokens -> (B, H, L, D) of every real token."""
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather([_bytes(p) for p in parts], _bytes(t), group=self.group)
        return self._real(torch.cat(parts, 1)).transpose(1, 2)

    def _to_heads(self, t: torch.Tensor) -> torch.Tensor:
        """(B, L_loc, H, D) of this rank's tokens -> (B, H/s, L, D) of every real token."""
        x = t.unflatten(2, (self.size, -1)).permute(2, 0, 1, 3, 4).contiguous()
        return self._real(self._all_to_all(x).permute(1, 0, 2, 3, 4).flatten(1, 2)).transpose(1, 2)

    def _to_tokens(self, o: torch.Tensor) -> torch.Tensor:
        """(B, L, H/s, D) of every real token -> (B, L_loc, H, D) of this rank's tokens."""
        if self.index is not None:
            full = o.new_zeros(o.shape[0], self.size * (self.t_loc + self.i_loc), *o.shape[2:])
            o = full.index_copy_(1, self.index, o)
        x = o.unflatten(1, (self.size, -1)).permute(1, 0, 2, 3, 4).contiguous()
        return self._all_to_all(x).permute(1, 2, 0, 3, 4).flatten(2, 3)

    def _attention(self, inner, func, q, k, v, heads, *rest, skip_reshape=False,
                   skip_output_reshape=False, **kwargs):  # fmt: skip
        """An `optimized_attention_override` with ComfyUI's signature; `inner` is the one the
        call had (or None)."""
        if (rest and rest[0] is not None) or kwargs.pop("mask", None) is not None:
            raise RuntimeError("sequence-parallel attention got a mask")
        if skip_reshape:  # (B, H, L, D)
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        else:  # (B, L, H * D)
            q, k, v = (t.unflatten(-1, (heads, -1)) for t in (q, k, v))
        attention = func if inner is None else functools.partial(inner, func)
        if heads % self.size:  # this rank's queries against every key
            q, k, v = q.transpose(1, 2), self._gather(k), self._gather(v)
            return attention(q, k, v, heads, None, skip_reshape=True,
                             skip_output_reshape=skip_output_reshape, **kwargs)  # fmt: skip
        q, k, v = (self._to_heads(t) for t in (q, k, v))
        h = heads // self.size
        out = attention(q, k, v, h, None, skip_reshape=True, **kwargs)
        out = self._to_tokens(out.unflatten(-1, (h, -1)))  # (B, L_loc, H, D)
        return out.transpose(1, 2) if skip_output_reshape else out.flatten(2)


# --- the plan of a call ----------------------------------------------------------------------


def _largest_divisor(n: int, of: int) -> int:
    return max(d for d in range(1, n + 1) if n % d == 0 and of % d == 0)


def plan(mode: str, world: int, batch: int, why_not_sp: str | None):
    """(groups, ranks per group, why not every rank is used or None). CFG groups take the
    batch (the cheaper split); sequence parallel takes the ranks within a group."""
    groups = 1 if mode == "sequence-parallel" else _largest_divisor(world, batch)
    sp = mode != "cfg-parallel" and why_not_sp is None
    size = world // groups if sp else 1
    if groups * size == world:
        return groups, size, None
    if mode == "cfg-parallel":
        return groups, size, f"a batch of {batch} splits over {groups} of {world} GPUs"
    return groups, size, f"no sequence parallel with {why_not_sp}"


# --- the worker pool -------------------------------------------------------------------------


@dataclass
class Call:
    """One diffusion-model call, described for the workers."""

    spec: tuple  # (args, kwargs) with Slots for tensors and the transformer options
    tensors: list[torch.Tensor]
    options: dict
    groups: int
    size: int
    attention: str | None
    fused: bool
    blocks: int
    out: tuple  # (shape, dtype) of each group's output


@dataclass
class Stats:
    calls: dict = field(default_factory=dict)  # (groups, size) -> calls
    local: dict = field(default_factory=dict)  # reason -> calls on rank 0 alone


class Pool:
    """Rank 0 (this process, on devices[0]) and one worker process per further device."""

    def __init__(self, devices: tuple[str, ...], backend: str):
        self.devices, self.backend = devices, backend
        self.device = torch.device(devices[0])
        self.world = len(devices)
        self.recipe = self.weights = self.procs = None
        self.links: list[Link] = []
        self.groups: dict = {}
        self.folder = tempfile.mkdtemp(prefix="qwen-turbo-multigpu-")  # mode 0700
        self.store_path = os.path.join(self.folder, "store")
        self.store = dist.FileStore(self.store_path)
        try:
            self._start()
        except BaseException:
            self.close(kill=True)
            raise

    def _start(self) -> None:
        import comfy.model_management as mm
        from comfy.cli_args import args

        if dist.is_initialized():
            raise MultiGPUError(
                "torch.distributed is already initialized in this process (by another node "
                "pack?); Multi-GPU needs its own process group"
            )
        env = dict(os.environ, **communicator_env())
        self.procs = []
        for rank, device in enumerate(self.devices[1:], 1):
            ops_r, ops_w = os.pipe()
            answers_r, answers_w = os.pipe()
            cfg = {"path": sys.path, "pack": PACK, "root": str(ROOT),
                   "init": str(ROOT / "__init__.py"), "rank": rank, "world": self.world,
                   "device": device, "backend": self.backend, "store": self.store_path,
                   "answers": answers_w}  # fmt: skip
            cmd = [sys.executable, "-c", BOOTSTRAP, json.dumps(cfg)]
            try:
                self.procs.append(subprocess.Popen(cmd, env=env, stdin=ops_r,
                                                   pass_fds=(answers_w,)))  # fmt: skip
            finally:
                os.close(ops_r)
                os.close(answers_w)
            self.links.append(Link(ops_w, answers_r))
        self.post({"op": "args", "args": vars(args)})
        deadline = time.monotonic() + START_TIMEOUT
        for rank, link in enumerate(self.links, 1):
            while not link.read().ready:
                self._check(starting=True)
                mm.throw_exception_if_processing_interrupted()  # Cancel stops the wait
                if time.monotonic() > deadline:
                    raise MultiGPUError(f"the worker on {self.devices[rank]} did not start "
                                        f"in {START_TIMEOUT:.0f} s")  # fmt: skip
                link.wait(0.05)
        extra = {"device_id": self.device} if self.backend == "nccl" else {}
        with communicator_scope():
            dist.init_process_group(
                self.backend,
                store=dist.PrefixStore("pg", self.store),
                rank=0,
                world_size=self.world,
                timeout=TIMEOUT,
                **extra,
            )
        log.info("Multi-GPU: workers started on %s (%s)", ", ".join(self.devices[1:]),
                 self.backend)  # fmt: skip

    def _check(self, starting: bool = False) -> None:
        """Raise MultiGPUError naming a worker that has exited, with its error if it sent one."""
        for rank, proc in enumerate(self.procs or (), 1):
            code = proc.poll()
            if code is None:
                continue
            error = self.links[rank - 1].read().error
            what = "failed to start" if starting else "failed"
            hint = (
                f" Each GPU holds a whole copy of the DiT: free memory on {self.devices[rank]} "
                "or use fewer GPUs (the node's `gpus`)."
                if error and "out of memory" in error.lower() else ""
            )  # fmt: skip
            raise MultiGPUError(
                f"Multi-GPU: the worker on {self.devices[rank]} {what} (exit code {code})"
                + (f": {error}" if error else "")
                + f". The workers were stopped; the next run starts them again.{hint}"
            )

    def _wait(self, works) -> None:
        """Wait for collectives, watching the workers: a dead one raises instead of a hang."""
        while not all(w.is_completed() for w in works):
            self._check()
            time.sleep(0.0002)
        for w in works:
            w.wait()

    def post(self, header: dict) -> None:
        """Send an operation to every worker (a worker gone raises MultiGPUError)."""
        line = wire.dumps(header)
        for link in self.links:
            try:
                link.send(line)
            except OSError:  # its pipe is closed: the worker has exited
                self._check()
                raise

    def load(self, blob: dict, signature, dm, patcher) -> None:
        """Build the model on the workers (when `blob` is new) and broadcast its weights."""
        sd = dm.state_dict()
        metas = [(name, tuple(t.shape), t.dtype) for name, t in sd.items()]
        self.post({"op": "load", "recipe": None if blob == self.recipe else blob, "metas": metas})
        pending, size = [], 0
        for name, t in sd.items():
            key = "diffusion_model." + name
            if key in patcher.patches and key not in patcher.backup:
                t = patched_weight(patcher, key, self.device)
            t = t.to(self.device).contiguous()
            if t.numel():
                pending.append(dist.broadcast(_bytes(t), 0, async_op=True))
                size += t.numel() * t.element_size()
            if size > PENDING_BYTES:
                self._wait(pending)
                pending, size = [], 0
        self._wait(pending)
        self.recipe, self.weights = blob, signature

    def run(self, call: Call, executor) -> torch.Tensor:
        """`call` on every rank: rank 0's share through `executor` (the wrappers inside this
        one, then the diffusion model), the workers' by broadcast; the outputs all_gathered."""
        metas = [(tuple(t.shape), t.dtype) for t in call.tensors]
        self.post({"op": "call", "spec": call.spec, "metas": metas, "groups": call.groups,
                   "size": call.size, "attention": call.attention, "fused": call.fused,
                   "blocks": call.blocks, "out": call.out})  # fmt: skip
        offsets, total = _layout(metas)
        flat = torch.zeros(total, dtype=torch.uint8, device=self.device)
        for o, t in zip(offsets, call.tensors, strict=True):
            if t.numel():
                flat[o : o + t.numel() * t.element_size()] = _bytes(t.to(self.device).contiguous())
        self._wait([dist.broadcast(flat, 0, async_op=True)])
        out = run_share(call, _unpack(flat, metas), call.options, 0, self.groups, executor)
        parts = [torch.empty_like(out) for _ in range(self.world)]
        self._wait([dist.all_gather([_bytes(p) for p in parts], _bytes(out), async_op=True)])
        return torch.cat(parts[:: call.size][: call.groups])

    def close(self, kill: bool = False) -> None:
        """Stop the workers (asked to, unless `kill` or one is gone: then killed, since the
        others may wait in a collective) and leave the process group."""
        ask = bool(self.procs) and not kill and all(p.poll() is None for p in self.procs)
        if ask:
            self.post({"op": "stop"})
        for p in self.procs or ():
            if ask:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(10)
            if p.poll() is None:
                p.kill()
            p.wait()
        if dist.is_initialized():
            abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
            if kill and self.backend == "nccl" and abort is not None:
                abort()  # NCCL kernels may wait on a dead peer: abort rather than destroy
            else:
                dist.destroy_process_group()
        for link in self.links:
            link.close()
        self.procs, self.links = None, []
        shutil.rmtree(self.folder, ignore_errors=True)


class Link:
    """Rank 0's ends of one worker's pipes: operations go out as lines of `wire`, and the
    worker's answers ({"ready": true}, {"error": text}) come back."""

    def __init__(self, ops: int, answers: int):
        self.ops = os.fdopen(ops, "wb")
        self.answers = answers
        os.set_blocking(answers, False)
        self.buffer = b""
        self.ready, self.error = False, None

    def send(self, line: bytes) -> None:
        self.ops.write(line)
        self.ops.flush()

    def wait(self, seconds: float) -> None:
        """Until an answer may have come, at most `seconds`."""
        select.select([self.answers], [], [], seconds)

    def read(self) -> "Link":
        """Take in what the worker has answered so far."""
        while True:
            try:
                chunk = os.read(self.answers, 1 << 16)
            except (BlockingIOError, OSError):
                break
            if not chunk:
                break
            self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        for line in lines:
            try:
                answer = wire.loads(line)
            except ValueError as e:
                log.warning("Multi-GPU: dropped a worker's answer that is not plain data (%s)", e)
                continue
            self.ready = self.ready or answer.get("ready") is True
            if isinstance(answer.get("error"), str):
                self.error = answer["error"]
        return self

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.ops.close()
        with contextlib.suppress(OSError):
            os.close(self.answers)


def run_share(call: Call, tensors, options: dict, rank: int, groups_cache: dict, forward):
    """This rank's share of `call`: its group's rows, its sequence chunk when the group is
    sequence parallel; zeros for a rank outside every group."""
    args, kwargs = call.spec
    x = tensors[args[0].i]
    batch, group = x.shape[0], rank // call.size
    shape, dtype = call.out
    sp = _sp_group(groups_cache, call.groups, call.size, rank) if call.size > 1 else None
    if call.attention in QUANTIZED:
        key = ("override", call.attention, call.groups, call.size)
        if key not in groups_cache:  # made once per plan, not per call
            scales_over = _call_group(groups_cache, call.groups, call.size)
            groups_cache[key] = attention_override(call.attention, amax_group=scales_over)
        options = {**options, "optimized_attention_override": groups_cache[key]}
    if group >= call.groups:
        return torch.zeros(shape, dtype=dtype, device=x.device)
    tensors = [_share(t, batch, call.groups, group) for t in tensors]
    if call.size > 1:
        options = SeqParallel(sp, call.size, rank % call.size).options(options, call.blocks)
    out = forward(*_fill(args, tensors, options), **_fill(kwargs, tensors, options))
    if out.shape != shape:
        raise RuntimeError(f"Multi-GPU: the model's output {tuple(out.shape)} is not {shape}")
    return out.to(dtype).contiguous()


_pool: Pool | None = None


def pool(devices: tuple[str, ...], backend: str) -> Pool:
    """The running pool for these devices, or a fresh one (any other pool is stopped)."""
    global _pool
    if _pool is not None and (_pool.devices, _pool.backend) == (devices, backend):
        return _pool
    shutdown()
    atexit.unregister(shutdown)  # once
    atexit.register(shutdown)
    _pool = Pool(devices, backend)
    return _pool


def shutdown(kill: bool = False) -> None:
    """Stop the workers, if any."""
    global _pool
    if _pool is not None:
        p, _pool = _pool, None
        p.close(kill)


# --- rank 0: the wrapper ---------------------------------------------------------------------

_tokens: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()
_recipes: "weakref.WeakKeyDictionary[torch.nn.Module, bytes]" = weakref.WeakKeyDictionary()


class Driver:
    """The DIFFUSION_MODEL wrapper of a Multi-GPU model. ModelPatcher deep-copies wrappers
    with its options on every clone; this one stays one object, so its clones share `stats`."""

    # its Python talks to the workers on every call: the CUDA Graph Sampler captures only
    # inside it (rank 0's share), never around it
    runs_python_per_call = True

    def __init__(self, base, devices, mode: str, backend: str):
        self.base = weakref.ref(base)
        self.devices, self.mode, self.backend = tuple(devices), mode, backend
        self.stats = Stats()

    def __deepcopy__(self, memo):
        return self

    def __call__(self, executor, *args, **kwargs):
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            # raised before any message, so the workers stay in step for the eager rerun
            raise RuntimeError("Multi-GPU model calls cannot be captured in a CUDA graph")
        try:
            call, patcher, dm, why = self.describe(executor, args, kwargs)
        except NotReplicable as e:
            return self._local(str(e), executor, args, kwargs)
        if call.groups * call.size == 1:
            return self._local(why, executor, args, kwargs)
        if why is not None:
            log_once(log, logging.INFO, f"Multi-GPU: {why}")
        key = (call.groups, call.size)
        self.stats.calls[key] = self.stats.calls.get(key, 0) + 1
        workers = pool(self.devices, self.backend)
        try:
            signature = (_tokens.setdefault(dm, uuid.uuid4().hex), patcher.patches_uuid)
            if workers.weights != signature:
                workers.load(_recipes[dm], signature, dm, patcher)
            return workers.run(call, executor)
        except BaseException as e:
            try:
                workers._check()
            except MultiGPUError as failed:
                shutdown(kill=True)
                raise failed from e
            shutdown(kill=True)  # rank 0 failed mid-call: the workers are out of step
            raise

    def _local(self, why: str, executor, args, kwargs):
        self.stats.local[why] = self.stats.local.get(why, 0) + 1
        log_once(log, logging.INFO, f"Multi-GPU: running on {self.devices[0]} alone: {why}")
        return executor(*args, **kwargs)

    def describe(self, executor, args, kwargs):
        """(Call, current ModelPatcher, diffusion model, why not every rank takes part or
        None); NotReplicable when the workers could not compute this call as rank 0 does."""
        base, dm = self.base(), executor.class_obj
        patcher = getattr(base, "current_patcher", None)
        if patcher is None:
            raise NotReplicable("no ModelPatcher is running the model")
        bound = inspect.signature(dm._forward).bind(*args, **kwargs).arguments
        options = bound.get("transformer_options") or {}
        if bound.get("control") is not None:
            raise NotReplicable("ControlNet inputs")
        patches = [name for k in ("patches", "patches_replace")
                   for name, v in options.get(k, {}).items() if v]  # fmt: skip
        if patches:
            raise NotReplicable(f"model patches ({', '.join(map(str, patches))})")
        chain = [(k, f) for k, fns in options.get("wrappers", {}).get("diffusion_model", {})
                 .items() for f in fns]  # fmt: skip
        at = next((i for i, (_, f) in enumerate(chain) if f is self), len(chain))
        foreign = [k for k, f in chain[at + 1 :] if not own(f)]
        if foreign:
            raise NotReplicable(f"the {foreign[0]!r} diffusion_model wrapper")
        override = options.get("optimized_attention_override")
        attention = attention_name(override) if override is not None else None
        if override is not None and attention is None:
            raise NotReplicable(f"attention override {override!r}")
        fused = fused_blocks(patcher, dm)
        if dm not in _recipes:
            _recipes[dm] = recipe(base)
        tensors: list[torch.Tensor] = []
        spec = (_strip(tuple(args), tensors, options), _strip(dict(kwargs), tensors, options))
        try:
            wire.encode(spec)
        except TypeError as e:
            raise NotReplicable(f"a model argument that is not plain data ({e})") from None
        x = args[0]
        groups, size, why = plan(self.mode, len(self.devices), x.shape[0],
                                 self._why_not_sp(dm, bound))  # fmt: skip
        out = ((x.shape[0] // groups, *x.shape[1:]), x.dtype)
        blocks = len(dm.transformer_blocks)
        call = Call(spec, tensors, options, groups, size, attention, fused, blocks, out)
        return call, patcher, dm, why

    @staticmethod
    def _why_not_sp(dm, bound) -> str | None:
        if bound.get("attention_mask") is not None:
            return "a text attention mask"
        extra = bound.get("kwargs", {})
        method = extra.get("ref_latents_method", getattr(dm, "default_ref_method", "index"))
        if bound.get("ref_latents") is not None and method == "index_timestep_zero":
            return "reference latents at timestep zero (Edit-2511)"
        return None


def parallel(model, devices, mode: str = "auto", backend: str = "nccl"):
    """A clone of `model` (a ModelPatcher) whose diffusion-model calls run on `devices`
    (the first: this process's, where `model` runs), split by `mode`."""
    import comfy.patcher_extension as pe
    from comfy.ldm.qwen_image.model import QwenImageTransformer2DModel

    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {MODES}")
    dm = getattr(model.model, "diffusion_model", None)
    if not isinstance(dm, QwenImageTransformer2DModel):
        raise ValueError(f"Multi-GPU runs Qwen-Image DiTs; this MODEL holds {type(dm).__name__}")
    model = model.clone()
    model.remove_wrappers_with_key(pe.WrappersMP.DIFFUSION_MODEL, KEY)
    driver = Driver(model.model, devices, mode, backend)
    model.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, KEY, driver)
    return model


def driver_of(model) -> Driver | None:
    import comfy.patcher_extension as pe

    found = model.get_wrappers(pe.WrappersMP.DIFFUSION_MODEL, KEY)
    return found[0] if found else None


def cuda_devices(load_device: torch.device, gpus: int) -> tuple[list[str], str | None]:
    """The devices for `gpus` GPUs with `load_device` first, and a note: why fewer (or none:
    the model stays as it is) are used."""
    if gpus <= 1:
        return [], "1 GPU asked for: the model runs as it is"
    if load_device.type != "cuda":
        return [], f"the model runs on {load_device.type}, not CUDA: it runs as it is"
    count = torch.cuda.device_count()
    if count < 2:
        return [], f"{count} CUDA device present: the model runs as it is"
    first = load_device.index if load_device.index is not None else torch.cuda.current_device()
    others = [f"cuda:{i}" for i in range(count) if i != first][: gpus - 1]
    note = None if len(others) == gpus - 1 else f"{count} CUDA devices present, not {gpus}"
    return [f"cuda:{first}", *others], note


# --- ranks 1..N-1 ----------------------------------------------------------------------------


def receive(stream) -> dict | None:
    """The next operation on `stream` (a worker's stdin), or None at its end (rank 0 gone).
    A line that is not an operation of `OPS` with its fields is dropped with a log line."""
    while line := stream.readline():
        try:
            op = wire.loads(line)
            fields = OPS.get(op.get("op")) if isinstance(op.get("op"), str) else None
            if fields is None or any(f not in op for f in fields):
                raise ValueError(f"not an operation: {str(op)[:200]}")
        except ValueError as e:
            log.warning("Multi-GPU worker: dropped a control message (%s)", e)
            continue
        return op
    return None


class Worker:
    def __init__(self, ops, rank: int, device: torch.device):
        self.ops, self.rank, self.device = ops, rank, device
        self.dm = None
        self.fused = None
        self.overrides: dict = {}
        self.groups: dict = {}

    def loop(self) -> None:
        while (header := receive(self.ops)) is not None and header["op"] != "stop":
            if header["op"] != "args":
                getattr(self, header["op"])(header)

    def load(self, header: dict) -> None:
        if header["recipe"] is not None:
            self.dm = self.fused = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self.dm = build(header["recipe"])
        current = self.dm.state_dict()
        new, works = {}, []
        for name, shape, dtype in header["metas"]:
            t = current.get(name)
            if t is None or t.is_meta or tuple(t.shape) != shape or t.dtype != dtype:
                t = torch.empty(shape, dtype=dtype, device=self.device)
            if t.numel():
                works.append(dist.broadcast(_bytes(t), 0, async_op=True))
            new[name] = t
        for w in works:
            w.wait()
        self.dm.load_state_dict(new, strict=True, assign=True)
        left = [n for n, t in [*self.dm.named_parameters(), *self.dm.named_buffers()] if t.is_meta]
        if left:
            raise RuntimeError(f"no weights came for {left[:3]}")

    def call(self, header: dict) -> None:
        metas = header["metas"]
        flat = torch.empty(_layout(metas)[1], dtype=torch.uint8, device=self.device)
        dist.broadcast(flat, 0)
        if self.fused != header["fused"]:
            set_fused(self.dm, header["fused"])
            self.fused = header["fused"]
        options = {}
        if header["attention"] is not None:
            name = header["attention"]
            options["optimized_attention_override"] = self.overrides.setdefault(
                name, attention_override(name)
            )
        fields = ("spec", "groups", "size", "attention", "fused", "blocks", "out")
        call = Call(tensors=None, options=options, **{k: header[k] for k in fields})
        with torch.inference_mode():
            out = run_share(call, _unpack(flat, metas), options, self.rank, self.groups,
                            self.dm._forward)  # fmt: skip
            parts = [torch.empty_like(out) for _ in range(dist.get_world_size())]
            dist.all_gather([_bytes(p) for p in parts], _bytes(out))


def worker_main(cfg: dict) -> None:
    """A worker process: ComfyUI's modules set up as in the parent, then operations until
    "stop" or the end of stdin. An error is answered for rank 0 to report, and the process
    exits."""
    rank, device = cfg["rank"], torch.device(cfg["device"])
    answers = os.fdopen(cfg["answers"], "wb")

    def answer(message: dict) -> None:
        with contextlib.suppress(OSError):  # rank 0 may be gone already
            answers.write(wire.dumps(message))
            answers.flush()

    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:  # CPU ranks (tests) share the cores
            torch.set_num_threads(max(1, torch.get_num_threads() // cfg["world"]))
        from comfy.cli_args import args

        first = receive(sys.stdin.buffer)
        if first is None or first["op"] != "args":
            sys.exit(0)
        vars(args).update(first["args"])
        args.cpu = device.type == "cpu"
        args.disable_dynamic_vram = True  # plain resident modules; no VRAM manager here
        import comfy.model_management  # noqa: F401  (set up for this device)

        answer({"ready": True})
        extra = {"device_id": device} if cfg["backend"] == "nccl" else {}
        store = dist.PrefixStore("pg", dist.FileStore(cfg["store"]))
        dist.init_process_group(cfg["backend"], store=store, rank=rank, world_size=cfg["world"],
                                timeout=TIMEOUT, **extra)  # fmt: skip
        Worker(sys.stdin.buffer, rank, device).loop()
        dist.destroy_process_group()
    except Exception as e:
        traceback.print_exc()
        answer({"error": f"{type(e).__name__}: {e}"[:2000]})
        sys.exit(1)
