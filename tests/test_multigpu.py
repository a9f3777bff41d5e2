"""Multi-GPU on CPU: this process as rank 0 and worker processes over gloo, on the narrow
2-block DiT (4 heads), through KSampler. Every split equals the single-process result, with
the path taken (ranks per call, calls left on rank 0) read from the driver's counters.

Latents of 6x10 give 15 image tokens and the prompts 7 text tokens: neither divides over 2,
4 or 8 ranks, so the padded sequence-parallel chunks are exercised; 3 and 8 ranks do not
divide the 4 heads, so there each rank gathers the keys and values.

The workers call `tests/multigpu_standins.py`'s functions named in `pool.WORKER_SETUP`: fp8
attention with its GPU kernel stood in, a fault in one rank's model call.
"""

import contextlib
import functools
import importlib
import ipaddress
import json
import logging
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import time

import comfy.model_management as mm
import comfy.model_patcher
import comfy.patcher_extension as pe
import comfy.sd
import comfy.utils
import psutil
import pytest
import torch
from comfy.cli_args import LatentPreviewMethod
from comfy_extras.nodes_model_advanced import ModelSamplingAuraFlow
from safetensors.torch import load_file

import nodes
import qwen_turbo.runtime
from qwen_turbo.nodes.multigpu import MultiGPU
from qwen_turbo.runtime import multigpu
from qwen_turbo.runtime.dit import attention, files, loader
from qwen_turbo.runtime.multigpu import wire
from tests.harness import models
from tests.harness.comfyui import COMFY, ROOT

pool_module = importlib.import_module("qwen_turbo.runtime.multigpu.pool")
STANDINS = "qwen_turbo.tests.multigpu_standins"  # as the workers import it
standins = importlib.import_module(STANDINS)

STEPS = 3
TEXT = models.NARROW["joint_attention_dim"]
TOL = 1e-5  # relative L2, float32
# fp8 rounding turns the float32 rounding of a batch of 1 against 2 (the modulation's GEMMs)
# into a few values rounded the other way: 1.6e-4 where CFG groups split the batch, against
# 1.2e-3 to 6e-3 with each rank's own scales instead of the call's
TOL_FP8_SPLIT_BATCH = 1e-3


@pytest.fixture(scope="module", autouse=True)
def _stop_workers():
    yield
    multigpu.shutdown()


def _cond(tokens, seed):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn((1, tokens, TEXT), generator=g), {}]]


def _sample(model, cfg=2.5, negative_tokens=7):
    latent = {"samples": torch.zeros((1, 16, 6, 10))}
    args = (42, STEPS, cfg, "euler", "simple", _cond(7, 1), _cond(negative_tokens, 2), latent)
    return nodes.common_ksampler(model, *args)[0]["samples"]


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _cpus(n):
    return ["cpu"] * n


def _lora(model):
    lora = load_file(str(models.narrow_lora_file()))
    return comfy.sd.load_lora_for_models(model, None, lora, 1.0, 0)[0]


# ranks, mode, CFG, (CFG groups, ranks per group): one pool for them (3 to 8 ranks: below,
# with fp8 attention)
CASES = [
    (2, "cfg-parallel", 2.5, (2, 1)),
    (2, "sequence-parallel", 2.5, (1, 2)),
    (2, "sequence-parallel", 1.0, (1, 2)),
    (2, "auto", 2.5, (2, 1)),
    (2, "auto", 1.0, (1, 2)),
]


@pytest.mark.parametrize(("ranks", "mode", "cfg", "split"), CASES)
def test_split_equals_single_process(narrow_dit, ranks, mode, cfg, split):
    ref = _sample(narrow_dit, cfg)
    model = multigpu.parallel(narrow_dit, _cpus(ranks), mode, backend="gloo")
    out = _sample(model, cfg)
    assert _rel(out, ref) < TOL
    stats = multigpu.driver_of(model).stats
    assert stats.calls == {split: STEPS} and not stats.local, stats


