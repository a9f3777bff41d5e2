"""Weight streaming on a partly loaded Optimized Loader model: each block's offloaded fp8 weights
copied ahead give ComfyUI's own per-layer copies' result, with and without a LoRA, and every
fallback (no room, no pinned memory, a layer reloaded) still gives it. Cond and uncond in
lockstep give ComfyUI's calls one by one, copying each block once, and each reason to run them
one by one does. A load to the GPU through the page-locked buffer gives ComfyUI's own load's
weights."""

import contextlib
import copy
import gc
import logging
import mmap
import threading
import time
import weakref

import comfy.cli_args
import comfy.model_management as mm
import comfy.model_patcher
import comfy.patcher_extension as pe
import comfy.sampler_helpers
import comfy.samplers
import comfy.sd
import comfy.utils
import pytest
import torch
from safetensors.torch import load_file, save_file

from qwen_turbo import runtime
from qwen_turbo.kernels.fp8_linear import FP8
from qwen_turbo.runtime import memory
from qwen_turbo.runtime.dit import config, loader, lockstep, streaming
from qwen_turbo.runtime.dit.patcher import HostCopies, LoaderState
from qwen_turbo.runtime.graphs import blocks, sampling
from tests.harness import models


def _model(sd, weight_dtype, lora=None, device=None, fused=True):
    """(patcher with fused blocks (or the host's) and `lora`, the same with streaming, its
    streamer), loading onto `device` where given (ComfyUI runs on the CPU in tests)."""
    patcher = loader.build(dict(sd), config.read_config(sd), weight_dtype)
    if fused:
        loader.add_fused_blocks(patcher)
    if device is not None:
        patcher.load_device = device
    if lora is not None:
        patcher, _ = comfy.sd.load_lora_for_models(patcher, None, lora, 1.0, 0)
    streamed = patcher.clone()
    return patcher, streamed, loader.stream_offloaded_weights(streamed)


def _sync(x):
    if x.is_cuda:
        torch.cuda.synchronize()


def _partly_loaded_forward(patcher, size=(12, 10), tokens=7, repeats=1, resident=False):
    """(output, seconds of the last of `repeats` forwards) with every layer left on the host
    (ComfyUI's lowvram marks; with `resident`, none), as a sampler runs it under
    inference_mode."""
    cfg = config.read_config(patcher.model.diffusion_model.state_dict())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, cfg.out_channels, 1, *size, generator=g)
    ctx = torch.randn(1, tokens, cfg.joint_attention_dim, generator=g)
    x, ctx, t = (v.to(patcher.load_device) for v in (x, ctx, torch.tensor([0.6])))
    opts = dict(patcher.model_options.get("transformer_options", {}))
    with torch.inference_mode():
        patcher.patch_model(patcher.load_device, lowvram_model_memory=0 if resident else 1)
        try:
            layers = [m for m in patcher.model.modules() if hasattr(m, "staged")]
            assert layers and all(streaming.offloaded(m) != resident for m in layers)
            for _ in range(repeats):
                _sync(x)
                start = time.perf_counter()
                out = patcher.model.apply_model(x, t, c_crossattn=ctx, transformer_options=opts)
                _sync(x)
            assert all(m.staged is None for m in layers)  # nothing kept after the call
        finally:
            patcher.unpatch_model(patcher.offload_device)
    mm.unload_all_models()
    return out.float(), time.perf_counter() - start


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("weight_dtype", ["fp8_e4m3fn", "fp8_e4m3fn_fast"])
def test_streamed_weights_give_comfyui_copies_result(narrow_sd, weight_dtype, lora):
    lora = load_file(str(models.narrow_lora_file())) if lora else None
    plain, streamed, streamer = _model(narrow_sd, weight_dtype, lora)
    want = _partly_loaded_forward(plain)[0]
    got = _partly_loaded_forward(streamed)[0]
    assert torch.equal(got, want)
    assert streamer.copies == len(streamer.layers)  # every block took its staged copies
    assert not streamer.ahead


def _out_of_memory(*args):
    raise torch.OutOfMemoryError("no room for the copy")


