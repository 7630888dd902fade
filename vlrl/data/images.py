"""Images: the accepted cell forms, cheap size probing, decoding and the Qwen-VL resize rule.

A dataset cell holding one image may be
- a path (str or os.PathLike; relative paths are joined to the image folder, else taken from the
  working directory as EasyR1 does; `file://` allowed),
- a PIL image,
- a dict `{"bytes": ..., "path": ...}` (how parquet files / `datasets.Image` features store images;
  `bytes` wins when present, else `path` is read),
- raw encoded bytes (PNG, JPEG, ...).
"""

from __future__ import annotations

import io
import math
import os
from typing import Any

from PIL import Image, UnidentifiedImageError

from vlrl.data.image_modes import ImageModeProblem, to_rgb

MAX_ASPECT_RATIO = 200  # Qwen-VL refuses images more elongated than this


class ImageProblem(ValueError):
    """An image cell that cannot be used; the message names the image (not the row)."""


def image_list(cell: Any) -> list[Any]:
    """The images of one row as a list (None -> [], a single image -> [image])."""
    if cell is None:
        return []
    if isinstance(cell, (list, tuple)):
        return list(cell)
    return [cell]


def image_path(value: Any, image_dir: str) -> str | None:
    """Filesystem path of a path-like cell (or a dict with only a path); None for in-memory images."""
    if isinstance(value, dict):
        if value.get("bytes") is not None:
            return None
        value = value.get("path")
        if value is None:
            raise ImageProblem("image dict has neither 'bytes' nor 'path'")
    if isinstance(value, (str, os.PathLike)):
        path = os.fspath(value)
        path = path[len("file://") :] if path.startswith("file://") else path
        if os.path.isabs(path):
            return path
        joined = os.path.join(image_dir, path)
        # EasyR1 opens relative paths from the working directory: accept those too
        if not os.path.exists(joined) and os.path.exists(path):
            return os.path.abspath(path)
        return joined
    return None


def describe(value: Any) -> str:
    """Short description of an image cell for error messages."""
    if isinstance(value, (str, os.PathLike)):
        return repr(os.fspath(value))
    if isinstance(value, dict):
        return f"dict(path={value.get('path')!r}, bytes={'yes' if value.get('bytes') else 'no'})"
    if isinstance(value, (bytes, bytearray)):
        return f"<{len(value)} bytes>"
    return type(value).__name__


def check_exists(value: Any, image_dir: str) -> None:
    """Raise ImageProblem when a path-like image does not exist or the form is unknown."""
    if isinstance(value, Image.Image) or (isinstance(value, (bytes, bytearray)) and value):
        return
    path = image_path(value, image_dir)
    if path is None:
        if isinstance(value, dict):
            return
        raise ImageProblem(f"unsupported image value of type {type(value).__name__}")
    if os.path.isdir(path):
        raise ImageProblem(f"image path {path} is a directory, not an image file")
    if not os.path.isfile(path):
        given = value.get("path") if isinstance(value, dict) else value
        given_path = os.fspath(given) if isinstance(given, (str, os.PathLike)) else None
        also = (
            f" (nor {os.path.abspath(given_path)}, from the working directory); relative image paths "
            f"are joined to {image_dir}: set data.image_dir to the folder they are relative to"
            if given_path is not None and not os.path.isabs(given_path)
            else ""
        )
        raise ImageProblem(f"image file {path} does not exist{also}")


def _open(value: Any, image_dir: str) -> Image.Image:
    """Open lazily (header only; pixels decode on `.load()`)."""
    if isinstance(value, Image.Image):
        return value
    check_exists(value, image_dir)
    path = image_path(value, image_dir)
    source: Any = (
        path if path is not None else io.BytesIO(value["bytes"] if isinstance(value, dict) else value)
    )
    try:
        return Image.open(source)
    except (UnidentifiedImageError, OSError) as err:
        where = path if path is not None else describe(value)
        raise ImageProblem(f"image {where} is not a readable image ({err})") from err
    except Image.DecompressionBombError as err:
        raise ImageProblem(_bomb_message(path or value, err)) from err