@pytest.fixture
def fp8_on_cpu(monkeypatch):
    """The quantized attention backends with their GPU kernel stood in
    (`multigpu_standins.attention_fp8_on_cpu`), in this process and in a fresh pool's
    workers."""
    multigpu.shutdown()
    for name, core in attention.QUANTIZED.items():
        standin = functools.partial(standins.attention_fp8_on_cpu, **core.keywords)
        monkeypatch.setitem(attention.QUANTIZED, name, standin)
    setup = [(f"{STANDINS}:fp8_on_cpu", [])]
    monkeypatch.setattr(pool_module, "WORKER_SETUP", setup)
    yield
    multigpu.shutdown()


# world size -> (mode, CFG, (CFG groups, ranks per group)) of each call, on one pool
QUANTIZED_PLANS = {
    3: [("sequence-parallel", 1.0, (1, 3))],  # 4 heads over 3 ranks: keys and values gathered
    4: [
        ("cfg-parallel", 2.5, (2, 1)),  # ranks 2 and 3 outside the call (issue 56)
        ("both", 2.5, (2, 2)),
        ("auto", 1.0, (1, 4)),
    ],
    8: [
        ("both", 2.5, (2, 4)),
        ("cfg-parallel", 2.5, (2, 1)),  # 6 ranks outside the call
        ("sequence-parallel", 1.0, (1, 8)),  # gathered, a text token per rank
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("ranks", QUANTIZED_PLANS)
def test_every_plan_with_fp8_attention_equals_one_process(narrow_loaded, fp8_on_cpu, ranks):
    """fp8 attention (its GPU kernel stood in; the pack's quantization, under Triton's
    interpreter, all-reduces the amaxes over the ranks of the call) over 3, 4 and 8 ranks,
    CFG groups, sequence parallel, both, and ranks left out of the call: each rank of a call
    quantizes with the whole call's scales, so every plan equals one process. Ranks outside
    the call make its group, as every rank must, and neither register nor use it."""
    model = narrow_loaded.clone()
    loader.set_attention(model, "fp8_cudnn")
    model = ModelSamplingAuraFlow().patch_aura(model, 3.1)[0]
    plain = ModelSamplingAuraFlow().patch_aura(narrow_loaded, 3.1)[0]
    refs = {}
    for mode, cfg, split in QUANTIZED_PLANS[ranks]:
        if cfg not in refs:
            refs[cfg] = _sample(model, cfg)
            assert _rel(refs[cfg], _sample(plain, cfg)) > 1e-3  # the quantization shows
        parallel = multigpu.parallel(model, _cpus(ranks), mode, backend="gloo")
        tol = TOL_FP8_SPLIT_BATCH if split[0] > 1 else TOL
        assert _rel(_sample(parallel, cfg), refs[cfg]) < tol, (mode, cfg)
        assert multigpu.driver_of(parallel).stats.calls == {split: STEPS}, (mode, cfg)


@pytest.mark.parametrize("attention", ["sdpa", "flash", "fp8_cudnn"])
def test_fused_blocks_and_attention_backend_on_the_workers(narrow_loaded, attention):
    """The Optimized Loader's fused blocks and attention override run on the workers too
    (fp8_cudnn with its scales over the ranks; on CPU it runs exact attention)."""
    fast = narrow_loaded.clone()
    loader.add_fused_blocks(fast)
    loader.set_attention(fast, attention)
    fast = ModelSamplingAuraFlow().patch_aura(fast, 3.1)[0]
    ref = _sample(fast, 1.0)
    model = multigpu.parallel(fast, _cpus(2), "sequence-parallel", backend="gloo")
    assert _rel(_sample(model, 1.0), ref) < TOL
    assert multigpu.driver_of(model).stats.calls == {(1, 2): STEPS}


@pytest.mark.parametrize("patch", ["fused on some blocks", "another node's block forward"])
def test_block_patches_the_workers_cannot_rebuild_run_on_rank_0(narrow_loaded, patch):
    """Workers rebuild the fused forward on every block or none; a model with it on some
    blocks, or with another node's forward on a block, runs on rank 0 with the same result."""
    model = narrow_loaded.clone()
    loader.add_fused_blocks(model)
    key = "diffusion_model.transformer_blocks.1.forward"
    if patch == "fused on some blocks":
        del model.object_patches[key]
        reason = "the fused forward on some blocks only"
    else:
        block = narrow_loaded.model.diffusion_model.transformer_blocks[1]
        forward = type(block).forward

        def tilted(*args, **kwargs):  # each channel scaled apart: no norm after it undoes it
            return tuple(
                t * torch.linspace(0.5, 1.5, t.shape[-1]) for t in forward(block, *args, **kwargs)
            )

        model.add_object_patch(key, tilted)
        reason = f"object patch on {key!r}"
    model = ModelSamplingAuraFlow().patch_aura(model, 3.1)[0]
    ref = _sample(model, 1.0)
    if patch == "another node's block forward":  # the patch shows
        plain = ModelSamplingAuraFlow().patch_aura(narrow_loaded, 3.1)[0]
        assert _rel(ref, _sample(plain, 1.0)) > 1e-3
    parallel = multigpu.parallel(model, _cpus(2), "sequence-parallel", backend="gloo")
    assert _rel(_sample(parallel, 1.0), ref) < TOL
    stats = multigpu.driver_of(parallel).stats
    assert stats.local == {reason: STEPS} and not stats.calls, stats


@pytest.mark.parametrize("name", [*attention.BACKENDS, *attention.QUANTIZED])
def test_attention_backends_are_known_by_name(name):
    assert multigpu.attention_name(attention.attention_override(name)) == name
    assert multigpu.attention_name(_foreign_wrapper) is None


def test_weights_follow_a_lora_and_back(narrow_dit):
    """The workers get the weights again whenever the model's patches change."""
    model = multigpu.parallel(narrow_dit, _cpus(2), "cfg-parallel", backend="gloo")
    with_lora = _lora(model)
    plain_ref, lora_ref = _sample(narrow_dit), _sample(_lora(narrow_dit))
    assert _rel(lora_ref, plain_ref) > 1e-2  # the LoRA shows
    for m, ref in ((model, plain_ref), (with_lora, lora_ref), (model, plain_ref)):
        assert _rel(_sample(m), ref) < TOL
    assert multigpu.driver_of(model).stats.calls == {(2, 1): 3 * STEPS}


@pytest.mark.parametrize("weight_dtype", ["bf16", "fp8_e4m3fn"])
def test_weights_patched_on_the_fly_are_sent_as_a_full_load_patches_them(weight_dtype):
    """Rank 0 partly loaded (lowvram: LoRA applied per call): the workers get each weight as
    a full load patches it in place, bit for bit."""
    sd, cfg = files.read_checkpoint(models.qwen_dit_narrow_file())
    with_lora = _lora(loader.build(sd, cfg, weight_dtype))
    keys = sorted(with_lora.patches)
    with torch.inference_mode():
        with_lora.load(with_lora.load_device, lowvram_model_memory=1)
        assert not any(k in with_lora.backup for k in keys)
        sent = {k: multigpu.patched_weight(with_lora, k, torch.device("cpu")) for k in keys}
        with_lora.detach()
        mm.unload_all_models()
        with_lora.load(with_lora.load_device, full_load=True)
        for k in keys:
            assert torch.equal(sent[k], comfy.utils.get_attr(with_lora.model, k)), k
        with_lora.detach()
    mm.unload_all_models()


def _double_block_patch(args):
    return {**args, "img": args["img"] * 0.9}


def _foreign_wrapper(executor, *args, **kwargs):
    return executor(*args, **kwargs) * 0.9


def test_calls_the_workers_cannot_reproduce_run_on_rank_0(narrow_dit):
    """Another node's model patch, or its diffusion-model wrapper inside this one, runs on rank
    0 alone (same result as one process), and the reason is counted."""
    patched = narrow_dit.clone()
    patched.set_model_patch(_double_block_patch, "double_block")
    wrapped = multigpu.parallel(narrow_dit, _cpus(2), "auto", backend="gloo")
    wrapped.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, "foreign", _foreign_wrapper)
    ref_wrapped = narrow_dit.clone()
    ref_wrapped.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, "foreign", _foreign_wrapper)
    cases = [
        (multigpu.parallel(patched, _cpus(2), "auto", backend="gloo"), patched,
         "model patches (double_block)"),
        (wrapped, ref_wrapped, "the 'foreign' diffusion_model wrapper"),
    ]  # fmt: skip
    for model, ref_model, reason in cases:
        ref = _sample(ref_model)
        assert _rel(ref, _sample(narrow_dit)) > 1e-3  # the patch shows
        assert _rel(_sample(model), ref) < TOL
        stats = multigpu.driver_of(model).stats
        assert stats.local == {reason: STEPS} and not stats.calls, stats


