"""Test-only ComfyUI nodes. Loaded by the test server, never shipped with the pack."""

import torch
from comfy_api.latest import ComfyExtension, io
from typing_extensions import override


class TestConditioning(io.ComfyNode):
    """Stands in for the 7B text encoder: seeded random Qwen-Image text embeddings."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="QwenTurboTestConditioning",
            display_name="Test Conditioning (Qwen Turbo tests)",
            category="QwenTurbo/testing",
            inputs=[
                io.Int.Input("seed", default=0, min=0, max=2**31 - 1),
                io.Int.Input("tokens", default=8, min=1, max=1024),
                io.Int.Input("width", default=3584, min=1, max=8192),
            ],
            outputs=[io.Conditioning.Output()],
        )

    @classmethod
    def execute(cls, seed, tokens, width) -> io.NodeOutput:
        g = torch.Generator().manual_seed(seed)
        cond = torch.randn((1, tokens, width), generator=g)
        return io.NodeOutput([[cond, {}]])


class TestingExtension(ComfyExtension):
    @override
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return [TestConditioning]


async def comfy_entrypoint() -> TestingExtension:
    return TestingExtension()
