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
                "Runs the Qwen-Image DiT on several GPUs of this machine, each taking a share "
                "of every model call. The output is a plain MODEL for any sampler."
            ),
            inputs=[
                io.Model.Input("model", tooltip="A Qwen-Image DiT, LoRAs applied or not."),
                io.Int.Input(
                    "gpus", default=2, min=1, max=16,
                    tooltip="GPUs to use, ComfyUI's own first. Each extra GPU holds a whole "
                    "copy of the DiT in a worker process kept between runs; 1: the model as it is.",
                ),
                io.Combo.Input(
                    "mode", options=multigpu.MODES, default="auto",
                    tooltip="cfg-parallel: cond and uncond on different GPUs, exact, no gain "
                    "at CFG 1. sequence-parallel: the tokens split between GPUs, gains at any "
                    "CFG, rounding like another attention kernel. both / auto: CFG first, then "
                    "sequence.",
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