def test_a_text_attention_mask_keeps_the_sequence_whole(narrow_dit):
    """A prompt padded with a mask (the text encoder's attention_mask) cannot have its tokens
    split: sequence-parallel runs such calls on one GPU, with the same result, and says why."""
    mask = torch.ones((1, 7))
    mask[:, 5:] = 0
    cond = _cond(7, 1)
    cond[0][1]["attention_mask"] = mask
    latent = {"samples": torch.zeros((1, 16, 6, 10))}
    args = (42, STEPS, 1.0, "euler", "simple", cond, _cond(7, 2), latent)
    ref = nodes.common_ksampler(narrow_dit, *args)[0]["samples"]
    if _rel(ref, _sample(narrow_dit, cfg=1.0)) == 0:
        pytest.skip("this ComfyUI does not pass the text mask to Qwen-Image (v0.3.64)")
    model = multigpu.parallel(narrow_dit, _cpus(2), "sequence-parallel", backend="gloo")
    assert _rel(nodes.common_ksampler(model, *args)[0]["samples"], ref) < TOL
    stats = multigpu.driver_of(model).stats
    assert stats.local == {"no sequence parallel with a text attention mask": STEPS}, stats


def _scaled_attention(func, *args, **kwargs):
    return func(*args, **kwargs) * 0.9


