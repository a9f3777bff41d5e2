"""Save Image (fast PNG): ComfyUI's SaveImage, its PNGs encoded on several cores."""

import json
import os

import folder_paths
from comfy.cli_args import args
from comfy_api.latest import io, ui
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from ..runtime import png
from . import report

COMPRESS_LEVEL = 4  # SaveImage's
NAME = "Save Image (fast PNG)"


def png_metadata(prompt, extra_pnginfo) -> PngInfo | None:
    """SaveImage's: the prompt and the workflow as text chunks, none with --disable-metadata."""
    if args.disable_metadata:
        return None
    metadata = PngInfo()
    if prompt is not None:
        metadata.add_text("prompt", json.dumps(prompt))
    for key, value in (extra_pnginfo or {}).items():
        metadata.add_text(key, json.dumps(value))
    return metadata


def save(images, filename_prefix: str, prompt=None, extra_pnginfo=None) -> list[ui.SavedResult]:
    """SaveImage's files, names and metadata. RGB and RGBA pictures go through png.encode;
    others (which SaveImage hands to PIL as they are) through PIL, as SaveImage does. Errors
    name the picture or file and what to change."""
    if len(images) == 0:
        raise ValueError(f"{NAME}: the batch holds no images")
    folder, filename, counter, subfolder, _ = folder_paths.get_save_image_path(
        filename_prefix, folder_paths.get_output_directory(), images[0].shape[1], images[0].shape[0]
    )
    metadata = png_metadata(prompt, extra_pnginfo)
    results = []
    for batch_number, image in enumerate(images):
        file = f"{filename.replace('%batch_num%', str(batch_number))}_{counter:05}_.png"
        path = os.path.join(folder, file)
        pixels = image.cpu().numpy()
        try:
            if pixels.ndim == 3 and pixels.shape[2] in png.COLOR_TYPES:
                data = png.encode(pixels, metadata.chunks if metadata else (), COMPRESS_LEVEL)
                with open(path, "wb") as f:  # encoded first: a failed encode leaves no file
                    f.write(data)
            else:
                picture = Image.fromarray(png.to_bytes(pixels))
                picture.save(path, pnginfo=metadata, compress_level=COMPRESS_LEVEL)
        except TypeError as e:  # PIL has no mode for this layout
            raise ValueError(
                f"{NAME}: a picture of shape {tuple(pixels.shape)} cannot be saved as PNG ({e}); "
                "it takes RGB or RGBA pictures (height, width, 3 or 4)"
            ) from e
        except OSError as e:
            raise OSError(
                f"{NAME}: cannot write {path} ({e}); check the output folder and its free space "
                "(ComfyUI's --output-directory)"
            ) from e
        results.append(ui.SavedResult(file, subfolder, io.FolderType.output))
        counter += 1
    return results


class SaveImage(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="QwenTurboSaveImage",
            display_name=NAME,
            category="QwenTurbo",
            description=(
                "ComfyUI's Save Image with the PNG encoded on several CPU cores: the same "
                "file names, pixels and workflow metadata, saved sooner."
            ),
            inputs=[
                io.Image.Input("images", tooltip="The images to save."),
                io.String.Input(
                    "filename_prefix",
                    default="ComfyUI",
                    tooltip="The prefix for the file to save, as in Save Image (it may "
                    "include %date:yyyy-MM-dd% or %Empty Latent Image.width%).",
                ),
            ],
            hidden=[io.Hidden.prompt, io.Hidden.extra_pnginfo, io.Hidden.unique_id],
            is_output_node=True,
        )

    @classmethod
    def execute(cls, images, filename_prefix="ComfyUI") -> io.NodeOutput:
        with report.measured(cls):
            results = save(images, filename_prefix, cls.hidden.prompt, cls.hidden.extra_pnginfo)
        return io.NodeOutput(ui=ui.SavedImages(results))
