"""A guided step's model calls in lockstep on a model that streams its weights: through
ComfyUI's own calc_cond_batch, each cond's output is bit-identical to ComfyUI's calls one after
another, and each offloaded block is staged once a step rather than once a call. Steps with
code around the calls that would run twice keep ComfyUI's order."""

import threading
import time
import uuid

import comfy.conds
import comfy.model_management as mm
import comfy.model_patcher
import comfy.sampler_helpers
import comfy.samplers
import comfy.sd
import pytest
import torch
from safetensors.torch import load_file

from qwen_turbo.runtime.dit import config, loader, lockstep
from qwen_turbo.runtime.graphs import cond_lockstep
from tests.harness import models


def _cond(tokens: int, width: int, seed: int) -> list[dict]:
    """One cond as calc_cond_batch takes it: a text of `tokens` tokens."""
    ctx = torch.randn(1, tokens, width, generator=torch.Generator().manual_seed(seed))
    return [{"model_conds": {"c_crossattn": comfy.conds.CONDCrossAttn(ctx)}, "uuid": uuid.uuid4()}]


def _streamed(narrow_sd, lockstepped: bool, lora=None):
    """(patcher with fused blocks and `lora` streaming its weights, its streamer), with the
    lockstep wrappers where `lockstepped`."""
    patcher = loader.build(dict(narrow_sd), config.read_config(narrow_sd), "fp8_e4m3fn_fast")
    loader.add_fused_blocks(patcher)
    if lora is not None:
        patcher, _ = comfy.sd.load_lora_for_models(patcher, None, lora, 1.0, 0)
    streamer = loader.stream_offloaded_weights(patcher)
    if lockstepped:
        cond_lockstep.install(patcher)
    return patcher, streamer


def _step(patcher, conds: list, offloaded=True, size=(12, 10), repeats=1) -> tuple[list, float]:
    """(ComfyUI's calc_cond_batch for `conds`, seconds of the last of `repeats`) on the model,
    its layers left on the host as ComfyUI's lowvram load leaves them (with `offloaded`),
    under inference_mode."""
    width = patcher.model.diffusion_model.txt_norm.weight.shape[0]
    cfg = config.read_config(patcher.model.diffusion_model.state_dict())
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, cfg.out_channels, 1, *size, generator=g).to(patcher.load_device)
    conds = [_cond(tokens, width, seed) for seed, tokens in enumerate(conds)]
    options = comfy.model_patcher.create_model_options_clone(patcher.model_options)
    comfy.sampler_helpers.prepare_model_patcher(patcher, {}, options)  # the sampler's wrappers
    t = torch.tensor([0.6], device=patcher.load_device)
    with torch.inference_mode():
        patcher.patch_model(patcher.load_device, lowvram_model_memory=1 if offloaded else 0)
        patcher.model.current_patcher = patcher  # as ComfyUI's sampler sets it
        try:
            for _ in range(repeats):
                _sync(x)
                start = time.perf_counter()
                out = comfy.samplers.calc_cond_batch(patcher.model, conds, x, t, options)
                _sync(x)
            return out, time.perf_counter() - start
        finally:
            patcher.unpatch_model(patcher.offload_device)
            mm.unload_all_models()


def _sync(x):
    if x.is_cuda:
        torch.cuda.synchronize()


@pytest.mark.parametrize("tokens, lora", [((7, 5), False), ((7, 5), True), ((7, 6, 5), False)])
def test_calls_in_lockstep_give_comfyui_calls_result(narrow_sd, tokens, lora):
    """Texts of different lengths (a prompt and its negative; three conds), with and without a
    LoRA: each output equals ComfyUI's separate calls', and each block's weights were staged
    once a step."""
    lora = load_file(str(models.narrow_lora_file())) if lora else None
    plain, plain_streamer = _streamed(narrow_sd, lockstepped=False, lora=lora)
    together, streamer = _streamed(narrow_sd, lockstepped=True, lora=lora)
    want = _step(plain, tokens)[0]
    got = _step(together, tokens)[0]
    assert len(got) == len(tokens)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    blocks = len(streamer.layers)
    assert plain_streamer.copies == len(tokens) * blocks
    assert streamer.copies == blocks


def test_a_model_all_on_the_gpu_runs_its_calls_as_comfyui_makes_them(narrow_sd):
    together, streamer = _streamed(narrow_sd, lockstepped=True)
    plain, _ = _streamed(narrow_sd, lockstepped=False)
    got = _step(together, (7, 5), offloaded=False)[0]
    want = _step(plain, (7, 5), offloaded=False)[0]
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert streamer.copies == 0