def test_another_nodes_attention_override_runs_on_rank_0(narrow_dit):
    """An attention override the workers cannot rebuild by name (another node's function)
    keeps the calls on rank 0: the same result, the reason counted."""
    ref_model = narrow_dit.clone()
    ref_model.model_options["transformer_options"]["optimized_attention_override"] = (
        _scaled_attention
    )
    ref = _sample(ref_model)
    assert _rel(ref, _sample(narrow_dit)) > 1e-3  # the override shows
    model = multigpu.parallel(ref_model, _cpus(2), "auto", backend="gloo")
    assert _rel(_sample(model), ref) < TOL
    stats = multigpu.driver_of(model).stats
    (reason,) = stats.local
    assert reason.startswith("attention override <function _scaled_attention")
    assert stats.local[reason] == STEPS and not stats.calls, stats


def test_unequal_prompt_lengths_split_by_sequence(narrow_dit):
    """Cond and uncond of different lengths come as two calls of one: auto splits each call's
    sequence instead of the batch."""
    ref = _sample(narrow_dit, negative_tokens=5)
    model = multigpu.parallel(narrow_dit, _cpus(2), "auto", backend="gloo")
    assert _rel(_sample(model, negative_tokens=5), ref) < TOL
    assert multigpu.driver_of(model).stats.calls == {(1, 2): 2 * STEPS}


def _workers():
    return multigpu.running().procs


