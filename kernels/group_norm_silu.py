"""GroupNorm with an optional fused SiLU: the AutoencoderKL VAE norm (SD1.5, SDXL, SD3, Flux).

Those VAEs run GroupNorm(32, C, eps=1e-6, affine) and then SiLU on activations as large as
1x128x2048x2048, where each of the 32 groups holds 16.7 M elements. PyTorch reduces each
(sample, group) in one thread block, so only B * G blocks (32 at batch 1) do the reading,
and SiLU is a second pass over memory. Here the statistics of each group are split across
many programs and merged exactly (Chan et al.), and the normalisation, affine and SiLU are
one pass: x is read twice and the output written once.

Three Triton launches:
  1. stats:   grid (B*G * P,). Program (group, chunk) reduces TILES * 4096 contiguous
              elements of its group to a partial (mean, M2), by per-lane Welford updates
              and an exact merge of the lanes.
  2. combine: grid (cdiv(B*G, GB),). Merges each group's P partials into (mean, rstd),
              float32, GB groups a program.
  3. apply:   grid (cdiv(B*C, ROWS) * cdiv(S, BLOCK_S),). Each program normalises a
              [ROWS, BLOCK_S] tile of (channel row, position), applies the affine and SiLU in
              float32 and rounds once to x's dtype.
"""

import contextlib

import torch
import torch.nn.functional as F

from ._triton import (
    HAS_TRITON,
    common_reason,
    custom_op,
    fast_launch,
    grad_reason,
    log_fallback_once,
    tl,
    triton,
)

OP = "group_norm_silu"

# Stats pass: one tile is BLOCK contiguous elements of a group (8 warps x 32 lanes x 16
# values: two 16-byte loads per thread in bf16/fp16). A program reduces a chunk of whole
# tiles; chunks are sized so that about _TARGET_PROGRAMS programs cover the tensor (many
# waves on 132 SMs), each with at least _MIN_TILES tiles, and a group has at most
# _MAX_CHUNKS chunks so the combine kernel holds all partials of a group in one block.
_STATS_BLOCK = 4096
_STATS_WARPS = 8
_TARGET_PROGRAMS = 8192
_MIN_TILES = 2
_MAX_CHUNKS = 4096
# Combine pass: [groups, chunks] tiles of up to _COMBINE_TILE partials (P <= _MAX_CHUNKS).
_COMBINE_TILE = 4096
# Apply pass: a [ROWS, BLOCK_S] tile of _APPLY_TILE elements; BLOCK_S covers a whole channel
# row up to _APPLY_TILE positions, so small maps (17x29, 1x1) stack several rows per tile.
_APPLY_TILE = 4096
_MIN_BLOCK_S = 16


def group_norm_silu_reference(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    silu: bool = True,
) -> torch.Tensor:
    """Eager reference: F.group_norm, then F.silu when `silu`, each in x's dtype."""
    y = F.group_norm(x, num_groups, weight, bias, eps)
    return F.silu(y) if silu else y


def _scratch(numel: int, device: torch.device) -> torch.Tensor:
    """float32 workspace for partials and per-group statistics (tests poison it)."""
    return torch.empty(numel, dtype=torch.float32, device=device)


