"""Pure torch + Triton ops. Never imports ComfyUI."""