@pytest.mark.parametrize("error", [None, "OutOfMemoryError: CUDA out of memory."])
def test_a_dead_worker_gives_a_clear_error_and_the_next_run_starts_fresh(narrow_dit, error):
    """A worker gone (killed, or out of memory: its error sent, then a hint): the error names
    it, and the next run starts fresh workers."""
    model = multigpu.parallel(narrow_dit, _cpus(2), "cfg-parallel", backend="gloo")
    ref = _sample(narrow_dit)
    assert _rel(_sample(model), ref) < TOL
    first = _workers()[0]
    if error:
        multigpu.running().links[0].error = error  # as the worker answers before it exits
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    failed = r"worker on cpu \(rank 1\) failed \(exit code -9\)"
    with pytest.raises(multigpu.MultiGPUError, match=failed) as e:
        _sample(model)
    assert ("free memory on cpu or use fewer GPUs" in str(e.value)) == bool(error), e.value
    assert multigpu.running() is None
    assert _rel(_sample(model), ref) < TOL  # fresh workers
    assert _workers()[0].pid != first.pid


# kind, ranks, mode, CFG: rank 1 fails at the forward of its STEPS-th model call
FAULTS = [
    ("raise", 2, "sequence-parallel", 1.0),  # rank 0 in a collective with it
    ("kill", 4, "both", 2.5),  # the others' collectives fail after it: rank 1 is named
    ("stall", 2, "sequence-parallel", 1.0),  # rank 0 in a collective until the deadline
]


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "ranks", "mode", "cfg"), FAULTS)
def test_a_failed_rank_ends_the_call_in_seconds(narrow_dit, monkeypatch, kind, ranks, mode, cfg):
    """A rank that raises, is killed (SIGKILL) or stalls mid-call never hangs rank 0: within
    seconds (a stall: the deadline, 4x the last call plus a floor, lowered here to 2 s) the
    call raises an error naming the rank with its last lines of output (a stalled one's, its
    stack); the pool is stopped, and the next run starts a fresh one and equals one process."""
    multigpu.shutdown()
    setup = [(f"{STANDINS}:fault", [kind, 1, STEPS])]
    monkeypatch.setattr(pool_module, "WORKER_SETUP", setup)
    monkeypatch.setattr(pool_module, "CALL_FLOOR_S", 2.0)
    starts = []

    def clock(executor, *args, **kwargs):
        starts.append(time.monotonic())
        return executor(*args, **kwargs)

    outer = narrow_dit.clone()
    outer.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, "clock", clock)
    model = multigpu.parallel(outer, _cpus(ranks), mode, backend="gloo")
    with pytest.raises(multigpu.MultiGPUError) as e:
        _sample(model, cfg)
    seconds, error = time.monotonic() - starts[-1], str(e.value)
    assert len(starts) == STEPS and multigpu.running() is None, error
    if kind == "stall":
        bound = float(re.search(r"did not finish in ([\d.]+) s \(2 s \+ 4 x", error)[1])
        assert bound < 10 and bound < seconds < bound + 3, (seconds, error)
        assert "Where rank 1 was:" in error and "in _stall" in error, error
    else:
        code = 1 if kind == "raise" else -9
        assert f"worker on cpu (rank 1) failed (exit code {code})" in error, error
        assert seconds < 5, (seconds, error)
        last = {"raise": "RuntimeError: injected fault on rank 1", "kill": "rank 1 kills"}[kind]
        assert last in error.split("Rank 1's last lines of output:")[1], error
    monkeypatch.setattr(pool_module, "WORKER_SETUP", [])
    assert _rel(_sample(model, cfg), _sample(narrow_dit, cfg)) < TOL