@pytest.mark.parametrize("short", ["room counted", "allocation"])
def test_no_room_leaves_comfyui_copies(narrow_sd, monkeypatch, short):
    """Where a block's copies do not fit, counted before or found when allocating, ComfyUI
    copies those layers itself: the same result."""
    plain, streamed, streamer = _model(narrow_sd, "fp8_e4m3fn_fast")
    if short == "room counted":
        monkeypatch.setattr(streaming, "room", lambda device: 0)
    else:
        monkeypatch.setattr(streaming, "room", lambda device: 2**40)
        monkeypatch.setattr(streaming, "new_slab", _out_of_memory)
    assert torch.equal(_partly_loaded_forward(streamed)[0], _partly_loaded_forward(plain)[0])
    assert streamer.copies == 0 and streamer.no_room == len(streamer.layers)


def test_host_memory_that_cannot_be_pinned_is_copied_as_it_is(narrow_sd, caplog, monkeypatch):
    """CPU-only torch cannot pin memory: streaming logs it once and copies from pageable
    memory."""
    plain, streamed, streamer = _model(narrow_sd, "fp8_e4m3fn_fast")
    if torch.cuda.is_available():
        pytest.skip("pinning works here")
    monkeypatch.setattr(runtime, "_logged", set())  # log_once may have said it already
    assert torch.equal(_partly_loaded_forward(streamed)[0], _partly_loaded_forward(plain)[0])
    assert not streamer.page_lock and streamer.copies == len(streamer.layers)
    assert "host memory not pinned" in caplog.text


def test_pageable_sources_are_pinned_once(narrow_sd, monkeypatch):
    """Weights, biases and LoRA factors left pageable get one pinned copy each, reused by
    later calls; nothing is pinned twice."""
    pinned = []

    def pin_memory(t):
        pinned.append(t)
        return t.clone()

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    lora = load_file(str(models.narrow_lora_file()))
    plain, streamed, streamer = _model(narrow_sd, "fp8_e4m3fn_fast", lora)
    want = _partly_loaded_forward(plain)[0]
    got = _partly_loaded_forward(streamed, repeats=2)[0]
    assert torch.equal(got, want)
    layers = [m for b in streamer.layers for m in b]
    lora_factors = sum(len(m._pinned) - 1 - (m.bias is not None) for m in layers)
    assert lora_factors == len(lora)  # each LoRA layer's up and down
    assert len(pinned) == sum(len(m._pinned) for m in layers)  # none pinned twice
    assert len({id(t) for t in pinned}) == len(pinned)


def test_nothing_is_page_locked_where_comfyui_pinning_is_off(narrow_sd, monkeypatch):
    """With ComfyUI's --disable-pinned-memory the streamer page-locks nothing: it copies from
    pageable memory, with the same result."""
    monkeypatch.setattr(comfy.cli_args.args, "disable_pinned_memory", True, raising=False)
    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: pinned.append(t) or t.clone())
    monkeypatch.setattr(streaming.Registered, "of", classmethod(lambda cls, t: pinned.append(t)))
    plain, streamed, streamer = _model(narrow_sd, "fp8_e4m3fn_fast")
    assert torch.equal(_partly_loaded_forward(streamed)[0], _partly_loaded_forward(plain)[0])
    assert not streamer.page_lock and streamer.copies == len(streamer.layers)
    assert pinned == []


def test_an_interrupted_call_leaves_no_copies(narrow_sd):
    """A block that raises (an interrupt, say) drops the copies made ahead for the next."""
    _, _, streamer = _model(narrow_sd, "fp8_e4m3fn")
    for m in (m for block in streamer.layers for m in block):
        m.prev_comfy_cast_weights = True

    def interrupted(x):
        assert 1 in streamer.ahead  # block 1's copies were started
        raise InterruptedError

    with pytest.raises(InterruptedError):
        streamer.forward(0, interrupted)(torch.zeros(1))
    assert not streamer.ahead
    assert all(m.staged is None for block in streamer.layers for m in block)


