"""8-bit attention (SageAttention2 style: QK^T in int8, PV in fp8), non-causal, no mask.

softmax(q k^T / sqrt(d)) v for q (B, H, Lq, D), k and v (B, H, Lk, D), in three steps:

1. Per-(batch, head, channel) statistics, PyTorch reductions: the mean of k over tokens,
   and the amax of q, of k - mean and of v.
2. Quantization (Triton, one program per block of tokens of one head):
   - k is smoothed, k - mean(k): every score of a query row changes by the same q . mean,
     which softmax ignores, and real keys' large per-channel offsets leave the int8 range.
   - Channel balancing: channel c of q is divided, and of k multiplied, by the power of two
     s_c nearest sqrt(amax q_c / amax k_c) (SmoothQuant's migration; q.k is unchanged, and
     exactly so, s_c being a power of two). An outlier channel of q (or of k) no longer sets
     the int8 step of all the other channels alone. With int8 scores (and exact P.V) the
     attention error on q with 3 channels x100 drops from 19 % to 5 %, and on q and k with
     x50 outliers in different channels from 84 % to 4.5 % (logits of std 15).
   - q and k to int8 with one float32 scale per block of tokens of a head (Q_BLOCK = 128 of
     q, K_BLOCK = 64 of k), amax / 127, rounding half away from zero. q carries the softmax
     scale times log2(e), so the kernel uses exp2.
   - v to float8_e4m3fn with one scale per channel, amax / 448, stored transposed as
     (B, H, D, Lk_pad): tokens (the reduction axis of P.V) contiguous, the K-major B operand
     Hopper's fp8 wgmma needs (Triton's fused-attention tutorial stores fp8 V the same way).
3. The attention kernel: S = (q8 . k8 in int32) * q_scale * k_scale in float32, online
   softmax in float32, P = exp2(S - m + 8) in [0, 256] rounded to fp8 (2^8 keeps P clear of
   e4m3's largest value 448; values under 2^-6, P < 2^-14 of the row max, are subnormal),
   P.V on fp8 tensor cores summed per tile in float32 (two-level accumulation), and
   out = acc * v_scale / l, where l sums the unrounded P.

Quantized buffers are zero-padded to whole blocks (Lq and Lk to multiples of 128), so the
kernel loads without masks; padded keys get a score of -inf through the FMA that applies
the k scales. Zero scales are clamped to MIN_SCALE: all-zero blocks and channels quantize to
zeros, not 0/0. Scores are at most 127^2 * D * q_scale * k_scale, far inside float32 for
any bfloat16 or float16 input, and the output is a weighted mean of rounded v rows (the
weights sum to 1 within P's rounding, 2^-4): finite.

Accuracy against exact attention (relative L2, measured by the tests): i.i.d. random q, k,
v give about 3.7 %, nearly all of it from fp8: e4m3 has 3 mantissa bits, so P and V each
carry about 2.6 % relative RMS rounding error, which a zero-mean V does not average away
(the int8 scores add about 1.3 %). With pv_fp8=False, P and V stay 16-bit (v's dtype) and
only QK^T is 8-bit: about 1.3 %, at the speed of 16-bit tensor cores for P.V. Very peaked
rows (logits in the thousands) can pick another key than exact attention where the top two
scores differ by less than the int8 rounding of the scores.

Inputs the kernel does not take (no Triton, CPU outside the interpreter, GPUs without the
tensor cores, float32, other head sizes, autograd) run F.scaled_dot_product_attention.
"""

import torch
import torch.nn.functional as F

from ._triton import HAS_TRITON, custom_op, grad_reason, log_fallback_once, tl, triton, unsupported

