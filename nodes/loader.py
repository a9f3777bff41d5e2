"""Optimized Loader: the Qwen-Image DiT with config from its weights, fp8, attention and fused
blocks; a plain MODEL for every stock node."""

from comfy_api.latest import io

from ..runtime import qwen_dit, qwen_loader
from . import report


class Loader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="QwenTurboLoader",
            display_name="Optimized Loader",
            category="QwenTurbo",
            description=(
                "Loads a Qwen-Image DiT (Qwen-Image, Qwen-Image-Edit 2509 and 2511; a single "
                "file, or a diffusers folder) with width, heads, layers, text width and the "
                "Edit variant read from the weights, and makes its forward "
                "faster: fused block kernels, fp8 weights or fp8 GEMMs, the attention backend "
                "of your choice. The output is a plain MODEL: LoRAs, ModelSamplingAuraFlow, "
                "KSampler and offloading work as with UNETLoader."
            ),
            inputs=[
                io.Combo.Input(
                    "unet_name", options=qwen_loader.model_names(),
                    tooltip="A file in models/diffusion_models (UNETLoader's list), or a "
                    "diffusers folder there holding transformer/config.json and its shards.",
                ),
                io.Combo.Input(
                    "weight_dtype", options=qwen_loader.WEIGHT_DTYPES, default="auto",
                    tooltip="auto: fp8 storage for fp8 files, else bf16. bf16: 38 GiB of "
                    "weights, the reference. fp8_e4m3fn: half the VRAM, bf16 compute, small "
                    "error. fp8_e4m3fn_fast: fp8 GEMMs with per-row activation scales (GPUs "
                    "with fp8 tensor cores: Ada, Hopper, Blackwell), fastest, error about 4%.",
                ),
                io.Combo.Input(
                    "attention", options=qwen_loader.ATTENTION, default="auto",
                    tooltip="auto: ComfyUI's attention (its launch flags decide). sdpa: "
                    "PyTorch SDPA with cuDNN first, the fastest on Hopper. flash: PyTorch's "
                    "FlashAttention-2 first. fp8_cudnn: cuDNN's fp8 attention (Hopper and newer, "
                    "needs `pip install nvidia-cudnn-frontend`; else sdpa): 1.37x faster than "
                    "sdpa at 2512^2; output error about 1% (0.84% on random weights at 2512^2).",
                ),
                io.Boolean.Input(
                    "fused_kernels", default=True,
                    tooltip="Run each transformer block with fused LayerNorm+modulation, "
                    "gated residual, q/k RMSNorm+RoPE and GELU kernels: less memory traffic, "
                    "same result within rounding. Falls back to PyTorch without Triton.",
                ),
                io.Combo.Input(
                    "compile", options=qwen_loader.COMPILE, default="off",
                    tooltip="regional: torch.compile each transformer block (compiles once, "
                    "a minute or two on the first run; recompiles for new sizes).",
                ),
            ],
            outputs=[io.Model.Output(tooltip="The diffusion model, for any sampler node.")],
            hidden=[io.Hidden.unique_id],
        )  # fmt: skip

    @classmethod
    def execute(cls, unet_name, weight_dtype, attention, fused_kernels, compile) -> io.NodeOutput:
        try:
            with report.measured(cls) as extra:
                model = qwen_loader.load(unet_name, weight_dtype, attention, fused_kernels, compile)
                extra["weights"] = model.qwen_turbo_weights
                if model.qwen_turbo_notes:
                    extra["note"] = "; ".join(model.qwen_turbo_notes)
        except (qwen_dit.NotQwenImageDiT, qwen_loader.HostLacks, qwen_loader.Unreadable) as e:
            raise ValueError(f"Optimized Loader: {unet_name}: {e}") from None
        return io.NodeOutput(model)