def test_a_layer_reloaded_after_its_copy_takes_comfyui_copy(narrow_sd):
    """A copy made ahead for a layer whose weight was replaced since is not used."""
    _, _, streamer = _model(narrow_sd, "fp8_e4m3fn")
    layers = streamer.layers[1]
    for m in layers:
        m.prev_comfy_cast_weights = True  # ComfyUI's mark of a layer left on the host
    streamer._prefetch(1, torch.device("cpu"))
    reloaded = layers[0]
    reloaded.weight = torch.nn.Parameter(reloaded.weight.clone(), requires_grad=False)
    seen = {}
    streamer.forward(1, lambda x: seen.update({m: m.staged for m in layers}))(torch.zeros(1))
    assert seen[reloaded] is None
    assert all(torch.equal(seen[m][0], m.weight) for m in layers[1:])
    assert all(m.staged is None for m in layers)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_weights_unregistered_by_another_owner_leave_no_error_behind():
    """A registration another owner already undid: dropping it fails in the driver, and the
    next kernel launch runs (CUDA keeps the failed call's error for the next launch's check)."""
    t = torch.empty(4 << 20, dtype=torch.uint8)
    registered = streaming.Registered.of(t)
    assert registered is not None
    assert torch.cuda.cudart().cudaHostUnregister(t.data_ptr()) == 0
    del registered
    assert torch.ones(3, device="cuda").mul(2).sum().item() == 6
    # the same launch after a failed unregister, the error not discarded
    assert torch.cuda.cudart().cudaHostUnregister(t.data_ptr()) != 0
    with pytest.raises(RuntimeError):
        torch.ones(3, device="cuda").mul(2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_room_is_free_memory_and_what_the_allocator_holds_unused():
    cuda = torch.device("cuda")
    held = torch.empty(64 << 20, dtype=torch.uint8, device=cuda)
    del held  # reserved, not allocated
    want = torch.cuda.mem_get_info(cuda)[0] + torch.cuda.memory_reserved(cuda)
    assert memory.room(cuda) == want - torch.cuda.memory_allocated(cuda)
    assert torch.cuda.memory_reserved(cuda) - torch.cuda.memory_allocated(cuda) >= 64 << 20


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("lora", [False, True])
def test_streaming_full_width_on_gpu(lora):
    """Six full-width blocks in fp8_fast with every layer on the host, 1328² (83² tokens and
    256 text tokens): streaming gives ComfyUI's per-layer copies' result bit for bit, in less
    time (second forwards: the first pins or compiles). A LoRA on the host's layers, applied
    per call and requantized for the fp8 GEMM, lands as close to the loaded model's as the
    loaded model's own requantization allows."""
    from qwen_turbo.cli import bench

    sd = {k: v.cpu() for k, v in bench.qwen_dit_state_dict(6, "cuda").items()}
    cuda = torch.device("cuda")
    plain, streamed, streamer = _model(
        sd, "fp8_e4m3fn_fast", bench.random_lora(sd) if lora else None, cuda
    )
    want, slow = _partly_loaded_forward(plain, (166, 166), 256, repeats=2)
    got, fast = _partly_loaded_forward(streamed, (166, 166), 256, repeats=2)
    assert torch.equal(got, want)
    assert streamer.copies == 2 * len(streamer.layers)
    large = [hit for block in streamer.layers for m in block
             for hit in getattr(m, "_pinned", {}).values()
             if hit[0].nbytes >= streaming.REGISTER_MIN]  # fmt: skip
    assert all(isinstance(h[1], streaming.Registered) for h in large)  # none copied
    print(f"{len(large)} tensors page-locked in place")
    print(f"LoRA {lora}: ComfyUI's copies {slow * 1e3:.1f} ms, streamed {fast * 1e3:.1f} ms")
    assert fast < slow
    if lora:
        loaded = _partly_loaded_forward(plain, (166, 166), 256, resident=True)[0]
        without = _model(sd, "fp8_e4m3fn_fast", device=cuda)[0]
        without = _partly_loaded_forward(without, (166, 166), 256)[0]
        rel, rel_without = (((o - loaded).norm() / loaded.norm()).item() for o in (got, without))
        print(f"rel. L2 to the loaded model: {rel:.2e}, without the LoRA {rel_without:.2e}")
        assert rel < 3e-2 and rel < rel_without / 4


def test_host_copies_are_not_deep_copied():
    """A deep copy of the model (ComfyUI's multi-GPU clones) holds no host tensors of the
    original's: keeping them would copy the file's pages into memory."""
    model = torch.nn.Linear(2, 2)
    model.qwen_turbo = LoaderState("bf16", hosts=HostCopies(w=(torch.zeros(4), 1234)))
    assert copy.deepcopy(model).qwen_turbo.hosts == {}
    assert model.qwen_turbo.hosts["w"][1] == 1234


def test_copies_ahead_lie_on_pages_of_their_own(monkeypatch):
    """Copies hold their sources' bytes; each plain one starts a page and shares none with
    another (ComfyUI page-locks each on its own) and starts its own storage (torch tells a
    tensor pinned by its storage's start); its pages go back to the OS when it goes, and the
    mapping when all have gone. A strided source is cloned."""
    mappings, advised = [], []

    class Mapping(mmap.mmap):
        def __init__(self, *args, **kwargs):
            mappings.append(weakref.ref(self))

        def madvise(self, option, start=0, length=None):
            advised.append((option, start))
            return super().madvise(option, start, *([] if length is None else [length]))

    monkeypatch.setattr(streaming.mmap, "mmap", Mapping)
    sources = [torch.randn(n) for n in (1, 1000, 1025, 7)] + [torch.randn(8, 6).t()]
    copies = list(streaming.copies_ahead(sources))
    for source, made in zip(sources, copies, strict=True):
        assert torch.equal(source, made) and made.data_ptr() != source.data_ptr()
    page = streaming.PAGE
    pages = [set(range(c.data_ptr() // page, (c.data_ptr() + c.nbytes - 1) // page + 1))
             for c in copies[:4]]  # fmt: skip
    assert all(c.data_ptr() % page == 0 for c in copies[:4])
    assert all(c.untyped_storage().data_ptr() == c.data_ptr() for c in copies[:4])
    assert sum(map(len, pages)) == len(set().union(*pages))
    start = copies[1].data_ptr() - copies[0].data_ptr()
    assert len(mappings) == 1 and (mmap.MADV_DONTNEED, start) not in advised
    del copies[1]
    assert (mmap.MADV_DONTNEED, start) in advised and mappings[0]() is not None
    copies.clear()
    gc.collect()
    assert mappings[0]() is None


def test_copies_ahead_without_madvise_are_allocated_one_by_one(monkeypatch):
    """Where pages cannot be given back one copy at a time (no madvise: Windows), each copy
    is an allocation of its own, freed with it."""

    class Mapping(mmap.mmap):
        madvise = None

        def __init__(self, *args, **kwargs):
            pytest.fail("a mapping without madvise would hold every copy until the last goes")

    monkeypatch.setattr(streaming.mmap, "mmap", Mapping)
    sources = [torch.randn(n) for n in (3, 1025)]
    copies = list(streaming.copies_ahead(sources))
    for source, made in zip(sources, copies, strict=True):
        assert torch.equal(source, made) and source.data_ptr() != made.data_ptr()


def test_uploader_stages_large_plain_host_tensors():
    """Through the buffer: contiguous host tensors of 1 MiB and more. Smaller ones, strided
    views and tensor subclasses (quantized layouts) take ComfyUI's `.to()`."""
    big = torch.zeros(streaming.STAGE_MIN, dtype=torch.uint8).view(FP8)

    class Subclass(torch.Tensor):
        pass

    assert streaming.Uploader.stages(big)
    assert streaming.Uploader.stages(torch.nn.Parameter(big, requires_grad=False))
    assert not streaming.Uploader.stages(big[:-1])
    assert not streaming.Uploader.stages(big.view(1024, 1024).t())
    assert not streaming.Uploader.stages(big.as_subclass(Subclass))
    assert not streaming.Uploader.stages(big.to("meta"))


def test_file_backed_tells_file_mappings_from_memory(tmp_path):
    """A tensor in a mapping of a file is file-backed, whole or as a view; one in the
    process's own memory is not."""
    path = tmp_path / "w.bin"
    path.write_bytes(bytes(range(256)) * 4096)
    mapped = torch.from_file(str(path), shared=False, size=1 << 20, dtype=torch.uint8)
    own = torch.zeros(1 << 20, dtype=torch.uint8)
    backed = streaming.file_backed([mapped, mapped[4096:], own])
    assert backed == {mapped.data_ptr(), mapped[4096:].data_ptr()}


def _resident_pages(t: torch.Tensor) -> int:
    """How many of the pages under `t` are in memory (Linux's mincore)."""
    import ctypes

    start, end = t.data_ptr() // 4096 * 4096, -(-(t.data_ptr() + t.nbytes) // 4096) * 4096
    vec = (ctypes.c_ubyte * ((end - start) // 4096))()
    assert ctypes.CDLL(None).mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), vec) == 0
    return sum(b & 1 for b in vec)


@pytest.mark.parametrize("short", [True, False])
def test_file_cache_of_weights_elsewhere_goes_back_where_ram_is_short(tmp_path, monkeypatch, short):
    """page_out drops the file pages under a mapped tensor where the host has less RAM
    available than the model and PAGE_CACHE_ROOM (the kernel keeps a large folio that the
    tensor covers only in part); elsewhere nothing. The tensor still reads the file's data."""
    import os

    path = tmp_path / "w.bin"
    data = os.urandom(16 << 20)
    path.write_bytes(data)
    os.sync()  # written back: clean pages, as a downloaded model's
    mapped = torch.from_file(str(path), shared=False, size=16 << 20, dtype=torch.uint8)
    view = mapped[100 : (8 << 20) + 100]
    assert int(view.sum()) > 0 and _resident_pages(view) == 2049  # read: cached
    monkeypatch.setattr(streaming, "PAGE_CACHE_ROOM", (1 << 50) if short else 0)
    asked = streaming.page_out([view], 1 << 20)
    assert asked == ((8 << 20) - 4096 if short else 0)
    assert (_resident_pages(view) < 1024) if short else (_resident_pages(view) == 2049)
    assert bytes(view[:4096].tolist()) == data[100:4196]


@pytest.mark.parametrize("nbytes", [2, 4097, 4098, 3 * 4096 + 2, (1 << 20) + 12345])
def test_uploader_fill_copies_every_byte(nbytes):
    """The threads' page-aligned parts of the buffer cover the tensor exactly, odd sizes too
    (a host buffer here: page-locked memory needs a GPU)."""
    from concurrent.futures import ThreadPoolExecutor

    uploader = streaming.Uploader.__new__(streaming.Uploader)
    uploader.buffer = torch.full((nbytes + 8192,), 7, dtype=torch.uint8)
    uploader.pool = ThreadPoolExecutor(streaming.FILL_THREADS)
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator())
    with uploader:
        uploader._fill(src[1:])  # an offset into its storage
    assert torch.equal(uploader.buffer[: nbytes - 1], src[1:])
    assert (uploader.buffer[nbytes - 1 :] == 7).all()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("weight_dtype", ["bf16", "fp8_e4m3fn"])
def test_load_to_gpu_through_the_buffer_gives_comfyui_load(tmp_path, monkeypatch, weight_dtype):
    """The full-width layer from an fp8 file (as the repackaged checkpoint), a LoRA on some
    weights, loaded onto the GPU: its large weights go through the page-locked buffer, and
    every weight comes out bit for bit as ComfyUI's own copies make it (the buffer off, as
    `--disable-pinned-memory` turns it off). Unloaded, each patched weight gets its host
    tensor back, and so does each other weight copied out of the file mapping (fp8 storage:
    the file's own tensors), with no copy back from the GPU; bf16 storage dequantizes, so
    those come back as copies, as with ComfyUI's load."""
    sd = load_file(str(models.qwen_dit_file()))
    sd = {k: v.to(FP8) if v.ndim == 2 and min(v.shape) >= 1024 else v for k, v in sd.items()}
    save_file(sd, str(tmp_path / "fp8.safetensors"))
    lora = load_file(str(models.full_lora_file()))
    staged, upload = [], streaming.Uploader.to
    monkeypatch.setattr(
        streaming.Uploader, "to", lambda s, t, d: staged.append(t.nbytes) or upload(s, t, d)
    )

    def load(pinned: bool):
        monkeypatch.setattr(comfy.cli_args.args, "disable_pinned_memory", not pinned, raising=False)
        sd = comfy.utils.load_torch_file(str(tmp_path / "fp8.safetensors"))
        with torch.inference_mode():  # as the executor runs the loaders: inference tensors
            patcher = loader.build(sd, config.read_config(sd), weight_dtype)
            patcher, _ = comfy.sd.load_lora_for_models(patcher, None, lora, 1.0, 0)
        host = patcher.model.state_dict()
        large = [k for k, t in host.items() if t.nbytes >= streaming.STAGE_MIN]
        backed = streaming.file_backed(host[k] for k in large if k not in patcher.patches)
        staged.clear()
        with torch.inference_mode():
            patcher.load(torch.device("cuda"), full_load=True)
            assert all(p.device.type == "cuda" for p in patcher.model.parameters())
            loaded = {k: _bytes(v.cpu()) for k, v in patcher.model.state_dict().items()}
            patcher.unpatch_model(torch.device("cpu"))
        assert patcher.patches
        restored = set()
        for key, t in patcher.model.state_dict().items():
            assert t.device.type == "cpu"
            assert torch.equal(_bytes(t), _bytes(host[key])), key
            if t.data_ptr() == host[key].data_ptr():
                restored.add(host[key].data_ptr())
        assert {host[k].data_ptr() for k in patcher.patches} <= restored
        return loaded, len(staged), len(large), backed, restored

    ours, uploads, large, backed, restored = load(pinned=True)
    assert (len(backed) > 0) == (weight_dtype == "fp8_e4m3fn")
    assert backed <= restored
    theirs, none, _, backed, restored = load(pinned=False)
    assert not backed & restored  # ComfyUI's own load copies them back
    assert uploads == large > 0 and none == 0
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key


def test_calls_in_lockstep_take_turns_at_each_block():
    """Each call runs on a thread of its own under the caller's inference mode, one at a time,
    handing over at each block's start; the results come back in order."""
    streamer = streaming.BlockStreamer([torch.nn.Identity() for _ in range(3)])
    order = []

    def call(k):
        def run():
            x = torch.zeros(1)
            for i in range(3):
                x = streamer.forward(i, lambda h, i=i: order.append((k, i)) or h + 1)(x)
            return k, int(x), torch.is_inference_mode_enabled()

        return run

    with torch.inference_mode():
        got = streamer.in_lockstep([call(0), call(1)])
    assert got == [(0, 3, True), (1, 3, True)]
    assert order == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]


def test_a_failed_lockstep_leaves_no_frames_behind():
    """The failed calls' frames (a model call's activations) go when the error does, without a
    garbage collection: ComfyUI's calls one by one run next, in that memory."""
    streamer = streaming.BlockStreamer([torch.nn.Identity()])
    alive = []

    def call(k):
        def run():
            x = torch.zeros(1)
            alive.append(weakref.ref(x))
            streamer.forward(0, lambda h: h)(x)
            if k == 0:
                raise RuntimeError("the first call fails")
            return x

        return run

    gc.disable()
    try:
        try:
            streamer.in_lockstep([call(0), call(1)])
        except RuntimeError as e:
            assert str(e) == "the first call fails"
        assert len(alive) == 2 and all(ref() is None for ref in alive)
    finally:
        gc.enable()


def _cond_batch(patcher, lengths, size=(12, 10), repeats=1):
    """(ComfyUI's calc_cond_batch for one step with a cond of each text length in `lengths`,
    positive first, every layer of `patcher` left on the host, as a sampler runs it; seconds
    of the last of `repeats` calls)."""
    cfg = config.read_config(patcher.model.diffusion_model.state_dict())
    device = patcher.load_device
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, cfg.out_channels, 1, *size, generator=g).to(device)
    texts = [torch.randn(1, n, cfg.joint_attention_dim, generator=g) for n in lengths]
    names = ["positive", "negative"][: len(lengths)]
    with torch.inference_mode():
        patcher.patch_model(device, lowvram_model_memory=1)
        patcher.pre_run()
        try:
            conds = {
                k: comfy.sampler_helpers.convert_cond([[t, {}]])
                for k, t in zip(names, texts, strict=True)
            }
            conds = comfy.samplers.process_conds(patcher.model, x, conds, device)
            options = comfy.model_patcher.create_model_options_clone(patcher.model_options)
            comfy.sampler_helpers.prepare_model_patcher(patcher, conds, options)  # the wrappers
            t = torch.tensor([0.6], device=device)
            for _ in range(repeats):
                _sync(x)
                start = time.perf_counter()
                out = comfy.samplers.calc_cond_batch(
                    patcher.model, [conds[k] for k in names], x, t, options
                )
                _sync(x)
        finally:
            patcher.cleanup()
            patcher.unpatch_model(patcher.offload_device)
    mm.unload_all_models()
    return [o.float() for o in out], time.perf_counter() - start


