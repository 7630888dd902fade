"""Every PIL image mode becomes the right 8-bit RGB pixels (compared with numpy references on the
raw values), or is refused with a reason."""

from __future__ import annotations

import colorsys
import io

import numpy as np
import pytest
from PIL import Image

from vlrl.data.image_modes import ImageModeProblem, to_rgb
from vlrl.data.images import ImageProblem, load_image

SIZE = (16, 12)  # (W, H)
rng = np.random.default_rng(0)


def _u8(*channels: int) -> np.ndarray:
    shape = (SIZE[1], SIZE[0], channels[0]) if channels else (SIZE[1], SIZE[0])
    return rng.integers(0, 256, size=shape, dtype=np.uint8)


def _over_white(colour: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    """[H, W, 3] colour composited over white with [H, W] alpha (both 0..255)."""
    a = alpha[..., None].astype(np.float64) / 255.0
    return colour.astype(np.float64) * a + 255.0 * (1.0 - a)


def _gray3(gray: np.ndarray) -> np.ndarray:
    return np.repeat(gray[..., None].astype(np.float64), 3, axis=2)


def _palette_image(alpha_index: int | None = None) -> tuple[Image.Image, np.ndarray, np.ndarray]:
    indices = rng.integers(0, 8, size=(SIZE[1], SIZE[0]), dtype=np.uint8)
    palette = rng.integers(0, 256, size=(256, 3), dtype=np.uint8)
    image = Image.fromarray(indices, mode="P")
    image.putpalette(palette.flatten().tolist())
    if alpha_index is not None:
        image.info["transparency"] = alpha_index
    return image, indices, palette


def _lab_reference(lab: np.ndarray) -> np.ndarray:
    """PIL's 8-bit LAB (bytes: L*255/100, then a and b as signed bytes) -> sRGB, via XYZ (D50) and
    Bradford adaptation to D65."""
    L = lab[..., 0] * 100.0 / 255.0
    a, b = lab[..., 1], lab[..., 2]
    fy = (L + 16.0) / 116.0
    fx, fz = fy + a / 500.0, fy - b / 200.0

    def finv(t):
        return np.where(t > 6 / 29, t**3, 3 * (6 / 29) ** 2 * (t - 4 / 29))

    xyz_d50 = np.stack([finv(fx) * 0.96422, finv(fy), finv(fz) * 0.82521], axis=-1)
    bradford_d50_to_d65 = np.array(
        [
            [0.9555766, -0.0230393, 0.0631636],
            [-0.0282895, 1.0099416, 0.0210077],
            [0.0122982, -0.0204830, 1.3299098],
        ]
    )
    xyz_to_srgb = np.array(
        [
            [3.2404542, -1.5371385, -0.4985314],
            [-0.9692660, 1.8760108, 0.0415560],
            [0.0556434, -0.2040259, 1.0572252],
        ]
    )
    linear = np.clip(xyz_d50 @ bradford_d50_to_d65.T @ xyz_to_srgb.T, 0.0, 1.0)
    srgb = np.where(linear <= 0.0031308, 12.92 * linear, 1.055 * linear ** (1 / 2.4) - 0.055)
    return srgb * 255.0


def _case(mode: str) -> tuple[Image.Image, np.ndarray, float]:
    """(image in `mode`, expected [H, W, 3] float RGB, tolerance in 8-bit levels)."""
    if mode == "L":
        gray = _u8()
        return Image.fromarray(gray, mode="L"), _gray3(gray), 0
    if mode == "1":
        bits = _u8() > 127
        return Image.fromarray(bits), _gray3(bits * 255), 0
    if mode == "RGBX":
        rgbx = _u8(4)
        return Image.fromarray(rgbx, mode="RGBX"), rgbx[..., :3].astype(float), 0
    if mode == "P":
        image, indices, palette = _palette_image()
        return image, palette[indices].astype(float), 0
    if mode == "P+transparency":
        image, indices, palette = _palette_image(alpha_index=3)
        alpha = np.where(indices == 3, 0, 255)
        return image, _over_white(palette[indices], alpha), 0
    if mode == "PA":
        _, indices, palette = _palette_image()
        alpha = _u8()
        image = Image.frombytes("PA", SIZE, np.stack([indices, alpha], axis=-1).tobytes())
        image.putpalette(palette.flatten().tolist())
        return image, _over_white(palette[indices], alpha), 1
    if mode == "LA":
        la = _u8(2)
        return Image.fromarray(la, mode="LA"), _over_white(_gray3(la[..., 0]), la[..., 1]), 1
    if mode == "RGBA":
        rgba = _u8(4)
        return Image.fromarray(rgba, mode="RGBA"), _over_white(rgba[..., :3], rgba[..., 3]), 1
    if mode == "RGBa":
        rgba = _u8(4)
        alpha = rgba[..., 3:].astype(np.float64)
        premultiplied = np.rint(rgba[..., :3] * alpha / 255.0).astype(np.uint8)
        raw = np.concatenate([premultiplied, rgba[..., 3:]], axis=-1)
        # composited premultiplied colour: c_p + 255 * (1 - a)
        expected = premultiplied + 255.0 - alpha
        return Image.frombytes("RGBa", SIZE, raw.tobytes()), expected, 2
    if mode == "CMYK":
        cmyk = _u8(4)
        k = cmyk[..., 3:].astype(np.float64)
        return Image.fromarray(cmyk, mode="CMYK"), (255.0 - cmyk[..., :3]) * (255.0 - k) / 255.0, 1
    if mode == "YCbCr":
        ycc = _u8(3).astype(np.float64)
        y, cb, cr = ycc[..., 0], ycc[..., 1] - 128, ycc[..., 2] - 128  # JFIF full-range
        rgb = np.stack([y + 1.402 * cr, y - 0.344136 * cb - 0.714136 * cr, y + 1.772 * cb], axis=-1)
        return Image.fromarray(ycc.astype(np.uint8), mode="YCbCr"), np.clip(rgb, 0, 255), 2
    if mode == "HSV":
        hsv = _u8(3)
        rgb = [colorsys.hsv_to_rgb(*(hsv[i, j] / 255.0)) for i in range(SIZE[1]) for j in range(SIZE[0])]
        expected = np.array(rgb).reshape(SIZE[1], SIZE[0], 3) * 255.0
        return Image.fromarray(hsv, mode="HSV"), expected, 3
    if mode == "LAB":
        # Mostly inside the sRGB gamut (out-of-gamut clipping is a matter of taste).
        lab = np.stack([_u8() // 2 + 60, *(rng.integers(-30, 31, size=(2, SIZE[1], SIZE[0])))], axis=-1)
        raw = lab.astype(np.int16).astype(np.uint8)  # a, b stored as signed bytes
        image = Image.frombytes("LAB", SIZE, raw.tobytes())
        # PIL's 8-bit LAB -> RGB interpolates on a grid (littlecms-style): a few dark, saturated
        # pixels are off by up to ~15 levels; the mean error is checked separately below.
        return image, _lab_reference(lab.astype(np.float64)), 16
    if mode.startswith("I;16") or mode == "I":
        values = rng.integers(0, 65536, size=(SIZE[1], SIZE[0]))
        dtype = {"I;16": "<u2", "I;16L": "<u2", "I;16B": ">u2", "I": "<i4"}[mode]
        image = Image.frombytes(mode, SIZE, values.astype(dtype).tobytes())
        return image, _gray3(values * 255.0 / 65535.0), 0.5
    if mode == "F":
        values = rng.random((SIZE[1], SIZE[0]))
        image = Image.frombytes("F", SIZE, values.astype("<f4").tobytes())
        return image, _gray3(values * 255.0), 0.5
    raise AssertionError(mode)


MODES = ["L", "1", "RGBX", "P", "P+transparency", "PA", "LA", "RGBA", "RGBa", "CMYK", "YCbCr", "HSV", "LAB",
         "I;16", "I;16L", "I;16B", "I", "F"]  # fmt: skip


@pytest.mark.parametrize("mode", MODES)
def test_mode_converts_like_the_reference(mode):
    image, expected, tolerance = _case(mode)
    assert image.mode == mode.split("+")[0]
    out = to_rgb(image)
    assert out.mode == "RGB" and out.size == SIZE
    error = np.abs(np.asarray(out).astype(np.float64) - expected)
    assert error.max() <= tolerance, (mode, error.max())
    assert error.mean() <= 1.0, (mode, error.mean())


def test_sixteen_bit_png_file_is_scaled_not_clipped(tmp_path):
    """The issue's case: a 16-bit grayscale PNG decoded through load_image (not all white)."""
    values = np.linspace(0, 65535, SIZE[0] * SIZE[1]).reshape(SIZE[1], SIZE[0]).astype(np.uint16)
    Image.fromarray(values).save(tmp_path / "deep.png")
    out = np.asarray(load_image("deep.png", str(tmp_path)))
    assert np.abs(out[..., 0] - np.rint(values.astype(np.float64) * 255 / 65535)).max() == 0
    assert out.min() == 0 and out.max() == 255


def test_colour_key_transparency_in_rgb_png(tmp_path):
    rgb = Image.new("RGB", SIZE, (10, 20, 30))
    rgb.putpixel((0, 0), (1, 2, 3))
    buffer = io.BytesIO()
    rgb.save(buffer, format="PNG", transparency=(1, 2, 3))
    out = load_image(buffer.getvalue(), ".")
    assert out.getpixel((0, 0)) == (255, 255, 255) and out.getpixel((1, 0)) == (10, 20, 30)


@pytest.mark.parametrize(
    "mode, values, match",
    [
        ("I", [-5, 70000], r"mode I\) with values -5..70000; only 16-bit data"),
        ("F", [0.0, 2.5], r"mode F\) with values 0..2.5; only \[0, 1\]"),
        ("F", [0.0, float("nan")], r"mode F\)"),
    ],
)
def test_values_outside_the_understood_range_are_refused(mode, values, match):
    dtype = "<i4" if mode == "I" else "<f4"
    image = Image.frombytes(mode, (2, 1), np.array(values).astype(dtype).tobytes())
    with pytest.raises(ImageModeProblem, match=match):
        to_rgb(image)
    with pytest.raises(ImageProblem, match=match):
        load_image(image, ".")
