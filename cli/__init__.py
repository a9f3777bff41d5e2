"""The command line (`python -m qwen_turbo`) and tools that run ComfyUI headless: finding
ComfyUI, running a workflow, converting workflows, random full-size weights and the bench."""
