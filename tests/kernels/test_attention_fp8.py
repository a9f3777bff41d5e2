"""fp8 attention through cuDNN or FlashAttention-3: the Triton passes (quantization with v's
channel means taken out, and back) against their PyTorch reference (CPU, through the
interpreter), every fallback branch, and on a Hopper GPU the whole op against exact attention.

Against exact attention the relative L2 error is fp8's own: q.k, P, v and O each carry
e4m3's 3-bit mantissa rounding (about 2.6 % RMS each). On an H200 (benchmarks/RESULTS.md):
5.8 % at L = 7,145 and 6.4 % at L = 24,905 on i.i.d. N(0, 1) inputs. Bound: 1e-1.
"""

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from qwen_turbo.kernels import attention_fp8 as mod
from qwen_turbo.kernels._triton import HAS_TRITON
from qwen_turbo.kernels.attention_fp8 import (
    DK,
    DQ,
    DS,
    DV,
    FP8,
    SO,
    SS,
    attention_fp8,
    quantize_reference,
)
from tests.kernels.common import (
    assert_compiles_full_graph,
    assert_cuda_graph_replays,
    assert_logged_once,
    needs_cuda,
    needs_triton,
)

OP = "attention_fp8"
REFERENCES = (mod, "attention_exact")  # what `kernel_only` makes fail
EXACT_TOL = 1e-1
FP8_NAN = 0x7F
ULP = 2**-23  # the scales: 1 / x may round apart by an ulp between Triton and PyTorch


@pytest.fixture
def poisoned(monkeypatch):
    """Every torch.empty / empty_like filled with NaN (fp8: its NaN bits), so that an
    element a kernel does not write shows."""
    real_empty, real_like = torch.empty, torch.empty_like

    def poison(t):
        if t.dtype == FP8:
            t.view(torch.uint8).fill_(FP8_NAN)
        elif t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poison(real_empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poison(real_like(*a, **kw)))