def _with_lockstep(sd, fused=False, device=None):
    """(patcher streaming its weights, the same with the lockstep wrapper, the streamer); the
    host's blocks unless `fused` (Triton's interpreter runs the fused ones slowly on the CPU)."""
    _, streamed, streamer = _model(sd, "fp8_e4m3fn_fast", fused=fused, device=device)
    both = streamed.clone()
    lockstep.add(both)
    return streamed, both, streamer


def test_cond_and_uncond_in_lockstep_give_the_calls_one_by_one(narrow_sd):
    """Texts of two lengths (which ComfyUI never batches): the same bits as ComfyUI's two
    calls, with each block's weights copied once for both."""
    alone, both, streamer = _with_lockstep(narrow_sd, fused=True)
    want = _cond_batch(alone, (7, 5))[0]
    assert streamer.copies == 2 * len(streamer.layers)  # each call copies every block
    streamer.copies = 0
    got = _cond_batch(both, (7, 5))[0]
    assert streamer.copies == len(streamer.layers)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert not streamer.shared and not streamer.ahead
    assert not [t for t in threading.enumerate() if t.name == "qwen-turbo-lockstep"]


def test_conds_comfyui_batches_are_left_to_it(narrow_sd, monkeypatch):
    """Texts of one length run as ComfyUI's one batch: no lockstep."""
    _, both, streamer = _with_lockstep(narrow_sd)
    monkeypatch.setattr(streaming.BlockStreamer, "in_lockstep", None)  # fails if called
    assert len(_cond_batch(both, (6, 6))[0]) == 2
    assert streamer.copies == len(streamer.layers)


