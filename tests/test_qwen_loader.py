"""Optimized Loader on CPU: config from the weights, the fused block against ComfyUI's and
diffusers' blocks, weight modes, diffusers folders, LoRA on fp8, attention, clear errors."""

import functools
import gc
import inspect
import logging
import threading
import weakref

import comfy.cli_args
import comfy.model_management as mm
import comfy.model_patcher
import comfy.sd
import comfy.utils
import pytest
import torch
from safetensors.torch import load_file

from qwen_turbo.kernels.fp8_linear import FP8
from qwen_turbo.nodes.loader import Loader
from qwen_turbo.runtime.dit import blocks, config, convert, files, fp8, loader, streaming
from qwen_turbo.runtime.dit import patcher as patcher_module
from tests.harness import models
from tests.kernels.common import assert_error_rule

GiB = 2**30


def _inputs(cfg: config.DiTConfig, seed=1, h=12, w=10, tokens=7):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, cfg.out_channels, 1, h, w, generator=g)
    ctx = torch.randn(1, tokens, cfg.joint_attention_dim, generator=g)
    return x, ctx


def _forward(patcher, x, ctx):
    """One forward as a sampler runs it: loaded (patched) and run under inference_mode, as
    ComfyUI's executor runs every node."""
    opts = dict(patcher.model_options.get("transformer_options", {}), wrappers=patcher.wrappers)
    with torch.inference_mode():
        mm.load_models_gpu([patcher])
        out = patcher.model.apply_model(
            x, torch.tensor([0.6], device=x.device), c_crossattn=ctx, transformer_options=opts
        )
    return out.float()


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


# --- config -------------------------------------------------------------------------------


def test_config_read_from_full_width_and_narrow_weights(narrow_sd):
    full = config.read_config(load_file(str(models.qwen_dit_file())))
    assert full == config.DiTConfig(64, 16, 1, 128, 24, 3584, (16, 56, 56))
    narrow = config.read_config(narrow_sd)
    assert narrow == config.DiTConfig(64, 16, 2, 32, 4, 64, (4, 14, 14))
    assert narrow.width == 128
    prefixed = {"model.diffusion_model." + k: v for k, v in narrow_sd.items()}
    assert config.read_config(convert.strip_prefix(prefixed)) == narrow


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 256])
def test_default_rope_axes_split_the_head(head_dim):
    axes = config.default_rope_axes(head_dim)
    assert sum(axes) == head_dim and all(a % 2 == 0 and a > 0 for a in axes)


def test_wrong_files_are_named(narrow_sd):
    vae = load_file(str(models.qwen_vae_file()))
    with pytest.raises(config.NotQwenImageDiT, match="a Wan / Qwen-Image VAE"):
        config.read_config(vae)
    lora = load_file(str(models.narrow_lora_file()))
    with pytest.raises(config.NotQwenImageDiT, match="a LoRA"):
        config.read_config(lora)
    with pytest.raises(config.NotQwenImageDiT, match="no Qwen-Image or NewBie DiT keys.*'foo.bar'"):
        config.read_config({"foo.bar": torch.ones(2)})
    broken = {k: v for k, v in narrow_sd.items() if not k.startswith("transformer_blocks.0.")}
    with pytest.raises(config.NotQwenImageDiT, match="norm_q"):
        config.read_config(broken)
    with pytest.raises(config.NotQwenImageDiT, match="RoPE axes"):
        config.read_config(narrow_sd, rope_axes=[16, 56, 56])


def test_node_errors_name_the_problem(diffusion_models, models_dir):
    with pytest.raises(FileNotFoundError, match="not found in .*diffusion_models.*Comfy-Org"):
        Loader.execute("missing.safetensors", "auto", "auto", True, "off")
    (diffusion_models / "vae_by_mistake.safetensors").symlink_to(models.qwen_vae_file())
    try:
        with pytest.raises(ValueError, match="vae_by_mistake.*not a Qwen-Image or NewBie.*VAE"):
            Loader.execute("vae_by_mistake.safetensors", "auto", "auto", True, "off")
    finally:
        (diffusion_models / "vae_by_mistake.safetensors").unlink()


