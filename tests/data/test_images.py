"""Image cell forms, size probing, decoding and the pixel-bound resize rule."""

from __future__ import annotations

import itertools

import pytest
from data_helpers import image, png_bytes, write_png
from PIL import Image

from vlrl.data.images import (
    ImageProblem,
    check_exists,
    image_list,
    load_image,
    probe_size,
    resize_image,
    smart_resize,
)


def test_smart_resize_matches_qwen_vl_utils():
    from qwen_vl_utils import smart_resize as reference

    sides = [17, 28, 56, 99, 224, 640, 1000, 3000]
    for (h, w), factor in itertools.product(itertools.product(sides, sides), (28, 32)):
        for low, high in ((4 * factor**2, 64 * factor**2), (256 * 256, 1024 * 1024)):
            expected = reference(h, w, factor, low, high)
            ours = smart_resize(h, w, factor, low, high)
            if min(expected) > 0:
                assert ours == expected, (h, w, factor)
            else:  # qwen-vl-utils floors a side to 0 here; we keep one block and stay in budget
                assert min(ours) == factor and ours[0] * ours[1] <= high, (h, w, factor)


@pytest.mark.parametrize("factor", [28, 32])
def test_pixel_bounds_hold(factor):
    low, high = 8 * factor**2, 40 * factor**2
    for h, w in [(10, 10), (20, 900), (900, 20), (4000, 3000), (300, 300), (1, 150), (17, 3000)]:
        rh, rw = smart_resize(h, w, factor, low, high)
        assert rh % factor == 0 and rw % factor == 0
        assert low <= rh * rw <= high, (h, w, rh, rw)


def test_extreme_aspect_ratio_refused():
    with pytest.raises(ImageProblem, match="aspect ratio"):
        smart_resize(1, 300, 28, 784, 10_000)


def test_every_cell_form_decodes(tmp_path):
    path = write_png(tmp_path / "sub" / "a.png", "blue", (30, 20))
    forms = {
        "relative path": "sub/a.png",
        "absolute path": path,
        "file url": "file://" + path,
        "PIL": image("blue", (30, 20)),
        "bytes dict": {"bytes": png_bytes("blue", (30, 20)), "path": None},
        "path dict": {"bytes": None, "path": "sub/a.png"},
        "raw bytes": png_bytes("blue", (30, 20)),
    }
    for name, cell in forms.items():
        assert probe_size(cell, str(tmp_path)) == (30, 20), name
        decoded = load_image(cell, str(tmp_path))
        assert decoded.mode == "RGB" and decoded.size == (30, 20), name
        assert decoded.getpixel((0, 0)) == (0, 0, 255), name


def test_transparent_pixels_become_white():
    rgba = Image.new("RGBA", (4, 4), (255, 0, 0, 0))
    assert load_image(rgba, ".").getpixel((0, 0)) == (255, 255, 255)
    assert load_image(image("red", (4, 4), "L"), ".").mode == "RGB"


def test_missing_and_broken_images(tmp_path):
    with pytest.raises(ImageProblem, match=r"image file .*nope.png does not exist"):
        check_exists("nope.png", str(tmp_path))
    (tmp_path / "fake.png").write_text("not an image")
    with pytest.raises(ImageProblem, match="fake.png is not a readable image"):
        probe_size("fake.png", str(tmp_path))
    with pytest.raises(ImageProblem, match="neither 'bytes' nor 'path'"):
        check_exists({"bytes": None, "path": None}, str(tmp_path))
    with pytest.raises(ImageProblem, match="unsupported image value of type int"):
        check_exists(3, str(tmp_path))
    truncated = png_bytes("red", (64, 64))[:-40]
    with pytest.raises(ImageProblem, match="could not be decoded"):
        load_image(truncated, str(tmp_path))


def test_resize_and_lists():
    img = image("red", (30, 20))
    assert resize_image(img, 20, 30) is img
    assert resize_image(img, 28, 56).size == (56, 28)
    assert (
        image_list(None) == [] and image_list("a.png") == ["a.png"] and image_list(("a", "b")) == ["a", "b"]
    )


def test_unexpected_decoder_errors_are_image_problems(monkeypatch):
    def broken_load(self):
        raise IndexError("tile out of range")

    monkeypatch.setattr("PIL.ImageFile.ImageFile.load", broken_load)
    with pytest.raises(ImageProblem, match=r"could not be decoded \(IndexError: tile out of range\)"):
        load_image(png_bytes(), ".")


def test_easyr1_sizes_at_the_pixel_bounds():
    """EasyR1 scales into the data bounds (truncating), then the processor rounds to its blocks:
    a 180x240 (width x height) image becomes 448x588 (rounding straight to the bound gave 448x616)."""
    from vlrl.data.images import scale_into_bounds

    height, width = scale_into_bounds(240, 180, 262144, 4194304)
    assert (width, height) == (443, 591)
    assert smart_resize(height, width, 28, 56 * 56, 28 * 28 * 16384) == (588, 448)
    assert scale_into_bounds(3000, 4000, None, 1_000_000) == (
        866,
        1154,
    )  # int(3000 * 0.2887), int(4000 * 0.2887)
    assert scale_into_bounds(300, 400, 1000, 10**6) == (300, 400)  # within: unchanged


def test_preparer_gives_easyr1_sizes(tokenizer_processor, make_config):
    """Through the row preparer, with a processor whose own bounds are Qwen2.5-VL's."""
    from vlrl.data.prepare import RowPreparer

    tokenizer, processor = tokenizer_processor("qwen2_5_vl")
    prep = RowPreparer(make_config(min_pixels=262144, max_pixels=4194304), tokenizer, processor)
    prep.processor_bounds = (56 * 56, 28 * 28 * 16384)  # Qwen2.5-VL's image processor defaults
    assert prep.target_size(240, 180) == (588, 448)


def test_relative_paths_from_the_data_folder_or_the_working_directory(tmp_path, monkeypatch):
    """The data file's folder first (vlrl), then the working directory (EasyR1)."""
    from vlrl.data.images import check_exists, image_path

    data_dir, cwd = tmp_path / "data", tmp_path / "run"
    write_png(data_dir / "imgs" / "a.png")
    write_png(cwd / "imgs" / "b.png")
    monkeypatch.chdir(cwd)
    assert image_path("imgs/a.png", str(data_dir)) == str(data_dir / "imgs" / "a.png")
    assert image_path("imgs/b.png", str(data_dir)) == str(cwd / "imgs" / "b.png")
    with pytest.raises(
        ImageProblem, match=r"imgs/c.png does not exist \(nor .*run/imgs/c.png, from the working"
    ):
        check_exists("imgs/c.png", str(data_dir))
    # a hub-style parquet's {path} cell: the message names the folder paths are joined to, and the key
    with pytest.raises(ImageProblem, match=r"are joined to .*data: set data.image_dir to the folder"):
        check_exists({"path": "imgs/d.png", "bytes": None}, str(data_dir))