def _joint(b, h, seq, d, dtype, seed, device="cpu", scale=1.0):
    """N(0, scale^2) as (B, H, L, D) views of (B, L, H, D) memory, the DiT's layout."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, seq, h, d, generator=g) * scale
    return x.to(device=device, dtype=dtype).transpose(1, 2)


def _qkv(b, h, lq, lk, d, dtype, seed, device="cpu"):
    return tuple(_joint(b, h, n, d, dtype, seed + i, device) for i, n in enumerate((lq, lk, lk)))


def _rel(out, exact):
    return ((out.double() - exact.double()).norm() / exact.double().norm()).item()


# The Triton passes (interpreter on CPU).


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b,h,seq,d", [(2, 3, 37, 64), (1, 2, 300, 128)])
@pytest.mark.parametrize("layout", ["joint", "contiguous"])
def test_quantize_matches_reference(poisoned, dtype, b, h, seq, d, layout):
    """Exact fp8 values in (B, L, H, D) memory and the six scales, for odd lengths and both
    input layouts; magnitudes differ per tensor, and v has channel means to take out."""
    q, k, v = (_joint(b, h, seq, d, dtype, seed=s, scale=10.0**s) for s in (-2, 0, 2))
    v = v + _joint(b, h, 1, d, dtype, seed=5, scale=300)
    if layout == "contiguous":
        q, k, v = (x.contiguous() for x in (q, k, v))
    out, scales, v_mean = mod.quantize(q, k, v)
    torch.testing.assert_close(v_mean, v.double().mean(2).float(), rtol=1e-5, atol=1e-3)
    for slot, x in enumerate((q, k, v)):
        ref8, descale = quantize_reference(x, v_mean if slot == DV else None)
        assert out[slot].shape == x.shape and out[slot].dtype == FP8
        assert out[slot].transpose(1, 2).is_contiguous()
        # values: the interpreter drops -0's sign
        assert torch.equal(out[slot].float(), ref8.float())
        torch.testing.assert_close(scales[slot : slot + 1], descale, rtol=ULP, atol=0)
    torch.testing.assert_close(scales[SO], 1 / scales[DV], rtol=ULP, atol=0)
    assert scales[SS] == 448 and scales[DS] == 1 / 448


@needs_triton
def test_quantize_without_smoothing(poisoned):
    q, k, v = _qkv(1, 2, 37, 37, 64, torch.bfloat16, seed=8)
    v = v + 5
    (_, _, v8), scales, v_mean = mod.quantize(q, k, v, smooth_v=False)
    assert (v_mean == 0).all()
    ref8, descale = quantize_reference(v)
    assert torch.equal(v8.float(), ref8.float())
    torch.testing.assert_close(scales[DV : DV + 1], descale, rtol=ULP, atol=0)


@needs_triton
def test_quantize_zero_and_huge(poisoned):
    """An all-zero q quantizes to zeros with a finite scale; float16 k of 3e4 lands on
    +-448; a constant v is all mean: zeros."""
    q = torch.zeros(1, 2, 37, 64, dtype=torch.float16)
    k = _joint(1, 2, 37, 64, torch.float16, seed=3, scale=1e4)
    v = torch.full_like(q, 7.0)
    (q8, k8, v8), scales, v_mean = mod.quantize(q, k, v)
    assert (q8.float() == 0).all() and (v8.float() == 0).all() and scales.isfinite().all()
    assert k8.float().abs().max() == 448
    assert torch.equal(k8.float(), quantize_reference(k)[0].float())
    assert (v_mean == 7).all()


@needs_triton
@pytest.mark.parametrize(
    "seq,device",
    [(300, "cpu"), pytest.param(25161, "cuda", marks=[pytest.mark.gpu, needs_cuda])],
)
def test_channel_means_of_a_half_equal_the_whole(poisoned, seq, device):
    """v's channel means for half the batch or half the heads (in the (B, L, H, D) memory
    a sequence-parallel rank holds) are the whole call's bit for bit: torch's mean is not,
    at 7,145 and 25,161 tokens on an H200. And they are the means."""
    v = _joint(2, 24, seq, 128, torch.bfloat16, seed=28, device=device) + 0.3
    whole = mod.channel_means(v)
    torch.testing.assert_close(whole, v.double().mean(2).float(), rtol=1e-5, atol=1e-6)
    for half in range(2):
        heads = v[:, 12 * half : 12 * half + 12].transpose(1, 2).contiguous().transpose(1, 2)
        assert torch.equal(mod.channel_means(heads), whole[:, 12 * half : 12 * half + 12])
        assert torch.equal(mod.channel_means(v[half : half + 1]), whole[half : half + 1])


# Rank RANK of a 2-process gloo group: its half (along SHARE_DIM) of the q, k, v saved in
# SHARE_DIR/qkv.pt, quantized with the group's amaxes, saved to SHARE_DIR/RANK.pt. It imports
# the kernels alone: the pack would import ComfyUI, which parses the process's argv.
RANK = """import os
import torch
import torch.distributed as dist
import tests.harness  # registers the pack as qwen_turbo, without running it
from qwen_turbo.kernels import attention_fp8 as mod

rank, path, dim = int(os.environ["RANK"]), os.environ["SHARE_DIR"], int(os.environ["SHARE_DIM"])
dist.init_process_group("gloo", init_method=f"file://{path}/store", rank=rank, world_size=2)
try:
    q, k, v = (x.chunk(2, dim)[rank] for x in torch.load(f"{path}/qkv.pt"))
    v = v * (1 + 9 * rank)  # the ranks' amaxes differ
    out, scales, _ = mod.quantize(q, k, v, amax_group=mod.register_amax_group(dist.group.WORLD))
    torch.save(([o.float() for o in out], scales), f"{path}/{rank}.pt")
finally:
    dist.destroy_process_group()
"""


@needs_triton
@pytest.mark.parametrize("dim", [0, 1], ids=["batch", "heads"])
def test_quantize_over_ranks_rounds_as_one_tensor(tmp_path, dim):
    """Two ranks each holding half of the batch (CFG-parallel) or of the heads (sequence
    parallel) quantize with the whole tensors' scales, so their fp8 values are the halves
    of the whole tensors'."""
    q, k, v = _qkv(2, 4, 37, 37, 64, torch.bfloat16, 11)
    torch.save((q, k, v), tmp_path / "qkv.pt")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "SHARE_DIR": str(tmp_path),
           "SHARE_DIM": str(dim)}  # fmt: skip
    ranks = [subprocess.Popen([sys.executable, "-c", RANK], env={**env, "RANK": str(r)})
             for r in range(2)]  # fmt: skip
    assert [p.wait(300) for p in ranks] == [0, 0]
    v = torch.cat([h * (1 + 9 * r) for r, h in enumerate(v.chunk(2, dim))], dim)
    out, scales, _ = mod.quantize(q, k, v)
    for rank in range(2):
        got, got_scales = torch.load(tmp_path / f"{rank}.pt")
        assert torch.equal(got_scales, scales)
        for x8, whole in zip(got, out, strict=True):
            assert torch.equal(x8, whole.float().chunk(2, dim)[rank])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dequantize(poisoned, dtype):
    g = torch.Generator().manual_seed(4)
    o8 = (torch.randn(2, 37, 3, 64, generator=g) * 100).to(FP8)
    scales = torch.rand(6, generator=g) + 0.5
    v_mean = torch.randn(2, 3, 64, generator=g)
    out = mod.dequantize(o8, scales, v_mean, dtype)
    assert out.dtype == dtype and out.shape == o8.shape
    assert torch.equal(out, (o8.float() * scales[DV] + v_mean[:, None]).to(dtype))


