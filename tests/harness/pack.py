"""The pack as `qwen_turbo`, imported once per process from this checkout.

`register()` makes `qwen_turbo.cli` and `qwen_turbo.kernels` importable before ComfyUI is on
sys.path (to find ComfyUI); `load()` runs the pack's `__init__` (its nodes) once it is.
"""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def register():
    """The `qwen_turbo` package, registered but not yet run."""
    if "qwen_turbo" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "qwen_turbo", ROOT / "__init__.py", submodule_search_locations=[str(ROOT)]
        )
        sys.modules["qwen_turbo"] = importlib.util.module_from_spec(spec)
    return sys.modules["qwen_turbo"]


def load():
    """Run the pack's `__init__` once (ComfyUI must be importable by now)."""
    pack = register()
    if not hasattr(pack, "WEB_DIRECTORY"):
        pack.__spec__.loader.exec_module(pack)
    return pack