class _Forged:
    """A pickle that, unpickled, creates the file at `path`."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _sockets(pid):
    return {(c.laddr, c.status) for c in psutil.Process(pid).net_connections("inet")}


def test_a_local_attacker_reaches_nothing_that_runs_code(narrow_dit, tmp_path):
    """Every socket the pool opens (this process's and its workers') is on loopback. Forged
    pickles sent from loopback to every port they listen on run nothing (no port speaks
    TCPStore's protocol any more: the ranks meet in a FileStore); the pool still serves the
    next run."""
    multigpu.shutdown()
    before = _sockets(os.getpid())
    model = multigpu.parallel(narrow_dit, _cpus(2), "cfg-parallel", backend="gloo")
    ref = _sample(narrow_dit)
    assert _rel(_sample(model), ref) < TOL
    opened = (_sockets(os.getpid()) - before) | _sockets(_workers()[0].pid)
    assert opened and all(ipaddress.ip_address(a.ip).is_loopback for a, _ in opened), opened
    marker = tmp_path / "ran"
    payload = pickle.dumps(_Forged(marker))
    ports = {a.port for a, status in opened if status == psutil.CONN_LISTEN}
    assert ports
    for port in ports:  # what a TCPStore client's "set" of each key would carry, and more
        for data in (payload, *(key + payload for key in (b"op/1", b"args", b"pg/0"))):
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", port), 1) as c,
            ):
                c.sendall(data)
    assert _rel(_sample(model), ref) < TOL
    assert not marker.exists()


def test_control_messages_are_plain_data_and_others_are_dropped(narrow_dit, tmp_path, capfd):
    """What a worker cannot take as an operation (not JSON, a pickle, an unknown operation,
    missing fields, a function named as a class or enum) is dropped with a log line and runs
    nothing; the worker serves the next run. The environment is as it was after the pool
    stops."""
    multigpu.shutdown()
    environ = dict(os.environ)
    model = multigpu.parallel(narrow_dit, _cpus(2), "cfg-parallel", backend="gloo")
    ref = _sample(narrow_dit)
    assert _rel(_sample(model), ref) < TOL
    marker = tmp_path / "ran"
    tampered = [
        b"not json",
        pickle.dumps(_Forged(marker)).replace(b"\n", b" "),
        b'{"dict": [["op", "__init__"]]}',
        b'{"dict": [["op", "load"]]}',
        b'{"dict": [["op", "stop"], ["x", {"class": "subprocess:Popen"}]]}',
        b'{"dict": [["op", "stop"], ["x", {"enum": "os:system", "value": "touch ran"}]]}',
    ]
    for line in tampered:
        multigpu.running().links[0].send(line + b"\n")
    assert _rel(_sample(model), ref) < TOL
    assert not marker.exists()
    multigpu.shutdown()
    assert dict(os.environ) == environ
    assert capfd.readouterr().err.count("dropped a control message") == len(tampered)


def test_wire_carries_plain_data_only():
    spec = ((wire.Slot(0), {"k": (1, 2.5, None)}), {"dtype": torch.bfloat16, "on": {True}})
    assert wire.loads(wire.dumps({"spec": spec})) == {"spec": spec}
    recipe = {"cls": torch.nn.Linear, "fast": LatentPreviewMethod.Auto}
    assert wire.loads(wire.dumps(recipe)) == recipe
    for value in (object(), print, _Forged("x"), type("Local", (torch.nn.Module,), {})):
        with pytest.raises(TypeError):
            wire.dumps({"x": value})
    for data in ('{"class": "builtins:eval"}', '{"class": "subprocess:Popen"}', "[1]"):
        with pytest.raises(ValueError):
            wire.loads(data)


def test_cancel_stops_the_workers_start():
    """ComfyUI's Cancel while the workers start (up to minutes on a slow disk): the wait stops,
    the started workers are stopped, and nothing is left initialized."""
    mm.interrupt_current_processing(True)
    try:
        with pytest.raises(mm.InterruptProcessingException):
            multigpu.pool(("cpu", "cpu"), "gloo")
    finally:
        mm.interrupt_current_processing(False)
    assert multigpu.running() is None and not torch.distributed.is_initialized()


def test_a_worker_that_cannot_start_is_named():
    failed = r"worker on cuda:999 \(rank 1\) failed to start.*: "
    with pytest.raises(multigpu.MultiGPUError, match=failed):
        multigpu.pool(("cpu", "cuda:999"), "gloo")
    assert multigpu.running() is None and not torch.distributed.is_initialized()


@pytest.mark.parametrize(
    ("mode", "world", "batch", "why_not_sp", "want"),
    [
        ("auto", 2, 2, None, (2, 1, None)),
        ("auto", 2, 1, None, (1, 2, None)),
        ("auto", 8, 2, None, (2, 4, None)),
        ("auto", 5, 2, None, (1, 5, None)),
        ("cfg-parallel", 4, 2, None, (2, 1, "a batch of 2 splits over 2 of 4 GPUs")),
        ("sequence-parallel", 4, 2, None, (1, 4, None)),
        ("both", 6, 2, None, (2, 3, None)),
        ("both", 2, 1, "a text attention mask",
         (1, 1, "no sequence parallel with a text attention mask")),
    ],
)  # fmt: skip
def test_plan(mode, world, batch, why_not_sp, want):
    assert multigpu.plan(mode, world, batch, why_not_sp) == want


def test_node_with_one_gpu_returns_the_model_as_it_is(narrow_dit, caplog, monkeypatch):
    monkeypatch.setattr(qwen_turbo.runtime, "_logged", set())  # log_once may have said it
    for gpus in (1, 2):  # this host: CPU, so 2 GPUs fall back as well
        with caplog.at_level(logging.WARNING):
            out = MultiGPU.execute(model=narrow_dit, gpus=gpus, mode="auto").result[0]
        assert out is narrow_dit
        assert ("not CUDA: it runs as it is" in caplog.text) == (gpus == 2)  # logged, not asked
    assert multigpu.cuda_devices(narrow_dit.load_device, 1) == (
        [],
        "1 GPU asked for: the model runs as it is",
    )
    assert "not CUDA" in multigpu.cuda_devices(torch.device("cpu"), 2)[1]


def test_devices_start_with_rank_0s_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    cuda1 = torch.device("cuda", 1)
    assert multigpu.cuda_devices(cuda1, 3) == (["cuda:1", "cuda:0", "cuda:2"], None)
    assert multigpu.cuda_devices(cuda1, 6) == (
        ["cuda:1", "cuda:0", "cuda:2", "cuda:3"], "4 CUDA devices present, not 6"
    )  # fmt: skip


def test_other_models_are_refused():
    vae_like = comfy.model_patcher.ModelPatcher(torch.nn.Linear(2, 2), "cpu", "cpu")
    with pytest.raises(ValueError, match="runs Qwen-Image DiTs"):
        multigpu.parallel(vae_like, _cpus(2))


def _bench(*args: str) -> dict:
    env = dict(os.environ, COMFYUI_PATH=str(COMFY))
    env.pop("TRITON_INTERPRET", None)
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "multigpu.py"),
        "--layers",
        "2",
        "--size",
        "512",
        "--guided-steps",
        "3",
        "--turbo-steps",
        "2",
        "--repeats",
        "1",
        *args,
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("sampler", ["ksampler", "graph"])
def test_node_on_two_gpus_equals_one(sampler):
    """The node on 2 GPUs (NCCL) against the same model on one, through KSampler and the CUDA
    Graph Sampler: CFG 4 split by batch, CFG 1 by sequence. In float32, so that only rounding
    differs (in bf16 a batch of 1 rounds differently from a batch of 2, on one GPU as well)."""
    guided, turbo = _bench("--variant", "fp32 fused sdpa", "--sampler", sampler)["rows"]
    for row, split in ((guided, "2x1"), (turbo, "1x2")):
        assert row["rel_l2"] <= TOL, row
        assert set(row["calls"]) == {split} and not row["local"], row
    if sampler == "ksampler":  # an untimed run and a timed one
        assert guided["calls"] == {"2x1": 2 * 3} and turbo["calls"] == {"1x2": 2 * 2}


# ComfyUI on cuda:0 in float32 (the test process's runs on CPU), the narrow DiT, sequence
# parallel over 2 GPUs, rank 1 failing as in test_a_failed_rank_ends_the_call_in_seconds; then
# a run without the fault. Prints the error, its time and the next run's rel L2, as JSON.
NCCL_FAULT = """
import importlib, json, sys, time
from tests.harness.comfyui import setup_comfy
setup_comfy(force_fp32=True)
import comfy.patcher_extension as pe, nodes, torch
from comfy_extras.nodes_model_advanced import ModelSamplingAuraFlow
from qwen_turbo.runtime import multigpu
from tests.harness import models

kind, steps = sys.argv[1], int(sys.argv[2])
pool = importlib.import_module("qwen_turbo.runtime.multigpu.pool")
model = ModelSamplingAuraFlow().patch_aura(models.load_narrow_dit(), 3.1)[0]
g = torch.Generator().manual_seed(1)
conds = [[[torch.randn((1, 7, models.NARROW["joint_attention_dim"]), generator=g), {}]]
         for _ in range(2)]
latent = {"samples": torch.zeros((1, 16, 6, 10))}
sample = lambda m: nodes.common_ksampler(m, 42, steps, 1.0, "euler", "simple", *conds,
                                         latent)[0]["samples"]
starts = []
def clock(executor, *args, **kwargs):
    starts.append(time.monotonic())
    return executor(*args, **kwargs)
outer = model.clone()
outer.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, "clock", clock)
parallel = multigpu.parallel(outer, ["cuda:0", "cuda:1"], "sequence-parallel")
pool.CALL_FLOOR_S = 2.0
pool.WORKER_SETUP = [(pool.PACK + ".tests.multigpu_standins:fault", [kind, 1, steps])]
try:
    sample(parallel)
    error = None
