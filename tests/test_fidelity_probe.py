"""The Optimized Loader's fidelity probe on CPU: the narrow DiT with outlier channels injected into
one block's attention, and 8-bit attention emulated (q, k and v rounded through float8_e4m3fn
at one scale per tensor, as fp8_cudnn quantizes): the probe marks that block and no other,
the marked block computes on the safe path, the result is cached and reused, and a probe that
fails leaves the sampling running."""

import logging

import comfy.model_management as mm
import comfy.ops
import folder_paths
import pytest
import torch
from comfy_extras.nodes_model_advanced import ModelSamplingAuraFlow

import nodes
from qwen_turbo.runtime.dit import attention, config, fp8, loader, probe, streaming
from qwen_turbo.runtime.dit.attention import OVERRIDE
from tests.harness import models

FP8_MAX = 448.0


def _round_fp8(t: torch.Tensor) -> torch.Tensor:
    scale = t.abs().amax().float().clamp_min(1e-12) / FP8_MAX
    return ((t.float() / scale).to(torch.float8_e4m3fn).float() * scale).to(t.dtype)


def emulated_fp8_attention(func, q, k, v, *args, **kwargs):
    """An attention override rounding its inputs as 8-bit attention does."""
    return func(_round_fp8(q), _round_fp8(k), _round_fp8(v), *args, **kwargs)


@pytest.fixture
def outlier_model(narrow_sd):
    """The narrow DiT (2 blocks) with outlier channels in block 1's attention."""
    sd = models.with_outliers(narrow_sd, [1])
    return loader.build(sd, config.read_config(sd), "fp8_e4m3fn")


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(folder_paths, "get_user_directory", lambda: str(tmp_path))
    return tmp_path


def test_the_probe_marks_the_block_with_outliers(outlier_model):
    result = probe.measure(outlier_model.model, torch.device("cpu"), emulated_fp8_attention, 0.15)
    assert result.kept == [1], result.errors
    assert result.errors[1] > 0.15 > result.errors[0] > 0
    assert outlier_model.model.qwen_turbo.safe_blocks == {1}
    assert result.summary().endswith("; 1 of 2 blocks kept bf16")


def test_without_outliers_no_block_is_marked(narrow_sd):
    model = loader.build(dict(narrow_sd), config.read_config(narrow_sd), "fp8_e4m3fn")
    result = probe.measure(model.model, torch.device("cpu"), emulated_fp8_attention, 0.15)
    assert result.kept == [] and max(result.errors) < 0.15, result.errors


def test_the_safe_forward_takes_the_reference_attention(narrow_sd, monkeypatch):
    """The safe path's attention in the probe is `unbuilt_override`'s, and with ComfyUI's
    attention as the lossy one the rerun takes it too: one call a block and pass."""
    calls = []

    def counted():
        reference = attention.unbuilt_override()

        def override(func, *args, **kwargs):
            calls.append(1)
            return reference(func, *args, **kwargs)

        return override

    monkeypatch.setattr(probe, "unbuilt_override", counted)
    model = loader.build(dict(narrow_sd), config.read_config(narrow_sd), "fp8_e4m3fn")
    result = probe.measure(model.model, torch.device("cpu"), None, 0.15)
    assert len(calls) == 4 and result.kept == []  # 2 blocks, safe and lossy


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_reference_attention_is_not_cudnns():
    """torch's cuDNN attention builds a graph at a process's first call (0.83 s on an H100),
    and torch takes it first on Hopper whatever priority is asked: at the probe's shape the
    reference runs another exact kernel, within bf16's rounding of float32 attention."""
    q, k, v = (torch.randn(1, 1088, 24 * 128, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))  # fmt: skip
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def heads(*ts):
        return [t.view(1, -1, 24, 128).transpose(1, 2) for t in ts]

    def ops(call):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = call()
        return out, {e.key for e in prof.key_averages()}

    if torch.cuda.get_device_capability() >= (9, 0):  # where torch would take cuDNN's
        assert any("cudnn_attention" in op for op in ops(lambda: sdpa(*heads(q, k, v)))[1])
    out, used = ops(lambda: attention.unbuilt_override()(None, q, k, v, 24))
    assert not any("cudnn_attention" in op for op in used), used
    ref = sdpa(*heads(q.float(), k.float(), v.float())).transpose(1, 2).reshape(out.shape)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 2**-7


def test_kept_blocks_compute_on_the_safe_path(narrow_sd):
    """A kept block's fp8 layers compute in bf16 and its attention is ComfyUI's (the loader's
    override steps aside for it); other blocks keep the override."""
    model = loader.build(dict(narrow_sd), config.read_config(narrow_sd), "fp8_e4m3fn_fast")
    loader.set_attention(model, "sdpa")
    override = model.model_options["transformer_options"]["optimized_attention_override"]
    probe.apply(model.model, [1])
    layers = [[m for m in b.modules() if isinstance(m, fp8.Fp8FastLinear)]
              for b in model.model.diffusion_model.transformer_blocks]  # fmt: skip
    if layers[0]:  # fp8 GEMMs need a CUDA GPU: on CPU the loader builds Fp8Linear
        assert {m.bf16_compute for m in layers[0]} == {False}
        assert {m.bf16_compute for m in layers[1]} == {True}
    q = k = v = torch.randn(1, 8, 4 * 32)
    calls = []

    def comfy_attention(*args, **kwargs):
        calls.append(kwargs["transformer_options"]["block_index"])
        return torch.zeros(1, 8, 4 * 32)

    for block in (0, 1):
        override(comfy_attention, q, k, v, 4, transformer_options={"block_index": block})
    assert calls == [1]
    assert attention.attention_override("sdpa").__name__ == "override"


