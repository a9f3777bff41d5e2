"""Optimized Loader: the Qwen-Image or NewBie-image DiT with config from its weights, fp8,
attention and fused blocks; a plain MODEL for every stock node."""

from comfy_api.latest import io

from ..runtime.dit import files, loader
from . import report


class Loader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="QwenTurboLoader",
            display_name="Optimized Loader",
            category="QwenTurbo",
            description=(
                "Loads a Qwen-Image, Qwen-Image-Edit or NewBie-image (Lumina-2) DiT, its shape "
                "read from the weights, with fused kernels, fp8 weights and a faster attention. "
                "The output is a plain MODEL: LoRAs, samplers and offloading work as with "
                "UNETLoader."
            ),
            inputs=[
                io.Combo.Input(
                    "unet_name", options=files.model_names(),
                    tooltip="A file in models/diffusion_models (UNETLoader's list), or a "
                    "diffusers folder there holding transformer/config.json and its shards.",
                ),
                io.Combo.Input(
                    "weight_dtype", options=loader.WEIGHT_DTYPES, default="auto",
                    tooltip="auto: fp8 for fp8 files, else bf16. fp8_e4m3fn halves the VRAM "
                    "of bf16 with a small error; fp8_e4m3fn_fast also computes in fp8 on Ada, "
                    "Hopper and Blackwell: the fastest, with a little more error.",
                ),
                io.Combo.Input(
                    "attention", options=loader.ATTENTION, default="auto",
                    tooltip="auto: ComfyUI's choice. sdpa: PyTorch's, cuDNN first. flash: "
                    "FlashAttention first. fp8: 8-bit attention on Hopper and newer, faster at "
                    "large sizes, a little less exact: FlashAttention-3's where it is installed "
                    "on Hopper, else cuDNN's (needs nvidia-cudnn-frontend, else sdpa). "
                    "fp8_cudnn: cuDNN's alone.",
                ),
                io.Boolean.Input(
                    "fused_kernels", default=True,
                    tooltip="Run each transformer block's norms, RoPE and GELU as fused "
                    "kernels: faster, the same result within rounding. PyTorch without Triton.",
                ),
                io.Combo.Input(
                    "compile", options=loader.COMPILE, default="off",
                    tooltip="regional: torch.compile each transformer block. The first run "
                    "at each size waits for the compile; little gain on top of fused_kernels.",
                ),
                io.Boolean.Input(
                    "quality_guard", default=True, optional=True,
                    tooltip="With fp8 compute or fp8 attention: at the first sampling with this "
                    "file, measure each transformer block against bf16 compute on a small "
                    "picture; blocks that differ by more than quality_threshold run in bf16. "
                    "The result is kept per file; the badge and the log show it.",
                ),
                io.Float.Input(
                    "quality_threshold", default=loader.DEFAULT_THRESHOLD, min=0.01, max=1.0,
                    step=0.01, optional=True,
                    tooltip="The relative error of a block's output above which it runs in bf16.",
                ),
            ],
            outputs=[io.Model.Output(tooltip="The diffusion model, for any sampler node.")],
            hidden=[io.Hidden.unique_id],
        )  # fmt: skip

    @classmethod
    def execute(
        cls, unet_name, weight_dtype, attention, fused_kernels, compile, quality_guard=True,
        quality_threshold=loader.DEFAULT_THRESHOLD,
    ) -> io.NodeOutput:  # fmt: skip
        try:
            with report.measured(cls) as extra:
                model = loader.load(unet_name, weight_dtype, attention, fused_kernels, compile,
                                    quality_guard, quality_threshold)  # fmt: skip
                state = model.model.qwen_turbo
                extra["weights"] = state.weights
                notes = [*state.notes, *([state.fidelity] if state.fidelity else [])]
                if notes:
                    extra["note"] = "; ".join(notes)
        except loader.USER_ERRORS as e:
            raise ValueError(f"Optimized Loader: {unet_name}: {e}") from None
        return io.NodeOutput(model)
