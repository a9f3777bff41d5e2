"""Save Image (fast PNG): the PNG encoder against PIL's decoder and zlib's checks, and the node
against ComfyUI's own SaveImage, in process and through a real server."""

import io
import json
import struct
import zlib

import folder_paths
import numpy as np
import pytest
import torch
from comfy.cli_args import args
from PIL import Image

import nodes
from qwen_turbo.nodes import save_image
from qwen_turbo.runtime import png


def _stock_bytes(image: np.ndarray) -> np.ndarray:
    return np.clip(255.0 * image, 0, 255).astype(np.uint8)


def _chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    """(type, data) of each chunk, each CRC checked."""
    assert data[:8] == png.SIGNATURE
    out, at = [], 8
    while at < len(data):
        (n,) = struct.unpack(">I", data[at : at + 4])
        kind, body = data[at + 4 : at + 8], data[at + 8 : at + 8 + n]
        (crc,) = struct.unpack(">I", data[at + 8 + n : at + 12 + n])
        assert crc == zlib.crc32(kind + body), kind
        out.append((kind, body))
        at += 12 + n
    return out


def _predict(kind: int, left: int, up: int, up_left: int) -> int:
    """PNG's predictors, from the spec: Sub, Up, Average, Paeth."""
    if kind == 1:
        return left
    if kind == 2:
        return up
    if kind == 3:
        return (left + up) // 2
    p = left + up - up_left
    pa, pb, pc = abs(p - left), abs(p - up), abs(p - up_left)
    return left if pa <= pb and pa <= pc else up if pb <= pc else up_left


def _unfilter(rows: np.ndarray, channels: int) -> np.ndarray:
    """The filters undone, byte by byte, as a decoder does."""
    out = np.zeros((rows.shape[0], rows.shape[1] - 1), np.int64)
    for y, row in enumerate(rows):
        for x, v in enumerate(row[1:].astype(np.int64)):
            left = out[y, x - channels] if x >= channels else 0
            up = out[y - 1, x] if y else 0
            up_left = out[y - 1, x - channels] if y and x >= channels else 0
            out[y, x] = (v + _predict(int(row[0]), left, up, up_left)) % 256
    return out.astype(np.uint8)


@pytest.mark.host_independent
@pytest.mark.parametrize("shape", [(1, 1, 3), (7, 5, 4), (131, 97, 3), (40, 3, 3), (33, 64, 4)])
@pytest.mark.parametrize("dtype", [np.uint8, np.float32])
def test_encode_decodes_to_the_pixels(monkeypatch, shape, dtype):
    """Odd sizes, several parts of rows (16 per part here), RGB and RGBA, bytes or floats
    (SaveImage's conversion, out-of-range values clipped): PIL decodes the same pixels, every
    chunk's CRC holds, and zlib's own check (adler32) passes on the joined parts."""
    monkeypatch.setattr(png, "PART_ROWS", 16)
    g = np.random.default_rng(sum(shape))
    image = g.integers(0, 256, shape, dtype=np.uint8) if dtype == np.uint8 else (
        g.random(shape, dtype=np.float32) * 1.2 - 0.1)  # fmt: skip
    expected = image if dtype == np.uint8 else _stock_bytes(image)
    data = png.encode(image, [(b"tEXt", b"prompt\0{}", False)])
    decoded = Image.open(io.BytesIO(data))
    assert decoded.mode == ("RGB" if shape[2] == 3 else "RGBA")
    assert np.array_equal(np.asarray(decoded), expected)
    assert decoded.text == {"prompt": "{}"}
    kinds = [k for k, _ in _chunks(data)]
    assert kinds == [b"IHDR", b"tEXt", b"IDAT", b"IEND"]
    rows = zlib.decompress(dict(_chunks(data))[b"IDAT"])  # checks adler32
    rows = np.frombuffer(rows, np.uint8).reshape(shape[0], -1)
    assert np.array_equal(_unfilter(rows, shape[2]), expected.reshape(shape[0], -1))


@pytest.mark.host_independent
def test_each_row_takes_the_cheapest_filter():
    """Every row's filter is one whose output (as signed bytes) sums smallest of the four,
    each byte as the spec's predictor gives it: a ramp with noise, the row above given."""
    g = np.random.default_rng(1)
    y, x = np.mgrid[0:6, 0:9]
    raw = ((x * 7 + y * 11)[..., None] + g.integers(0, 9, (6, 9, 3))).astype(np.uint8)
    raw = raw.reshape(6, -1)
    rows = png.filtered_rows(raw[1:], raw[0], 3)
    full = raw.astype(np.int64)
    for r, row in enumerate(rows, start=1):
        costs = {}
        for kind in (1, 2, 3, 4):
            filtered = [
                (full[r, i] - _predict(kind, full[r, i - 3] if i >= 3 else 0, full[r - 1, i],
                                       full[r - 1, i - 3] if i >= 3 else 0)) % 256
                for i in range(raw.shape[1])
            ]  # fmt: skip
            costs[kind] = (sum(min(b, 256 - b) for b in filtered), filtered)
        assert costs[row[0]][0] == min(c for c, _ in costs.values()), (r, row[0], costs)
        assert list(row[1:]) == costs[row[0]][1]


