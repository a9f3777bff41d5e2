"""Importing the pack: no ComfyUI needed for the math, no Triton needed for the nodes."""

import subprocess
import sys
import textwrap

from tests.harness.comfyui import COMFY, ROOT

LOAD = f"""
import importlib.util, sys, threading
before = (list(sys.path), threading.active_count())
spec = importlib.util.spec_from_file_location(
    "qwen_turbo", {str(ROOT / "__init__.py")!r}, submodule_search_locations=[{str(ROOT)!r}])
pack = importlib.util.module_from_spec(spec)
sys.modules["qwen_turbo"] = pack
spec.loader.exec_module(pack)
"""


def _run(code: str) -> str:
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_kernels_and_runtime_import_without_comfyui():
    out = _run(
        LOAD
        + """
import qwen_turbo.kernels.group_norm_stats
import qwen_turbo.runtime.vae.describe, qwen_turbo.runtime.vae.executor
assert not any(m == "comfy" or m.startswith("comfy.") for m in sys.modules), "imported comfy"
assert not hasattr(pack, "comfy_entrypoint")
assert (list(sys.path), threading.active_count()) == before, "import had side effects"
print("ok")
"""
    )
    assert out.strip() == "ok"


def test_nodes_register_without_triton():
    out = _run(
        f"""
import sys
sys.modules["triton"] = None  # as on a machine without Triton
sys.path.insert(0, {str(COMFY)!r})
from comfy.cli_args import args
args.cpu = True
"""
        + LOAD
        + """
import asyncio
from qwen_turbo.nodes import NODES
ext = asyncio.run(pack.comfy_entrypoint())
ids = [n.define_schema().node_id for n in asyncio.run(ext.get_node_list())]
assert ids == [n.define_schema().node_id for n in NODES]
print(",".join(ids))
"""
    )
    assert "QwenTurboVAEDecodeTiled" in out.strip().split(",")


def test_the_pack_is_imported_once_as_qwen_turbo():
    """The suite's own imports load the pack's code only as `qwen_turbo`: a second copy (its
    `runtime`, `kernels` or `cli` as top-level packages) would keep its own log-once set and
    registries. Tests and benchmarks are modules of their own."""
    pack = [str(ROOT / d) for d in ("runtime", "kernels", "cli", "nodes")]
    copies = [
        name for name, module in list(sys.modules.items())
        if not name.startswith("qwen_turbo")
        and str(getattr(module, "__file__", None) or "").startswith(tuple(pack))
    ]  # fmt: skip
    assert not copies, copies
    assert sys.modules["qwen_turbo.runtime"].__file__.startswith(str(ROOT))
