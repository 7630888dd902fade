"""Converting every PIL image mode to 8-bit RGB, or refusing it with a reason.

PIL's own `convert("RGB")` is right for most modes but silently wrong for some:
- 16-bit grayscale (`I;16`, `I;16B`, ..., and `I`) is *clipped* to 255, so a 16-bit PNG turns white;
- `F` (float) is clipped the same way;
- alpha is dropped, leaving whatever colour the transparent pixels happen to hold.

Rules (docs/data.md, "Image modes"):
- alpha (RGBA, LA, PA, RGBa, P or L/RGB with a `transparency` key) is composited over white,
  `out = colour * a + 255 * (1 - a)`, as qwen-vl-utils does;
- 16-bit grayscale is scaled to 8 bits, `round(v * 255 / 65535)`; `I` (32-bit int) is read as
  16-bit data and refused when a value lies outside 0..65535;
- `F` is read as [0, 1] data (`round(v * 255)`) and refused when a value lies outside it;
- 1, L, P, RGBX, CMYK, YCbCr, HSV, LAB use PIL's conversion (checked against numpy references in
  tests/data/test_image_modes.py);
- anything else is refused.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

BACKGROUND = (255, 255, 255)
"""Colour transparent pixels are composited onto."""

SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N")
PIL_CONVERTS = ("1", "L", "P", "RGBX", "CMYK", "YCbCr", "HSV", "LAB")
ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")


class ImageModeProblem(ValueError):
    """An image whose pixel values cannot be mapped to RGB unambiguously."""


def _gray_to_rgb(gray: np.ndarray) -> Image.Image:
    """[H, W] uint8 -> RGB image."""
    return Image.fromarray(np.repeat(gray[:, :, None], 3, axis=2), mode="RGB")


def _sixteen_bit(image: Image.Image) -> Image.Image:
    values = np.asarray(image).astype(np.int64)  # [H, W]
    if image.mode == "I" and values.size and (values.min() < 0 or values.max() > 65535):
        raise ImageModeProblem(
            f"32-bit integer image (mode I) with values {values.min()}..{values.max()}; only 16-bit data "
            "(0..65535) is understood: save it as an 8- or 16-bit PNG"
        )
    return _gray_to_rgb(((values * 255 + 32767) // 65535).astype(np.uint8))


def _float(image: Image.Image) -> Image.Image:
    values = np.asarray(image, dtype=np.float64)  # [H, W]
    if values.size and not (np.isfinite(values).all() and values.min() >= 0.0 and values.max() <= 1.0):
        raise ImageModeProblem(
            f"float image (mode F) with values {np.nanmin(values):g}..{np.nanmax(values):g}; only [0, 1] "
            "is understood: scale it to [0, 1] or save it as an 8-bit image"
        )
    return _gray_to_rgb(np.rint(values * 255.0).astype(np.uint8))


def _has_alpha(image: Image.Image) -> bool:
    return image.mode in ALPHA_MODES or (image.mode in ("P", "L", "RGB") and "transparency" in image.info)


def _composite(image: Image.Image) -> Image.Image:
    if image.mode == "La":  # premultiplied; PIL converts it only to LA
        image = image.convert("LA")
    rgba = image.convert("RGBA")  # applies palette / colour-key transparency too
    background = Image.new("RGB", rgba.size, BACKGROUND)
    background.paste(rgba, mask=rgba.getchannel("A"))
    return background


def to_rgb(image: Image.Image) -> Image.Image:
    """8-bit RGB version of a decoded image (raises ImageModeProblem for values it cannot map)."""
    mode = image.mode
    if _has_alpha(image):
        return _composite(image)
    if mode == "RGB":
        return image
    if mode in SIXTEEN_BIT or mode == "I":
        return _sixteen_bit(image)
    if mode == "F":
        return _float(image)
    if mode in PIL_CONVERTS:
        return image.convert("RGB")
    raise ImageModeProblem(f"image mode {mode!r} is not supported: save the image as RGB")
