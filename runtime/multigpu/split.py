"""How one model call is split over the ranks: the plan (CFG groups and sequence parallel),
each rank's share of the tensors, the process groups (made with the communicators on
loopback), sequence parallel around the blocks and attention, and `run_share`, one rank's
part of a call on rank 0 and the workers alike."""

import contextlib
import functools
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..dit.attention import QUANTIZED, attention_override
from .wire import Slot


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
    of a plan, in the same order, the first time it meets the plan (new_group's rule), also
    the groups it is not in."""
    if groups == 1 and size == dist.get_world_size():
        return None  # the whole world
    if (groups, size) not in cache:
        cache[groups, size] = [_new_group(range(j * size, (j + 1) * size)) for j in range(groups)]
    return cache[groups, size][rank // size] if rank < groups * size else None


def _call_group(cache: dict, groups: int, size: int):
    """The process group of the ranks that take part in a call of this plan, None on a rank
    outside it; made, where it is not the whole world, as `_sp_group` makes its groups."""
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
    (NCCL's bootstrap, gloo's pairs), NVLink multicast off (NCCL_NVLS_ENABLE), and NCCL's
    watchdog aborting a failed communicator without taking the process down (its default
    would end ComfyUI's process; rank 0's own watch reports the failure)."""
    lo = loopback()
    return {"NCCL_SOCKET_IFNAME": lo, "GLOO_SOCKET_IFNAME": lo, "NCCL_NVLS_ENABLE": "0",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}  # fmt: skip


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
    """A process group of `ranks` (every rank calls this), None on a rank outside it."""
    with communicator_scope():
        group = dist.new_group(list(ranks))
    return None if group is dist.GroupMember.NON_GROUP_MEMBER else group


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
                            r * self.i_loc + q - self.t_loc < self.n_img)  # fmt: skip
        self.index = None if bool(valid.all()) else valid.flatten().nonzero()[:, 0].to(img.device)
        mine = valid[self.rank]  # this rank's tokens that are real, not padding
        self.padding = None if bool(mine.all()) else (~mine)[:, None, None].to(img.device)

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
            if self.padding is not None:  # zeros: a quantized attention's scale is the call's
                q = q.masked_fill(self.padding, 0)
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


def run_share(call: Call, tensors, options: dict, rank: int, groups_cache: dict, forward):
    """This rank's share of `call`: its group's rows, its sequence chunk when the group is
    sequence parallel; zeros for a rank outside every group."""
    args, kwargs = call.spec
    x = tensors[args[0].i]
    batch, group = x.shape[0], rank // call.size
    shape, dtype = call.out
    # every rank makes the plan's groups (new_group's rule); only those in the call use them
    sp = _sp_group(groups_cache, call.groups, call.size, rank) if call.size > 1 else None
    quantized = call.attention in QUANTIZED
    scales_over = _call_group(groups_cache, call.groups, call.size) if quantized else None
    if group >= call.groups:  # outside the call: no collective, no group registered
        return torch.zeros(shape, dtype=dtype, device=x.device)
    if quantized:
        key = ("override", call.attention, call.groups, call.size)
        if key not in groups_cache:  # made once per plan, not per call
            groups_cache[key] = attention_override(call.attention, amax_group=scales_over)
        options = {**options, "optimized_attention_override": groups_cache[key]}
    tensors = [_share(t, batch, call.groups, group) for t in tensors]
    if call.size > 1:
        options = SeqParallel(sp, call.size, rank % call.size).options(options, call.blocks)
    from ..dit import fp8  # here: a worker imports ComfyUI only once its device is set

    with fp8.without_kept_blocks():  # as every rank's model computes
        out = forward(*_fill(args, tensors, options), **_fill(kwargs, tensors, options))
    if out.shape != shape:
        raise RuntimeError(f"Multi-GPU: the model's output {tuple(out.shape)} is not {shape}")
    return out.to(dtype).contiguous()
