"""Multi-GPU: a Qwen-Image MODEL whose model calls run on several GPUs of this machine."""

import logging

from comfy_api.latest import io

from ..runtime import log_once, multigpu
from . import report

log = logging.getLogger(__name__)


class MultiGPU(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="QwenTurboMultiGPU",
            display_name="Multi-GPU",
            category="QwenTurbo",
            description=(
                "Runs the Qwen-Image DiT on several GPUs of this machine: one worker process "
                "per extra GPU holds a copy of the DiT (weights and LoRAs come from this one "
                "over NCCL) and takes a share of every model call. The output is a plain "
                "MODEL for KSampler and the CUDA Graph Sampler, with the same result."
            ),
            inputs=[
                io.Model.Input("model", tooltip="A Qwen-Image DiT, LoRAs applied or not."),
                io.Int.Input(
                    "gpus", default=2, min=1, max=16,
                    tooltip="GPUs to use, this process's first. Each extra GPU holds a whole "
                    "copy of the DiT (about 20 GiB in fp8, 38 GiB in bf16) and one worker "
                    "process, started on the first run and kept for the next ones. 1: the "
                    "model runs as it is.",
                ),
                io.Combo.Input(
                    "mode", options=multigpu.MODES, default="auto",
                    tooltip="cfg-parallel: cond and uncond of a guided step on different GPUs "
                    "(no gain at CFG 1). sequence-parallel: each GPU takes a share of the "
                    "image and text tokens, attention exchanges them (all-to-all over the "
                    "heads where the GPU count divides the 24 heads, else each GPU gathers "
                    "every token's keys and values); gains at CFG 1 too, at large sizes most. "
                    "both / auto: CFG groups first, sequence parallel inside each (4 GPUs at "
                    "CFG > 1: 2 groups of 2).",
                ),
            ],
            outputs=[io.Model.Output(tooltip="The model, for any sampler node.")],
            hidden=[io.Hidden.unique_id],
        )  # fmt: skip

    @classmethod
    def execute(cls, model, gpus, mode) -> io.NodeOutput:
        with report.measured(cls) as extra:
            devices, note = multigpu.cuda_devices(model.load_device, gpus)
            if devices:
                model = multigpu.parallel(model, devices, mode)
                extra["gpus"] = ", ".join(devices)
            if note:
                extra["note"] = note
            if note and gpus > 1:  # fewer than asked for: say so where no badge is seen too
                log_once(log, logging.WARNING, f"Multi-GPU: {note}")
        return io.NodeOutput(model)