@needs_triton
def test_dequantize_bf16_output(poisoned):
    """FlashAttention-3's O comes out in bf16: only v's means are added, in float32."""
    g = torch.Generator().manual_seed(5)
    o = torch.randn(2, 37, 3, 64, generator=g).to(torch.bfloat16)
    scales = torch.rand(6, generator=g) + 0.5
    v_mean = torch.randn(2, 3, 64, generator=g)
    out = mod.dequantize(o, scales, v_mean, torch.bfloat16)
    assert torch.equal(out, (o.float() + v_mean[:, None]).to(torch.bfloat16))


@needs_triton
def test_scales_and_means_round_trip():
    """The passes with cuDNN's part done in float32 from the same fp8 tensors and scales
    (q.k descaled by DQ, DK; v by DV; O scaled by SO): close to exact attention, v's
    large channel means added back."""
    q, k, v = _qkv(1, 2, 77, 300, 64, torch.bfloat16, seed=6)
    v = v + _joint(1, 2, 1, 64, torch.bfloat16, seed=7, scale=50)
    (q8, k8, v8), scales, v_mean = mod.quantize(q, k, v)
    s = (q8.float() * scales[DQ]) @ (k8.float() * scales[DK]).mT / 8
    o = s.softmax(-1) @ (v8.float() * scales[DV])
    o8 = (o * scales[SO]).clamp(-448, 448).to(FP8).transpose(1, 2).contiguous()
    out = mod.dequantize(o8, scales, v_mean, torch.bfloat16).transpose(1, 2)
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    assert _rel(out, exact) <= 2e-2, _rel(out, exact)  # mostly the mean, exact


# Fallbacks: each branch runs exact SDPA on the inputs as given, logged once.


@pytest.fixture
def with_cudnn(monkeypatch):
    """As if the cuDNN frontend were installed (the CPU venv has none)."""
    monkeypatch.setattr(mod, "cudnn", object())


def _assert_falls_back(q, k, v, caplog, reason):
    out = attention_fp8(q, k, v)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), rtol=0, atol=0)
    assert_logged_once(caplog, OP, reason)


def test_fallback_no_frontend(monkeypatch, fresh_log):
    monkeypatch.setattr(mod, "cudnn", None)
    q, k, v = _qkv(1, 2, 5, 7, 64, torch.bfloat16, seed=0)
    _assert_falls_back(q, k, v, fresh_log, "pip install nvidia-cudnn-frontend")


def test_fallback_cpu(with_cudnn, fresh_log):
    q, k, v = _qkv(1, 2, 5, 7, 64, torch.bfloat16, seed=0)
    _assert_falls_back(q, k, v, fresh_log, "tensors on cpu are not supported")


def test_fallback_old_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 9))
    reason = mod._device_reason(torch.device("cuda", 0))
    assert reason == "compute capability 8.9: cuDNN's fp8 attention needs 9.0+"


@pytest.fixture
def on_gpu(with_cudnn, monkeypatch):
    """CPU tensors pass the device check (the interpreter stands in for the GPU)."""
    monkeypatch.setattr(mod, "_device_reason", lambda device: None)


@pytest.mark.parametrize(
    "change,reason",
    [
        (lambda q, k, v: (q.float(), k.float(), v.float()), "are not supported (bfloat16"),
        (lambda q, k, v: (q, k, v.half()), "torch.bfloat16, torch.bfloat16, torch.float16"),
        (lambda q, k, v: (q[0], k[0], v[0]), "are not (B, H, L, D)"),
        (lambda q, k, v: (q, k[:, :1], v[:, :1]), "do not match q"),
        (lambda q, k, v: (q, k[:, :, :0], v[:, :, :0]), "do not match q"),
        (lambda q, k, v: (q[..., :32], k[..., :32], v[..., :32]), "head size 32"),
        (lambda q, k, v: (q.mT.contiguous().mT, k, v), "head dimension is not contiguous"),
    ],
    ids=["float32", "mixed", "3d", "heads", "no keys", "head size", "strides"],
)
def test_fallback_inputs(on_gpu, fresh_log, change, reason):
    q, k, v = change(*_qkv(1, 2, 5, 7, 64, torch.bfloat16, seed=0))
    if q.dtype != v.dtype:
        with pytest.raises(RuntimeError):  # SDPA's own error for mixed dtypes
            attention_fp8(q, k, v)
        assert_logged_once(fresh_log, OP, reason)
    else:
        _assert_falls_back(q, k, v, fresh_log, reason)


