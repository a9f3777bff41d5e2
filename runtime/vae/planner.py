"""The plan of a tiled run: the ops split into chains, each chain into tiles within a budget.

Runs of Local ops execute as chains. Each tile reads its input with a halo as wide as the
chain's receptive field and keeps only its interior, so tiles are stitched, never blended, and
the result equals an untiled run. Where a chain downsamples, tile borders and halos sit on
multiples of its downscale factor, so every crop sees the whole tensor's pixel grid. A chain
ends wherever its full output is small enough to keep; keeping it costs memory, recomputing
halos costs time.
"""

import math
from dataclasses import dataclass, field
from fractions import Fraction

import torch

from .ops import Local, Stats

MIN_TILE = 8  # input pixels


@dataclass
class Chain:
    ops: list
    scale: Fraction  # output size / input size
    halo: int
    tiles: list[tuple[int, int, int, int]]  # (y0, y1, x0, x1) in input pixels
    store_on_device: bool


@dataclass
class Plan:
    steps: list = field(default_factory=list)  # Chain | Global | (Stats, rows)

    @property
    def total(self) -> int:
        return sum(len(s.tiles) if isinstance(s, Chain) else 1 for s in self.steps)

    @property
    def max_tiles(self) -> int:
        return max((len(s.tiles) for s in self.steps if isinstance(s, Chain)), default=1)


def _grid(h: int, w: int, th: int, tw: int, step: int) -> list[tuple[int, int, int, int]]:
    """Tiles of about th x tw covering h x w, their borders on multiples of `step`."""
    ny, nx = math.ceil(h / th), math.ceil(w / tw)
    ys = [round(i * (h // step) / ny) * step for i in range(ny)] + [h]
    xs = [round(i * (w // step) / nx) * step for i in range(nx)] + [w]
    return [(ys[i], ys[i + 1], xs[j], xs[j + 1]) for i in range(ny) for j in range(nx)]


def _chain_geometry(ops: list) -> tuple[Fraction, int, int]:
    """(scale, halo, step): tile borders and the halo sit on multiples of `step`, the chain's
    downscale factor, so every downsampling op sees the same pixel grid as untiled."""
    scale, radius, step = Fraction(1), 0.0, 1
    for op in ops:
        radius += op.radius / scale
        scale *= op.scale
        step = math.lcm(step, scale.denominator)
    return scale, step * math.ceil(radius / step - 1e-9), step


def _tile_bytes(ops, c_in, th, tw, halo, per_px) -> float:
    """Working set of one tile of a chain: its input crop, the largest op, its output."""
    pix = (th + 2 * halo) * (tw + 2 * halo)
    c, worst, scale = c_in, 0.0, 1.0
    for op in ops:
        scale *= op.scale
        worst = max(worst, op.peak_channels * pix * scale * scale)
        c = op.out_channels
    return per_px * (c_in * pix + worst + c * th * tw * scale * scale)


def plan_tiles(
    ops: list,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    budget: int,
    tile_px: int = 0,
) -> Plan:
    """Split `ops` into chains and tiles so that the working set stays within `budget` bytes.

    shape: the input's shape (B, C, [T,] H, W). tile_px: tile side in pixels at each chain's
    larger end (image pixels for a decoder's last chain and an encoder's first), 0 = the
    largest tile that fits.
    """
    batch = shape[0] * (shape[2] if len(shape) == 5 else 1)
    per_px = batch * torch.finfo(dtype).bits // 8
    keep_limit = budget / 4  # a chain may end where its output is this small
    c, h, w = shape[1], shape[-2], shape[-1]
    out = Plan()
    run: list[Local] = []
    resident = True  # whether the current state is on the device

    def flush():
        nonlocal c, h, w, resident
        if not run:
            return
        scale, halo, step = _chain_geometry(run)
        c_out = run[-1].out_channels
        in_bytes = per_px * c * h * w if resident else 0
        out_bytes = per_px * c_out * h * w * float(scale) ** 2
        on_device = in_bytes + out_bytes <= 0.6 * budget
        held = in_bytes + (out_bytes if on_device else 0)

        def fits(th, tw, halo=halo):
            return _tile_bytes(run, c, th, tw, halo, per_px) + held <= budget

        def side(t, n):  # a tile side: on the grid's step, within the tensor
            return min(step * max(1, math.ceil(t / step)), n)

        if tile_px:
            t = math.ceil(tile_px / max(scale, 1))
            th, tw = side(t, h), side(t, w)
        elif fits(h, w, 0):
            th, tw = h, w
        else:
            # the largest tile that fits: squares, or full-width strips where a tensor on the
            # host is read or written, so each strip is one contiguous copy

            def tile(t):
                return side(t, h), (side(t, w) if resident and on_device else w)

            lo, hi = MIN_TILE, max(h, w)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if fits(*tile(mid)) else (lo, mid - 1)
            th, tw = tile(lo)
        out.steps.append(Chain(list(run), scale, halo, _grid(h, w, th, tw, step), on_device))
        c, h, w = c_out, int(h * scale), int(w * scale)
        resident = on_device
        run.clear()

    for op in ops:
        if isinstance(op, Local):
            run.append(op)
            # end the chain where its output is cheap to keep
            scale = float(_chain_geometry(run)[0])
            if per_px * op.out_channels * h * w * scale * scale <= keep_limit:
                flush()
        else:
            flush()
            if isinstance(op, Stats):
                rows = max(1, int(keep_limit // max(1, 4 * per_px * c * w)))
                out.steps.append((op, rows))
            else:
                out.steps.append(op)
                c, resident = op.out_channels, True
    flush()
    return out
