"""Multi-GPU on CPU: this process as rank 0 and worker processes over gloo, on the narrow
2-block DiT (4 heads), through KSampler. Every split equals the single-process result, with
the path taken (ranks per call, calls left on rank 0) read from the driver's counters.

Latents of 6x10 give 15 image tokens and the prompts 7 text tokens: neither divides over 2 or
4 ranks, so the padded sequence-parallel chunks are exercised; 3 ranks do not divide the 4
heads, so there each rank gathers the keys and values.
"""

import contextlib
import ipaddress
import json
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys

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

STEPS = 3
TEXT = models.NARROW["joint_attention_dim"]
TOL = 1e-5  # relative L2, float32


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


# ranks, mode, CFG, (CFG groups, ranks per group); 2-rank cases first: one pool for them
CASES = [
    (2, "cfg-parallel", 2.5, (2, 1)),
    (2, "sequence-parallel", 2.5, (1, 2)),
    (2, "sequence-parallel", 1.0, (1, 2)),
    (2, "auto", 2.5, (2, 1)),
    (2, "auto", 1.0, (1, 2)),
    (4, "both", 2.5, (2, 2)),
    (4, "auto", 1.0, (1, 4)),
    (3, "sequence-parallel", 1.0, (1, 3)),  # 3 ranks, 4 heads: keys and values gathered
    (6, "both", 2.5, (2, 3)),
]


@pytest.mark.parametrize(("ranks", "mode", "cfg", "split"), CASES)
def test_split_equals_single_process(narrow_dit, ranks, mode, cfg, split):
    ref = _sample(narrow_dit, cfg)
    model = multigpu.parallel(narrow_dit, _cpus(ranks), mode, backend="gloo")
    out = _sample(model, cfg)
    assert _rel(out, ref) < TOL
    stats = multigpu.driver_of(model).stats
    assert stats.calls == {split: STEPS} and not stats.local, stats


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
    with pytest.raises(multigpu.MultiGPUError, match=r"worker on cpu failed \(exit code -9\)") as e:
        _sample(model)
    assert ("free memory on cpu or use fewer GPUs" in str(e.value)) == bool(error), e.value
    assert multigpu.running() is None
    assert _rel(_sample(model), ref) < TOL  # fresh workers
    assert _workers()[0].pid != first.pid


def test_a_worker_dying_mid_run_stops_the_run(narrow_dit):
    """One of 3 workers killed between two model calls of a run (by a wrapper outside the
    driver's): the call fails with the worker named, the others (waiting in a collective) are
    stopped too; the next run works."""
    calls = []

    def killer(executor, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            proc = _workers()[0]
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        return executor(*args, **kwargs)

    outer = narrow_dit.clone()
    outer.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, "killer", killer)
    model = multigpu.parallel(outer, _cpus(4), "both", backend="gloo")
    with pytest.raises(multigpu.MultiGPUError, match="worker on cpu failed"):
        _sample(model)
    assert len(calls) == 2 and multigpu.running() is None
    assert _rel(_sample(model), _sample(narrow_dit)) < TOL
    assert multigpu.driver_of(model).stats.calls == {(2, 2): 2 + STEPS}


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
    with pytest.raises(multigpu.MultiGPUError, match=r"worker on cuda:999 failed to start.*: "):
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
