"""Attention on fp8 q, k, v through cuDNN's fused fp8 SDPA (NVIDIA Hopper and newer).

softmax(q k^T / sqrt(D)) v with q, k, v scaled per tensor into float8_e4m3fn, P in fp8
(scaled by 448) and O in fp8: cuDNN has no 16-bit output for fp8 SDPA before Blackwell.
O is a convex combination of v's rows, so O scaled like v cannot overflow.

v is smoothed: its per-channel mean over the tokens is taken out before quantization and
added back to O (exact, as each row of P sums to 1). In the DiT that mean holds 20-65 % of
v's norm; without smoothing the error grew with it and with L, to 12-29 % at L = 24,905 on
the random-weight model's attention inputs, against 0.3-1.5 % with it (H200). That fits
the limited precision of Hopper's fp8 tensor-core accumulation over long same-sign sums.

Passes around cuDNN's kernel (Triton): v's channel means; the per-tensor amax of q, k and
v; the scale and cast, which also writes the scales cuDNN reads (device tensors: no host
sync, CUDA graphs capture it); and O back to q's dtype plus the means. q, k, v and O are
(B, L, H, D) in memory, the joint layout the DiT's projections read and write.

cuDNN's graph API comes from the optional `nvidia-cudnn-frontend` package. Without it,
on other GPUs, on masked calls or on shapes cuDNN declines, the call runs exact SDPA and
logs why once. Each built plan is also kept on disk, serialized (`plan_cache_dir()`, about
100 kB a shape): a later process loads it in 0.04 s where a process's first build takes
0.34 s with the CUDA driver's cache filled and 1.05 s without (H100, benchmarks/RESULTS.md
7.5). Measured on an H200 (cuDNN 9.19) at L = 24,905, H = 24, D = 128: 9.91 ms
for the whole call (cuDNN's kernel 9.44) against 13.56 ms for cuDNN's bf16 attention
(benchmarks/RESULTS.md). At L = 7,145 the passes around the kernel (0.5 ms) eat its gain.
Relative L2 error against exact attention on i.i.d. N(0, 1) inputs, about 6 %: each of
q.k, P, v and O carries e4m3's 3-bit mantissa rounding (about 2.6 % RMS each).

On Hopper, where FlashAttention-3 is installed (`flash_attn_3`, built from the
hopper/ folder of Dao-AILab/flash-attention with fp8; not on PyPI), kernel "auto" runs its
fp8 forward instead of cuDNN's graph, on the same quantized q, k, v and scales: its O comes
out in bf16, and the last pass only adds v's means. Its kernel took 8.15 ms against cuDNN's
9.11 at L = 24,905 and 1.42 against 1.73 ms at 2 × 7,145 on an H100, with cuDNN's error
(benchmarks/RESULTS.md 3.12). After a failed call, cuDNN's runs for that head size.
"""

import atexit
import hashlib
import importlib
import logging
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ._triton import (
    HAS_TRITON,
    custom_op,
    fast_launch,
    grad_reason,
    log_fallback_once,
    tl,
    triton,
    unsupported,
)

try:
    import cudnn
except ImportError:  # optional: `pip install nvidia-cudnn-frontend`
    cudnn = None

# Optional: FlashAttention-3's forward op, from Dao-AILab/flash-attention's hopper/ folder,
# called directly: its Python wrapper's first call imports torch._dynamo (4.5-6.5 s on an H100
# machine, 2.2 s more for a first picture through ComfyUI).
FA3_ARGUMENTS = {"q_descale", "k_descale", "v_descale", "softmax_scale", "num_splits"}


def fa3_op_reason(op) -> str | None:
    """Why the op `op` (torch.ops.flash_attn_3.fwd) cannot be called as the pack calls it."""
    missing = FA3_ARGUMENTS - {a.name for a in op.default._schema.arguments}
    return f"FlashAttention-3's fwd op has no {', '.join(sorted(missing))}" if missing else None


