"""Runs the pack inside the real ComfyUI: locating it, tiny models, a server, workflows."""

from .pack import register

register()  # `qwen_turbo` before anything of the pack is imported, so it is imported once
