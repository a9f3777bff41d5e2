"""kernels/warmup: the manifest matches the kernels; a warmed-up launch compiles nothing."""

import inspect
import json
import os
import subprocess
import sys

import pytest
import torch

from qwen_turbo.kernels import warmup
from tests.harness.comfyui import ROOT

# Triton's launch options, passed beside a kernel's own arguments
LAUNCH_OPTIONS = {"num_warps", "num_stages", "num_ctas", "maxnreg"}


def test_manifest_entries_bind_to_their_kernels():
    """Every recorded launch still fits its kernel's signature (a changed kernel needs a new
    recording: `benchmarks/card_workflow.py --record-kernels kernels/warmup.json`)."""
    entries = json.loads(warmup.MANIFEST.read_text())
    names = {name for _, name, _, _ in entries}
    # the DiT's fused blocks with fp8 GEMMs and fp8 attention, and the VAE's decoder
    for name in ("_layernorm_modulate_kernel", "_qk_norm_rope_kernel", "_quantize_rows_kernel",
                 "_quant_kernel", "_channel_rms_norm_silu_kernel"):  # fmt: skip
        assert name in names, name
    for module, name, args, kwargs in entries:
        signature = inspect.signature(warmup.kernel(module, name).fn)
        own = {k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS}
        signature.bind(*args, **own)  # raises on a missing, extra or renamed argument
        assert len(args) + len(own) == len(signature.parameters), (module, name)


def test_the_probes_launches_come_first():
    """The warm-up compiles the manifest in its order; the fidelity probe is the first to
    launch the DiT's kernels, at its own token counts, so their entries lead (listed last, those
    the warm-up had not reached yet compiled again on the main thread, under the probe)."""
    from qwen_turbo.runtime.dit import probe

    image = (probe.SIDE // 16) ** 2  # 2x2 patches of the 8x latent
    tokens = {image, probe.TEXT_TOKENS, image + probe.TEXT_TOKENS}
    entries = json.loads(warmup.MANIFEST.read_text())
    at_probe = [
        i for i, (module, _, args, _) in enumerate(entries)
        if module != "channel_rms_norm_silu" and next(
            (a for a in args if type(a) is int), None) in tokens
    ]  # fmt: skip
    assert len(at_probe) >= 10  # its row, q/k and attention kernels
    assert at_probe == list(range(len(at_probe)))


def test_tensor_arguments_keep_dtype_and_alignment():
    x = torch.zeros(64, dtype=torch.bfloat16)
    assert warmup._arg(x) == {"dtype": "bfloat16", "aligned": True}
    assert warmup._arg(x[1:]) == {"dtype": "bfloat16", "aligned": False}  # 2 bytes in
    assert warmup._arg(7) == 7
    for aligned in (True, False):
        p = warmup._value({"dtype": "float8_e4m3fn", "aligned": aligned})
        assert p.dtype is torch.float8_e4m3fn
        assert (p.data_ptr() % 16 == 0) is aligned


def test_save_adds_each_entry_once(tmp_path):
    path = tmp_path / "warmup.json"
    a = ["m", "_a_kernel", [{"dtype": "float32", "aligned": True}, 3], {"BLOCK": 16}]
    b = ["m", "_b_kernel", [5], {}]
    assert warmup.save([a], path) == 1
    assert warmup.save([a, b], path) == 2
    assert json.loads(path.read_text()) == [a, b]
    assert len(path.read_text().splitlines()) == 4  # brackets and one line per entry


def test_start_does_nothing_off_cuda(tmp_path):
    missing = tmp_path / "none.json"  # never read
    assert warmup.start(torch.device("cpu"), manifest=missing) is None


def test_a_start_takes_its_kernels_launches_only(tmp_path):
    path = tmp_path / "warmup.json"
    a = ["fp8_linear", "_a_kernel", [3], {}]
    b = ["channel_rms_norm_silu", "_b_kernel", [5], {}]
    warmup.save([a, b], path)
    assert warmup.selected(path) == [a, b]
    assert warmup.selected(path, {"channel_rms_norm_silu"}) == [b]
    assert warmup.selected(path, {"rms_norm_gate"}) == []


# One process per case, each with an empty Triton cache: `record` launches two ops and saves
# their manifest; `warm` warms up from a manifest, then launches the same ops, counting the
# compiles, and the builds of their C launchers, before and at the launches.
SCRIPT = """
import json, sys, torch
from pathlib import Path
sys.path.insert(0, sys.argv[3])
from tests.harness import pack
pack.load()
import triton.runtime.build
from triton.runtime.jit import JITFunction
from qwen_turbo.kernels import fp8_linear, layernorm_modulate, warmup

compiles, builds = [], []
compile = JITFunction._do_compile
JITFunction._do_compile = lambda self, *a, **k: compiles.append(1) or compile(self, *a, **k)
build = triton.runtime.build._build
triton.runtime.build._build = lambda *a, **k: builds.append(1) or build(*a, **k)
g = torch.Generator("cuda").manual_seed(0)
x = torch.randn(1, 157, 3072, device="cuda", dtype=torch.bfloat16, generator=g)
mod = torch.randn(1, 3072, device="cuda", dtype=torch.bfloat16, generator=g)
def ops():
    layernorm_modulate.layernorm_modulate(x, mod, mod)
    fp8_linear.quantize_rows(x[0], gelu=True)
    torch.cuda.synchronize()
manifest = Path(sys.argv[2])
if sys.argv[1] == "record":
    with warmup.record() as entries:
        ops()
    warmup.save(entries, manifest)
else:
    warmup.start(torch.device("cuda"), manifest=manifest).join()
    ahead, built = len(compiles), len(builds)
    ops()
    print(json.dumps({"ahead": ahead, "at_launch": len(compiles) - ahead,
                      "launchers_at_launch": len(builds) - built}))
"""


def _run(tmp_path, mode: str, manifest, cache: str) -> str:
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / cache)}
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode, str(manifest), str(ROOT)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_warmed_up_launches_compile_nothing(tmp_path):
    manifest, empty = tmp_path / "warmup.json", tmp_path / "empty.json"
    _run(tmp_path, "record", manifest, "cache-record")
    recorded = len(json.loads(manifest.read_text()))
    assert recorded >= 2
    warmed = json.loads(_run(tmp_path, "warm", manifest, "cache-warm"))
    assert warmed == {"ahead": recorded, "at_launch": 0, "launchers_at_launch": 0}, warmed
    empty.write_text("[]")
    cold = json.loads(_run(tmp_path, "warm", empty, "cache-cold"))
    assert cold["ahead"] == 0 and cold["at_launch"] == recorded, cold
    assert cold["launchers_at_launch"] >= 1, cold  # what the warm-up built ahead
