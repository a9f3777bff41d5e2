"""Qwen Turbo: fast, memory-safe Qwen-Image-2512 (and friends) in ComfyUI.

`kernels/` and `runtime/` import without ComfyUI; the nodes load only inside it.
"""

WEB_DIRECTORY = "./js"

try:
    import comfy_api.latest  # noqa: F401
except ImportError:  # outside ComfyUI
    pass
else:
    from .nodes import comfy_entrypoint  # noqa: F401