def test_foreign_code_in_the_call_keeps_lockstep_off(narrow_sd, caplog, monkeypatch):
    """Another node's wrapper inside the model call may keep state across calls: ComfyUI's
    calls one by one, the reason logged."""
    alone, both, streamer = _with_lockstep(narrow_sd)
    want = _cond_batch(alone, (7, 5))[0]
    both.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, "other", lambda e, *a, **k: e(*a, **k))
    monkeypatch.setattr(runtime, "_logged", set())
    caplog.set_level(logging.INFO)
    streamer.copies = 0
    got = _cond_batch(both, (7, 5))[0]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert streamer.copies == 2 * len(streamer.layers)
    assert "conds not in lockstep: 'other' diffusion_model wrapper" in caplog.text


def _raising_in(call: int, error: Exception):
    """A BlockStreamer._staged that raises `error` in the lockstep's call `call`."""
    staged = streaming.BlockStreamer._staged

    def raising(self, i, device, lockstep):
        if lockstep is not None and lockstep[2] == call:
            raise error
        return staged(self, i, device, lockstep)

    return raising


def test_out_of_memory_in_lockstep_runs_the_calls_one_by_one(narrow_sd, monkeypatch):
    alone, both, streamer = _with_lockstep(narrow_sd)
    want = _cond_batch(alone, (7, 5))[0]
    monkeypatch.setattr(streaming.BlockStreamer, "_staged",
                        _raising_in(1, torch.OutOfMemoryError("no room")))  # fmt: skip
    got = _cond_batch(both, (7, 5))[0]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    wrapper = both.wrappers["calc_cond_batch"][lockstep.KEY][0]
    assert wrapper.out_of_memory  # that size runs one by one from now on
    assert not streamer.shared and not streamer.ahead


