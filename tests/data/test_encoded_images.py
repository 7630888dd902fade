"""Images cross to the ranks encoded (the file's own bytes where possible) and decode there to
exactly the pixels the driver's decode-and-resize used to send."""

from __future__ import annotations

import io
import pickle
from functools import partial

import numpy as np
import pytest
import torch
from data_helpers import write_jsonl
from PIL import Image

from vlrl.data import RLDataset
from vlrl.data.encoded_images import EncodedImage, decoded, encode_image
from vlrl.data.images import ImageProblem, load_image, resize_image, smart_resize

rng = np.random.default_rng(0)
# 28-px blocks between 4 and 64 blocks: a 40x30 image grows, a 300x200 one shrinks
target = partial(smart_resize, factor=28, min_pixels=4 * 28 * 28, max_pixels=64 * 28 * 28)


def _noise(mode: str, size: tuple[int, int]) -> Image.Image:
    """[H, W(, C)] random pixels in `mode` (noise, so a lossy or wrong decode shows)."""
    w, h = size
    if mode == "I;16":
        return Image.fromarray(rng.integers(0, 65536, (h, w), dtype=np.uint16))
    if mode == "1":
        return _noise("L", size).convert("1")
    if mode == "P":
        image = Image.fromarray(rng.integers(0, 8, (h, w), dtype=np.uint8), mode="P")
        image.putpalette(rng.integers(0, 256, 768, dtype=np.uint8).tolist())
        image.info["transparency"] = 3  # colour-key alpha: composited over white
        return image
    bands = len(Image.new(mode, (1, 1)).getbands())
    shape = (h, w) if bands == 1 else (h, w, bands)
    return Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode=mode)


def _file(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buffer.getvalue()


def _today(cell: object) -> Image.Image:
    """What the driver's loader sent before: decoded, converted to RGB and resized there."""
    rgb = load_image(cell, "")
    return resize_image(rgb, *target(rgb.height, rgb.width))


def _on_rank(image: EncodedImage) -> Image.Image:
    """What a rank decodes from the object store (pickled as Ray does)."""
    return decoded(pickle.loads(pickle.dumps(image)))


CASES = [
    ("JPEG", "RGB"), ("JPEG", "L"), ("JPEG", "CMYK"), ("PNG", "RGB"), ("PNG", "RGBA"), ("PNG", "L"),
    ("PNG", "LA"), ("PNG", "P"), ("PNG", "I;16"), ("WEBP", "RGB"), ("GIF", "P"), ("BMP", "RGB"),
]  # fmt: skip


@pytest.mark.parametrize("fmt,mode", CASES)
@pytest.mark.parametrize("size", [(40, 30), (56, 112), (300, 200)])
def test_file_bytes_decode_to_todays_pixels(fmt, mode, size):
    data = _file(_noise(mode, size), fmt)
    encoded = encode_image(data, "", target, verified=True)
    expected = _today(data)
    assert encoded.size == expected.size and encoded.size == (encoded.width, encoded.height)
    got = _on_rank(encoded)
    assert got.mode == "RGB" and np.array_equal(np.asarray(got), np.asarray(expected))
    if size != (300, 200):  # not shrunk: the file's own bytes cross
        assert encoded.data == data


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "LA", "P", "I;16", "1"])
@pytest.mark.parametrize("size", [(40, 30), (300, 200)])
def test_decoded_pixels_cross_as_lossless_png(mode, size):
    image = _noise(mode, size)
    encoded = encode_image(image, "", target, verified=False)
    assert encoded.data.startswith(b"\x89PNG")
    got = _on_rank(encoded)
    assert np.array_equal(np.asarray(got), np.asarray(_today(image)))
    # the smaller of the two is encoded: the original when the model's size is larger, else the resized
    with Image.open(io.BytesIO(encoded.data)) as png:
        assert png.size == (size if size == (40, 30) else encoded.size)


def test_a_file_larger_than_its_resized_pixels_crosses_resized():
    data = _file(_noise("RGB", (900, 600)), "BMP")  # 1.6 MB uncompressed, shrunk to ~50k pixels
    encoded = encode_image(data, "", target, verified=True)
    assert encoded.data.startswith(b"\x89PNG") and len(encoded.data) < len(data) / 5
    assert np.array_equal(np.asarray(_on_rank(encoded)), np.asarray(_today(data)))


def test_paths_and_dicts_cross_as_the_file(tmp_path):
    path = tmp_path / "a.jpg"
    path.write_bytes(_file(_noise("RGB", (80, 60)), "JPEG"))
    for cell in ("a.jpg", str(path), {"path": str(path), "bytes": None}, {"bytes": path.read_bytes()}):
        encoded = encode_image(cell, str(tmp_path), target, verified=True)
        assert encoded.data == path.read_bytes()
        assert np.array_equal(np.asarray(decoded(encoded)), np.asarray(_today(str(path))))