except multigpu.MultiGPUError as e:
    error = str(e)
result = {"error": error, "seconds": time.monotonic() - starts[-1], "calls": len(starts),
          "stopped": multigpu.running() is None}
pool.WORKER_SETUP = []
ref, out = sample(model), sample(parallel)
multigpu.shutdown()
print(json.dumps({**result, "rel": ((out - ref).norm() / ref.norm()).item()}))
"""


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("kind", ["raise", "kill", "stall"])
def test_a_failed_rank_ends_the_call_in_seconds_under_nccl(kind):
    """Under NCCL rank 0's kernels wait on the failed rank: its watch kills the worker and
    aborts the communicators. The error comes within seconds, names the rank, the pool stops,
    and the next run starts a fresh one and equals one GPU (float32)."""
    env = dict(os.environ, COMFYUI_PATH=str(COMFY))
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-c", NCCL_FAULT, kind, str(STEPS)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    error = result["error"] or ""
    assert result["stopped"] and result["calls"] == STEPS and result["rel"] <= TOL, result
    if kind == "stall":
        assert "did not finish in" in error and "in _stall" in error, error
        assert result["seconds"] < 10, result
    else:
        assert "worker on cuda:1 (rank 1) failed" in error and result["seconds"] < 5, result
        last = {"raise": "injected fault on rank 1", "kill": "(exit code -9)"}[kind]
        assert last in error, error


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_nccl_sockets_are_on_loopback():
    """NCCL's sockets (made when the pool starts: the communicators are bound to a device) in
    this process and the worker are on loopback; the environment is as it was after."""
    multigpu.shutdown()
    environ, before = dict(os.environ), _sockets(os.getpid())
    pool = multigpu.pool(("cuda:0", "cuda:1"), "nccl")
    opened = (_sockets(os.getpid()) - before) | _sockets(pool.procs[0].pid)
    multigpu.shutdown()
    assert opened and all(ipaddress.ip_address(a.ip).is_loopback for a, _ in opened), opened
    assert dict(os.environ) == environ


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("attention", ["fp8_cudnn", "fp8"])
def test_fp8_attention_split_by_batch_equals_one_gpu(attention):
    """fp8 attention (cuDNN's, or FlashAttention-3's where installed) quantizes with the scales
    and v's means of the whole call's batch on every rank, so CFG 4 split by batch rounds as the
    batched call on one GPU does. At 2512², where the bf16 GEMMs of a batch of 1 and of 2 round
    alike (at 512² they do not)."""
    guided, _ = _bench("--variant", f"fp8_fast fused {attention}", "--size", "2512")["rows"]
    assert guided["rel_l2"] <= TOL and set(guided["calls"]) == {"2x1"}, guided