def test_an_error_in_one_call_stops_the_other_and_is_raised(narrow_sd, monkeypatch):
    _, both, streamer = _with_lockstep(narrow_sd)
    monkeypatch.setattr(streaming.BlockStreamer, "_staged", _raising_in(1, InterruptedError()))
    with pytest.raises(InterruptedError):
        _cond_batch(both, (7, 5))[0]
    assert not streamer.shared and not streamer.ahead
    assert not [t for t in threading.enumerate() if t.name == "qwen-turbo-lockstep"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_lockstep_full_width_on_gpu():
    """Six full-width blocks in fp8_fast with fp8_cudnn attention, every layer on the host,
    1328² with texts of 256 and 31 tokens: the conds in lockstep give the calls one by one bit
    for bit, copying each block once a step."""
    from qwen_turbo.cli import bench

    sd = {k: v.cpu() for k, v in bench.qwen_dit_state_dict(6, "cuda").items()}
    alone, both, streamer = _with_lockstep(sd, fused=True, device=torch.device("cuda"))
    loader.set_attention(alone, "fp8_cudnn")
    loader.set_attention(both, "fp8_cudnn")
    want, slow = _cond_batch(alone, (256, 31), (166, 166), repeats=2)
    streamer.copies = 0
    got, fast = _cond_batch(both, (256, 31), (166, 166), repeats=2)
    assert streamer.copies == 2 * len(streamer.layers)  # once a step, two steps
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    print(f"one by one {slow * 1e3:.1f} ms, in lockstep {fast * 1e3:.1f} ms")


@pytest.mark.parametrize("case", ["partly loads", "loads whole", "one length"])
def test_the_load_leaves_room_for_the_second_call(narrow_sd, monkeypatch, case):
    """Texts of two lengths on a model ComfyUI loads partly: half its estimate for one call is
    held while it loads for a guided run; nothing where the whole model loads or ComfyUI
    batches the conds."""
    _, both, _ = _with_lockstep(narrow_sd)
    both.load_device = torch.device("cuda")  # the count only; nothing is allocated
    latent = torch.zeros(1, 16, 1, 64, 64)
    lengths = (8, 8) if case == "one length" else (8, 5)
    conds = {k: comfy.sampler_helpers.convert_cond([[torch.zeros(1, n, 64), {}]])
             for k, n in zip(("positive", "negative"), lengths, strict=True)}  # fmt: skip
    one = comfy.sampler_helpers.estimate_memory(both, latent.shape, conds)[1]
    left = max(mm.minimum_inference_memory(), one + mm.extra_reserved_memory())
    size = 2**30 if case == "loads whole" else 40 * 2**30
    monkeypatch.setattr(both, "model_size", lambda: size)
    monkeypatch.setattr(lockstep.batch_fit, "freeable", lambda device: left + 8 * 2**30)
    want = int(lockstep.ROOM_SHARE * one) if case == "partly loads" else 0
    assert one > 0 and lockstep.lockstep_room(both, latent.shape, conds) == want
    if case == "partly loads":  # with block graphs, their pool and both calls' chains too
        graphs = loader.add_block_graphs(both)
        x = 32 * 32 * graphs.blocks[0].dim * 2  # 2x2 patches of the latent, bf16
        txt = 8 * graphs.blocks[0].dim * 2  # the longer text
        want += blocks.PEAK_PER_STATE * x + 2 * blocks.CHAIN_PER_STATES * (x + txt)
        assert lockstep.lockstep_room(both, latent.shape, conds) == want
        large = (1, 16, 1, 320, 320)  # 25,600 tokens: no room for the graphs
        one = comfy.sampler_helpers.estimate_memory(both, large, conds)[1]
        assert lockstep.lockstep_room(both, large, conds) == int(lockstep.ROOM_SHARE * one)
    holds = []

    @contextlib.contextmanager
    def hold(device, nbytes):
        holds.append(nbytes)
        yield

    monkeypatch.setattr(memory, "hold", hold)
    monkeypatch.setattr(sampling, "load_hold", lambda *a: 0)  # the cond batch's own room
    assert sampling.room_for_cond_batch(lambda *a: "loaded", both, latent.shape, conds) == "loaded"
    assert holds == [want]  # the CUDA Graph Sampler's guided runs ask it
