"""Runs the pack inside the real ComfyUI for the tests and benchmarks: locating and setting it
up, tiny models, a server, workflows, CUDA graph stand-ins."""

from .pack import register

register()  # `qwen_turbo` before anything of the pack is imported, so it is imported once
