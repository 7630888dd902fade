"""A crop/zoom tool for images: the model names a box of the image it sees, the tool returns that
region cut from the row's full-resolution original, enlarged.

Per-row context (the dataset's `tools_kwargs` column, hidden from the model):
    {"zoom_in": {"image_path": "/data/img/0001.png", "shown_size": [588, 448]}}
- `image_path`: the full-resolution original.
- `shown_size`: [width, height] of the image as the model saw it (after the data pipeline's resize);
  the box is in that frame, as Qwen2.5-VL writes boxes (absolute pixels of its input). Leave it out
  when the box is in the original's pixels. examples/prepare_zoom_data.py writes both.

The box is clamped to the image; a box that is not four numbers, is empty or lies outside the image
raises `ValueError` with the reason (the model reads it as the tool's answer, counted in
`multi_turn/tool_errors`). Small boxes are grown around their centre to `MIN_SIDE` original pixels so
the crop is never thinner than one vision patch block.

Declared with its schema in examples/tools/zoom.yaml.
"""

from __future__ import annotations

import math
from typing import Any

from PIL import Image

MIN_SIDE = 28  # original pixels: one 14-pixel patch x 2x2 merge block of Qwen2-VL / Qwen2.5-VL
MAX_ASPECT = 50  # a thinner crop is grown on its short side (Qwen processors refuse ratios > 200)


def zoom_in(
    bbox_2d: list[float], *, image_path: str, shown_size: list[int] | None = None, upscale_to: int = 448
) -> tuple[str, Image.Image]:
    """Zoom into a region of the image: returns the region [x1, y1, x2, y2] enlarged.

    Args:
        bbox_2d: the region as [x1, y1, x2, y2] in pixels of the image you see (top-left, bottom-right)
    """
    original = Image.open(image_path).convert("RGB")
    width, height = original.size
    frame_w, frame_h = _frame(shown_size, width, height)
    x1, y1, x2, y2 = _box(bbox_2d)
    sx, sy = width / frame_w, height / frame_h  # frame pixels -> original pixels
    left, right = _span(x1 * sx, x2 * sx, width, "x")
    top, bottom = _span(y1 * sy, y2 * sy, height, "y")
    left, right = _grow(left, right, max(MIN_SIDE, math.ceil((bottom - top) / MAX_ASPECT)), width)
    top, bottom = _grow(top, bottom, max(MIN_SIDE, math.ceil((right - left) / MAX_ASPECT)), height)
    crop = original.crop((left, top, right, bottom))
    scale = upscale_to / max(crop.size)
    if scale > 1:  # enlarge small regions so the vision tower sees them at a useful size
        crop = crop.resize((round(crop.width * scale), round(crop.height * scale)), Image.Resampling.BICUBIC)
    shown = [round(v) for v in (left / sx, top / sy, right / sx, bottom / sy)]
    return f"zoomed into [{', '.join(map(str, shown))}]", crop


def _frame(shown_size: Any, width: int, height: int) -> tuple[float, float]:
    if shown_size is None:
        return float(width), float(height)
    if not (isinstance(shown_size, (list, tuple)) and len(shown_size) == 2 and min(shown_size) > 0):
        raise ValueError(f"tools_kwargs shown_size must be [width, height], got {shown_size!r}")  # a data bug
    return float(shown_size[0]), float(shown_size[1])


def _box(bbox: Any) -> tuple[float, float, float, float]:
    if not isinstance(bbox, (list, tuple)) or len(bbox) != 4:
        raise ValueError(f"bbox_2d must be four numbers [x1, y1, x2, y2], got {bbox!r}")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in bbox):
        raise ValueError(f"bbox_2d must hold numbers only, got {bbox!r}")
    x1, y1, x2, y2 = (float(v) for v in bbox)
    if x2 <= x1 or y2 <= y1:
        raise ValueError(f"bbox_2d {list(bbox)} is empty: need x1 < x2 and y1 < y2")
    return x1, y1, x2, y2


def _span(lo: float, hi: float, limit: int, axis: str) -> tuple[int, int]:
    """[lo, hi) clamped to [0, limit), in whole pixels; refused when nothing is left."""
    start, end = max(0, math.floor(lo)), min(limit, math.ceil(hi))
    if end <= start:
        raise ValueError(f"the box lies outside the image along {axis}")
    return start, end


def _grow(start: int, end: int, size: int, limit: int) -> tuple[int, int]:
    """Grow [start, end) around its centre to at least `size` pixels (at most the image), within [0, limit)."""
    size = min(size, limit)
    if end - start >= size:
        return start, end
    start = max(0, min((start + end - size) // 2, limit - size))
    return start, start + size
