"""The pack as `qwen_turbo`, imported once per process from this checkout.

`register()` makes `qwen_turbo.cli` and `qwen_turbo.kernels` importable before ComfyUI is on
sys.path (to find ComfyUI); `load()` runs the pack's `__init__` (its nodes) once it is.

The checkout is on sys.path (for `tests`), which would also show the pack's folders as
top-level packages: transformers imports a `kernels` it finds without metadata to read its
version. `register()` hides them (sys.modules entries of None), as ComfyUI's sys.path does.
"""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


FOLDERS = ("kernels", "runtime", "cli")  # not `nodes`: that top-level name is ComfyUI's


def register():
    """The `qwen_turbo` package, registered but not yet run."""
    for name in FOLDERS:
        spec = importlib.util.find_spec(name) if name not in sys.modules else None
        if spec and spec.origin and Path(spec.origin).resolve().is_relative_to(ROOT):
            sys.modules[name] = None  # `import kernels` fails, find_spec gives None
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