def test_fallback_cudnn_declines(on_gpu, monkeypatch, fresh_log):
    """A shape cuDNN cannot build is remembered: built once, logged once, exact SDPA."""
    built = []

    def decline(*args):
        built.append(args)
        raise RuntimeError("no engine proposed a plan for this graph\nsecond line")

    monkeypatch.setattr(mod, "_plans", {})
    monkeypatch.setattr(mod, "_handles", {None: "handle"})
    monkeypatch.setattr(mod, "_Plan", decline)
    q, k, v = _qkv(1, 2, 5, 7, 64, torch.bfloat16, seed=0)
    _assert_falls_back(q, k, v, fresh_log, "cuDNN declined the fp8 attention graph: no engine")
    attention_fp8(q, k, v)
    assert built == [("handle", None, 1, 2, 5, 7, 64)]


# FlashAttention-3 (kernel "auto"): chosen only where it can run; a failure hands over to cuDNN.


def flash_attn_3_in_float32(q8, k8, v8, q_descale, k_descale, v_descale, softmax_scale,
                            num_splits):  # fmt: skip
    """FlashAttention-3's fp8 forward op (torch.ops.flash_attn_3.fwd) in float32 from its
    inputs: (B, L, H, D) fp8 q, k, v and (B, H) descales; bf16 out first."""
    assert num_splits == 1
    q, k, v = (x.float() * d[:, None, :, None] for x, d in
               ((q8, q_descale), (k8, k_descale), (v8, v_descale)))  # fmt: skip
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * softmax_scale
    out = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v).to(torch.bfloat16)
    return out, None, None, None


@pytest.fixture
def hopper(on_gpu, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    monkeypatch.setattr(mod, "_fa3_failed", {})


def test_fa3_reason_and_kernel_name(hopper, monkeypatch):
    """Why not FlashAttention-3, and which kernel the badge names, for each case."""
    cpu = torch.device("cpu")  # `hopper` makes it pass for a Hopper GPU
    missing = "flash_attn_3 (FlashAttention-3) is not installed"
    monkeypatch.setattr(mod, "flash_attn_3", None)
    monkeypatch.setattr(mod, "FA3_MISSING", missing)
    assert mod.fa3_reason(cpu, 64) == missing
    assert mod.kernel_name(cpu, 64) == f"cuDNN's ({missing})"
    monkeypatch.setattr(mod, "flash_attn_3", flash_attn_3_in_float32)
    assert mod.fa3_reason(cpu, 64) is None
    assert mod.kernel_name(cpu, 64) == "FlashAttention-3's"
    assert mod.kernel_name(cpu, 64, kernel="cudnn") == "cuDNN's"
    mod._fa3_failed[64] = "FlashAttention-3 failed: no"
    assert mod.fa3_reason(cpu, 64) == "FlashAttention-3 failed: no"
    assert mod.fa3_reason(cpu, 128) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (10, 0))
    assert "Hopper (compute capability 9.0) only" in mod.fa3_reason(cpu, 128)
    monkeypatch.setattr(mod, "flash_attn_3", None)
    assert mod.kernel_name(cpu, 128) == "cuDNN's"  # no word of FlashAttention-3 off Hopper
    monkeypatch.setattr(mod, "cudnn", None)
    assert mod.kernel_name(cpu, 128) == "exact SDPA (the cuDNN frontend is not installed)"


def test_fa3_not_installed_or_not_loadable(monkeypatch):
    """The badge's reason tells a FlashAttention-3 that is absent from one that is installed
    but does not load (built for another torch: its extension's undefined symbols)."""
    absent = "flash_attn_3 (FlashAttention-3) is not installed"
    assert mod.load_fa3("qwen_turbo_absent_package._C") == (None, absent)

    def broken(name):
        raise ImportError(f"{name}: undefined symbol: _ZN3c104cuda9SetDeviceEab")

    monkeypatch.setattr(mod.importlib, "import_module", broken)
    op, reason = mod.load_fa3()
    assert op is None
    assert reason == (
        "flash_attn_3 (FlashAttention-3) did not load: flash_attn_3._C: undefined symbol: "
        "_ZN3c104cuda9SetDeviceEab"
    )


