"""Runs a plan tile by tile: crops with their halos in, interiors stitched out."""

import torch

from ...kernels.group_norm_stats import finalize_moments, group_moments, merge_moments
from .. import host
from .ops import Global, State, Stats
from .planner import Chain, Plan


def _host_buffer(like: torch.Tensor, h: int, w: int, device) -> torch.Tensor:
    """A host tensor of shape (*lead, h, w) stored rows first, so that full-width row strips
    are contiguous (one DMA each, pinned when the device is a GPU)."""
    pin = torch.device(device).type == "cuda" and not host.pinning_disabled()
    buf = torch.empty(h, *like.shape[:-2], w, dtype=like.dtype, pin_memory=pin)
    return buf.movedim(0, -2)


def _rows(t: torch.Tensor, a0: int, a1: int, b0: int, b1: int, device) -> torch.Tensor:
    """t[..., a0:a1, b0:b1] on `device`; a strip of a host buffer moves as one block."""
    if t.device.type == "cpu" and b0 == 0 and b1 == t.shape[-1]:
        strip = t.movedim(-2, 0)[a0:a1]
        if strip.is_contiguous():
            return strip.to(device).movedim(0, -2)
    return t[..., a0:a1, b0:b1].to(device)


def _write(dst: torch.Tensor, src: torch.Tensor, y0: int, y1: int, x0: int, x1: int) -> None:
    if dst.device.type == "cpu" and x0 == 0 and x1 == dst.shape[-1]:
        strip = dst.movedim(-2, 0)[y0:y1]
        if strip.is_contiguous():
            strip.copy_(src.movedim(-2, 0))
            return
    dst[..., y0:y1, x0:x1] = src


def _run_chain(chain: Chain, x: State, device, tick) -> State:
    h, w = x[0].shape[-2:]
    halo = chain.halo

    def at(n: int) -> int:  # input pixels to output pixels (exact: tiles sit on the grid)
        return int(n * chain.scale)

    out = None
    for y0, y1, x0, x1 in chain.tiles:
        a0, a1 = max(0, y0 - halo), min(h, y1 + halo)
        b0, b1 = max(0, x0 - halo), min(w, x1 + halo)
        crop = tuple(_rows(t, a0, a1, b0, b1, device) for t in x)
        for op in chain.ops:
            crop = op.fn(*crop)
        ya, xa = at(y0 - a0), at(x0 - b0)
        inner = [t[..., ya : ya + at(y1 - y0), xa : xa + at(x1 - x0)] for t in crop]
        if out is None:
            if chain.store_on_device and len(chain.tiles) == 1:
                out = tuple(inner)
            elif chain.store_on_device:
                out = tuple(
                    torch.empty(*t.shape[:-2], at(h), at(w), dtype=t.dtype, device=device)
                    for t in inner
                )
            else:
                out = tuple(_host_buffer(t, at(h), at(w), device) for t in inner)
        if out[0] is not inner[0]:
            for o, t in zip(out, inner, strict=True):
                _write(o, t, at(y0), at(y1), at(x0), at(x1))
        del crop, inner
        tick()
    return out


def _run_stats(op: Stats, rows: int, x: State, device) -> None:
    t = x[op.index]
    acc = None
    for r0 in range(0, t.shape[-2], rows):
        m = group_moments(_rows(t, r0, r0 + rows, 0, t.shape[-1], device), op.norm.num_groups)
        acc = m if acc is None else merge_moments(acc, m)
    op.mean, op.rstd = finalize_moments(acc, op.norm.eps)


def execute(plan: Plan, x: torch.Tensor, device, progress=None) -> torch.Tensor:
    """Run a plan on `x` (already in the VAE's dtype): a latent for a decoder's ops, pixels
    for an encoder's. Returns the last op's output.

    progress: optional callable(done, total), called after each tile; it may raise to stop.
    """
    total, done = plan.total, 0

    def tick():
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total)

    state: State = (x,)
    with torch.inference_mode():
        for step in plan.steps:
            if isinstance(step, Chain):
                state = _run_chain(step, state, device, tick)
            elif isinstance(step, Global):
                state = step.fn(*(t.to(device) for t in state))
                tick()
            else:
                _run_stats(*step, state, device)
                tick()
    return state[0]
