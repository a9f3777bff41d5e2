"""The Qwen-Image DiT: reading checkpoints (`files`), what they say (`config`), converting
their weights (`convert`), fp8 Linear ops (`fp8`), the fused transformer block (`blocks`),
attention backends (`attention`), streaming offloaded weights (`streaming`), cond and uncond
in lockstep where the weights stream (`lockstep`), the ModelPatcher (`patcher`), and building
the MODEL the Optimized Loader returns (`loader`)."""
