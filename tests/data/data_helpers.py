"""Helpers shared by the data-pipeline tests: small images and data-file writers."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from PIL import Image


def image(colour: str = "red", size: tuple[int, int] = (56, 56), mode: str = "RGB") -> Image.Image:
    """A plain image."""
    return Image.new(mode, size, colour)


def png_bytes(colour: str = "red", size: tuple[int, int] = (56, 56)) -> bytes:
    """PNG-encoded bytes of a plain image."""
    buffer = io.BytesIO()
    image(colour, size).save(buffer, format="PNG")
    return buffer.getvalue()


def write_png(path: Path, colour: str = "red", size: tuple[int, int] = (56, 56)) -> str:
    """Write a PNG and return its path as str."""
    path.parent.mkdir(parents=True, exist_ok=True)
    image(colour, size).save(path)
    return str(path)


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> str:
    """Write rows as JSON lines and return the path as str."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def write_video(path: Path, colours: list[str], size: tuple[int, int] = (56, 56), fps: int = 4) -> str:
    """Write an MPEG-4 video with one plain frame per colour (PyAV) and return its path as str."""
    import av
    import numpy as np

    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        for colour in colours:
            frame = av.VideoFrame.from_ndarray(np.asarray(image(colour, size)), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return str(path)


def write_empty_video(path: Path) -> str:
    """Write a video file whose one video stream holds no frames, and return its path as str.

    AVI keeps the empty stream in its header (MP4 drops an empty track: it reads as no stream)."""
    import av

    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=4)
        stream.width, stream.height = 56, 56
        stream.pix_fmt = "yuv420p"
        container.start_encoding()  # writes the header with the stream, and no packet follows
    return str(path)