def test_fa3_op_without_the_arguments_the_pack_passes():
    """An op whose schema lacks what the pack passes (another FlashAttention-3) is not used."""
    assert mod.fa3_op_reason(torch.ops.aten.add) == (
        "FlashAttention-3's fwd op has no k_descale, num_splits, q_descale, softmax_scale, "
        "v_descale"
    )


@needs_triton
@pytest.mark.parametrize("kernel", ["auto", "cudnn"])
def test_fa3_takes_the_quantized_inputs(hopper, monkeypatch, kernel):
    """Kernel "auto" hands `quantize`'s fp8 q, k, v ((B, L, H, D)) and its descales (per
    batch and head) to FlashAttention-3, and adds v's means to its bf16 O: close to exact
    attention with v's large means; "cudnn" never calls it."""
    called = []
    monkeypatch.setattr(mod, "flash_attn_3", lambda *a, **kw: called.append(a) or
                        flash_attn_3_in_float32(*a, **kw))  # fmt: skip
    monkeypatch.setattr(mod, "_plan", lambda q, k: "cuDNN declined: exact SDPA")
    q, k, v = _qkv(2, 3, 77, 300, 64, torch.bfloat16, seed=8)
    v = v + _joint(2, 3, 1, 64, torch.bfloat16, seed=9, scale=50)
    out = attention_fp8(q, k, v, kernel=kernel)
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    assert out.shape == q.shape and out.dtype == q.dtype
    if kernel == "cudnn":
        assert not called and torch.equal(out, F.scaled_dot_product_attention(q, k, v))
        return
    assert [tuple(t.shape) for t in called[0]] == [(2, 77, 3, 64), (2, 300, 3, 64)] + [
        (2, 300, 3, 64)
    ]
    assert out.transpose(1, 2).is_contiguous()
    assert _rel(out, exact) <= 2e-2, _rel(out, exact)  # mostly the mean, exact


@needs_triton
def test_fa3_failure_hands_over_to_cudnn(hopper, monkeypatch, caplog):
    """A FlashAttention-3 call that raises (built without fp8 or this head size) is logged
    once, remembered for the head size, and that call and later ones take cuDNN's path."""
    calls = []

    def fails(*args, **kwargs):
        calls.append(args)
        raise RuntimeError("FlashAttention-3 was not built with fp8\nsecond line")

    monkeypatch.setattr(mod, "flash_attn_3", fails)
    monkeypatch.setattr(mod, "_plan", lambda q, k: "cuDNN declined: exact SDPA")
    q, k, v = _qkv(1, 2, 5, 7, 64, torch.bfloat16, seed=0)
    for _ in range(2):
        out = attention_fp8(q, k, v)
        assert torch.equal(out, F.scaled_dot_product_attention(q, k, v))
    assert len(calls) == 1
    assert mod._fa3_failed == {64: "FlashAttention-3 failed: FlashAttention-3 was not built "
                               "with fp8"}  # fmt: skip
    warnings = [r for r in caplog.records if "cuDNN from now on" in r.getMessage()]
    assert len(warnings) == 1


def test_fa3_without_the_cudnn_frontend(hopper, monkeypatch, fresh_log):
    """FlashAttention-3 needs no cuDNN frontend; without either, exact SDPA, logged."""
    monkeypatch.setattr(mod, "cudnn", None)
    q, k, v = _qkv(1, 2, 5, 7, 64, torch.bfloat16, seed=0)
    monkeypatch.setattr(mod, "flash_attn_3", flash_attn_3_in_float32)
    assert mod.attention_fp8_reason(q, k, v) is None
    assert "nvidia-cudnn-frontend" in mod.attention_fp8_reason(q, k, v, kernel="cudnn")
    monkeypatch.setattr(mod, "flash_attn_3", None)
    monkeypatch.setattr(mod, "FA3_MISSING", "flash_attn_3 (FlashAttention-3) is not installed")
    _assert_falls_back(q, k, v, fresh_log, "pip install nvidia-cudnn-frontend")


# The plan cache on disk.


