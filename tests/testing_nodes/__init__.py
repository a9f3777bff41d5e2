"""Test-only ComfyUI nodes. Loaded by the test server, never shipped with the pack."""

import math

import node_helpers
import torch
from comfy.utils import common_upscale
from comfy_api.latest import ComfyExtension, io
from typing_extensions import override


def _text_inputs() -> list:
    """seed, tokens, width: the random text embeddings both test nodes make."""
    return [
        io.Int.Input("seed", default=0, min=0, max=2**31 - 1),
        io.Int.Input("tokens", default=8, min=1, max=1024),
        io.Int.Input("width", default=3584, min=1, max=8192),
    ]


class TestConditioning(io.ComfyNode):
    """Stands in for the 7B text encoder: seeded random Qwen-Image text embeddings."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="QwenTurboTestConditioning",
            display_name="Test Conditioning (Qwen Turbo tests)",
            category="QwenTurbo/testing",
            inputs=[
                *_text_inputs(),
                io.Int.Input(
                    "pooled",
                    default=0,
                    min=0,
                    max=4096,
                    optional=True,
                    tooltip="a pooled vector's width (NewBie's CLIP: 1024); 0: none",
                ),
            ],
            outputs=[io.Conditioning.Output()],
        )

    @classmethod
    def execute(cls, seed, tokens, width, pooled=0) -> io.NodeOutput:
        g = torch.Generator().manual_seed(seed)
        cond = torch.randn((1, tokens, width), generator=g)
        extra = {"pooled_output": torch.randn((1, pooled), generator=g)} if pooled else {}
        return io.NodeOutput([[cond, extra]])


class TestEditConditioning(io.ComfyNode):
    """Stands in for TextEncodeQwenImageEditPlus: seeded random text embeddings with each
    picture's vision tokens (196: Qwen2.5-VL's for a 392² picture, 14 px patches merged 2x2),
    and the pictures VAE-encoded as that node does (each scaled to about `reference_side`²,
    sides multiples of 8, area filter) as `reference_latents`."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="QwenTurboTestEditConditioning",
            display_name="Test Edit Conditioning (Qwen Turbo tests)",
            category="QwenTurbo/testing",
            inputs=[
                *_text_inputs(),
                io.Int.Input("vision_tokens", default=196, min=0, max=4096, tooltip="per picture"),
                io.Int.Input(
                    "reference_side",
                    default=1024,
                    min=8,
                    max=4096,
                    tooltip="TextEncodeQwenImageEditPlus: 1024",
                ),
                io.Vae.Input("vae", optional=True),
                io.Image.Input("image1", optional=True),
                io.Image.Input("image2", optional=True),
                io.Image.Input("image3", optional=True),
            ],
            outputs=[io.Conditioning.Output()],
        )

    @classmethod
    def execute(
        cls, seed, tokens, width, vision_tokens, reference_side, vae=None, image1=None,
        image2=None, image3=None,
    ) -> io.NodeOutput:  # fmt: skip
        images = [i for i in (image1, image2, image3) if i is not None]
        refs = []
        for image in images if vae is not None else ():
            samples = image.movedim(-1, 1)
            scale = math.sqrt(reference_side**2 / (samples.shape[3] * samples.shape[2]))
            w, h = (round(samples.shape[d] * scale / 8.0) * 8 for d in (3, 2))
            s = common_upscale(samples, w, h, "area", "disabled")
            refs.append(vae.encode(s.movedim(1, -1)[:, :, :, :3]))
        g = torch.Generator().manual_seed(seed)
        cond = [[torch.randn((1, tokens + vision_tokens * len(images), width), generator=g), {}]]
        if refs:
            cond = node_helpers.conditioning_set_values(
                cond, {"reference_latents": refs}, append=True
            )
        return io.NodeOutput(cond)


class TestingExtension(ComfyExtension):
    @override
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return [TestConditioning, TestEditConditioning]


async def comfy_entrypoint() -> TestingExtension:
    return TestingExtension()