@pytest.mark.host_independent
def test_compresses_as_pil_does():
    """A smooth picture with noise: no larger than PIL's file at SaveImage's level, by 1%."""
    y, x = np.mgrid[0:512, 0:640]
    base = np.sin(x / 40.0) * 60 + np.cos(y / 55.0) * 50 + 128
    noise = np.random.default_rng(0).normal(0, 6, (512, 640, 3))
    image = np.clip(np.stack([base, base * 0.7, 255 - base], -1) + noise, 0, 255).astype(np.uint8)
    ours = len(png.encode(image))
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="png", compress_level=4)
    assert ours <= 1.01 * len(buf.getvalue()), (ours, len(buf.getvalue()))


@pytest.fixture
def output_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(folder_paths, "output_directory", str(tmp_path))
    return tmp_path


def _texts(path) -> dict:
    return dict(Image.open(path).text)


@pytest.mark.parametrize("channels", [3, 4, 1])
def test_save_writes_what_comfyuis_save_image_writes(output_dir, channels):
    """A batch of 2 with a prompt and a workflow: the same names in the same folder, the same
    pixels and text chunks as SaveImage's files. One channel (not RGB or RGBA) goes through
    PIL as SaveImage does."""
    images = torch.rand((2, 37, 53, channels), generator=torch.Generator().manual_seed(channels))
    prompt, extra = {"1": {"class_type": "X", "inputs": {}}}, {"workflow": {"nodes": ["é"]}}
    if channels == 1:  # PIL takes a 2-D array for grey
        images = images[..., 0]
    stock = nodes.SaveImage().save_images(images, "stock/pic", prompt, extra)["ui"]["images"]
    ours = save_image.save(images, "ours/pic", prompt, extra)
    assert [r["filename"] for r in ours] == [r["filename"] for r in stock]
    assert [r["filename"] for r in ours] == ["pic_00001_.png", "pic_00002_.png"]
    assert [r["subfolder"] for r in ours] == ["ours", "ours"]
    assert {r["type"] for r in ours} == {"output"}
    for a, b in zip(stock, ours, strict=True):
        a, b = output_dir / "stock" / a["filename"], output_dir / "ours" / b["filename"]
        assert np.array_equal(np.asarray(Image.open(a)), np.asarray(Image.open(b)))
        texts = {"prompt": json.dumps(prompt), "workflow": json.dumps(extra["workflow"])}
        assert _texts(a) == _texts(b) == texts
    # the counter goes on as SaveImage's does
    assert save_image.save(images[:1], "ours/pic")[0]["filename"] == "pic_00003_.png"


def test_bad_pictures_and_folders_are_named(output_dir, monkeypatch):
    """An empty batch, a picture PIL has no mode for, and a folder that cannot be written give
    errors naming them; a failed encode leaves no empty file behind."""
    with pytest.raises(ValueError, match="the batch holds no images"):
        save_image.save(torch.rand((0, 8, 8, 3)), "pic")
    with pytest.raises(ValueError, match=r"shape \(8, 8, 1\) cannot be saved as PNG"):
        save_image.save(torch.rand((1, 8, 8, 1)), "pic")

    def broken(*args):
        raise RuntimeError("encode failed")

    with monkeypatch.context() as m:
        m.setattr(png, "encode", broken)
        with pytest.raises(RuntimeError, match="encode failed"):
            save_image.save(torch.rand((1, 8, 8, 3)), "pic")
    assert not list(output_dir.glob("*.png"))
    missing = output_dir / "gone"
    real = folder_paths.get_save_image_path
    monkeypatch.setattr(
        folder_paths, "get_save_image_path", lambda *a: (str(missing), *real(*a)[1:])
    )
    with pytest.raises(OSError, match=r"cannot write .*gone.*check the output folder"):
        save_image.save(torch.rand((1, 8, 8, 3)), "pic")


def test_disable_metadata_writes_no_text(output_dir, monkeypatch):
    monkeypatch.setattr(args, "disable_metadata", True)
    (saved,) = save_image.save(torch.rand((1, 8, 8, 3)), "pic", {"1": {}}, {"workflow": {}})
    assert _texts(output_dir / saved["filename"]) == {}


def test_node_in_a_workflow_saves_as_save_image(comfy_server):
    """Through ComfyUI's server: LoadImage of a noisy picture into SaveImage and Save Image
    (fast PNG); the executor's prompt and the client's workflow reach both files alike, and
    the UI lists the file."""
    g = np.random.default_rng(3)
    (comfy_server.base / "input").mkdir(exist_ok=True)
    Image.fromarray(g.integers(0, 256, (45, 70, 3), dtype=np.uint8)).save(
        comfy_server.base / "input" / "noise.png"
    )
    prompt = {
        "1": {"class_type": "LoadImage", "inputs": {"image": "noise.png"}},
        "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": "s"}},
        "3": {"class_type": "QwenTurboSaveImage",
              "inputs": {"images": ["1", 0], "filename_prefix": "fast"}},
    }  # fmt: skip
    workflow = {"nodes": [], "links": [], "version": 0.4}
    entry = comfy_server.run(prompt, extra_data={"extra_pnginfo": {"workflow": workflow}})
    (stock,) = comfy_server.images(entry, "2")
    (ours,) = comfy_server.images(entry, "3")
    assert ours.name.startswith("fast_") and ours.suffix == ".png"
    assert np.array_equal(np.asarray(Image.open(stock)), np.asarray(Image.open(ours)))
    assert _texts(stock) == _texts(ours)
    assert json.loads(_texts(ours)["workflow"]) == workflow
    assert json.loads(_texts(ours)["prompt"])["3"]["class_type"] == "QwenTurboSaveImage"