def test_plan_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("QWEN_TURBO_CUDNN_CACHE", str(tmp_path))
    assert mod.plan_cache_dir() == tmp_path
    monkeypatch.setenv("QWEN_TURBO_CUDNN_CACHE", "0")
    assert mod.plan_cache_dir() is None
    monkeypatch.delenv("QWEN_TURBO_CUDNN_CACHE")
    assert mod.plan_cache_dir() == Path.home() / ".cache" / "qwen_turbo" / "cudnn"


class _FakeGraph:
    """Stands in for a cuDNN pygraph: serializes to `data`, or raises where cuDNN cannot."""

    def __init__(self, data=None, serializable=True):
        self.data, self.serializable = data, serializable

    def serialize(self):
        if not self.serializable:
            raise RuntimeError("this engine cannot be serialized")
        return self.data

    def deserialize(self, data):
        if data == list(b"damaged"):
            raise RuntimeError("not a plan")
        self.data = data

    def get_workspace_size(self):
        return 0


@pytest.mark.parametrize("serializable", [True, False])
def test_plan_built_kept_then_loaded(monkeypatch, tmp_path, serializable):
    """On the CPU, cuDNN faked: a plan is built and kept, the next one of that shape is
    loaded, a damaged file is built again and replaced; where cuDNN cannot serialize the
    engine each plan is built and nothing is kept. Another shape gets a file of its own."""
    fake = types.SimpleNamespace(pygraph=lambda handle: _FakeGraph(), backend_version=lambda: 91900,
                                 __version__="1.32.0")  # fmt: skip
    props = types.SimpleNamespace(name="GPU", major=9, minor=0)
    monkeypatch.setattr(mod, "cudnn", fake)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setenv("QWEN_TURBO_CUDNN_CACHE", str(tmp_path))
    builds = []

    def build(handle, *shape):
        builds.append(shape)
        return _FakeGraph([len(builds)], serializable)

    monkeypatch.setattr(mod._Plan, "_build", staticmethod(build))
    first, second = mod._Plan("h", 0, 1, 2, 5, 5, 64), mod._Plan("h", 0, 1, 2, 5, 5, 64)
    files = list(tmp_path.iterdir())
    if not serializable:
        assert not first.loaded and not second.loaded and len(builds) == 2 and files == []
        return
    assert not first.loaded and second.loaded and second.graph.data == [1] and len(builds) == 1
    files[0].write_bytes(b"damaged")
    again = mod._Plan("h", 0, 1, 2, 5, 5, 64)
    assert not again.loaded and mod.read_plan(files[0]) == [2]
    mod._Plan("h", 0, 1, 2, 6, 6, 64)
    assert len(list(tmp_path.iterdir())) == 2


def test_plan_files_round_trip(tmp_path):
    """Written whole then renamed (no part file left), read back as bytes; nothing to read or
    nowhere to write is not an error."""
    path = tmp_path / "new" / "a.plan"
    mod.write_plan(path, [0, 7, 255])
    assert mod.read_plan(path) == [0, 7, 255]
    assert [f.name for f in path.parent.iterdir()] == ["a.plan"]
    assert mod.read_plan(tmp_path / "missing.plan") is None and mod.read_plan(None) is None
    blocked = tmp_path / "file"
    blocked.write_text("")
    mod.write_plan(blocked / "b.plan", [1])  # its folder is a file: logged, not raised
    mod.write_plan(None, [1])


# On a Hopper GPU with the cuDNN frontend.

needs_cudnn_fp8 = pytest.mark.skipif(
    mod.cudnn is None
    or not torch.cuda.is_available()
    or torch.cuda.get_device_capability() < (9, 0)
    or not HAS_TRITON,
    reason="needs the cuDNN frontend and a GPU of compute capability 9.0+",
)


def _gpu_rel(out, q, k, v):
    """Relative L2 of out against float32 SDPA (float64 stand-in: its error is ~1e-6)."""
    exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    return _rel(out.float(), exact)


@pytest.mark.gpu
@needs_cuda
@needs_cudnn_fp8
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b,h,lq,lk,d", [(1, 24, 7145, 7145, 128), (2, 4, 1000, 2077, 64)])
@pytest.mark.parametrize("kernel", mod.KERNELS)
def test_gpu_matches_exact(kernel_only, dtype, b, h, lq, lk, d, kernel):
    q, k, v = _qkv(b, h, lq, lk, d, dtype, seed=20, device="cuda")
    out = attention_fp8(q, k, v, kernel=kernel)
    assert out.shape == q.shape and out.dtype == dtype and out.isfinite().all()
    assert out.transpose(1, 2).is_contiguous()
    assert _gpu_rel(out, q, k, v) <= EXACT_TOL, _gpu_rel(out, q, k, v)