def open_header(value: Any, image_dir: str) -> Image.Image:
    """The image of a file, dict or bytes cell opened lazily (header read, pixels not decoded);
    the caller closes it. Raises ImageProblem as `load_image` does."""
    return _open(value, image_dir)


def _bomb_message(value: Any, err: Exception) -> str:
    return (
        f"image {describe(value)} is too large to decode safely ({err}); shrink the image, or raise "
        "PIL.Image.MAX_IMAGE_PIXELS if you trust the file"
    )


def probe_size(value: Any, image_dir: str) -> tuple[int, int]:
    """(width, height) read from the image header, without decoding the pixels."""
    image = _open(value, image_dir)
    size = image.size
    if image is not value:  # we opened a file or buffer: release it now
        image.close()
    return size


def load_image(value: Any, image_dir: str) -> Image.Image:
    """Decode an image cell into an RGB PIL image (raises ImageProblem on any decoding error).

    Every mode is converted by `image_modes.to_rgb` (16-bit scaled, alpha over white, ...)."""
    image = _open(value, image_dir)
    try:
        image.load()
        return to_rgb(image)
    except ImageModeProblem as err:
        raise ImageProblem(f"image {describe(value)}: {err}") from err
    except (OSError, ValueError, SyntaxError) as err:
        raise ImageProblem(f"image {describe(value)} could not be decoded ({err})") from err
    except Image.DecompressionBombError as err:  # raised by load() for some formats
        raise ImageProblem(_bomb_message(value, err)) from err
    except MemoryError:
        raise
    except Exception as err:  # a malformed file can make a decoder raise anything (struct.error, ...)
        raise ImageProblem(
            f"image {describe(value)} could not be decoded ({type(err).__name__}: {err})"
        ) from err


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) rounded to multiples of `factor` with min_pixels <= h*w <= max_pixels.

    The qwen-vl-utils rule: round each side to the nearest multiple; if the area is too large,
    scale both sides down by the same ratio (flooring); if too small, up (ceiling). Identical
    results except where qwen-vl-utils would return a zero side.
    """
    if min(height, width) <= 0:
        raise ImageProblem(f"image has an empty side ({width}x{height})")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageProblem(f"image aspect ratio {width}x{height} exceeds {MAX_ASPECT_RATIO}")
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = math.floor(height / beta / factor) * factor
        w_bar = math.floor(width / beta / factor) * factor
        # Very elongated images can floor a side to 0 (qwen-vl-utils returns 0 there): keep one
        # block on the short side and give the long side what the pixel budget allows.
        longest = max(factor, max_pixels // (factor * factor) * factor)
        if h_bar < factor:
            h_bar, w_bar = factor, min(max(w_bar, factor), longest)
        if w_bar < factor:
            w_bar, h_bar = factor, min(max(h_bar, factor), longest)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def scale_into_bounds(
    height: int, width: int, min_pixels: int | None, max_pixels: int | None
) -> tuple[int, int]:
    """(height, width) scaled by one factor so the area is at most `max_pixels` and at least
    `min_pixels` (None: no bound); sides are truncated to integers (so the area may end a little
    inside the bound). Unchanged when already within."""
    if min(height, width) <= 0:
        raise ImageProblem(f"image has an empty side ({width}x{height})")
    if max_pixels is not None and height * width > max_pixels:
        scale = math.sqrt(max_pixels / (height * width))
        height, width = int(height * scale), int(width * scale)
    if min_pixels is not None and height * width < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        height, width = int(height * scale), int(width * scale)
    if min(height, width) <= 0:
        raise ImageProblem(f"image scales to an empty side ({width}x{height}) within the pixel bounds")
    return height, width


def resize_image(image: Image.Image, height: int, width: int) -> Image.Image:
    """Bicubic resize to (height, width); returns the image itself when it already has that size."""
    if image.size == (width, height):
        return image
    return image.resize((width, height), resample=Image.Resampling.BICUBIC)