def load_fa3(module: str = "flash_attn_3._C"):
    """(FlashAttention-3's fwd op, None), or (None, why not): not installed, or installed but
    not loadable here (built for another torch or CUDA), or without the arguments passed."""
    try:
        importlib.import_module(module)  # registers torch.ops.flash_attn_3
    except Exception as e:  # absent, or an extension built for another torch (undefined symbols)
        if isinstance(e, ModuleNotFoundError) and e.name and module.startswith(e.name):
            return None, "flash_attn_3 (FlashAttention-3) is not installed"
        return None, f"flash_attn_3 (FlashAttention-3) did not load: {e}".splitlines()[0][:300]
    reason = fa3_op_reason(torch.ops.flash_attn_3.fwd)
    return (None, reason) if reason else (torch.ops.flash_attn_3.fwd, None)


flash_attn_3, FA3_MISSING = load_fa3()

log = logging.getLogger(__name__)
OP = "attention_fp8"
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_AMAX = 1e-30  # an all-zero tensor gets a finite scale (and stays zero)
IN_DTYPES = (torch.bfloat16, torch.float16)
HEAD_DIMS = (64, 128)
# Slots of the float32 scales tensor: q, k, v descales (amax / 448), then 1 / v's descale
# (O's scale), 448 (P's scale) and 1 / 448 (P's descale).
DQ, DK, DV, SO, SS, DS = range(6)
SUMS_CHUNK = 64  # block sums added per step of the channel means' second pass

_plans: dict[tuple, object] = {}  # shape key -> _Plan, or the reason cuDNN declined it
# Serialized plans: a new name when the graph below changes, so that old files are not read.
PLAN_FORMAT = "fp8-sdpa-1"
_handles: dict[int, object] = {}
_amax_groups: dict[str, object] = {}  # group name -> process group (`register_amax_group`)
KERNELS = ("auto", "cudnn")  # auto: FlashAttention-3 where `fa3_reason` is None, else cuDNN
_fa3_failed: dict[int, str] = {}  # head size -> why FlashAttention-3's call failed


def register_amax_group(group) -> str:
    """The name `attention_fp8` and `quantize` take for a torch.distributed process group
    (the custom op takes strings, not groups); the group is kept under it."""
    _amax_groups[group.group_name] = group
    return group.group_name