OP = "attention_8bit"
FP8 = torch.float8_e4m3fn
IN_DTYPES = (torch.bfloat16, torch.float16)
HEAD_DIMS = (32, 64, 128)  # int8/fp8 dots need K >= 32; 128 fills a program's registers
LOG2E = 1.4426950408889634
Q_BLOCK = 128  # q tokens per scale; every BLOCK_M divides it
K_BLOCK = 64  # k tokens per scale; every BLOCK_N is a multiple of it
PAD = 128  # quantized q and k/v are padded to multiples of the largest block
P_SHIFT = 8.0  # P = exp2(S - m + P_SHIFT) <= 2^8
MIN_SCALE = 1e-12
FP8_MAX = 448.0
# (BLOCK_M, BLOCK_N, num_warps, num_stages) the autotuner tries on GPUs, once per head size
# and P.V precision. At D = 128 for sm_90 none spills (ptxas: 200-255 registers, 66-165 KB
# of shared memory); 4 warps or 4 stages of 128-key tiles spill.
CONFIGS = [(128, 64, 8, 4), (128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 2)]
# Triton's interpreter (CPU tests) runs this one, which the reference's tiling defaults to.
INTERPRET_CONFIG = (128, 64)


def _pad(n: int) -> int:
    return -(-n // PAD) * PAD


def _amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| over tokens in float32, (B, H, D): one aminmax pass, no |x| temporary."""
    lo, hi = torch.aminmax(x, dim=2)
    return torch.maximum(hi.float(), -lo.float())


def _factors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pv_fp8: bool):
    """The per-(batch, head, channel) float32 (B, H, D) factors of the quantization: k's mean,
    q's and k's channel multipliers (q's with the softmax scale and log2(e)), v's fp8 scale
    and its reciprocal (ones when P.V is 16-bit)."""
    k_mean = k.mean(dim=2, dtype=torch.float32)
    q_amax = _amax(q)
    lo, hi = torch.aminmax(k, dim=2)
    k_amax = torch.maximum(hi.float() - k_mean, k_mean - lo.float())
    # s = 2^round(log2(sqrt(q_amax / k_amax))): q / s and k * s have about the same amax.
    ratio = q_amax.clamp_min(MIN_SCALE) / k_amax.clamp_min(MIN_SCALE)
    s = torch.exp2(torch.round(0.5 * torch.log2(ratio)).clamp(-64, 64))
    q_mul = (q.shape[-1] ** -0.5 * LOG2E) / s
    if pv_fp8:
        v_scale = (_amax(v) / FP8_MAX).clamp_min(MIN_SCALE)
        v_inv = 1.0 / v_scale
    else:
        v_scale = v_inv = torch.ones_like(k_mean)
    return k_mean, q_mul, s, v_scale, v_inv


def _quant_int8_reference(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x: float32 (B, H, L, D). Returns (int8 values as float32, (B, H, L_pad, D), the
    padding rows zero; float32 scales (B, H, L_pad / block)), L_pad = L rounded up to PAD."""
    n = x.shape[2]
    x = F.pad(x, (0, 0, 0, _pad(n) - n)).unflatten(2, (-1, block))
    scale = (x.abs().amax(dim=(3, 4)) / 127.0).clamp_min(MIN_SCALE)
    xq = x / scale[..., None, None]
    xq = torch.trunc((xq + torch.where(xq >= 0, 0.5, -0.5)).clamp(-127, 127))
    return xq.flatten(2, 3), scale


def attention_8bit_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pv_fp8: bool = True,
    block_n: int = INTERPRET_CONFIG[1],
) -> torch.Tensor:
    """The kernel's algorithm in PyTorch (float32): the same quantization of q, k, v and P,
    and the same online softmax over tiles of `block_n` keys (P is rounded relative to the
    running row max, so the tiling matters). q: (B, H, Lq, D); k, v: (B, H, Lk, D); any
    float dtype and strides. Returns (B, H, Lq, D) in q's dtype. For tests: it holds
    (B, H, Lq, block_n) scores at a time and is slow."""
    b, h, lq, d = q.shape
    lk = k.shape[2]
    k_mean, q_mul, k_mul, v_scale, v_inv = _factors(q, k, v, pv_fp8)
    qi, qs = _quant_int8_reference(q.float() * q_mul[:, :, None], Q_BLOCK)
    ki, ks = _quant_int8_reference((k.float() - k_mean[:, :, None]) * k_mul[:, :, None], K_BLOCK)
    if pv_fp8:
        vq = (v.float() * v_inv[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).float()
    else:
        vq = v.float()
    row_scale = qs.repeat_interleave(Q_BLOCK, dim=2)[:, :, :lq, None]
    col_scale = ks.repeat_interleave(K_BLOCK, dim=2)[:, :, None, :lk]
    m = torch.full((b, h, lq, 1), float("-inf"), device=q.device)
    l_sum = torch.zeros((b, h, lq, 1), device=q.device)
    acc = torch.zeros((b, h, lq, d), device=q.device)
    for start in range(0, lk, block_n):
        cols = slice(start, min(start + block_n, lk))
        # Integer dot products below 2^24 are exact in float32, in any order.
        dots = qi[:, :, :lq] @ ki[:, :, cols].transpose(-1, -2)
        s = dots * (row_scale * col_scale[..., cols])
        m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
        alpha = torch.exp2(m - m_new)
        p = torch.exp2(s - (m_new - P_SHIFT))
        l_sum = l_sum * alpha + p.sum(dim=-1, keepdim=True)
        p = p.to(FP8 if pv_fp8 else v.dtype).float()
        acc = acc * alpha + p @ vq[:, :, cols]
        m = m_new
    return (acc * (v_scale[:, :, None] / l_sum)).to(q.dtype)


if HAS_TRITON:

    @triton.jit
    def _round_e4m3(x):
        """x (float32, |x| <= 448) rounded to the nearest float8_e4m3fn value, ties to even,
        kept in float32. Only for Triton's interpreter, whose fp32 -> fp8 cast mis-rounds
        values whose mantissa carries into the exponent (126.6 -> 64, 1.2 % of random
        values): a value already on the fp8 grid converts exactly. GPUs round in the cast."""
        bits = x.to(tl.int32, bitcast=True)
        # Normal range: drop 20 of float32's 23 mantissa bits, to nearest, ties to even.
        bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576
        normal = bits.to(tl.float32, bitcast=True)
        sub = tl.floor(x * 512.0 + 0.5) / 512.0  # subnormals (|x| < 2^-6): steps of 2^-9
        return tl.where(tl.abs(x) < 0.015625, sub, normal)

    @triton.jit
    def _round_bf16(x):
        """x (float32, finite) rounded to the nearest bfloat16, ties to even, kept in float32:
        the interpreter's fp32 -> bf16 cast truncates; GPUs round in the cast."""
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _quant_int8_kernel(
        x_ptr,
        mean_ptr,
        mul_ptr,
        out_ptr,
        scale_ptr,
        L,
        H,
        n_blocks,
        sx_b,
        sx_h,
        sx_l,
        sx_d,
        SUB_MEAN: tl.constexpr,
        D: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """One program: BLOCK tokens of one (b, h) of x (B, H, L, D), any strides, to int8.

        Grid (n_blocks, B * H). x' = (x - mean) * mul per channel (mean only with SUB_MEAN;
        mean_ptr, mul_ptr: float32 (B, H, D)); x' ~= out * scale. out: contiguous int8
        (B, H, n_blocks * BLOCK, D), rows past L written as 0; scale_ptr: (B, H, n_blocks).
        """
        blk = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        b = bh // H
        h = bh % H
        # int64 offsets: B * H * L * D passes 2^31 for a batch of a few 2512^2 images.
        offs_l = blk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        offs_d = tl.arange(0, D)
        mask = (offs_l < L)[:, None]
        x_offs = b * sx_b + h * sx_h + offs_l[:, None] * sx_l + offs_d[None, :] * sx_d
        x = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
        if SUB_MEAN:
            mean = tl.load(mean_ptr + bh * D + offs_d)
            x = tl.where(mask, x - mean[None, :], 0.0)  # padding rows stay 0
        x = x * tl.load(mul_ptr + bh * D + offs_d)[None, :]
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        scale = tl.maximum(amax / 127.0, 1e-12)  # MIN_SCALE: a zero block gives zeros
        xq = x / scale
        # Round half away from zero (the cast truncates); the clamp only catches a last-ulp
        # 127.0000x from the division.
        xq = tl.clamp(xq + tl.where(xq >= 0, 0.5, -0.5), -127.0, 127.0)
        out_offs = (bh * n_blocks * BLOCK + offs_l[:, None]) * D + offs_d[None, :]
        tl.store(out_ptr + out_offs, xq.to(tl.int8))
        tl.store(scale_ptr + bh * n_blocks + blk, scale)

    @triton.jit
    def _quant_v_kernel(
        v_ptr,
        inv_ptr,
        out_ptr,
        L,
        H,
        L_pad,
        sv_b,
        sv_h,
        sv_l,
        sv_d,
        D: tl.constexpr,
        BLOCK: tl.constexpr,
        PV_FP8: tl.constexpr,
        INTERPRET: tl.constexpr,
    ):
        """One program: BLOCK tokens of one (b, h) of v (B, H, L, D), any strides.

        Grid (L_pad / BLOCK, B * H); tokens past L are written as 0. With PV_FP8, v times
        inv_ptr (float32 (B, H, D), 1 / the channel scales) in float8_e4m3fn, transposed:
        out is contiguous (B, H, D, L_pad). Otherwise a copy in out's 16-bit dtype,
        contiguous (B, H, L_pad, D).
        """
        blk = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        b = bh // H
        h = bh % H
        offs_l = blk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        offs_d = tl.arange(0, D)
        mask = (offs_l < L)[:, None]
        v_offs = b * sv_b + h * sv_h + offs_l[:, None] * sv_l + offs_d[None, :] * sv_d
        x = tl.load(v_ptr + v_offs, mask=mask, other=0.0)
        if PV_FP8:
            inv = tl.load(inv_ptr + bh * D + offs_d)
            x = tl.clamp(x.to(tl.float32) * inv[None, :], -448.0, 448.0)
            if INTERPRET:
                x = _round_e4m3(x)
            out_offs = bh * D * L_pad + offs_d[None, :] * L_pad + offs_l[:, None]
            tl.store(out_ptr + out_offs, x.to(tl.float8e4nv))
        else:
            out_offs = (bh * L_pad + offs_l[:, None]) * D + offs_d[None, :]
            tl.store(out_ptr + out_offs, x.to(out_ptr.dtype.element_ty))

    @triton.jit
    def _attn_tile(
        acc,
        l_i,
        m_i,
        q,
        qs,
        k_base,
        v_base,
        ks_base,
        start_n,
        Lk,
        Lk_pad,
        D: tl.constexpr,
        BLOCK_N: tl.constexpr,
        K_BLK: tl.constexpr,
        PV_FP8: tl.constexpr,
        INTERPRET: tl.constexpr,
    ):
        """One tile of BLOCK_N keys: the online-softmax update of (acc, l_i, m_i)."""
        offs_n = start_n + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, D)
        # k^T tile [D, BLOCK_N] of the (Lk_pad, D) int8 rows: D contiguous (K-major).
        kt = tl.load(k_base + offs_n[None, :] * D + offs_d[:, None])
        dots = tl.dot(q, kt)  # int32, exact
        # q_scale * k_scale per key, and -inf for padded keys: one FMA per score.
        col = tl.load(ks_base + offs_n // K_BLK) * qs
        bias = tl.where(offs_n < Lk, 0.0, float("-inf"))
        s = dots.to(tl.float32) * col[None, :] + bias[None, :]
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every tile has a real key
        alpha = tl.math.exp2(m_i - m_new)  # 0 on the first tile (m_i = -inf)
        p = tl.math.exp2(s - (m_new - 8.0)[:, None])  # 8 = P_SHIFT: p in [0, 256]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if PV_FP8:
            if INTERPRET:
                p = _round_e4m3(p)
            # v tile [BLOCK_N, D] of the transposed (D, Lk_pad) rows: tokens contiguous.
            v = tl.load(v_base + offs_d[None, :] * Lk_pad + offs_n[:, None])
            # max_num_imprecise_acc = BLOCK_N: the fp8 tensor cores' reduced-precision sum
            # covers one tile, then adds into the float32 accumulator (two-level).
            acc = tl.dot(
                p.to(tl.float8e4nv), v, acc * alpha[:, None], max_num_imprecise_acc=BLOCK_N
            )
        else:
            v = tl.load(v_base + offs_n[:, None] * D + offs_d[None, :])
            if INTERPRET:
                # The interpreter multiplies bfloat16 bit patterns as integers: a float32 dot
                # of the values the GPU's 16-bit dot takes (p rounded first: see _round_bf16).
                if v.dtype == tl.bfloat16:
                    p = _round_bf16(p)
                p = p.to(v.dtype).to(tl.float32)
                acc = tl.dot(p, v.to(tl.float32), acc * alpha[:, None])
            else:
                acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        return acc, l_i, m_new

    @triton.jit
    def _attention_8bit_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        qs_ptr,
        ks_ptr,
        vs_ptr,
        o_ptr,
        Lq,
        Lk,
        Lq_pad,
        Lk_pad,
        H,
        so_b,
        so_h,
        so_l,
        so_d,
        D: tl.constexpr,
        Q_BLK: tl.constexpr,
        K_BLK: tl.constexpr,
        N_TILES: tl.constexpr,
        PV_FP8: tl.constexpr,
        INTERPRET: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """One program: BLOCK_M queries of one (b, h) against all Lk keys.

        Grid (cdiv(Lq, BLOCK_M), B * H). q_ptr, k_ptr: contiguous int8 (B, H, Lq_pad, D),
        (B, H, Lk_pad, D); v_ptr: contiguous fp8 (B, H, D, Lk_pad) with PV_FP8, else 16-bit
        (B, H, Lk_pad, D); scales float32 (B, H, Lq_pad / Q_BLK), (B, H, Lk_pad / K_BLK),
        (B, H, D). o_ptr: (B, H, Lq, D), any strides. N_TILES > 0 makes the key loop's trip
        count a constant (Triton 3.6's interpreter cannot take a runtime loop bound with
        NumPy >= 2.4); with 0 it is cdiv(Lk, BLOCK_N) at run time, one compile for all Lk.
        """
        pid_m = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D)
        q = tl.load(q_ptr + (bh * Lq_pad + offs_m[:, None]) * D + offs_d[None, :])
        qs = tl.load(qs_ptr + bh * (Lq_pad // Q_BLK) + (pid_m * BLOCK_M) // Q_BLK)
        k_base = k_ptr + bh * Lk_pad * D
        v_base = v_ptr + bh * Lk_pad * D
        ks_base = ks_ptr + bh * (Lk_pad // K_BLK)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        if N_TILES > 0:
            for i in range(N_TILES):
                acc, l_i, m_i = _attn_tile(
                    acc, l_i, m_i, q, qs, k_base, v_base, ks_base, i * BLOCK_N, Lk, Lk_pad,
                    D, BLOCK_N, K_BLK, PV_FP8, INTERPRET,
                )  # fmt: skip
        else:
            for i in range(0, tl.cdiv(Lk, BLOCK_N)):
                acc, l_i, m_i = _attn_tile(
                    acc, l_i, m_i, q, qs, k_base, v_base, ks_base, i * BLOCK_N, Lk, Lk_pad,
                    D, BLOCK_N, K_BLK, PV_FP8, INTERPRET,
                )  # fmt: skip
        vs = tl.load(vs_ptr + bh * D + offs_d)
        out = acc * vs[None, :] * (1.0 / l_i)[:, None]  # l_i >= 256: the row max gives 2^8
        if INTERPRET and o_ptr.dtype.element_ty == tl.bfloat16:
            out = _round_bf16(out)
        b = bh // H
        h = bh % H
        o_offs = b * so_b + h * so_h + offs_m[:, None] * so_l + offs_d[None, :] * so_d
        tl.store(o_ptr + o_offs, out.to(o_ptr.dtype.element_ty), mask=(offs_m < Lq)[:, None])

    _attention_8bit_tuned = triton.autotune(
        [
            triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
            for bm, bn, w, s in CONFIGS
        ],
        key=["D", "PV_FP8"],
    )(_attention_8bit_kernel)

    def _quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pv_fp8: bool) -> dict:
        """The quantization passes: q, k, v ((B, H, L, D), any strides, all bfloat16 or all
        float16, Lk >= 1) to the kernel's padded int8 / fp8 buffers and scales. Returns the
        kernel's arguments as a dict (for `_attend`)."""
        b, h, lq, d = q.shape
        lk = k.shape[2]
        dev = q.device
        lq_pad, lk_pad = _pad(lq), _pad(lk)
        q8 = torch.empty((b, h, lq_pad, d), dtype=torch.int8, device=dev)
        k8 = torch.empty((b, h, lk_pad, d), dtype=torch.int8, device=dev)
        qs = torch.empty((b, h, lq_pad // Q_BLOCK), dtype=torch.float32, device=dev)
        ks = torch.empty((b, h, lk_pad // K_BLOCK), dtype=torch.float32, device=dev)
        v8 = torch.empty((b, h, d, lk_pad) if pv_fp8 else (b, h, lk_pad, d),
                         dtype=FP8 if pv_fp8 else v.dtype, device=dev)  # fmt: skip
        k_mean, q_mul, k_mul, v_scale, v_inv = _factors(q, k, v, pv_fp8)
        interpret = not q.is_cuda  # Triton's interpreter: see _round_e4m3, _round_bf16
        _quant_int8_kernel[(lq_pad // Q_BLOCK, b * h)](
            q, k_mean, q_mul, q8, qs, lq, h, lq_pad // Q_BLOCK, *q.stride(),
            SUB_MEAN=False, D=d, BLOCK=Q_BLOCK, num_warps=8,
        )  # fmt: skip
        _quant_int8_kernel[(lk_pad // K_BLOCK, b * h)](
            k, k_mean, k_mul, k8, ks, lk, h, lk_pad // K_BLOCK, *k.stride(),
            SUB_MEAN=True, D=d, BLOCK=K_BLOCK, num_warps=4,
        )  # fmt: skip
        _quant_v_kernel[(lk_pad // 64, b * h)](
            v, v_inv, v8, lk, h, lk_pad, *v.stride(),
            D=d, BLOCK=64, PV_FP8=pv_fp8, INTERPRET=interpret, num_warps=4,
        )  # fmt: skip
        return {"q8": q8, "k8": k8, "v8": v8, "qs": qs, "ks": ks, "vs": v_scale,
                "lq": lq, "lk": lk, "pv_fp8": pv_fp8}  # fmt: skip

    def _attend(
        qnt: dict, out: torch.Tensor, config: tuple[int, int, int, int] | None = None
    ) -> torch.Tensor:
        """The attention kernel on `_quantize`'s buffers, into `out` ((B, H, Lq, D), any
        strides). config: (BLOCK_M, BLOCK_N, num_warps, num_stages) to run without the
        autotuner; the interpreter runs INTERPRET_CONFIG unless given one."""
        b, h, lq_pad, d = qnt["q8"].shape
        lq, lk, lk_pad = qnt["lq"], qnt["lk"], qnt["k8"].shape[2]
        cuda = out.is_cuda
        args = (qnt["q8"], qnt["k8"], qnt["v8"], qnt["qs"], qnt["ks"], qnt["vs"], out,
                lq, lk, lq_pad, lk_pad, h, *out.stride())  # fmt: skip
        consts = {"D": d, "Q_BLK": Q_BLOCK, "K_BLK": K_BLOCK, "PV_FP8": qnt["pv_fp8"],
                  "INTERPRET": not cuda}  # fmt: skip
        if config is None and not cuda:
            config = (*INTERPRET_CONFIG, 8, 3)
        if config is None:
            grid = lambda meta: (triton.cdiv(lq, meta["BLOCK_M"]), b * h)  # noqa: E731
            _attention_8bit_tuned[grid](*args, **consts, N_TILES=0)
        else:
            block_m, block_n, warps, stages = config
            _attention_8bit_kernel[(triton.cdiv(lq, block_m), b * h)](
                *args, **consts, N_TILES=0 if cuda else triton.cdiv(lk, block_n),
                BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages,
            )  # fmt: skip
        return out

    def _launch(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        pv_fp8: bool = True,
        config: tuple[int, int, int, int] | None = None,
    ) -> torch.Tensor:
        """Quantize q, k, v and run the kernel into `out`, (B, H, Lq, D) of any strides.

        q: (B, H, Lq, D), k and v: (B, H, Lk, D), any strides, all bfloat16 or all float16,
        Lk >= 1. config: as `_attend`'s.
        """
        if out.numel() == 0:
            return out
        return _attend(_quantize(q, k, v, pv_fp8), out, config)

    @custom_op("qwen_turbo::attention_8bit")
    def _attention_8bit_op(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pv_fp8: bool
    ) -> torch.Tensor:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        return _launch(q, k, v, out, pv_fp8)

    @_attention_8bit_op.register_fake
    def _(q, k, v, pv_fp8):
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def _device_reason(device: torch.device, pv_fp8: bool = True) -> str | None:
    """Why a CUDA device cannot run the kernel: int8 tensor cores need compute capability
    8.0+, fp8 ones 8.9+. None for other devices (`unsupported` decides those)."""
    if device.type != "cuda":
        return None
    cap = torch.cuda.get_device_capability(device)
    need, what = ((8, 9), "fp8") if pv_fp8 else ((8, 0), "int8")
    if cap < need:
        return (
            f"compute capability {cap[0]}.{cap[1]} has no {what} tensor cores "
            f"(needs {need[0]}.{need[1]}+)"
        )
    return None


def attention_8bit_reason(
    q: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    pv_fp8: bool = True,
) -> str | None:
    """Why `attention_8bit` would use exact SDPA for these inputs, or None if it would not.

    With q alone, what q decides: the env switch, Triton, the device (a CUDA GPU of compute
    capability 8.9+, or 8.0+ with pv_fp8=False; CPU only under TRITON_INTERPRET=1), the
    dtype (bfloat16 or float16), the layout (B, H, L, D), the head size (32, 64 or 128) and
    autograd. With k and v also that they match q (dtype, device, batch, heads, head size)
    and each other's shape, with at least one token.
    """
    reason = unsupported(q) or _device_reason(q.device, pv_fp8)
    if reason is not None:
        return reason
    if q.dtype not in IN_DTYPES:
        return f"dtype {q.dtype} is not supported (bfloat16, float16)"
    if q.ndim != 4:
        return f"q has {q.ndim} dims; the kernel takes (B, H, L, D)"
    b, h, _, d = q.shape
    if d not in HEAD_DIMS:
        return f"head size {d} is not supported ({', '.join(map(str, HEAD_DIMS))})"
    for name, t in (("k", k), ("v", v)):
        if t is None:
            continue
        if t.dtype != q.dtype or t.device != q.device:
            return f"{name} is {t.dtype} on {t.device}, q is {q.dtype} on {q.device}"
        if t.ndim != 4 or (t.shape[0], t.shape[1], t.shape[3]) != (b, h, d):
            return f"{name} has shape {tuple(t.shape)}, not ({b}, {h}, L, {d})"
    if k is not None and v is not None:
        if k.shape != v.shape:
            return f"k has shape {tuple(k.shape)}, v {tuple(v.shape)}"
        if k.shape[2] == 0:
            return "k and v have no tokens"
    return grad_reason(q, k, v)


def attention_exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The fallback: F.scaled_dot_product_attention on the inputs as given (no mask)."""
    return F.scaled_dot_product_attention(q, k, v)


def attention_8bit(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pv_fp8: bool = True
) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v with q.k^T in int8 and, with pv_fp8, P.v in fp8.

    q: (B, H, Lq, D); k, v: (B, H, Lk, D); bfloat16 or float16, any strides; D in (32, 64,
    128); any lengths; no mask, not causal. Returns a contiguous (B, H, Lq, D) tensor in q's
    dtype. Relative L2 error against exact attention: about 3.7 % on i.i.d. random inputs
    with pv_fp8, 1.3 % without (P.v then runs on 16-bit tensor cores); see the module
    docstring. Other inputs and devices (see `attention_8bit_reason`) use
    F.scaled_dot_product_attention on the inputs as given, and log why once.
    """
    reason = attention_8bit_reason(q, k, v, pv_fp8)
    if reason is not None:
        log_fallback_once(OP, reason)
        return attention_exact(q, k, v)
    return _attention_8bit_op(q, k, v, pv_fp8)


def attention_flops(b: int, h: int, lq: int, lk: int, d: int) -> int:
    """Multiply-adds of QK^T and PV at 2 flops each: 4 B H Lq Lk D."""
    return 4 * b * h * lq * lk * d
