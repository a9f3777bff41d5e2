"""Where ComfyUI is: COMFYUI_PATH, then an ancestor folder (this pack in custom_nodes/), then
comfy-cli's default workspace ~/comfy/ComfyUI."""

import os
from pathlib import Path

PACK = Path(__file__).resolve().parent.parent
HOW_TO_PROVIDE = (
    "no ComfyUI found. Set COMFYUI_PATH=/path/to/ComfyUI, put this pack in "
    "ComfyUI/custom_nodes/, or check ComfyUI out at ~/comfy/ComfyUI."
)


def is_comfyui(path: Path) -> bool:
    return (path / "main.py").is_file() and (path / "comfy").is_dir()


def find_comfyui() -> Path | None:
    """COMFYUI_PATH (None if it is not a ComfyUI), an ancestor folder, ~/comfy/ComfyUI."""
    env = os.environ.get("COMFYUI_PATH")
    if env:
        return Path(env).resolve() if is_comfyui(Path(env)) else None
    for parent in PACK.parents:
        if is_comfyui(parent):
            return parent
    home = Path.home() / "comfy" / "ComfyUI"
    return home if is_comfyui(home) else None