if HAS_TRITON:

    def _chunking(n: int, groups: int) -> tuple[int, int]:
        """(TILES, P): tiles of _STATS_BLOCK per stats program and programs per group, for
        `groups` groups of n elements. TILES is a power of two: it is a compile-time constant
        (a loop bound; Triton's interpreter cannot loop to a runtime bound under NumPy 2.4), so
        rounding it keeps the number of compiled variants to a handful."""
        tiles = triton.cdiv(n, _STATS_BLOCK)
        per_chunk = max(
            min(_MIN_TILES, tiles),
            triton.cdiv(tiles * groups, _TARGET_PROGRAMS),
            triton.cdiv(tiles, _MAX_CHUNKS),
        )
        per_chunk = triton.next_power_of_2(per_chunk)
        return per_chunk, triton.cdiv(n, per_chunk * _STATS_BLOCK)

    def _apply_blocks(rows: int, s: int) -> tuple[int, int, int]:
        """(ROWS, BLOCK_S, num_warps) for `rows` channel rows of `s` positions each."""
        block_s = max(_MIN_BLOCK_S, min(_APPLY_TILE, triton.next_power_of_2(s)))
        block_r = max(1, min(_APPLY_TILE // block_s, triton.next_power_of_2(rows)))
        num_warps = 8 if block_r * block_s >= 2048 else 4
        return block_r, block_s, num_warps

    @fast_launch
    @triton.jit
    def _group_norm_silu_stats_kernel(
        x_ptr,
        pmean_ptr,
        pm2_ptr,
        N,
        P,
        TILES: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """Partial (mean, M2) of one chunk, TILES * BLOCK contiguous elements of one group.

        x: contiguous, viewed as (B*G, N) with N = (C/G) * spatial, any float dtype.
        pmean, pm2: float32 (B*G, P). Program pid handles group pid // P, chunk pid % P;
        the last chunk of a group is short.
        """
        pid = tl.program_id(0)
        grp = pid // P
        chunk = pid % P
        # int64 offsets: B*C*H*W passes 2^31 for large images and video.
        start = chunk.to(tl.int64) * TILES * BLOCK
        base = x_ptr + grp.to(tl.int64) * N + start
        n = tl.minimum(N - start, TILES * BLOCK)  # elements in this chunk
        lanes = tl.arange(0, BLOCK)
        # Welford per lane, in float32: lane l sees elements l, l + BLOCK, l + 2*BLOCK, ...
        # Every update subtracts the running mean before squaring, so a large common offset
        # (mean 1000, std 1) does not cancel the way E[x^2] - E[x]^2 would in float32. A
        # lane that is valid in tile t was valid in every earlier tile, so all valid lanes
        # hold count t + 1 and 1 / count is one scalar per tile. Invalid lanes (past the end
        # of a short chunk) get delta = 0 and keep their state. When N is a multiple of 16
        # the mask is constant over 16 lanes and the loads stay vectorised.
        mean = tl.zeros([BLOCK], dtype=tl.float32)
        m2 = tl.zeros([BLOCK], dtype=tl.float32)
        for t in range(0, TILES):
            idx = t * BLOCK + lanes
            valid = idx < n
            v = tl.load(base + idx, mask=valid, other=0.0).to(tl.float32)
            r = 1.0 / (t + 1.0)
            delta = tl.where(valid, v - mean, 0.0)
            mean += delta * r
            m2 += delta * (v - mean)
        # Merge the lanes exactly (Chan et al. for many parts): the chunk mean is the
        # count-weighted mean of the lane means, and M2 adds each lane's M2 plus its count
        # times the squared distance of its mean from the chunk mean. Lane l holds
        # cdiv(n - l, BLOCK) elements (n >= 1 and l < BLOCK keep the numerator >= 0);
        # empty lanes weigh 0.
        cnt = ((n - lanes + BLOCK - 1) // BLOCK).to(tl.float32)
        chunk_mean = tl.div_rn(tl.sum(cnt * mean, axis=0), n.to(tl.float32))
        d = mean - chunk_mean
        chunk_m2 = tl.sum(m2 + cnt * d * d, axis=0)
        tl.store(pmean_ptr + pid, chunk_mean)
        tl.store(pm2_ptr + pid, chunk_m2)

    @fast_launch
    @triton.jit
    def _group_norm_silu_combine_kernel(
        pmean_ptr,
        pm2_ptr,
        mean_ptr,
        rstd_ptr,
        GROUPS,
        N,
        CHUNK,
        P,
        eps,
        GB: tl.constexpr,
        BLOCK_P: tl.constexpr,
    ):
        """Merge the P partials of each of GB groups into mean and rstd = 1 / sqrt(var + eps).

        pmean, pm2: float32 (GROUPS, P) with GROUPS = B*G; mean, rstd: float32 (GROUPS,).
        Biased variance, as F.group_norm.
        """
        grps = tl.program_id(0) * GB + tl.arange(0, GB)
        offs = tl.arange(0, BLOCK_P)
        gmask = grps < GROUPS
        pmask = offs < P
        mask = gmask[:, None] & pmask[None, :]
        idx = grps[:, None] * P + offs[None, :]
        pm = tl.load(pmean_ptr + idx, mask=mask, other=0.0)
        pm2 = tl.load(pm2_ptr + idx, mask=mask, other=0.0)
        # Chunk counts: CHUNK each, the last one short; padding chunks weigh 0. Their sum is
        # N (taken as a sum: an int argument equal to 1 is a constexpr, which has no .to()).
        cnt = tl.minimum(N - offs.to(tl.int64) * CHUNK, CHUNK)
        cnt = tl.where(pmask, cnt, 0).to(tl.float32)
        n = tl.sum(cnt, axis=0)
        # Chan et al. again, now over chunks: count-weighted mean of the chunk means, then
        # the chunks' M2 plus the spread of their means around the group mean.
        mean = tl.div_rn(tl.sum(cnt[None, :] * pm, axis=1), n)
        d = pm - mean[:, None]
        m2 = tl.sum(pm2 + cnt[None, :] * d * d, axis=1)
        # Clamp the variance: rounding can leave M2 a hair below zero for a constant group.
        var = tl.maximum(tl.div_rn(m2, n), 0.0)
        rstd = tl.div_rn(1.0, tl.sqrt_rn(var + eps))
        tl.store(mean_ptr + grps, mean, mask=gmask)
        tl.store(rstd_ptr + grps, rstd, mask=gmask)

    @fast_launch
    @triton.jit
    def _group_norm_silu_apply_kernel(
        x_ptr,
        mean_ptr,
        rstd_ptr,
        w_ptr,
        b_ptr,
        out_ptr,
        ROWS_TOTAL,
        C,
        CPG,
        S,
        HAS_W: tl.constexpr,
        HAS_B: tl.constexpr,
        SILU: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK_S: tl.constexpr,
    ):
        """out = silu((x - mean) * rstd * w + b) on a [ROWS, BLOCK_S] tile.

        x, out: contiguous, viewed as (B*C, S); row r is channel r % C of sample r // C and
        belongs to group r // CPG (CPG = C / G channels per group). mean, rstd: float32
        (B*G,); w, b: (C,), any float dtype. The grid is flat, positions fastest.
        """
        pid = tl.program_id(0)
        n_sb = tl.cdiv(S, BLOCK_S)
        rows = (pid // n_sb) * ROWS + tl.arange(0, ROWS)
        cols = (pid % n_sb).to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S)
        rmask = rows < ROWS_TOTAL
        mask = rmask[:, None] & (cols < S)[None, :]
        grp = rows // CPG
        mean = tl.load(mean_ptr + grp, mask=rmask, other=0.0)
        scale = tl.load(rstd_ptr + grp, mask=rmask, other=0.0)
        if HAS_W:
            scale *= tl.load(w_ptr + rows % C, mask=rmask, other=0.0).to(tl.float32)
        if HAS_B:
            shift = tl.load(b_ptr + rows % C, mask=rmask, other=0.0).to(tl.float32)
        else:
            shift = tl.zeros([ROWS], dtype=tl.float32)
        offs = rows.to(tl.int64)[:, None] * S + cols[None, :]
        v = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        # Subtract the mean before scaling: x - mean is exact-ish in float32 for x close to
        # the mean, whereas x * scale - mean * scale would round two large products.
        y = (v - mean[:, None]) * scale[:, None] + shift[:, None]
        if SILU:
            # sigmoid(y) = 1 / (1 + exp(-y)): for y << 0, exp(-y) = inf and y * 0 = -0, no NaN.
            y = y * tl.sigmoid(y)
        # The only rounding to x's dtype; PyTorch rounds after the norm and again after SiLU.
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)

    def _launch(
        x: torch.Tensor,
        num_groups: int,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        eps: float,
        silu: bool,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """Run the three kernels into `out`. x, out: contiguous, same shape and dtype,
        (B, C, *spatial), non-empty; weight, bias: contiguous (C,) on x's device or None."""
        b, c = x.shape[:2]
        s = x[0, 0].numel()
        groups = b * num_groups
        n = (c // num_groups) * s
        tiles, p = _chunking(n, groups)
        ws = _scratch(2 * groups * p + 2 * groups, x.device)
        pmean, pm2 = ws[: groups * p], ws[groups * p : 2 * groups * p]
        mean, rstd = ws[2 * groups * p : 2 * groups * p + groups], ws[2 * groups * p + groups :]
        _group_norm_silu_stats_kernel[(groups * p,)](
            x, pmean, pm2, n, p, TILES=tiles, BLOCK=_STATS_BLOCK, num_warps=_STATS_WARPS
        )
        block_p = max(16, triton.next_power_of_2(p))
        gb = max(1, min(_COMBINE_TILE // block_p, triton.next_power_of_2(groups)))
        _group_norm_silu_combine_kernel[(triton.cdiv(groups, gb),)](
            pmean,
            pm2,
            mean,
            rstd,
            groups,
            n,
            tiles * _STATS_BLOCK,
            p,
            eps,
            GB=gb,
            BLOCK_P=block_p,
            num_warps=4,
        )
        rows, block_s, num_warps = _apply_blocks(b * c, s)
        grid = (triton.cdiv(b * c, rows) * triton.cdiv(s, block_s),)
        _group_norm_silu_apply_kernel[grid](
            x,
            mean,
            rstd,
            x if weight is None else weight,  # never read when HAS_W is False
            x if bias is None else bias,  # never read when HAS_B is False
            out,
            b * c,
            c,
            c // num_groups,
            s,
            HAS_W=weight is not None,
            HAS_B=bias is not None,
            SILU=silu,
            ROWS=rows,
            BLOCK_S=block_s,
            num_warps=num_warps,
        )
        return out

    @custom_op("qwen_turbo::group_norm_silu")
    def _group_norm_silu_op(
        x: torch.Tensor,
        num_groups: int,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        eps: float,
        silu: bool,
    ) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        weight = None if weight is None else weight.reshape(-1).contiguous()
        bias = None if bias is None else bias.reshape(-1).contiguous()
        # Triton launches on the current CUDA device; make it x's (ComfyUI may run on cuda:1).
        with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
            return _launch(x, num_groups, weight, bias, eps, silu, out)

    @_group_norm_silu_op.register_fake
    def _(x, num_groups, weight, bias, eps, silu):
        return torch.empty_like(x, memory_format=torch.contiguous_format)


def _why_not(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> str | None:
    """Why the Triton path cannot take this call, or None when it can."""
    reason = common_reason(x)
    if reason is not None:
        return reason
    if x.ndim not in (3, 4, 5):
        return f"x has {x.ndim} dims; the kernel takes (B, C, *spatial) with 1-3 spatial dims"
    c = x.shape[1]
    if num_groups < 1 or c % num_groups:
        return f"{c} channels do not split into {num_groups} groups"
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and (p.numel() != c or p.device != x.device):
            return f"{name} is not {c} values on {x.device}"
    if x.numel() == 0:
        return "x is empty"
    return grad_reason(x, weight, bias)


def group_norm_silu(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    silu: bool = True,
) -> torch.Tensor:
    """F.group_norm(x, num_groups, weight, bias, eps), then SiLU if `silu`.

    x: (B, C, L), (B, C, H, W) or (B, C, T, H, W), channels-first, bfloat16, float16 or
    float32, any strides (a non-contiguous x is copied to contiguous first).
    num_groups: G, any divisor of C. weight, bias: C values each (any float dtype, on x's
    device) or None for no affine.
    Returns a contiguous tensor of x's shape and dtype. Mean and variance (biased) are
    taken over each (sample, group) in float32; the normalisation, affine and SiLU run in
    float32 with one final rounding. Other inputs (dtypes, devices, shapes, autograd) use
    the eager reference, logged once per reason.
    """
    reason = _why_not(x, num_groups, weight, bias)
    if reason is not None:
        log_fallback_once(OP, reason)
        return group_norm_silu_reference(x, num_groups, weight, bias, eps, silu).contiguous()
    return _group_norm_silu_op(x, num_groups, weight, bias, float(eps), bool(silu))


class GroupNormSiLU(torch.nn.Module):
    """Drop-in for torch.nn.GroupNorm (and comfy.ops' GroupNorm), optionally with the SiLU
    that follows it fused.

    Holds the norm's own `weight` and `bias` Parameters under the norm's names, so the patched
    tree names its weights as the original does (ComfyUI's ModelPatcher backs weights up and
    restores them by name, across object patches); they are cast to x's dtype and device on
    every call, as ComfyUI does.
    """

    def __init__(self, norm: torch.nn.GroupNorm, silu: bool):
        super().__init__()
        if not isinstance(norm, torch.nn.GroupNorm):
            raise ValueError(f"GroupNormSiLU wraps a torch.nn.GroupNorm, not {type(norm)}")
        self.weight, self.bias = norm.weight, norm.bias
        self.num_groups, self.eps, self.silu = norm.num_groups, norm.eps, silu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = None if self.weight is None else self.weight.to(x)
        b = None if self.bias is None else self.bias.to(x)
        return group_norm_silu(x, self.num_groups, w, b, self.eps, self.silu)

    def extra_repr(self) -> str:
        return f"silu={self.silu}"