class _Base:
    model_lowvram = True


def _wrapper(executor, *args, **kwargs):
    return executor(*args, **kwargs)


@pytest.mark.parametrize(
    "case, why",
    [
        ("all loaded", "weights all on the GPU"),
        ("ControlNet", "control per call"),
        ("hooks", "hooks per call"),
        ("model_function_wrapper", "model_function_wrapper per call"),
        ("foreign wrapper", "'other' diffusion_model wrapper runs Python per step"),
        ("torch.compile", "'torch.compile' apply_model wrapper runs Python per step"),
        ("model patch", "model patches (double_block) run Python per step"),
        ("plain", None),
    ],
)
def test_steps_with_code_that_would_run_twice_keep_comfyui_order(case, why):
    model = _Base()
    if case == "all loaded":
        model.model_lowvram = False
    conds = [[{"uuid": 1}], [{"uuid": 2}]]
    if case in ("ControlNet", "hooks"):
        conds[0][0]["control" if case == "ControlNet" else "hooks"] = object()
    options = {"transformer_options": {}}
    if case == "model_function_wrapper":
        options["model_function_wrapper"] = _wrapper
    wrappers = options["transformer_options"].setdefault("wrappers", {})
    if case == "foreign wrapper":
        wrappers["diffusion_model"] = {"other": [_wrapper]}
    if case == "torch.compile":
        wrappers["apply_model"] = {"torch.compile": [_wrapper]}
    if case == "model patch":
        options["transformer_options"]["patches"] = {"double_block": [_wrapper]}
    _wrapper.__module__ = "custom_nodes.other"
    assert cond_lockstep.why_alone(model, conds, options, []) == why


def test_a_call_other_than_the_recorded_one_runs_now():
    x = torch.zeros(1, 2, 3)
    replay = cond_lockstep.Replay([(None, (x,), {})], [torch.ones(1, 2, 3)])
    assert torch.equal(replay.output(None, (x,), {}), torch.ones(1, 2, 3))
    other = torch.zeros(1, 2, 4)
    assert torch.equal(replay.output(lambda t: t + 2, (other,), {}), other + 2)


def _calls(events: list, n_blocks: int, fail_at=None):
    def call(k):
        def run():
            assert torch.is_inference_mode_enabled()  # the caller's thread state
            for i in range(n_blocks):
                events.append((k, i))
                if (k, i) == fail_at:
                    raise RuntimeError("block failed")
                lockstep.block_end()
            return k

        return run

    import contextvars

    return [(call(k), contextvars.copy_context()) for k in range(3)]


def test_lockstep_runs_block_i_of_every_call_in_turn():
    events = []
    with torch.inference_mode():
        assert lockstep.run(_calls(events, 4)) == [0, 1, 2]
    assert events == [(k, i) for i in range(4) for k in range(3)]
    assert threading.active_count() == 1 or not any(
        t.name.startswith("qwen-turbo-lockstep") for t in threading.enumerate()
    )


def test_an_error_in_one_call_stops_none_of_the_others_and_is_raised():
    events = []
    with torch.inference_mode(), pytest.raises(RuntimeError, match="block failed"):
        lockstep.run(_calls(events, 3, fail_at=(1, 1)))
    assert [e for e in events if e[0] != 1] == [(k, i) for i in range(3) for k in (0, 2)]
    assert (1, 2) not in events


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_lockstep_full_width_on_gpu():
    """Six full-width blocks in fp8_fast with every layer on the host, 1328² (83² tokens), a
    prompt of 256 tokens and a negative of 200: each output is bit-identical to ComfyUI's
    calls one after another, in less time (second steps: the first pins and compiles)."""
    from qwen_turbo.cli import bench

    sd = {k: v.cpu() for k, v in bench.qwen_dit_state_dict(6, "cuda").items()}
    plain, _ = _streamed(sd, lockstepped=False)
    together, streamer = _streamed(sd, lockstepped=True)
    for p in (plain, together):
        p.load_device = torch.device("cuda")
    want, alone = _step(plain, (256, 200), size=(166, 166), repeats=2)
    got, fast = _step(together, (256, 200), size=(166, 166), repeats=2)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert streamer.copies == 2 * len(streamer.layers)  # once a step
    print(f"one call after another {alone * 1e3:.1f} ms, in lockstep {fast * 1e3:.1f} ms")
    assert fast < alone
