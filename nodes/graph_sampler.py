"""CUDA Graph Sampler: KSampler whose steps (or model calls) replay captured CUDA graphs."""

import comfy.samplers
from comfy_api.latest import io

from ..runtime.graphs import sampling
from . import report

CAPTURE_MODES = sampling.CAPTURE_MODES


class CUDAGraphSampler(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="QwenTurboCUDAGraphSampler",
            display_name="CUDA Graph Sampler",
            category="QwenTurbo",
            description=(
                "KSampler with its steps replayed as CUDA graphs: the same inputs and result, "
                "less CPU overhead. Helps most at small sizes."
            ),
            inputs=[
                io.Model.Input("model", tooltip="The model used for denoising the input latent."),
                io.Int.Input(
                    "seed", default=0, min=0, max=0xFFFFFFFFFFFFFFFF, control_after_generate=True,
                    tooltip="The random seed used for creating the noise.",
                ),
                io.Int.Input(
                    "steps", default=20, min=1, max=10000,
                    tooltip="The number of steps used in the denoising process.",
                ),
                io.Float.Input(
                    "cfg", default=8.0, min=0.0, max=100.0, step=0.1, round=0.01,
                    tooltip="Classifier-free guidance scale, as in KSampler.",
                ),
                io.Combo.Input(
                    "sampler_name", options=comfy.samplers.KSampler.SAMPLERS,
                    tooltip="The sampling algorithm, as in KSampler.",
                ),
                io.Combo.Input(
                    "scheduler", options=comfy.samplers.KSampler.SCHEDULERS,
                    tooltip="How the noise is removed over the steps, as in KSampler.",
                ),
                io.Conditioning.Input("positive", tooltip="What to include in the image."),
                io.Conditioning.Input("negative", tooltip="What to exclude from the image."),
                io.Latent.Input("latent_image", tooltip="The latent image to denoise."),
                io.Float.Input(
                    "denoise", default=1.0, min=0.0, max=1.0, step=0.01,
                    tooltip="The amount of denoising applied; below 1 for img2img and hires "
                    "second passes.",
                ),
                io.Combo.Input(
                    "capture", options=CAPTURE_MODES, default=CAPTURE_MODES[1], optional=True,
                    tooltip="whole CFG step: one graph per step; model forward: one per model "
                    "call; off: KSampler. A capture costs one extra forward and some VRAM; what "
                    "cannot be captured runs as KSampler, and the badge says why.",
                ),
            ],
            outputs=[io.Latent.Output(tooltip="The denoised latent.")],
            hidden=[io.Hidden.unique_id],
        )  # fmt: skip

    @classmethod
    def execute(
        cls, model, seed, steps, cfg, sampler_name, scheduler, positive, negative,
        latent_image, denoise=1.0, capture=CAPTURE_MODES[1],
    ) -> io.NodeOutput:  # fmt: skip
        with report.measured(cls) as extra:
            latent, extra["note"], extra["graphs"] = sampling.sample(
                model, capture, seed, steps, cfg, sampler_name, scheduler, positive, negative,
                latent_image, denoise,
            )  # fmt: skip
        return io.NodeOutput(latent)