def _sample(model):
    m = ModelSamplingAuraFlow().patch_aura(model, 3.1)[0]
    cond = [[torch.randn((1, 6, 64), generator=torch.Generator().manual_seed(3)), {}]]
    latent = {"samples": torch.zeros((1, 16, 1, 8, 8))}
    return nodes.common_ksampler(m, 1, 1, 1.0, "euler", "simple", cond, cond, latent)[0]


def _guarded(sd, user_dir, monkeypatch):
    """A model of `sd` with the emulated 8-bit attention and the probe set up as a load on a
    GPU sets it up (`guard_fidelity`), from a file under user_dir."""
    path = user_dir / "dit.safetensors"
    if not path.exists():
        path.write_bytes((8).to_bytes(8, "little") + b'{"a": 1}' + b"\0" * 64)
    model = loader.build(dict(sd), config.read_config(sd), "fp8_e4m3fn")
    model.model_options.setdefault("transformer_options", {})[OVERRIDE] = emulated_fp8_attention
    loader.guard_fidelity(model, path, "test setting", 0.15)
    return model


def test_the_probe_runs_at_the_first_sampling_and_is_cached(
    narrow_sd, user_dir, monkeypatch, caplog
):
    sd = models.with_outliers(narrow_sd, [1])
    model = _guarded(sd, user_dir, monkeypatch)
    assert model.model.qwen_turbo.fidelity is None  # not yet: it runs with the weights loaded
    with caplog.at_level(logging.INFO):
        _sample(model)
    state = model.model.qwen_turbo
    assert state.safe_blocks == {1} and "1 of 2 blocks kept bf16" in state.fidelity
    assert "fidelity probe" in caplog.text
    assert (user_dir / "qwen_turbo" / "fidelity.json").is_file()

    def no_probe(*args, **kwargs):
        raise AssertionError("the cached result should serve")

    monkeypatch.setattr(probe, "measure", no_probe)
    again = _guarded(sd, user_dir, monkeypatch)
    assert again.model.qwen_turbo.safe_blocks == {1}
    assert again.model.qwen_turbo.fidelity == state.fidelity
    _sample(again)  # nothing probed


def test_on_a_partly_loaded_model_each_block_reruns_on_its_staged_copies(outlier_model,
                                                                         monkeypatch):  # fmt: skip
    """On the model all on the device the streamer stages nothing. With every layer left on
    the host (ComfyUI's lowvram load) it stages each block's copies once: the lossy rerun runs
    on them, no layer of a block takes a copy of ComfyUI's, and the probe measures what it
    measures on the model all on the device."""
    cpu = torch.device("cpu")
    resident = probe.measure(outlier_model.model, cpu, emulated_fp8_attention, 0.15)
    streamer = loader.stream_offloaded_weights(outlier_model)
    outlier_model.patch_model(cpu)  # all on the device: the streamer stages nothing
    try:
        loaded = probe.measure(outlier_model.model, cpu, emulated_fp8_attention, 0.15)
        assert loaded.errors == resident.errors and streamer.copies == 0
    finally:
        outlier_model.unpatch_model(cpu)
    streams = {id(m) for layers in streamer.layers for m in layers}
    copies = []
    cast = comfy.ops.cast_bias_weight

    def counted(s, *args, **kwargs):
        copies.extend([s] if id(s) in streams else [])
        return cast(s, *args, **kwargs)

    monkeypatch.setattr(comfy.ops, "cast_bias_weight", counted)
    outlier_model.patch_model(cpu, lowvram_model_memory=1)
    try:
        assert all(streaming.offloaded(m) for layers in streamer.layers for m in layers)
        got = probe.measure(outlier_model.model, cpu, emulated_fp8_attention, 0.15)
    finally:
        outlier_model.unpatch_model(cpu)
    assert got.kept == [1] and got.errors == resident.errors
    assert streamer.copies == len(streamer.layers) and copies == []
    assert streamer.after is None


def test_a_probe_that_runs_out_of_memory_leaves_the_sampling_running(
    narrow_sd, user_dir, monkeypatch, caplog
):
    def out_of_memory(*args, **kwargs):
        raise mm.OOM_EXCEPTION("CUDA out of memory. Tried to allocate 20.00 MiB")

    monkeypatch.setattr(probe, "measure", out_of_memory)
    model = _guarded(narrow_sd, user_dir, monkeypatch)
    with caplog.at_level(logging.WARNING):
        assert torch.isfinite(_sample(model)["samples"]).all()
    assert model.model.qwen_turbo.fidelity == "fidelity probe skipped"
    assert "fidelity probe skipped (out of memory)" in caplog.text
    assert not (user_dir / "qwen_turbo" / "fidelity.json").exists()


def test_the_cache_key_follows_the_file_and_the_setting(tmp_path):
    path = tmp_path / "a.safetensors"
    path.write_bytes((8).to_bytes(8, "little") + b'{"a": 1}' + b"\0" * 16)
    key = probe.cache_key(path, "s")
    assert probe.cache_key(path, "s") == key != probe.cache_key(path, "t")
    path.write_bytes((8).to_bytes(8, "little") + b'{"a": 2}' + b"\0" * 16)
    assert probe.cache_key(path, "s") != key
