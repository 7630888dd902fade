"""Images cross from the driver to the ranks as their encoded files, and are decoded on the rank.

The driver's loader used to hand the ranks decoded, resized RGB (an 896x896 image is 2.4 MB; 512
prompts, 1.2 GB a step through the driver's node), where the file is 10-50x smaller. Now a prompt's
image is an `EncodedImage`: the file's own bytes (PNG, JPEG, ...) and the size the model sees. The
resize moves to the rank: the prompt's image-token count is a function of that size alone
(`RowPreparer.target_size`, read from the header), so the driver needs no pixels. The rank decodes
and resizes with the functions the driver used (`load_image`, `resize_image`): identical pixels.

Re-encoded losslessly (PNG) instead, from the smaller of the decoded and the resized image:
- the row holds decoded pixels (a PIL image);
- the format is not one every rank's PIL reads (`PASS_THROUGH`);
- the resize shrinks the image and the file is larger than the resized RGB would be (a big photo
  shrunk to `max_pixels`), or the file has more pixels than PIL's default decompression-bomb limit
  (the rank keeps the default).
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

from vlrl.data.images import ImageProblem, check_exists, image_path, load_image, open_header, resize_image

PASS_THROUGH = frozenset({"PNG", "JPEG", "MPO", "WEBP", "GIF", "BMP", "TIFF"})
"""Formats that cross as the file's bytes (Pillow reads them without plugins)."""
RANK_MAX_PIXELS = 89_478_485  # PIL's default `Image.MAX_IMAGE_PIXELS`, what a rank process has

TargetSize = Callable[[int, int], tuple[int, int]]
"""(height, width) of the original -> (height, width) the model sees."""


@dataclass(eq=False)
class EncodedImage:
    """An image file's bytes and the (height, width) the model sees; `pixels()` decodes it (once:
    the decoded image is kept on the object, and never pickled)."""

    data: bytes
    height: int
    width: int
    _pixels: Image.Image | None = field(default=None, repr=False)

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) the model sees, as PIL's `Image.size`."""
        return self.width, self.height

    def pixels(self) -> Image.Image:
        """The RGB image at (height, width): `load_image` (mode rules) then the bicubic resize."""
        if self._pixels is None:
            self._pixels = resize_image(load_image(self.data, ""), self.height, self.width)
        return self._pixels

    def __getstate__(self) -> dict[str, Any]:
        return {"data": self.data, "height": self.height, "width": self.width, "_pixels": None}


def decoded(value: Any) -> Any:
    """The pixels of an `EncodedImage` (decoded once per object); anything else as it is."""
    return value.pixels() if isinstance(value, EncodedImage) else value


def encode_image(cell: Any, image_dir: str, target_size: TargetSize, verified: bool) -> EncodedImage:
    """What crosses to the ranks for one image cell.

    `verified`: the start-up check decoded this very file or buffer (same path, size and mtime, or
    same SHA-256), so only its header is read here; otherwise it is decoded here too, so a file that
    changed since start-up fails now, naming its row."""
    if isinstance(cell, Image.Image):
        return from_pixels(load_image(cell, image_dir), target_size)
    header = open_header(cell, image_dir)
    try:
        fmt, (width, height) = header.format, header.size
    finally:
        header.close()
    h, w = target_size(height, width)
    data = _read(cell, image_dir)
    # shrunk by the resize to fewer bytes than the file: the resized image crosses instead
    smaller_resized = h * w < width * height and h * w * 3 < len(data)
    if fmt not in PASS_THROUGH or smaller_resized or width * height > RANK_MAX_PIXELS:
        return from_pixels(load_image(cell, image_dir), target_size)
    if not verified:
        load_image(cell, image_dir).close()  # raises ImageProblem naming the file
    return EncodedImage(data, h, w)


def from_pixels(rgb: Image.Image, target_size: TargetSize) -> EncodedImage:
    """PNG of the decoded RGB image, or of the resized one when that has fewer pixels."""
    h, w = target_size(rgb.height, rgb.width)
    if h * w < rgb.height * rgb.width:
        rgb = resize_image(rgb, h, w)
    buffer = io.BytesIO()
    # compress_level 1: lossless either way; the fastest level keeps the driver's encode cheap
    rgb.save(buffer, format="PNG", compress_level=1)
    return EncodedImage(buffer.getvalue(), h, w)


def _read(cell: Any, image_dir: str) -> bytes:
    """The encoded bytes of a path, `{"bytes", "path"}` dict or raw-bytes cell."""
    check_exists(cell, image_dir)
    path = image_path(cell, image_dir)
    if path is None:
        return bytes(cell["bytes"] if isinstance(cell, dict) else cell)
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as err:
        raise ImageProblem(f"image {os.fspath(path)!r} cannot be read ({err})") from err
