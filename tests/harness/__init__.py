"""Runs the pack inside the real ComfyUI: locating it, tiny models, a server, workflows."""