def quantize_reference(
    x: torch.Tensor, mean: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, H, L, D) less `mean` (float32 (B, H, D), optional) in float8_e4m3fn, scaled by
    448 / amax, as (B, L, H, D) memory viewed (B, H, L, D); and the descale amax / 448
    (float32, one element)."""
    x = x.float() if mean is None else x.float() - mean[:, :, None]
    amax = x.abs().amax().clamp(min=MIN_AMAX)
    scale = torch.full_like(amax, FP8_MAX) / amax  # `448 / amax` would multiply by 1 / amax
    x8 = (x * scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return x8.transpose(1, 2).contiguous().transpose(1, 2), (1 / scale).reshape(1)


def attention_exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The fallback: F.scaled_dot_product_attention on the inputs as given (no mask)."""
    return F.scaled_dot_product_attention(q, k, v)


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
    def _load_block(x_ptr, mean_ptr, bh, L, H, sx_b, sx_h, sx_l, SUB_MEAN, D, BLOCK):
        """Program axis 0's BLOCK tokens of one (b, h) of x (B, H, L, D) (last stride 1) in
        float32, less the channel means (float32 (B, H, D)) with SUB_MEAN; rows past L are
        0. Also the token offsets and the row mask."""
        offs_l = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        offs_d = tl.arange(0, D)
        mask = (offs_l < L)[:, None]
        offs = (bh // H) * sx_b + (bh % H) * sx_h + offs_l[:, None] * sx_l + offs_d[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if SUB_MEAN:
            x = tl.where(mask, x - tl.load(mean_ptr + bh * D + offs_d)[None, :], 0.0)
        return x, offs_l, mask

    @fast_launch
    @triton.jit
    def _sum_kernel(
        x_ptr, sums_ptr, L, H, sx_b, sx_h, sx_l, D: tl.constexpr, BLOCK: tl.constexpr
    ):  # fmt: skip
        """The per-channel sum of one `_load_block` to sums (B * H, blocks, D)."""
        bh = tl.program_id(1).to(tl.int64)
        x, _, _ = _load_block(x_ptr, x_ptr, bh, L, H, sx_b, sx_h, sx_l, False, D, BLOCK)
        offs = (bh * tl.num_programs(0) + tl.program_id(0)) * D + tl.arange(0, D)
        tl.store(sums_ptr + offs, tl.sum(x, axis=0))

    @fast_launch
    @triton.jit
    def _mean_kernel(
        sums_ptr, mean_ptr, L, BLOCKS,
        D: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr,
    ):  # fmt: skip
        """One (b, h)'s channel means from its block sums, added in an order set by BLOCKS
        alone: CHUNKS chunks of CHUNK blocks (a constexpr count: the interpreter cannot loop
        to a runtime one)."""
        bh = tl.program_id(0).to(tl.int64)
        offs_d = tl.arange(0, D)
        acc = tl.zeros((D,), dtype=tl.float32)
        for c in range(CHUNKS):
            offs_i = c * CHUNK + tl.arange(0, CHUNK)
            offs = (bh * BLOCKS + offs_i[:, None]) * D + offs_d[None, :]
            chunk = tl.load(sums_ptr + offs, mask=(offs_i < BLOCKS)[:, None], other=0.0)
            acc += tl.sum(chunk, axis=0)
        tl.store(mean_ptr + bh * D + offs_d, tl.math.div_rn(acc, L.to(tl.float32)))

    def channel_means(x: torch.Tensor) -> torch.Tensor:
        """x (B, H, L, D)'s means over L, float32 (B, H, D). Each (b, h) is added in an order
        fixed by L alone (torch's reduction order follows its launch shape, so half a batch
        or half the heads would round otherwise): Multi-GPU ranks holding parts of one
        call get the whole call's means."""
        b, h, seq, d = x.shape
        block = 16384 // d
        grid = (triton.cdiv(seq, block), b * h)
        sums = torch.empty((b * h, grid[0], d), dtype=torch.float32, device=x.device)
        _sum_kernel[grid](x, sums, seq, h, *x.stride()[:3], D=d, BLOCK=block)
        mean = torch.empty((b, h, d), dtype=torch.float32, device=x.device)
        chunks = triton.cdiv(grid[0], SUMS_CHUNK)
        _mean_kernel[(b * h,)](sums, mean, seq, grid[0], D=d, CHUNK=SUMS_CHUNK, CHUNKS=chunks)
        return mean

    @fast_launch
    @triton.jit
    def _amax_kernel(
        x_ptr, mean_ptr, amax_ptr, L, H, sx_b, sx_h, sx_l,
        SUB_MEAN: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """max |x - mean| of one `_load_block` into the int32 amax_ptr as float32 bits:
        non-negative floats order like their bits."""
        bh = tl.program_id(1).to(tl.int64)
        x, _, _ = _load_block(x_ptr, mean_ptr, bh, L, H, sx_b, sx_h, sx_l, SUB_MEAN, D, BLOCK)
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        tl.atomic_max(amax_ptr, amax.to(tl.int32, bitcast=True))

    @fast_launch
    @triton.jit
    def _quant_kernel(
        x_ptr, mean_ptr, amax_ptr, out_ptr, scales_ptr, L, H, sx_b, sx_h, sx_l,
        SLOT: tl.constexpr, SUB_MEAN: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
        INTERPRET: tl.constexpr,
    ):  # fmt: skip
        """(x - mean) * 448 / amax in fp8, one `_load_block`, to out (B, L, H, D)
        contiguous. Program (0, 0) writes the descale to scales[SLOT] (for v also O's
        scale, 448 and 1 / 448)."""
        bh = tl.program_id(1).to(tl.int64)
        x, offs_l, mask = _load_block(x_ptr, mean_ptr, bh, L, H, sx_b, sx_h, sx_l, SUB_MEAN,
                                      D, BLOCK)  # fmt: skip
        amax = tl.maximum(tl.load(amax_ptr).to(tl.float32, bitcast=True), 1e-30)  # MIN_AMAX
        scale = tl.math.div_rn(448.0, amax)  # IEEE division: `/` is approximate on GPUs
        x = tl.clamp(x * scale, -448.0, 448.0)
        if INTERPRET:
            x = _round_e4m3(x)
        out_offs = ((bh // H * L + offs_l[:, None]) * H + bh % H) * D + tl.arange(0, D)[None, :]
        tl.store(out_ptr + out_offs, x.to(tl.float8e4nv), mask=mask)
        if tl.program_id(0) + tl.program_id(1) == 0:
            tl.store(scales_ptr + SLOT, tl.math.div_rn(1.0, scale))
            if SLOT == 2:
                tl.store(scales_ptr + 3, scale)
                tl.store(scales_ptr + 4, 448.0)
                tl.store(scales_ptr + 5, 1.0 / 448.0)

    @fast_launch
    @triton.jit
    def _dequant_kernel(
        o_ptr, scales_ptr, mean_ptr, out_ptr, L, HD, SCALED: tl.constexpr,
        BLOCK_L: tl.constexpr, BLOCK_C: tl.constexpr, INTERPRET: tl.constexpr,
    ):  # fmt: skip
        """out = o ((B, L, H * D) contiguous) * scales[DV] (with SCALED, for fp8 o) + mean
        (float32 (B, H * D)), in out's dtype; grid (L blocks, H * D blocks, B)."""
        b = tl.program_id(2).to(tl.int64)
        offs_l = tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L)
        offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask_c = offs_c < HD
        mask = (offs_l < L)[:, None] & mask_c[None, :]
        offs = (b * L + offs_l[:, None]) * HD + offs_c[None, :]
        mean = tl.load(mean_ptr + b * HD + offs_c, mask=mask_c, other=0.0)
        x = tl.load(o_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if SCALED:
            x = x * tl.load(scales_ptr + 2)
        x = x + mean[None, :]
        if INTERPRET and out_ptr.dtype.element_ty == tl.bfloat16:
            x = _round_bf16(x)
        tl.store(out_ptr + offs, x.to(out_ptr.dtype.element_ty), mask=mask)

    def quantize(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, smooth_v: bool = True, amax_group=""
    ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """q, k and v less its channel means ((B, H, L, D), last stride 1) in fp8, (B, L, H,
        D) memory viewed (B, H, L, D); the float32 scales (slots DQ..DS) and v's channel
        means (float32 (B, H, D); zeros without smooth_v). With `amax_group` (a name from
        `register_amax_group()`) the amaxes are the largest over that group's ranks."""
        dev = q.device
        if smooth_v:
            v_mean = channel_means(v)
        else:
            v_mean = torch.zeros(v.shape[:2] + v.shape[3:], dtype=torch.float32, device=dev)
        amax = torch.zeros(3, dtype=torch.int32, device=dev)
        scales = torch.empty(6, dtype=torch.float32, device=dev)
        launches = []
        for slot, x in enumerate((q, k, v)):
            b, h, seq, d = x.shape
            block = 16384 // d
            grid = (triton.cdiv(seq, block), b * h)
            args = (x, v_mean, amax[slot:])
            shape = (seq, h, *x.stride()[:3])
            sub_mean = smooth_v and slot == DV
            _amax_kernel[grid](*args, *shape, SUB_MEAN=sub_mean, D=d, BLOCK=block)
            launches.append((slot, x, grid, args, shape, sub_mean, block))
        if amax_group:  # non-negative floats order as their int32 bits do
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=_amax_groups[amax_group])
        out = []
        for slot, x, grid, args, shape, sub_mean, block in launches:
            b, h, seq, d = x.shape
            x8 = torch.empty((b, seq, h, d), dtype=FP8, device=dev)
            _quant_kernel[grid](*args, x8, scales, *shape, SLOT=slot, SUB_MEAN=sub_mean,
                                D=d, BLOCK=block, INTERPRET=not x.is_cuda)  # fmt: skip
            out.append(x8.transpose(1, 2))
        return out, scales, v_mean

    def dequantize(
        o8: torch.Tensor, scales: torch.Tensor, v_mean: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """o8 ((B, L, H, D) contiguous) * scales[DV] (fp8 o8 only) + v_mean (float32 (B, H,
        D)), in `dtype`."""
        out = torch.empty_like(o8, dtype=dtype)
        b, seq, h, d = o8.shape
        grid = (triton.cdiv(seq, 16), triton.cdiv(h * d, 512), b)
        _dequant_kernel[grid](o8, scales, v_mean, out, seq, h * d, SCALED=o8.dtype == FP8,
                              BLOCK_L=16, BLOCK_C=512, INTERPRET=not o8.is_cuda)  # fmt: skip
        return out


def plan_cache_dir() -> Path | None:
    """Where built plans are kept: QWEN_TURBO_CUDNN_CACHE, else ~/.cache/qwen_turbo/cudnn;
    None where QWEN_TURBO_CUDNN_CACHE is 0."""
    where = os.environ.get("QWEN_TURBO_CUDNN_CACHE", "")
    if where == "0":
        return None
    return Path(where) if where else Path.home() / ".cache" / "qwen_turbo" / "cudnn"


def _plan_file(device: int, shape: tuple) -> Path | None:
    """The file of a plan for `shape` on `device`: named for cuDNN's and the frontend's
    versions, the GPU and the shape, since a plan holds kernels compiled for them."""
    folder = plan_cache_dir()
    if folder is None:
        return None
    props = torch.cuda.get_device_properties(device)
    key = (PLAN_FORMAT, cudnn.backend_version(), cudnn.__version__, props.name, props.major,
           props.minor, shape)  # fmt: skip
    return folder / f"{hashlib.sha256(repr(key).encode()).hexdigest()[:32]}.plan"


def read_plan(path: Path | None) -> list[int] | None:
    """A serialized plan's bytes, or None where there is none to read."""
    try:
        return list(path.read_bytes()) if path is not None else None
    except OSError:
        return None


def write_plan(path: Path | None, data: list[int]) -> None:
    """Keeps a serialized plan at `path` (written whole, then renamed: a reader never sees
    part of it); a failure costs only the next process's rebuild."""
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_suffix(f".{os.getpid()}.part")
        part.write_bytes(bytes(data))
        os.replace(part, path)
    except OSError as e:
        log.debug("cuDNN plan not kept at %s: %s", path, e)


class _Plan:
    """A cuDNN fp8 SDPA graph for one shape, built or loaded from the plan cache; its tensors
    by uid: q, k, v, O, the two amaxes, then the six scales (slots DQ..DS)."""

    def __init__(self, handle, device: int, b: int, h: int, lq: int, lk: int, d: int):
        self.handle = handle
        path = _plan_file(device, (b, h, lq, lk, d))
        data = read_plan(path)
        self.loaded = False
        if data is not None:
            try:
                self.graph = cudnn.pygraph(handle=handle)
                self.graph.deserialize(data)
                self.loaded = True
            except Exception as e:  # another cuDNN's file, or a damaged one: built again
                log.debug("cuDNN plan at %s not loaded: %s", path, e)
        if not self.loaded:
            self.graph = self._build(handle, b, h, lq, lk, d)
            try:
                write_plan(path, self.graph.serialize())
            except Exception as e:  # an engine cuDNN cannot serialize: built in each process
                log.debug("cuDNN plan not serialized: %s", e)
        self.workspace = self.graph.get_workspace_size()

    @classmethod
    def _build(cls, handle, b: int, h: int, lq: int, lk: int, d: int):
        g = cudnn.pygraph(io_data_type=cudnn.data_type.FP8_E4M3, handle=handle,
                          intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT)  # fmt: skip

        def fp8(seq):  # (B, H, L, D) over (B, L, H, D) memory
            return dict(dim=[b, h, seq, d], stride=[seq * h * d, d, h * d, 1],
                        data_type=cudnn.data_type.FP8_E4M3)  # fmt: skip

        one = dict(dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.FLOAT)
        q, k, v = g.tensor(**fp8(lq)), g.tensor(**fp8(lk)), g.tensor(**fp8(lk))
        scales = [g.tensor(**one) for _ in range(6)]
        dq, dk, dv, so, ss, ds = scales
        o, _, amax_s, amax_o = g.sdpa_fp8(
            q=q, k=k, v=v, descale_q=dq, descale_k=dk, descale_v=dv,
            descale_s=ds, scale_s=ss, scale_o=so, is_inference=True,
            attn_scale=1 / math.sqrt(d), use_causal_mask=False,
        )  # fmt: skip
        o.set_output(True).set_dim(fp8(lq)["dim"]).set_stride(fp8(lq)["stride"])
        o.set_data_type(cudnn.data_type.FP8_E4M3)
        for t in (amax_s, amax_o):
            t.set_output(True).set_dim(one["dim"]).set_stride(one["stride"])
            t.set_data_type(cudnn.data_type.FLOAT)
        for uid, t in enumerate((q, k, v, o, amax_s, amax_o, *scales)):
            t.set_uid(uid)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        return g

    def run(self, q8, k8, v8, scales: torch.Tensor, out: torch.Tensor) -> None:
        amax = torch.empty(2, dtype=torch.float32, device=out.device)
        pack = [q8, k8, v8, out, amax[0:1], amax[1:2], *(scales[i : i + 1] for i in range(6))]
        ws = torch.empty(self.workspace, dtype=torch.uint8, device=out.device)
        cudnn.set_stream(self.handle, torch.cuda.current_stream(out.device).cuda_stream)
        self.graph.execute(dict(enumerate(pack)), ws, handle=self.handle)


@atexit.register
def _free_plans() -> None:
    """cuDNN's graphs freed before the interpreter's teardown, where nanobind would list each
    one left as leaked in the console."""
    _plans.clear()
    _handles.clear()


def _plan(q: torch.Tensor, k: torch.Tensor):
    """The cached plan for q, k's shapes on q's device, or why cuDNN declined them."""
    b, h, lq, d = q.shape
    key = (q.device.index, b, h, lq, k.shape[2], d)
    if key not in _plans:
        try:
            if key[0] not in _handles:
                with torch.cuda.device(key[0]):
                    _handles[key[0]] = cudnn.create_handle()
            _plans[key] = _Plan(_handles[key[0]], *key)
        except Exception as e:  # cuDNN's "not supported" errors have no common base
            _plans[key] = f"cuDNN declined the fp8 attention graph: {e}".splitlines()[0][:300]
    return _plans[key]


def _device_reason(device: torch.device) -> str | None:
    """Why this device cannot run cuDNN's fp8 attention, or None."""
    if device.type != "cuda":
        return f"tensors on {device.type} are not supported (cuDNN needs a CUDA GPU)"
    cap = torch.cuda.get_device_capability(device)
    if cap < (9, 0):
        return f"compute capability {cap[0]}.{cap[1]}: cuDNN's fp8 attention needs 9.0+"
    return None


def fa3_reason(device: torch.device, head_dim: int) -> str | None:
    """Why kernel "auto" would not run FlashAttention-3 on `device` (CUDA), or None."""
    if flash_attn_3 is None:
        return FA3_MISSING
    if torch.cuda.get_device_capability(device) != (9, 0):
        return "FlashAttention-3's fp8 forward runs on Hopper (compute capability 9.0) only"
    return _fa3_failed.get(head_dim)


def kernel_name(device: torch.device, head_dim: int, kernel: str = "auto") -> str:
    """Which attention `attention_fp8` runs on `device` for this head size, and why not the
    faster one where it is not."""
    reason = _device_reason(device)
    if reason is not None:
        return f"exact SDPA ({reason})"
    hopper = torch.cuda.get_device_capability(device) == (9, 0)
    fa3 = fa3_reason(device, head_dim) if kernel == "auto" and hopper else None
    if kernel == "auto" and hopper and fa3 is None:
        return "FlashAttention-3's"
    if cudnn is None:
        return "exact SDPA (the cuDNN frontend is not installed)"
    return "cuDNN's" + (f" ({fa3})" if fa3 else "")


def attention_fp8_reason(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: str = "auto"
) -> str | None:
    """Why `attention_fp8` would run exact SDPA for these inputs, or None if it would not
    (before asking cuDNN, which may still decline a shape)."""
    reason = unsupported(q) or _device_reason(q.device)
    fa3 = kernel == "auto" and reason is None and fa3_reason(q.device, q.shape[-1]) is None
    if cudnn is None and not fa3:
        return "the cuDNN frontend is not installed (pip install nvidia-cudnn-frontend)"
    if reason is not None:
        return reason
    if q.dtype not in IN_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtypes {q.dtype}, {k.dtype}, {v.dtype} are not supported (bfloat16, float16)"
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        return f"shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)} are not (B, H, L, D)"
    b, h, _, d = q.shape
    if (k.shape[0], k.shape[1], k.shape[3]) != (b, h, d) or k.shape[2] == 0:
        return f"k and v {tuple(k.shape)} do not match q {tuple(q.shape)}"
    if d not in HEAD_DIMS:
        return f"head size {d} is not supported ({', '.join(map(str, HEAD_DIMS))})"
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        return "the head dimension is not contiguous"
    return grad_reason(q, k, v)


def attention_fp8(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, smooth_v: bool = True, amax_group="",
    kernel: str = "auto",
) -> torch.Tensor:  # fmt: skip
    """softmax(q k^T / sqrt(D)) v on fp8 tensor cores, through FlashAttention-3 (kernel
    "auto", where `fa3_reason` is None) or cuDNN.

    q: (B, H, Lq, D); k, v: (B, H, Lk, D); bfloat16 or float16, last stride 1; D 64 or
    128. Returns (B, H, Lq, D) in q's dtype over (B, Lq, H, D) memory. smooth_v=False
    leaves v's channel means in (only to measure what smoothing does). `amax_group`, a
    process group's name from `register_amax_group()`, makes every rank of it quantize with
    the amaxes of all their inputs together: ranks holding parts of one call's batch or heads then
    round as one GPU holding it all would (each rank must make the call). Other inputs, GPUs
    without it, or shapes cuDNN declines (see `attention_fp8_reason`) run exact SDPA and
    log why once.
    """
    reason = attention_fp8_reason(q, k, v, kernel)
    if reason is not None:
        log_fallback_once(OP, reason)
        return attention_exact(q, k, v)
    return _attention_fp8_op(q, k, v, smooth_v, amax_group, kernel).transpose(1, 2)


if HAS_TRITON:

    @custom_op("qwen_turbo::attention_fp8")
    def _attention_fp8_op(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, smooth_v: bool, amax_group: str,
        kernel: str,
    ) -> torch.Tensor:  # fmt: skip
        """(B, Lq, H, D); the kernel is chosen here, where torch.compile does not trace."""
        if kernel == "auto" and fa3_reason(q.device, q.shape[-1]) is None:
            (q8, k8, v8), scales, v_mean = quantize(q, k, v, smooth_v, amax_group)
            try:
                o = _flash_attn_3(q8, k8, v8, scales)
            except Exception as e:  # built without fp8 or this head size, say
                _fa3_failed[q.shape[-1]] = f"FlashAttention-3 failed: {e}".splitlines()[0][:300]
                log.warning("%s: %s; cuDNN from now on", OP, _fa3_failed[q.shape[-1]])
            else:
                return dequantize(o, scales, v_mean, q.dtype)
        plan = _plan(q, k)
        if isinstance(plan, str):
            log_fallback_once(OP, plan)
            return attention_exact(q, k, v).transpose(1, 2).contiguous()
        (q8, k8, v8), scales, v_mean = quantize(q, k, v, smooth_v, amax_group)
        b, h, lq, d = q.shape
        o8 = torch.empty((b, lq, h, d), dtype=FP8, device=q.device)
        plan.run(q8, k8, v8, scales, o8)
        return dequantize(o8, scales, v_mean, q.dtype)

    def _flash_attn_3(q8, k8, v8, scales: torch.Tensor) -> torch.Tensor:
        """FlashAttention-3's fp8 forward on `quantize`'s outputs: bf16 (B, Lq, H, D)."""
        b, h, _, d = q8.shape
        descales = (scales[i].expand(b, h) for i in (DQ, DK, DV))  # read through strides
        out = flash_attn_3(*(t.transpose(1, 2) for t in (q8, k8, v8)), q_descale=next(descales),
                           k_descale=next(descales), v_descale=next(descales),
                           softmax_scale=d**-0.5, num_splits=1)[0]  # fmt: skip
        return out.contiguous()  # as `dequantize` reads it

    @_attention_fp8_op.register_fake
    def _(q, k, v, smooth_v, amax_group, kernel):
        b, h, lq, d = q.shape
        return q.new_empty((b, lq, h, d))