needs_flash_attn_3 = pytest.mark.skipif(
    mod.flash_attn_3 is None
    or not torch.cuda.is_available()
    or torch.cuda.get_device_capability() != (9, 0)
    or not HAS_TRITON,
    reason="needs FlashAttention-3 (flash_attn_3) and a Hopper GPU",
)


@pytest.mark.gpu
@needs_cuda
@needs_cudnn_fp8
@needs_flash_attn_3
@pytest.mark.parametrize("b,h,lq,lk", [(1, 24, 7145, 7145), (2, 4, 1000, 2077)])
def test_gpu_flash_attn_3(kernel_only, monkeypatch, b, h, lq, lk):
    """Kernel "auto" runs FlashAttention-3 (and records no failure), within fp8's error of
    exact attention and of cuDNN's path, and a CUDA graph replays it."""
    calls, real = [], mod.flash_attn_3
    monkeypatch.setattr(mod, "flash_attn_3", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v = _qkv(b, h, lq, lk, 128, torch.bfloat16, seed=23, device="cuda")
    out = attention_fp8(q, k, v)
    assert calls and not mod._fa3_failed
    assert out.isfinite().all() and out.transpose(1, 2).is_contiguous()
    assert _gpu_rel(out, q, k, v) <= EXACT_TOL, _gpu_rel(out, q, k, v)
    assert _rel(out, attention_fp8(q, k, v, kernel="cudnn")) <= EXACT_TOL
    assert_cuda_graph_replays(lambda: attention_fp8(q, k, v), q, 2)


@pytest.mark.gpu
@needs_cuda
@needs_cudnn_fp8
def test_gpu_plan_cache(kernel_only, monkeypatch, tmp_path):
    """A built plan is kept on disk; the next one of that shape is loaded from it and computes
    the same bits; a damaged file is built again and replaced."""
    monkeypatch.setenv("QWEN_TURBO_CUDNN_CACHE", str(tmp_path))
    import cudnn

    handle = cudnn.create_handle()
    gen = torch.Generator("cuda").manual_seed(4)
    q8, k8, v8 = (torch.randn(1, 333, 2, 64, device="cuda", generator=gen).to(mod.FP8)
                  for _ in range(3))  # fmt: skip
    scales = torch.tensor([0.5, 0.5, 0.5, 2, 448, 1 / 448], device="cuda")

    def run(plan):
        out = torch.full_like(q8, float("nan"))
        plan.run(q8, k8, v8, scales, out)
        return out.float()

    built = mod._Plan(handle, 0, 1, 2, 333, 333, 64)
    (path,) = tmp_path.iterdir()
    loaded = mod._Plan(handle, 0, 1, 2, 333, 333, 64)
    assert not built.loaded and loaded.loaded
    torch.testing.assert_close(run(loaded), run(built), rtol=0, atol=0)
    assert run(built).isfinite().all()
    path.write_bytes(b"not a plan")
    again = mod._Plan(handle, 0, 1, 2, 333, 333, 64)
    assert not again.loaded and mod._Plan(handle, 0, 1, 2, 333, 333, 64).loaded
    torch.testing.assert_close(run(again), run(built), rtol=0, atol=0)


EXIT = """import torch
import tests.harness  # registers the pack as qwen_turbo, without running it
from qwen_turbo.kernels import attention_fp8 as mod

q = torch.randn(1, 2, 333, 64, device="cuda", dtype=torch.bfloat16)
assert mod.attention_fp8(q, q, q, kernel="cudnn").isfinite().all()
"""


@pytest.mark.gpu
@needs_cuda
@needs_cudnn_fp8
def test_gpu_process_exits_without_leak_reports(tmp_path):
    """A process whose attention built a plan, and one that loaded it, exit without
    nanobind's list of cuDNN objects left alive (printed in ComfyUI's console at exit)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path),
           "QWEN_TURBO_CUDNN_CACHE": str(tmp_path)}  # fmt: skip
    for _ in ("built", "loaded"):
        run = subprocess.run([sys.executable, "-c", EXIT], env=env, capture_output=True,
                             text=True, timeout=300)  # fmt: skip
        assert run.returncode == 0 and "leaked" not in run.stderr, run.stderr[-3000:]
    assert len(list(tmp_path.iterdir())) == 1


@pytest.mark.gpu
@needs_cuda
@needs_cudnn_fp8
@pytest.mark.parametrize("seq", [1280, 7145])
@pytest.mark.parametrize("dim", [0, 1], ids=["batch", "heads"])
@pytest.mark.parametrize(
    "kernel", ["cudnn", pytest.param("flash_attn_3", marks=needs_flash_attn_3)]
)
def test_gpu_half_of_a_call_rounds_as_the_whole(kernel_only, seq, dim, kernel):
    """The fp8 attention kernel on half the batch or half the heads, at the whole call's
    scales (what Multi-GPU ranks compute), gives the whole call's output for that half bit for
    bit."""
    xs = _qkv(2, 24, seq, seq, 128, torch.bfloat16, seed=27, device="cuda")
    (q8, k8, v8), scales, _ = mod.quantize(*xs)

    def run(*xs):  # in (B, L, H, D) memory, as quantize writes it
        q8, k8, v8 = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in xs)
        if kernel == "flash_attn_3":
            return mod._flash_attn_3(q8, k8, v8, scales).view(torch.int16)
        b, h, lq, d = q8.shape
        o8 = torch.empty((b, lq, h, d), dtype=FP8, device="cuda")
        mod._plan(q8, k8).run(q8, k8, v8, scales, o8)
        return o8.view(torch.uint8)

    whole = run(q8, k8, v8)
    for half in range(2):
        got = run(*(x.chunk(2, dim)[half] for x in (q8, k8, v8)))
        assert torch.equal(got, whole.chunk(2, 0 if dim == 0 else 2)[half])


@pytest.mark.gpu
@needs_cuda
@needs_cudnn_fp8
def test_gpu_quantize_matches_reference(poisoned):
    xs = _qkv(1, 24, 1000, 2077, 128, torch.bfloat16, seed=21, device="cuda")
    out, scales, v_mean = mod.quantize(*xs)
    for slot, (x, x8) in enumerate(zip(xs, out, strict=True)):
        ref8, descale = quantize_reference(x, v_mean if slot == DV else None)
        assert torch.equal(x8.view(torch.uint8), ref8.view(torch.uint8))
        torch.testing.assert_close(scales[slot : slot + 1], descale, rtol=ULP, atol=0)


@pytest.mark.gpu
@needs_cuda
@needs_cudnn_fp8
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_huge_values_finite(kernel_only, dtype):
    """Logits of about 1e6 (every row a hard argmax) and |v| up to ~3e4: finite, and
    within v's range (O is a convex combination of v's rows; fp8 rounds by 2^-4 at most)."""
    q, k, v = _qkv(1, 24, 7145, 7145, 128, dtype, seed=22, device="cuda")
    q, k, v = q * 1e3, k * 1e3, v * 5e3
    out = attention_fp8(q, k, v)
    assert out.isfinite().all()
    assert out.float().abs().max() <= v.float().abs().max() * (1 + 2**-4)


@pytest.mark.gpu
@needs_cuda
@needs_cudnn_fp8
def test_gpu_v_channel_means(kernel_only):
    """v with channel means holding most of its norm, as in the DiT's later layers, at the
    2512^2 sequence length. Without smoothing the error here is about the mean's share of
    O (it was 12-29 % on the DiT's inputs); smoothed, it is fp8's own on the rest."""
    q, k, v = _qkv(1, 24, 24905, 24905, 128, torch.bfloat16, seed=25, device="cuda")
    v = v + _joint(1, 24, 1, 128, torch.bfloat16, seed=26, device="cuda", scale=3)
    err = _gpu_rel(attention_fp8(q, k, v), q, k, v)
    err_raw = _gpu_rel(attention_fp8(q, k, v, smooth_v=False), q, k, v)
    assert err <= 1e-2 and err_raw >= 3 * err, (err, err_raw)


@pytest.mark.gpu
@needs_cuda
@needs_cudnn_fp8
def test_gpu_cuda_graph_capture(kernel_only):
    q, k, v = _qkv(1, 24, 1000, 1000, 128, torch.bfloat16, seed=23, device="cuda")
    assert_cuda_graph_replays(lambda: attention_fp8(q, k, v), q, 2)


@pytest.mark.gpu
@needs_cuda
@needs_cudnn_fp8
def test_gpu_torch_compile_full_graph(kernel_only):
    q, k, v = _qkv(1, 2, 500, 700, 128, torch.bfloat16, seed=24, device="cuda")
    assert_compiles_full_graph(lambda x: attention_fp8(x, k, v) * 2, q)