def test_decoded_once_and_never_pickled():
    encoded = encode_image(_file(_noise("RGB", (40, 30)), "PNG"), "", target, verified=True)
    first = decoded(encoded)
    assert decoded(encoded) is first  # one decode per object: the rank keeps one object per reference
    assert len(pickle.dumps(encoded)) < len(encoded.data) + 200  # the pixels stay on the rank
    assert decoded(first) is first  # anything else (a tool's PIL image) passes through


def test_an_unverified_file_is_decoded_on_the_driver(tmp_path):
    data = _file(_noise("RGB", (56, 56)), "PNG")
    (tmp_path / "t.png").write_bytes(data[:-40])  # truncated: the header still reads
    assert encode_image("t.png", str(tmp_path), target, verified=True).data == data[:-40]
    with pytest.raises(ImageProblem, match="t.png"):
        encode_image("t.png", str(tmp_path), target, verified=False)


def test_dataset_images_decode_to_todays_pixels_and_pixel_values(tmp_path, tokenizer_processor, make_config):
    """Through `RLDataset` (its real target sizes): JPEG and PNG sources, RGBA / L / P modes."""
    tokenizer, processor = tokenizer_processor("qwen2_5_vl")
    sources = {"a.jpg": ("JPEG", "RGB", (300, 200)), "b.png": ("PNG", "RGBA", (40, 30)),
               "c.png": ("PNG", "L", (56, 84)), "d.png": ("PNG", "P", (90, 70))}  # fmt: skip
    for name, (fmt, mode, size) in sources.items():
        (tmp_path / name).write_bytes(_file(_noise(mode, size), fmt))
    rows = [{"problem": "<image><image>two", "answer": "1", "images": ["a.jpg", "b.png"]},
            {"problem": "<image>one", "answer": "2", "images": ["c.png"]},
            {"problem": "<image>one", "answer": "3", "images": ["d.png"]}]  # fmt: skip
    config = make_config(image_dir=str(tmp_path), min_pixels=8 * 28 * 28, max_pixels=40 * 28 * 28)
    dataset = RLDataset(write_jsonl(tmp_path / "d.jsonl", rows), config, tokenizer, processor)
    for i, row in enumerate(rows):
        sample = dataset[i]
        for cell, encoded in zip(row["images"], sample.images):
            rgb = load_image(cell, str(tmp_path))
            today = resize_image(rgb, *dataset.prep.target_size(rgb.height, rgb.width))
            rank = _on_rank(encoded)
            assert np.array_equal(np.asarray(rank), np.asarray(today))
            assert encoded.data == (tmp_path / cell).read_bytes()
            values = [processor.image_processor(images=[im], do_resize=False, return_tensors="pt")
                      for im in (today, rank)]  # fmt: skip
            assert torch.equal(values[0]["pixel_values"], values[1]["pixel_values"])


def test_rows_in_flight_keep_their_encoded_images_through_a_checkpoint(tmp_path):
    """Asynchronous mode writes the generation in flight with its images (`AsyncRollout.save`,
    torch.save) and a resume publishes them again: encoded images survive as bytes."""
    encoded = encode_image(_file(_noise("RGB", (40, 30)), "JPEG"), "", target, verified=True)
    pixels = decoded(encoded)
    torch.save({"images": [[encoded]]}, tmp_path / "in_flight.pt")
    loaded = torch.load(tmp_path / "in_flight.pt", weights_only=False)["images"][0][0]
    assert isinstance(loaded, EncodedImage) and loaded.data == encoded.data and loaded._pixels is None
    assert np.array_equal(np.asarray(decoded(loaded)), np.asarray(pixels))


def test_the_engine_and_vision_cache_take_encoded_images_too(tokenizer_processor):
    """Batches built without a rank's fetch (tests, tools) hand the engine and the actor's vision
    cache encoded images: they decode them where they use them, to the same inputs."""
    from vlrl.rollout.vllm_inputs import ImageIds, vllm_request
    from vlrl.workers.vision import VisionCache

    encoded = encode_image(_file(_noise("RGB", (40, 30)), "JPEG"), "", target, verified=True)
    pixels = decoded(encoded)
    ids = ImageIds()
    request = vllm_request([1, 2], [encoded], image_ids=ids)
    assert request["multi_modal_data"]["image"] == [pixels]
    assert request["multi_modal_uuids"]["image"] == [ids(pixels)]
    image_processor = tokenizer_processor("qwen2_5_vl")[1].image_processor
    a, b = VisionCache(image_processor).sample([encoded]), VisionCache(image_processor).sample([pixels])
    assert a is not None and b is not None and all(torch.equal(x, y) for x, y in zip(a, b))
