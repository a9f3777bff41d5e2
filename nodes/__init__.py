"""The pack's V3 nodes. Node ids are saved in users' workflows: never rename them."""

from comfy_api.latest import ComfyExtension, io
from typing_extensions import override

from .graph_sampler import CUDAGraphSampler
from .loader import Loader
from .multigpu import MultiGPU
from .save_image import SaveImage
from .vae_patches import FusedNormPatch, TextureUpsample
from .vae_tiling import VAEDecodeTiled, VAEEncodeTiled

NODES: list[type[io.ComfyNode]] = [
    Loader,
    CUDAGraphSampler,
    FusedNormPatch,
    TextureUpsample,
    VAEDecodeTiled,
    VAEEncodeTiled,
    MultiGPU,
    SaveImage,
]


class QwenTurboExtension(ComfyExtension):
    @override
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return NODES


async def comfy_entrypoint() -> QwenTurboExtension:
    return QwenTurboExtension()
