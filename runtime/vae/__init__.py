"""VAE Tiling and the VAE patches: exact tiled decodes and encodes within a VRAM budget.

- `describe`, `wan`, `autoencoder_kl`, `ops`: a VAE family's decoder or encoder as ops;
- `planner`: the ops split into chains and tiles within a budget; `executor` runs the plan;
- `budget`: the budget asked of ComfyUI, making room, and the retries after running out;
- `tiled`: `decode` and `encode`, as ComfyUI's `VAE.decode` and `VAE.encode`;
- `patches`: VAE clones whose modules run the fused kernels.

Only `budget` and `tiled` import ComfyUI.
"""