@pytest.mark.parametrize("damage", ["truncated", "not safetensors", "empty"])
def test_a_damaged_file_is_named_with_what_to_do(diffusion_models, damage):
    """A download cut short, or another kind of file under the .safetensors name: the node's
    error names the file and says to download it again, on both hosts' readers."""
    data = models.qwen_dit_file().read_bytes()
    content = {"truncated": data[: len(data) // 2], "not safetensors": b"PK\x03\x04" + data[:64],
               "empty": b""}[damage]  # fmt: skip
    (diffusion_models / "damaged.safetensors").write_bytes(content)
    with pytest.raises(ValueError) as e:
        Loader.execute("damaged.safetensors", "auto", "auto", True, "off")
    msg = str(e.value)
    assert msg.startswith("Optimized Loader: damaged.safetensors: cannot read "), msg
    assert "truncated, corrupt or not safetensors. Download it again" in msg


@pytest.mark.parametrize("weight_dtype", ["fp8_e4m3fn", "bf16"])
def test_converting_the_weights_shows_progress_and_stops_when_asked(narrow_sd, monkeypatch,
                                                                   weight_dtype):  # fmt: skip
    """bf16 weights made fp8, or fp8 weights made bf16, on the CPU: ComfyUI's progress bar
    runs to the end, at most a hundred updates; an interrupt stops the pass."""
    sd = dict(narrow_sd) if weight_dtype == "fp8_e4m3fn" else convert.to_scaled_fp8(narrow_sd)
    updates = []

    class Bar:
        def __init__(self, total):
            pass

        def update_absolute(self, value, total=None):
            updates.append((value, total))

    monkeypatch.setattr(comfy.utils, "ProgressBar", Bar)
    cfg = config.read_config(narrow_sd)
    assert loader.build(dict(sd), cfg, weight_dtype).model.qwen_turbo.weights == weight_dtype
    assert updates[-1] == (len(sd), len(sd)) and len(updates) <= 101
    assert [v for v, _ in updates] == sorted({v for v, _ in updates})
    mm.interrupt_current_processing(True)
    try:
        with pytest.raises(mm.InterruptProcessingException):
            loader.build(dict(sd), cfg, weight_dtype)
    finally:
        mm.interrupt_current_processing(False)


# --- the fused block ----------------------------------------------------------------------


def _block_inputs(width, dtype, seed=3, n_img=37, n_txt=11, head_dim=32):
    from comfy.ldm.flux.layers import EmbedND

    g = torch.Generator().manual_seed(seed)
    img = torch.randn(1, n_img, width, generator=g) * 2
    txt = torch.randn(1, n_txt, width, generator=g)
    temb = torch.randn(1, width, generator=g)
    ids = torch.randn(1, n_img + n_txt, 3, generator=g) * 20
    axes = config.default_rope_axes(head_dim)
    freqs = EmbedND(dim=head_dim, theta=10000, axes_dim=list(axes))(ids).squeeze(1).unsqueeze(2)
    return [t.to(dtype) for t in (img, txt, temb, freqs)]


def _comfy_block(dtype):
    import comfy.ops
    from comfy.ldm.qwen_image.model import QwenImageTransformerBlock

    block = QwenImageTransformerBlock(128, 4, 32, operations=comfy.ops.disable_weight_init)
    block.load_state_dict(models.random_state_dict(block, seed=5))
    return block.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_block_equals_comfy_block(dtype):
    import comfy.ldm.qwen_image.model as qm

    block = _comfy_block(dtype)
    img, txt, temb, freqs = _block_inputs(128, dtype)
    fused = blocks.fused_block_forward(block, qm.optimized_attention_masked)
    freqs = models.host_rope(freqs)  # as the host's model passes it
    # Newer hosts' RoPE (comfy-kitchen) has no float64; float32 is far more exact than bf16.
    wide = torch.float32 if hasattr(qm, "apply_rope1") else torch.float64
    with torch.inference_mode():
        out = fused(img, txt, None, temb, freqs)
        eager = block(img, txt, None, temb, freqs)
        exact = _comfy_block(wide)(*(t.to(wide) for t in (img, txt)), None,
                                   temb.to(wide), freqs.to(wide))  # fmt: skip
    for o, e, x in zip(out, eager, exact, strict=True):
        assert o.dtype == dtype and o.isfinite().all()
        if dtype == torch.float32:
            torch.testing.assert_close(o, e, rtol=1e-5, atol=1e-5)
        else:
            assert_error_rule(o, x, e, atol=2 * torch.finfo(dtype).eps * x.abs().max().item())


def _takes_timestep_zero_index() -> bool:
    import inspect

    import comfy.ldm.qwen_image.model as qm

    return (
        "timestep_zero_index" in inspect.signature(qm.QwenImageTransformerBlock.forward).parameters
    )


def test_fused_block_sends_what_it_does_not_handle_to_the_host_block():
    """A text mask, attention patches and any argument the host adds run the block's own
    forward: its exact result, and a reason. Edit-2511's `timestep_zero_index` goes along."""
    import inspect

    import comfy.ldm.qwen_image.model as qm

    block = _comfy_block(torch.float32)
    img, txt, temb, freqs = _block_inputs(128, torch.float32)
    freqs = models.host_rope(freqs)
    reasons = []
    fused = blocks.fused_block_forward(block, qm.optimized_attention_masked, reasons.append)
    mask = torch.ones(1, txt.shape[1])
    patch = {"patches": {"attn1_patch": [lambda q, k, v, **kw: {}]}}
    calls = [((None,), {"transformer_options": patch}, "attn1_patch")]
    if "encoder_hidden_states_mask" in inspect.signature(qm.Attention.forward).parameters:
        calls.append(((mask,), {}, "text attention mask"))
    if _takes_timestep_zero_index():
        two = torch.cat([temb, torch.randn_like(temb)])
        zero = {"temb": two, "timestep_zero_index": 24, "transformer_options": patch}
        calls.append(((None,), zero, "attn1_patch"))
    with torch.inference_mode():
        for extra, kwargs, why in calls:
            kwargs = {"temb": temb, "image_rotary_emb": freqs, **kwargs}
            out = fused(img, txt, *extra, **kwargs)
            want = block(img, txt, *extra, **kwargs)
            for o, w in zip(out, want, strict=True):
                torch.testing.assert_close(o, w, rtol=0, atol=0)
            assert why in reasons[-1]
    assert len(reasons) == len(calls)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_block_with_norms_left_on_the_host_never_waits_for_the_gpu():
    """A partial load leaves the q/k norms' gains on the host: the fused block copies them
    without a synchronizing copy (each would drain the GPU's queue) and gives the result of
    the block on the GPU."""
    import comfy.ldm.qwen_image.model as qm

    block = _comfy_block(torch.bfloat16).cuda()
    img, txt, temb, freqs = (t.cuda() for t in _block_inputs(128, torch.bfloat16))
    freqs = models.host_rope(freqs)
    fused = blocks.fused_block_forward(block, qm.optimized_attention_masked)
    with torch.inference_mode():
        want = fused(img, txt, None, temb, freqs)
        attn = block.attn
        for norm in (attn.norm_q, attn.norm_k, attn.norm_added_q, attn.norm_added_k):
            norm.cpu()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = fused(img, txt, None, temb, freqs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


@pytest.mark.skipif(
    not _takes_timestep_zero_index(), reason="this host's block has no timestep_zero_index"
)
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_block_modulates_reference_tokens_at_timestep_zero(dtype, batch):
    """Edit-2511 (newer hosts): with `timestep_zero_index` temb holds the timestep's rows then
    timestep 0's, and the image tokens from that index on (the reference images') take the
    latter. The fused block computes it, no host fallback, equal to the host's block."""
    import comfy.ldm.qwen_image.model as qm

    block = _comfy_block(dtype)
    img, txt, temb, freqs = _block_inputs(128, dtype)
    g = torch.Generator().manual_seed(9)
    img, txt = img.expand(batch, -1, -1).clone(), txt.expand(batch, -1, -1).clone()
    temb = torch.cat([temb.expand(batch, -1), torch.randn(batch, 128, generator=g).to(dtype)])
    freqs = models.host_rope(freqs)
    split = 24  # of 37 image tokens: 13 reference tokens
    reasons = []
    fused = blocks.fused_block_forward(block, qm.optimized_attention_masked, reasons.append)
    wide = torch.float32
    with torch.inference_mode():
        out = fused(img, txt, None, temb, freqs, timestep_zero_index=split)
        eager = block(img, txt, None, temb, freqs, timestep_zero_index=split)
        exact = _comfy_block(wide)(*(t.to(wide) for t in (img, txt)), None, temb.to(wide),
                                   freqs.to(wide), timestep_zero_index=split)  # fmt: skip
        plain = block(img, txt, None, temb[:batch], freqs)  # every token at the timestep
    assert reasons == []
    for o, e, x, p in zip(out, eager, exact, plain, strict=True):
        assert o.dtype == dtype and o.shape == e.shape and o.isfinite().all()
        if dtype == torch.float32:
            torch.testing.assert_close(o, e, rtol=1e-5, atol=1e-5)
        else:
            assert_error_rule(o, x, e, atol=2 * torch.finfo(dtype).eps * x.abs().max().item())
        assert not torch.allclose(o.float(), p.float(), rtol=1e-2, atol=1e-2)


def test_fused_block_equals_diffusers_block():
    """diffusers' QwenImageTransformerBlock with the same weights (same key names) and the
    same rotations as complex numbers: (cos + i sin) per pair."""
    import comfy.ldm.qwen_image.model as qm
    from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformerBlock

    block = _comfy_block(torch.float32)
    theirs = QwenImageTransformerBlock(dim=128, num_attention_heads=4, attention_head_dim=32)
    missing, unexpected = theirs.load_state_dict(block.state_dict(), strict=False)
    assert not unexpected and not [k for k in missing if "weight" in k or "bias" in k]
    img, txt, temb, freqs = _block_inputs(128, torch.float32)
    rot = torch.complex(freqs[0, :, 0, :, 0, 0], freqs[0, :, 0, :, 1, 0])  # (L, Dh/2)
    n_txt = txt.shape[1]
    fused = blocks.fused_block_forward(block, qm.optimized_attention_masked)
    with torch.inference_mode():
        ours = fused(img, txt, None, temb, freqs)
        ref = theirs(img, txt, None, temb, image_rotary_emb=(rot[n_txt:], rot[:n_txt]))
    for o, r in zip(ours, ref, strict=True):
        torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-4)


# --- loading ------------------------------------------------------------------------------


def test_loader_equals_stock_unetloader():
    """Full width, one layer: fused off gives UNETLoader's output bit for bit; fused on
    within float32 rounding."""
    path = models.qwen_dit_file()
    stock = comfy.sd.load_diffusion_model(str(path))
    sd, cfg = files.read_checkpoint(path)
    x, ctx = _inputs(cfg, h=8, w=6, tokens=5)
    ref = _forward(stock, x, ctx)
    plain = loader.build(dict(sd), cfg)
    torch.testing.assert_close(_forward(plain, x, ctx), ref, rtol=0, atol=0)
    loader.add_fused_blocks(plain)
    assert _rel(_forward(plain, x, ctx), ref) < 1e-5
    mm.unload_all_models()


def test_diffusers_folder_loads_the_same_weights(tmp_path, narrow_sd):
    folder = models.diffusers_folder(models.qwen_dit_narrow_file(), tmp_path, shards=3)
    assert len(list((folder / "transformer").glob("*.safetensors"))) == 3
    sd, cfg = files.read_checkpoint(folder)
    assert cfg == config.read_config(narrow_sd)
    assert sd.keys() == narrow_sd.keys()
    assert all(torch.equal(sd[k], narrow_sd[k]) for k in sd)
    (folder / "transformer" / next(iter(sorted((folder / "transformer").glob("*-00002-*"))))
     .name).unlink()  # fmt: skip
    with pytest.raises(FileNotFoundError, match="listed in the index but missing"):
        files.read_checkpoint(folder)
    (index,) = (folder / "transformer").glob("*.index.json")
    index.write_text("{")  # a download cut short
    with pytest.raises(files.Unreadable, match=r"cannot read .*index.json: Expecting.*Download"):
        files.read_checkpoint(folder)


@pytest.mark.parametrize("weight_dtype", ["fp8_e4m3fn", "fp8_e4m3fn_fast"])
def test_a_checkpoint_missing_a_linear_weight_is_named_unreadable(narrow_sd, weight_dtype):
    """The fp8 Linears' weights are the state dict's own tensors (nothing allocated for them
    first); one the file lacks is an incomplete download, said so, not left uninitialized."""
    patcher = loader.build(dict(narrow_sd), config.read_config(narrow_sd), weight_dtype)
    linears = [m for m in patcher.model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and not any(t.is_meta for t in patcher.model.parameters())
    sd = dict(narrow_sd)
    del sd["transformer_blocks.1.attn.to_k.weight"]
    with pytest.raises(files.Unreadable, match=r"lacks 1 weights .*to_k.weight.*download"):
        loader.build(sd, config.read_config(narrow_sd), weight_dtype)


def test_model_names_list_files_and_diffusers_folders(diffusion_models):
    names = files.model_names()
    assert models.qwen_dit_narrow_file().name in names
    folder = models.qwen_dit_narrow_file().stem + "/"
    assert folder in names
    assert files.resolve(folder) == diffusion_models / folder.rstrip("/")


def test_fp8_storage_is_scaled_and_close(narrow_sd):
    cfg = config.read_config(narrow_sd)
    x, ctx = _inputs(cfg)
    ref = _forward(loader.build(dict(narrow_sd), cfg, "bf16"), x, ctx)
    patcher = loader.build(dict(narrow_sd), cfg, "fp8_e4m3fn")
    model = patcher.model.diffusion_model
    w8, scale = fp8.fp8_parts(model.transformer_blocks[0].attn.to_q)
    assert w8.dtype == FP8
    w = narrow_sd["transformer_blocks.0.attn.to_q.weight"].float()
    torch.testing.assert_close(scale.float(), w.abs().amax() * convert.HEADROOM / 448)
    for outside in ("img_in", "txt_in", "proj_out", "norm_out.linear"):  # kept unquantized
        layer = comfy.utils.get_attr(model, outside)
        assert fp8.fp8_parts(layer) is None or layer.scale_weight.item() == 1
        assert layer.weight.dtype != FP8
        torch.testing.assert_close(layer.weight.float(), narrow_sd[outside + ".weight"].float())
    # Biases and norm gains (v0.3 would build them in fp8) keep their bf16 values.
    for name, t in model.named_parameters():
        if name.endswith(".bias") or ("norm" in name and not name.endswith("scale_weight")):
            assert t.dtype in (torch.bfloat16, torch.float32), name
            torch.testing.assert_close(t.float(), narrow_sd[name].float(), rtol=0, atol=0)
    out = _forward(patcher, x, ctx)
    assert out.isfinite().all() and 0 < _rel(out, ref) < 5e-2
    mm.unload_all_models()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_conversion_on_the_gpu_is_the_cpus_within_a_step(narrow_sd, monkeypatch):
    """Weights quantized on the GPU, one at a time, land on the CPU: the same scales (within
    float32 rounding) and fp8 values within one e4m3 step of the CPU's; out of GPU memory, the
    rest convert on the CPU, with its bits."""
    cpu = convert.to_scaled_fp8(dict(narrow_sd))

    def close(got, exact: bool):
        assert got.keys() == cpu.keys()
        for k, t in cpu.items():
            assert got[k].device.type == "cpu" and got[k].dtype == t.dtype, k
            a, b = got[k].float(), t.float()
            if exact:
                assert torch.equal(a, b), k
            else:  # e4m3: 3 mantissa bits, a step of 1/8 of the value's power of two
                assert ((a - b).abs() <= b.abs() / 8 + 2**-9).all(), k

    close(convert.to_scaled_fp8(dict(narrow_sd), device=torch.device("cuda")), exact=False)
    real = convert._quantize

    def out_of_memory_on_gpu(t):
        if t.is_cuda:
            raise torch.OutOfMemoryError("test")
        return real(t)

    monkeypatch.setattr(convert, "_quantize", out_of_memory_on_gpu)
    close(convert.to_scaled_fp8(dict(narrow_sd), device=torch.device("cuda")), exact=True)


def test_fp8_fast_without_fp8_gemms_falls_back_and_logs(narrow_sd, caplog):
    cfg = config.read_config(narrow_sd)
    with caplog.at_level(logging.WARNING, logger=convert.log.name):
        patcher = loader.build(dict(narrow_sd), cfg, "fp8_e4m3fn_fast")
    assert "fp8 GEMMs need a CUDA GPU, not cpu; using fp8 storage" in caplog.text
    assert patcher.model.qwen_turbo.weights == "fp8_e4m3fn"


def test_fp8_file_round_trips_through_bf16(narrow_sd):
    """A plain fp8 file (no scales, as Comfy-Org's): auto keeps fp8 storage; bf16 dequantizes."""
    fp8_sd = {k: v.to(FP8) if convert.is_linear_weight(k, v) else v for k, v in narrow_sd.items()}
    cfg = config.read_config(fp8_sd)
    auto = loader.build(dict(fp8_sd), cfg, "auto")
    assert auto.model.qwen_turbo.weights == "fp8_e4m3fn"
    bf16 = loader.build(dict(fp8_sd), cfg, "bf16")
    x, ctx = _inputs(cfg)
    torch.testing.assert_close(_forward(auto, x, ctx), _forward(bf16, x, ctx), rtol=2e-2, atol=2e-2)
    mm.unload_all_models()


def test_fp8mixed_checkpoint_loads_as_stock_reads_it(diffusion_models):
    """A `fp8mixed` file (newer ComfyUI's quantized layout): auto keeps its fp8 weights and
    scales. On a host that reads it (mixed-precision ops), the result equals UNETLoader's;
    there, the host's own quantized weights fail to load under inference_mode (why the
    Optimized Loader keeps its own fp8 Linear)."""
    import comfy.ops

    path = models.qwen_dit_fp8mixed_file()
    (diffusion_models / path.name).unlink(missing_ok=True)
    (diffusion_models / path.name).symlink_to(path)
    sd, cfg = files.read_checkpoint(path)
    assert not [k for k in sd if k.endswith((".comfy_quant", ".weight_scale"))]
    patcher = loader.load(path.name)
    assert patcher.model.qwen_turbo.weights == "fp8_e4m3fn"
    w8, scale = fp8.fp8_parts(patcher.model.diffusion_model.transformer_blocks[0].img_mod[1])
    mixed = load_file(str(path))
    assert torch.equal(w8, mixed["transformer_blocks.0.img_mod.1.weight"])
    assert torch.equal(scale, mixed["transformer_blocks.0.img_mod.1.weight_scale"])
    x, ctx = _inputs(cfg, h=8, w=6, tokens=5)
    ours = _forward(patcher, x, ctx)
    bf16 = _forward(loader.build(convert.dequantize(sd, torch.bfloat16), cfg, "bf16"), x, ctx)
    assert _rel(ours, bf16) < 1e-2
    if hasattr(comfy.ops, "mixed_precision_ops"):
        stock = comfy.sd.load_diffusion_model(str(path))
        with pytest.raises(RuntimeError, match="version_counter for inference tensor"):
            _forward(stock, x, ctx)
        mm.unload_all_models()
        want = stock.model.apply_model(  # unloaded, the model runs where it is
            x, torch.tensor([0.6]), c_crossattn=ctx, transformer_options={}
        ).float()
        assert _rel(ours, want) < 1e-5
    mm.unload_all_models()


def test_other_quantization_formats_get_a_clear_error(narrow_sd):
    import json

    sd = models.to_fp8mixed(convert.to_scaled_fp8(dict(narrow_sd)))
    conf = json.dumps({"format": "nvfp4"}).encode()
    sd["transformer_blocks.0.attn.to_q.comfy_quant"] = torch.tensor(list(conf), dtype=torch.uint8)
    with pytest.raises(config.NotQwenImageDiT, match="to_q is quantized as 'nvfp4'.*UNETLoader"):
        convert.from_mixed(sd)


@pytest.mark.parametrize("weight_dtype", ["bf16", "fp8_e4m3fn"])
def test_lora_applies_on_loaded_weights(narrow_sd, weight_dtype):
    """LoraLoaderModelOnly's path on our MODEL equals merging the LoRA into the weights."""
    cfg = config.read_config(narrow_sd)
    lora = load_file(str(models.narrow_lora_file()))
    merged = dict(narrow_sd)
    for key in lora:
        if key.endswith(".lora_up.weight"):
            base = key[len("diffusion_model.") : -len(".lora_up.weight")] + ".weight"
            down = lora[key.replace("lora_up", "lora_down")].float()
            merged[base] = (narrow_sd[base].float() + lora[key].float() @ down).to(torch.bfloat16)
    x, ctx = _inputs(cfg)
    patcher = loader.build(dict(narrow_sd), cfg, weight_dtype)
    loader.add_fused_blocks(patcher)
    with_lora, _ = comfy.sd.load_lora_for_models(patcher, None, lora, 1.0, 0)
    out = _forward(with_lora, x, ctx)
    want = _forward(loader.build(merged, cfg, weight_dtype), x, ctx)
    without = _forward(patcher, x, ctx)
    tol = 1e-2 if weight_dtype == "bf16" else 6e-2
    assert _rel(out, want) < tol < _rel(without, want)
    mm.unload_all_models()


def test_fp8_scale_copies_stay_out_of_the_state_dict(narrow_sd):
    """The scale copied per device is a cache, not a parameter: the state dict keeps its
    keys, and a second device replaces the first device's copy."""
    model = loader.build(dict(narrow_sd), config.read_config(narrow_sd), "fp8_e4m3fn")
    keys = set(model.model.state_dict())
    layer = next(m for m in model.model.modules() if isinstance(m, fp8.Fp8Linear))
    for device in ("cpu", "meta", "cpu"):
        assert layer._scale(torch.device(device)).device.type == device
    assert set(model.model.state_dict()) == keys


def test_fp8_layers_keep_the_state_dicts_tensors():
    """No copy at load: with v0.33's dynamic VRAM these are views of comfy-aimdo's file
    mapping, copied only where ComfyUI pins them (below)."""
    layer = fp8.fp8_ops(fast=False).Linear(8, 4)
    sd = {
        "weight": torch.randn(4, 8).to(FP8),
        "bias": torch.randn(4, dtype=torch.bfloat16),
        "scale_weight": torch.tensor(0.5),
    }
    layer.load_state_dict(dict(sd))
    for name, t in sd.items():
        assert getattr(layer, name).data_ptr() == t.data_ptr(), name


@pytest.mark.parametrize("dynamic_vram", [False, True])
def test_pinned_weights_leave_the_dynamic_vram_file_mapping(monkeypatch, narrow_sd, dynamic_vram):
    """With dynamic VRAM a weight ComfyUI pins is first copied out of the state dict's
    tensors (comfy-aimdo's file mapping, which the driver cannot page-lock), once; the others
    stay views. Without it ComfyUI pins the weight itself."""
    memory = pytest.importorskip("comfy.memory_management")
    if not hasattr(comfy.model_patcher.ModelPatcher, "pin_weight_to_device"):
        pytest.skip("this ComfyUI pins no weights")
    monkeypatch.setattr(memory, "aimdo_enabled", dynamic_vram)
    pinned = []
    monkeypatch.setattr(mm, "pin_memory", lambda t: pinned.append(t) or False)
    sd = dict(narrow_sd)
    patcher = loader.build(dict(sd), config.read_config(sd), "fp8_e4m3fn")
    key = "diffusion_model.transformer_blocks.0.img_mlp.net.0.proj.weight"
    other = "diffusion_model.transformer_blocks.1.img_mlp.net.0.proj.weight"
    view = comfy.utils.get_attr(patcher.model, key)
    assert view.dtype == FP8
    patcher.pin_weight_to_device(key)
    patcher.pin_weight_to_device(key)
    kept = comfy.utils.get_attr(patcher.model, key)
    assert [t.data_ptr() for t in pinned] == [kept.data_ptr()] * 2  # copied once
    assert (kept.data_ptr() != view.data_ptr()) is dynamic_vram
    assert torch.equal(kept.float(), view.float())
    mapped = patcher.model.qwen_turbo.mapped
    assert (comfy.utils.get_attr(patcher.model, other).data_ptr() in mapped) is dynamic_vram


def test_weights_unloaded_for_room_stay_in_the_file_mapping(monkeypatch, narrow_sd):
    """With dynamic VRAM, where ComfyUI takes weights off the GPU to make room for another
    model (a text encoder on a new prompt), a weight in comfy-aimdo's file mapping goes back
    there as it is: not copied to be pinned (twice the RAM), not pinned."""
    memory = pytest.importorskip("comfy.memory_management")
    if not hasattr(comfy.model_patcher.ModelPatcher, "pin_weight_to_device"):
        pytest.skip("this ComfyUI pins no weights")
    monkeypatch.setattr(memory, "aimdo_enabled", True)
    pinned = []
    monkeypatch.setattr(mm, "pin_memory", lambda t: pinned.append(t.data_ptr()) or True)
    patcher = loader.build(dict(narrow_sd), config.read_config(narrow_sd), "fp8_e4m3fn")
    mapped = set(patcher.model.qwen_turbo.mapped)
    assert mapped
    patcher.load(torch.device("cpu"), full_load=True)
    patcher.partially_unload(torch.device("cpu"), memory_to_free=1 << 40)
    now = {p.data_ptr() for p in patcher.model.parameters()}
    assert mapped <= now  # every mapped weight is still the mapping's tensor
    assert not mapped & set(pinned)
    assert patcher.model.qwen_turbo.mapped == mapped
    # a load that leaves a weight offloaded still pins a copy of it
    key = "diffusion_model.transformer_blocks.0.img_mlp.net.0.proj.weight"
    patcher.pin_weight_to_device(key)
    assert comfy.utils.get_attr(patcher.model, key).data_ptr() not in mapped


def test_a_load_pins_copies_of_the_mapped_weights_it_offloads(monkeypatch, narrow_sd):
    """With dynamic VRAM, a load that leaves weights offloaded pins a copy of each mapped one
    (made on the copy threads, the same bytes) and of no other, after its own work."""
    memory = pytest.importorskip("comfy.memory_management")
    if not hasattr(comfy.model_patcher.ModelPatcher, "pin_weight_to_device"):
        pytest.skip("this ComfyUI pins no weights")
    monkeypatch.setattr(memory, "aimdo_enabled", True)
    pinned, threads = [], set()
    monkeypatch.setattr(mm, "pin_memory", lambda t: pinned.append(t.data_ptr()) or False)
    memmove = streaming.ctypes.memmove

    def copy(*args):
        threads.add(threading.current_thread().name)
        return memmove(*args)

    monkeypatch.setattr(streaming.ctypes, "memmove", copy)
    patcher = loader.build(dict(narrow_sd), config.read_config(narrow_sd), "fp8_e4m3fn")
    mapped = patcher.model.qwen_turbo.mapped
    sd = patcher.model.state_dict()
    before = {k: v.clone() for k, v in sd.items() if v.data_ptr() in mapped}
    views = {sd[k].data_ptr() for k in before}
    assert before
    patcher.load(torch.device("cpu"), lowvram_model_memory=1)  # every weight offloaded
    after = patcher.model.state_dict()
    assert not mapped and {after[k].data_ptr() for k in before} <= set(pinned)
    assert not views & set(pinned)
    assert all(torch.equal(after[k].float(), v.float()) for k, v in before.items())
    assert threads and all(name.startswith("qwen-turbo-pin") for name in threads)
    assert patcher._to_pin is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_copies_of_mapped_weights_page_locked_by_comfyui_on_gpu(monkeypatch, narrow_sd):
    """The copies of offloaded mapped weights (one huge-page allocation) are page-locked by
    ComfyUI one by one, hold the mapping's bytes, and are all unregistered by its unpinning."""
    memory = pytest.importorskip("comfy.memory_management")
    if not hasattr(mm, "PINNED_MEMORY"):
        pytest.skip("this ComfyUI pins no weights")
    monkeypatch.setattr(memory, "aimdo_enabled", True)
    monkeypatch.setattr(mm, "MAX_PINNED_MEMORY", 1 << 40)
    total = mm.TOTAL_PINNED_MEMORY
    patcher = loader.build(dict(narrow_sd), config.read_config(narrow_sd), "fp8_e4m3fn")
    mapped = patcher.model.qwen_turbo.mapped
    before = {k: v.clone() for k, v in patcher.model.state_dict().items() if v.data_ptr() in mapped}
    patcher.load(torch.device("cuda"), lowvram_model_memory=1)
    sd = patcher.model.state_dict()
    copies = [sd[k] for k in before if sd[k].device.type == "cpu"]
    assert copies and all(t.is_pinned() and t.data_ptr() in mm.PINNED_MEMORY for t in copies)
    assert all(torch.equal(sd[k].cpu().float(), v.float()) for k, v in before.items())
    patcher.unpin_all_weights()
    assert not any(t.is_pinned() for t in copies) and total == mm.TOTAL_PINNED_MEMORY
    patcher.detach()


def test_mapped_weights_stay_in_the_mapping_where_comfyui_pinning_is_off(monkeypatch, narrow_sd):
    """With ComfyUI's --disable-pinned-memory a load that offloads mapped weights leaves them
    as views of the mapping: a copy would not be pinned, only held twice in RAM."""
    memory = pytest.importorskip("comfy.memory_management")
    if not hasattr(comfy.model_patcher.ModelPatcher, "pin_weight_to_device"):
        pytest.skip("this ComfyUI pins no weights")
    monkeypatch.setattr(memory, "aimdo_enabled", True)
    monkeypatch.setattr(comfy.cli_args.args, "disable_pinned_memory", True, raising=False)
    pinned = []
    monkeypatch.setattr(mm, "pin_memory", lambda t: pinned.append(t.data_ptr()) or False)
    patcher = loader.build(dict(narrow_sd), config.read_config(narrow_sd), "fp8_e4m3fn")
    mapped = set(patcher.model.qwen_turbo.mapped)
    assert mapped
    patcher.load(torch.device("cpu"), lowvram_model_memory=1)  # every weight offloaded
    assert mapped <= {p.data_ptr() for p in patcher.model.parameters()}
    assert patcher.model.qwen_turbo.mapped == mapped and not mapped & set(pinned)


def test_a_dropped_clone_leaves_the_page_locked_weights_to_its_parent(monkeypatch, narrow_sd):
    """ComfyUI's clones share their parent's page-locked weights: a sampler's clone, dropped,
    unpins none of them; the model's own patcher, dropped, unpins them all."""
    if not hasattr(comfy.model_patcher.ModelPatcher, "unpin_all_weights"):
        pytest.skip("this ComfyUI pins no weights")
    unpinned = []
    monkeypatch.setattr(mm, "pin_memory", lambda t: True)
    monkeypatch.setattr(mm, "unpin_memory", lambda t: unpinned.append(t.data_ptr()) or True)
    patcher = loader.build(dict(narrow_sd), config.read_config(narrow_sd), "bf16")
    key = "diffusion_model.transformer_blocks.0.img_mlp.net.0.proj.weight"
    patcher.pin_weight_to_device(key)
    clone = patcher.clone().clone()
    assert clone.pinned is patcher.pinned == {key}
    del clone
    gc.collect()
    assert unpinned == [] and patcher.pinned == {key}
    ptr = comfy.utils.get_attr(patcher.model, key).data_ptr()
    del patcher
    gc.collect()
    assert unpinned == [ptr]


def _fp8_layers(k: int, n: int):
    """An Fp8FastLinear and an Fp8Linear (k -> n) loaded from one random scaled-fp8 state
    dict (scale 0.5), and that state dict."""
    sd = {
        "weight": torch.randn(n, k).to(FP8),
        "bias": torch.randn(n, dtype=torch.bfloat16),
        "scale_weight": torch.tensor(0.5),
    }
    fast, plain = fp8.fp8_ops(fast=True).Linear(k, n), fp8.fp8_ops(fast=False).Linear(k, n)
    for layer in (fast, plain):
        layer.load_state_dict(dict(sd))
    return fast, plain, sd


def test_fp8_fast_layers_compute_in_bf16_on_the_safe_path(monkeypatch):
    """Under fp8.safe_compute an Fp8FastLinear runs no fp8 GEMM, alone, fused with its GELU or
    sharing its input, and gives Fp8Linear's result; outside it the fp8 GEMMs run. A layer the
    fidelity probe keeps computes as on the safe path, except inside without_kept_blocks."""
    gemms = []
    monkeypatch.setattr(fp8, "fp8_linear", lambda x, w, *a, **k: gemms.append(x) or x[..., :4])
    monkeypatch.setattr(fp8, "_gemv_sized", lambda x: False)
    fast, plain, _ = _fp8_layers(8, 4)
    x = torch.randn(5, 8, dtype=torch.bfloat16)
    with fp8.safe_compute():
        assert fp8.in_safe_compute()
        torch.testing.assert_close(fast(x), plain(x), rtol=0, atol=0)
        gelu = fast.linear_of_gelu(x)
        shared = fast.linears_of_one_input(x, [fast, fast])
    torch.testing.assert_close(gelu, plain(fp8.gelu_tanh(x)), rtol=0, atol=0)
    assert all(torch.equal(o, plain(x)) for o in shared)
    assert not gemms and not fp8.in_safe_compute()
    fast(x), fast.linear_of_gelu(x), fast.linears_of_one_input(x, [fast, fast])
    assert len(gemms) == 4
    fast.bf16_compute = True  # a block the fidelity probe keeps: bf16 compute, as Fp8Linear
    torch.testing.assert_close(fast(x), plain(x), rtol=0, atol=0)
    assert len(gemms) == 4
    with fp8.without_kept_blocks():  # Multi-GPU's ranks: every block as loaded
        fast(x)
    assert len(gemms) == 5


def test_fp8_fast_mlp_leaves_row_scales_and_bias_to_the_next_kernel(monkeypatch):
    """The MLP's first linear returns an `Unscaled` (fp8_linear_unscaled); the second
    quantizes it, finished, with its GELU, and returns one too. Where the second cannot run an
    fp8 GEMM (no fp8 GPU here), it finishes its input first and computes as Fp8Linear."""
    from qwen_turbo.kernels import fp8_linear as kernels

    fast, plain, sd = _fp8_layers(16, 16)
    x = torch.randn(20, 16, dtype=torch.bfloat16)
    y = kernels.Unscaled(x, torch.rand(20, 1) + 0.5, torch.randn(16, dtype=torch.bfloat16))
    out = fast.linear_of_gelu(y, unscaled=True)  # no fp8 GEMMs on this CPU
    torch.testing.assert_close(out, plain(fp8.gelu_tanh(y.value())), rtol=0, atol=0)
    assert fast.unscaled(x).dtype == torch.bfloat16  # a tensor: fp8_linear's fallback

    calls = []  # as on an fp8 GPU: the GEMMs recorded, not run
    monkeypatch.setattr(kernels, "fp8_gemm_reason", lambda device: None)
    monkeypatch.setattr(
        fp8, "fp8_linear_unscaled",
        lambda x, w, scale, bias, gelu, x_fp8: calls.append((x, scale, bias, gelu, x_fp8)) or y,
    )  # fmt: skip
    assert fast.unscaled(x) is y and calls[0][1].numel() == 1 and calls[0][4] is None
    monkeypatch.setattr(fp8, "fp8_linear", lambda x, *args: x)
    handle = fast.register_forward_hook(lambda *args: None)  # a hook sees the finished output
    assert fast.unscaled(x) is x and len(calls) == 1
    handle.remove()
    assert fast.linear_of_gelu(y, unscaled=True) is y
    _, scale, bias, gelu, x_fp8 = calls[1]
    assert gelu and torch.equal(bias, sd["bias"]) and scale.item() == 0.5
    expected = kernels.quantize_rows_reference(y.raw, True, y.row_scale, y.bias)
    torch.testing.assert_close(x_fp8[1], expected[1], rtol=1e-6, atol=0)  # finished, GELU


@pytest.mark.parametrize(
    "newcomer", ["on demand", "on demand, larger than the model's share of the card", "static",
                 "on demand, free_memory wrapped", "on demand, load_models_gpu wrapped"],
)  # fmt: skip
def test_a_model_loading_on_demand_gets_the_room_it_computes_in(monkeypatch, narrow_sd, newcomer):
    """ComfyUI's load_models_gpu makes room for another model (a text encoder on a new
    prompt) by asking the loaded models to free memory. Where every model it loads takes its
    weights on demand (v0.33's dynamic VRAM), it leaves such models loaded beside each other;
    the Optimized Loader's model then frees only what the newcomer computes in (the load's
    minimum) and the largest weight it casts at once (comfy-aimdo's cast buffer grows to it),
    less what is free, and stays loaded, also where ComfyUI asks for more than the
    model holds (a 9 GiB text encoder beside 5 GiB of the DiT: ComfyUI would unload it whole).
    For any other newcomer, or where another node wraps ComfyUI's free_memory (the pack cannot
    tell), it frees what is asked."""
    if "for_dynamic" not in inspect.signature(mm.free_memory).parameters:
        pytest.skip("this ComfyUI loads no model on demand")
    device = torch.device("meta")  # not the CPU, which load_models_gpu makes no room on
    patcher = loader.build(dict(narrow_sd), config.read_config(narrow_sd), "fp8_e4m3fn")
    on_card = 5 if "larger" in newcomer else 50
    patcher.model.model_loaded_weight_memory = on_card * GiB  # as if on the card
    resident = mm.LoadedModel(patcher)
    resident.device, resident.real_model = device, weakref.ref(patcher.model)
    embedding = torch.nn.Embedding(4096, 512, dtype=torch.bfloat16, device="meta")  # 4 MiB
    new = comfy.model_patcher.ModelPatcher(embedding, device, torch.device("cpu"), size=9 * GiB)
    on_demand = newcomer.startswith("on demand")
    monkeypatch.setattr(new, "is_dynamic", lambda: on_demand)
    monkeypatch.setattr(new, "loaded_ram_size", lambda: 0, raising=False)
    if "wrapped" in newcomer:  # another node's wrapper: the pack cannot read the frames
        name = newcomer.split(", ")[1].split()[0]
        wrapped = getattr(mm, name)
        monkeypatch.setattr(
            mm, name, functools.wraps(wrapped)(lambda *a, f=wrapped, **k: f(*a, **k))
        )
    monkeypatch.setattr(mm, "current_loaded_models", [resident])
    asked = []

    def free(dev=None, torch_free_too=False):  # 1 GiB and what the model freed
        n = GiB + sum(asked)
        return (n, n) if torch_free_too else n

    monkeypatch.setattr(mm, "get_free_memory", free)
    monkeypatch.setattr(mm, "ensure_pin_budget", lambda *a, **k: True)
    monkeypatch.setattr(mm, "ensure_pin_registerable", lambda *a, **k: True)

    def weights_free(self, device_to, memory_to_free=0, *args, **kwargs):
        asked.append(memory_to_free)
        return memory_to_free

    monkeypatch.setattr(comfy.model_patcher.ModelPatcher, "partially_unload", weights_free)
    mm.load_models_gpu([new], memory_required=3 * GiB)
    minimum = max(mm.minimum_inference_memory(), 3 * GiB + mm.extra_reserved_memory())
    if newcomer.startswith("on demand") and "wrapped" not in newcomer:
        assert asked == [minimum + 4 * 2**20 - GiB]  # and the largest weight it casts
        assert patcher.loaded_size() == on_card * GiB  # asked anywhere else, what it holds
    else:
        assert asked and asked[0] >= 9 * GiB
    assert resident in mm.current_loaded_models


@pytest.mark.parametrize(
    "beside", ["on demand", "on demand, first load", "on demand and static",
               "on demand, load_models_gpu wrapped", "on demand, first load, wrapped"],
)  # fmt: skip
def test_a_sampling_load_keeps_a_text_encoder_loading_on_demand(monkeypatch, narrow_sd, beside):
    """Loading a statically loaded model again for sampling, ComfyUI's load_models_gpu (v0.33)
    makes room for its offloaded size on top of what it computes in, unloading for it the text
    encoder that loads on demand, page-locked weights and all. Beside such models only, the
    Optimized Loader's model (5 GiB on the card, 1 GiB free, 3.4 GiB to compute in) makes that
    room, with the offload buffer its load keeps out of what it is given, of the text encoder's
    VRAM (4 GiB) and asks ComfyUI for none; its load takes the rest of that VRAM: the text
    encoder stays loaded. So too at its first load. Beside a statically
    loaded model, or where another node wraps load_models_gpu (the pack cannot tell),
    ComfyUI's request stands."""
    if "for_dynamic" not in inspect.signature(mm.free_memory).parameters:
        pytest.skip("this ComfyUI loads no model on demand")
    device = torch.device("meta")  # not the CPU, which load_models_gpu makes no room on
    patcher = loader.build(dict(narrow_sd), config.read_config(narrow_sd), "fp8_e4m3fn")
    patcher.load_device = patcher.model.device = device
    first = "first load" in beside
    patcher.size, patcher.model.model_loaded_weight_memory = 20 * GiB, 0 if first else 5 * GiB
    if first:  # not on the card yet
        patcher.model.device = torch.device("cpu")
    else:  # the offload buffer its last load kept room for
        patcher.model.model_offload_buffer_memory = GiB // 4
    vram = {"text encoder": 4 * GiB, "static": 2 * GiB}
    freed, detached, loads = [], [], []

    def loaded(model, name="", size=0, on_demand=False):
        if model is None:
            model = comfy.model_patcher.ModelPatcher(torch.nn.Module(), device, device, size)
            monkeypatch.setattr(model, "is_dynamic", lambda: on_demand)
            monkeypatch.setattr(model, "loaded_size", lambda: vram[name])
            monkeypatch.setattr(model, "detach", lambda *a: detached.append(name))
        entry = mm.LoadedModel(model)
        entry.device, entry.real_model = device, weakref.ref(model.model)
        entry.model_finalizer = weakref.finalize(model, lambda: None)
        return entry

    def partially_unload(self, device_to, memory_to_free=0, *args, **kwargs):
        if self.model is patcher.model:
            self.model.model_loaded_weight_memory -= memory_to_free
            freed.append(("DiT", memory_to_free))
            return memory_to_free
        name = "text encoder" if self.size == 9 * GiB else "static"
        n = min(memory_to_free, vram[name])
        vram[name] -= n
        freed.append((name, n))
        return n

    encoder = loaded(None, "text encoder", 9 * GiB, True)
    current = [encoder] if first else [loaded(patcher), encoder]
    if "static" in beside:
        current.append(loaded(None, "static", 3 * GiB))
    monkeypatch.setattr(mm, "current_loaded_models", current)
    if "wrapped" in beside:
        wrapped = mm.load_models_gpu
        monkeypatch.setattr(
            mm, "load_models_gpu", functools.wraps(wrapped)(lambda *a, **k: wrapped(*a, **k))
        )

    asks = []

    def free(dev=None, torch_free_too=False):  # 1 GiB and what was freed, less 4 kB an ask
        asks.append(1)
        n = GiB + sum(n for _, n in freed) - 4096 * len(asks)
        return (n, n) if torch_free_too else n

    monkeypatch.setattr(mm, "get_free_memory", free)
    monkeypatch.setattr(mm, "vram_state", mm.VRAMState.NORMAL_VRAM)
    monkeypatch.setattr(mm, "lowvram_available", True)
    monkeypatch.setattr(mm, "ensure_pin_budget", lambda *a, **k: True)
    monkeypatch.setattr(mm, "ensure_pin_registerable", lambda *a, **k: True)
    monkeypatch.setattr(comfy.model_patcher.ModelPatcher, "partially_unload", partially_unload)
    monkeypatch.setattr(comfy.model_patcher.ModelPatcher, "partially_load",
                        lambda self, device, extra, *a, **k: loads.append(extra))  # fmt: skip
    monkeypatch.setattr(comfy.model_patcher.ModelPatcher, "model_patches_to", lambda *a: None)
    mm.load_models_gpu([patcher.clone()], memory_required=3 * GiB)
    room = max(mm.minimum_inference_memory(), 3 * GiB + mm.extra_reserved_memory())
    if beside in ("on demand", "on demand, first load"):
        assert detached == [] and encoder in mm.current_loaded_models
        # the room of its VRAM, then the rest of it for weights: ComfyUI's 0.1 "load nothing"
        room += GiB // 4 if not first else patcher_module.ROOM_MARGIN
        assert freed[0][0] == "text encoder" and freed[0][1] >= room - GiB and len(freed) == 2
        assert vram["text encoder"] == 0 and loads[0] > 0.1  # the rest went to the weights
    else:
        assert "text encoder" in detached  # unloaded whole, its page-locked weights with it
    assert patcher.loaded_size() == (0 if first else 5 * GiB)  # asked anywhere else, as is
    assert patcher.model_size() == 20 * GiB


@pytest.mark.parametrize(
    "on_card",
    ["all", "half", "none", "none, some page-locked", "half, load_models_gpu wrapped"],
)
def test_a_load_asks_to_page_lock_only_what_is_off_the_card(monkeypatch, narrow_sd, on_card):
    """ComfyUI's load_models_gpu (v0.33) makes room in page-locked memory, evicting other
    models' pins (a text encoder's), for the whole size of each statically loaded model. The
    Optimized Loader's model asks for what is neither on the card nor page-locked already,
    which ComfyUI pins where a load leaves it offloaded: nothing once it is all there, less
    what an earlier load pinned. Where another node wraps load_models_gpu (the pack cannot
    tell), ComfyUI's request stands."""
    if "total_pins_required" not in mm.load_models_gpu.__code__.co_varnames:
        pytest.skip("this ComfyUI pins nothing for statically loaded models")
    device = torch.device("meta")  # not the CPU, which load_models_gpu makes no room on
    patcher = loader.build(dict(narrow_sd), config.read_config(narrow_sd), "fp8_e4m3fn")
    size = patcher.model_size()
    loaded = {"all": size, "half": size // 2}.get(on_card.split(",")[0], 0)
    patcher.model.model_loaded_weight_memory = loaded
    pinned = 0
    if "page-locked" in on_card:  # ComfyUI's record of the host weights it pinned
        for k, w in list(patcher.model.named_parameters())[::2]:
            patcher.pinned.add(k)
            pinned += w.nbytes
    patcher.load_device = device
    resident = mm.LoadedModel(patcher)
    resident.device, resident.real_model = device, weakref.ref(patcher.model)
    resident.model_finalizer = weakref.finalize(patcher, lambda: None)
    monkeypatch.setattr(mm, "current_loaded_models", [resident] if loaded else [])
    if "wrapped" in on_card:
        wrapped = mm.load_models_gpu
        monkeypatch.setattr(
            mm, "load_models_gpu", functools.wraps(wrapped)(lambda *a, **k: wrapped(*a, **k))
        )
    asked = []
    free = 100 * GiB  # nothing to unload
    monkeypatch.setattr(mm, "get_free_memory", lambda *a, torch_free_too=False: (
        (free, free) if torch_free_too else free))  # fmt: skip
    monkeypatch.setattr(mm, "ensure_pin_budget", lambda n, **k: asked.append(n) or True)
    monkeypatch.setattr(mm, "ensure_pin_registerable", lambda n, **k: asked.append(n) or True)
    monkeypatch.setattr(mm.LoadedModel, "model_load", lambda self, *a, **k: None)
    mm.load_models_gpu([patcher])
    want = size - loaded - pinned if "wrapped" not in on_card else size
    assert asked == ([want, want] if want else [])  # nothing to pin: no request
    assert patcher.model_size() == size  # asked anything else, the whole size


@pytest.mark.parametrize("weight_dtype", ["fp8_e4m3fn", "fp8_e4m3fn_fast"])
def test_lora_on_offloaded_fp8_layers(narrow_sd, weight_dtype):
    """A partly loaded model (ComfyUI's lowvram: LoRA patches run per call on the layers left
    on the host) applies the LoRA as the loaded model does, without its requantization: its
    result is as close to the loaded one as fp8 rounding allows, far closer than without."""
    cfg = config.read_config(narrow_sd)
    lora = load_file(str(models.narrow_lora_file()))
    x, ctx = _inputs(cfg)
    patcher = loader.build(dict(narrow_sd), cfg, weight_dtype)
    with_lora, _ = comfy.sd.load_lora_for_models(patcher, None, lora, 1.0, 0)
    loaded = _forward(with_lora, x, ctx)
    without = _forward(patcher, x, ctx)
    mm.unload_all_models()
    with torch.inference_mode():
        with_lora.load(with_lora.load_device, lowvram_model_memory=1)
        lowvram = [m for m in with_lora.model.modules() if getattr(m, "weight_function", None)]
        assert any(isinstance(m, fp8.Fp8Linear) for m in lowvram)
        opts = dict(with_lora.model_options.get("transformer_options", {}))
        out = with_lora.model.apply_model(
            x, torch.tensor([0.6]), c_crossattn=ctx, transformer_options=opts
        ).float()
        with_lora.detach()
    assert _rel(out, loaded) < 2e-2 < _rel(without, loaded)
    mm.unload_all_models()


# fp8_cudnn: SDPA on CPU float32
@pytest.mark.parametrize("attention", ["sdpa", "flash", "fp8_cudnn"])
def test_attention_choice_keeps_the_result(narrow_sd, attention):
    cfg = config.read_config(narrow_sd)
    x, ctx = _inputs(cfg)
    patcher = loader.build(dict(narrow_sd), cfg)
    ref = _forward(patcher, x, ctx)
    chosen = patcher.clone()
    loader.set_attention(chosen, attention)
    assert "optimized_attention_override" in chosen.model_options["transformer_options"]
    assert "optimized_attention_override" not in patcher.model_options["transformer_options"]
    torch.testing.assert_close(_forward(chosen, x, ctx), ref, rtol=1e-5, atol=1e-5)
    mm.unload_all_models()


def test_regional_compile_wraps_each_block(narrow_sd, monkeypatch):
    import comfy_api.torch_helpers as helpers
    from comfy.patcher_extension import WrappersMP

    keys = []
    wrap = helpers.set_torch_compile_wrapper
    spy = lambda *a, **k: keys.extend(k["keys"]) or wrap(*a, **k)  # noqa: E731
    monkeypatch.setattr(helpers, "set_torch_compile_wrapper", spy)
    patcher = loader.build(dict(narrow_sd), config.read_config(narrow_sd))
    loader.compile_blocks(patcher)
    n = len(patcher.model.diffusion_model.transformer_blocks)
    assert n > 1 and keys == [f"diffusion_model.transformer_blocks.{i}" for i in range(n)]
    assert patcher.model_options["torch_compile_kwargs"]["backend"] == "inductor"
    assert "torch.compile" in patcher.wrappers[WrappersMP.APPLY_MODEL]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("attention", ["auto", "fp8_cudnn"])
def test_fused_block_full_width_on_gpu(attention):
    """Qwen-Image's real block (3072 wide, 24 heads) in bf16 at 1328^2 image tokens + 256 text
    tokens: fused against ComfyUI's, both against the float32 block. With fp8_cudnn
    attention the block's outputs stay within 2% of the float32 block's."""
    import comfy.ldm.qwen_image.model as qm
    import comfy.ops
    from comfy.ldm.flux.layers import EmbedND
    from comfy.ldm.qwen_image.model import QwenImageTransformerBlock

    from qwen_turbo.runtime.dit.attention import QUANTIZED, comfy_signature, quantized

    def block(dtype):
        b = QwenImageTransformerBlock(3072, 24, 128, operations=comfy.ops.disable_weight_init)
        b.load_state_dict(models.random_state_dict(b, seed=5))
        return b.to("cuda", dtype)

    g = torch.Generator().manual_seed(3)
    n_img, n_txt = 83 * 83, 256
    img, txt = torch.randn(1, n_img, 3072, generator=g), torch.randn(1, n_txt, 3072, generator=g)
    temb = torch.randn(1, 3072, generator=g)
    ids = torch.randn(1, n_img + n_txt, 3, generator=g) * 40
    freqs = EmbedND(dim=128, theta=10000, axes_dim=[16, 56, 56])(ids).squeeze(1).unsqueeze(2)
    freqs = models.host_rope(freqs)
    args32 = [t.cuda() for t in (img, txt, temb, freqs)]
    args16 = [t.to(torch.bfloat16) for t in args32]
    ours, stock = block(torch.bfloat16), block(torch.float32)
    attend = qm.optimized_attention_masked
    if attention != "auto":
        attend = comfy_signature(quantized(QUANTIZED[attention]))
    with torch.inference_mode():
        fused = blocks.fused_block_forward(ours, attend)
        out = fused(args16[0], args16[1], None, args16[2], args16[3])
        eager = ours(args16[0], args16[1], None, args16[2], args16[3])
        exact = stock(args32[0], args32[1], None, args32[2], args32[3])
    for o, e, x in zip(out, eager, exact, strict=True):
        assert o.isfinite().all()
        if attention != "auto":
            assert _rel(o.float(), x) < 2e-2
            continue
        assert _rel(o.float(), x) <= 2 * _rel(e.float(), x) + 1e-3
        assert _rel(o.float(), e.float()) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_fast_linear_on_gpu():
    """The fp8_fast ops' Linear (the loader's MODEL runs on CPU in tests, so it is built here
    directly): fp8 GEMM with per-row scales for many rows, fp8_gemv (bf16 activations) for
    GEMV inputs."""
    import torch.nn.functional as F

    from qwen_turbo.kernels.fp8_linear import fp8_gemv

    g = torch.Generator().manual_seed(0)
    w = torch.randn(3072, 3072, generator=g) / 3072**0.5
    bias = torch.randn(3072, generator=g) * 0.05
    sd = convert.to_scaled_fp8({"l.weight": w.bfloat16(), "l.bias": bias.bfloat16()},
                                    quantize=lambda k: True)  # fmt: skip
    linear = fp8.fp8_ops(fast=True).Linear(3072, 3072, device="cuda")
    linear.load_state_dict({k[2:]: v.cuda() for k, v in sd.items()})
    w8, scale = fp8.fp8_parts(linear)
    assert w8.dtype == FP8
    row = scale.float().reshape(1, 1).expand(1, 3072).contiguous()
    for rows in (257, 1):
        x = torch.randn(1, rows, 3072, generator=g).to("cuda", torch.bfloat16)
        with torch.inference_mode():
            out = linear(x)
            want = F.linear(x.float(), w.cuda(), bias.cuda())
            gemv = fp8_gemv(x, w8, row, linear.bias.to(x.dtype))
        assert out.isfinite().all() and _rel(out, want) < 5e-2
        assert (rows < fp8.GEMV_ROWS) == torch.equal(out, gemv)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_fast_linears_of_one_input_on_gpu():
    """q, k and v of one stream quantize their input once: the same bits as three calls. A
    GEMV-sized input, or a linear kept in bf16 among them, takes the plain calls."""
    g = torch.Generator().manual_seed(1)
    ops = fp8.fp8_ops(fast=True)
    linears = []
    for i, n in enumerate((3072, 3072, 1024)):
        w = torch.randn(n, 3072, generator=g) / 3072**0.5
        sd = convert.to_scaled_fp8({"l.weight": w.bfloat16()}, quantize=lambda k, i=i: i < 2)
        linear = ops.Linear(3072, n, bias=False, device="cuda")
        linear.load_state_dict({k[2:]: v.cuda() for k, v in sd.items()}, strict=False)
        if fp8.fp8_parts(linear) is None:
            linear.weight.data = linear.weight.data.to(torch.bfloat16)
        linears.append(linear)
    assert [fp8.fp8_parts(lin) is not None for lin in linears] == [True, True, False]
    for rows, chosen in ((257, linears[:2]), (1, linears[:2]), (257, linears)):
        x = torch.randn(1, rows, 3072, generator=g).to("cuda", torch.bfloat16)
        with torch.inference_mode():
            shared = chosen[0].linears_of_one_input(x, chosen)
            each = [linear(x) for linear in chosen]
        for a, b in zip(shared, each, strict=True):
            assert a.isfinite().all()
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize(
    "dtype, attention, fused, measured",
    [("fp8_e4m3fn_fast", "fp8", True, True), ("fp8_e4m3fn", "fp8_cudnn", True, True),
     ("fp8_e4m3fn_fast", "sdpa", True, False), ("bf16", "fp8", True, False),
     ("fp8_e4m3fn_fast", "fp8_cudnn", False, False)],
)  # fmt: skip
def test_sampling_asks_comfyui_for_the_measured_activations(
    diffusion_models, monkeypatch, dtype, attention, fused, measured
):
    """What KSampler asks ComfyUI's memory manager to keep free beside the weights: with the
    bundled workflows' settings (fp8 weights, fused blocks, fp8 attention), ComfyUI's own estimate
    scaled to the measured factor; with others, exactly UNETLoader's request; and ComfyUI's
    inside host_estimate."""
    import nodes

    path = models.qwen_dit_file()
    (diffusion_models / path.name).unlink(missing_ok=True)
    (diffusion_models / path.name).symlink_to(path)
    asked, load = [], mm.load_models_gpu

    def load_models_gpu(models, memory_required=0, **kwargs):
        asked.append(memory_required)
        return load(models, memory_required=memory_required, **kwargs)

    monkeypatch.setattr(mm, "load_models_gpu", load_models_gpu)
    cond = [[torch.randn(1, 7, 3584, generator=torch.Generator().manual_seed(3)), {}]]
    latent = {"samples": torch.zeros(1, 16, 1, 12, 10)}
    stock = comfy.sd.load_diffusion_model(str(path))
    pack = loader.load(path.name, dtype, attention, fused)
    for model in (stock, pack):
        nodes.common_ksampler(model, 1, 1, 1.0, "euler", "simple", cond, cond, latent)
    with loader.host_estimate(pack):
        nodes.common_ksampler(pack, 1, 1, 1.0, "euler", "simple", cond, cond, latent)
    scale = loader.ACTIVATIONS_FACTOR / stock.model.memory_usage_factor if measured else 1
    assert asked[1] == pytest.approx(asked[0] * scale, rel=1e-6)
    assert asked[1] < asked[0] if measured else asked[1] == asked[0]
    assert asked[2] == asked[0]
    mm.unload_all_models()
