"""The images taken away at validation: blank and swapped images keep every size (so the prompt's
image tokens stay valid), and the check's metrics and warning by hand."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from vlrl.batch.rows import PromptBatch
from vlrl.data.encoded_images import EncodedImage
from vlrl.trainer.visual_reliance import BlindCheck, blanked, image_slice, swapped


def _image(colour: tuple[int, int, int], width: int, height: int) -> EncodedImage:
    buffer = io.BytesIO()
    Image.new("RGB", (width * 2, height * 2), colour).save(buffer, format="PNG")  # the file is larger
    return EncodedImage(buffer.getvalue(), height, width)


def _prompts(images: list[list[EncodedImage]]) -> PromptBatch:
    n = len(images)
    ids = torch.ones(n, 2, dtype=torch.long)
    return PromptBatch(ids, ids, ids, [[1]] * n, images, ["p"] * n, ["a"] * n, [{}] * n, list(range(n)))


def test_blank_and_swapped_images_keep_every_size() -> None:
    red, green, blue = _image((255, 0, 0), 28, 56), _image((0, 255, 0), 56, 28), _image((0, 0, 255), 28, 28)
    prompts = _prompts([[red], [], [green, blue]])
    rows = image_slice(prompts, 5)
    assert rows is not None and rows.uids == [0, 2]  # the text-only prompt is left out
    assert image_slice(prompts, 1).uids == [0] and image_slice(_prompts([[], []]), 4) is None
    grey = blanked(rows)
    assert [[i.size for i in row] for row in grey.images] == [[(28, 56)], [(56, 28), (28, 28)]]
    assert {colour for row in grey.images for i in row for _, colour in i.pixels().getcolors()} == {
        (128, 128, 128)
    }
    assert rows.images[0][0] is red  # the batch itself is unchanged
    other = swapped(rows)
    assert [[i.size for i in row] for row in other.images] == [[(28, 56)], [(56, 28), (28, 28)]]
    # row 0 gets row 2's first image (green); row 2 gets row 0's only image (red) for both
    colours = [[i.pixels().getpixel((3, 3)) for i in row] for row in other.images]
    assert colours == [[(0, 255, 0)], [(255, 0, 0), (255, 0, 0)]]


def test_the_check_by_hand_and_its_warning() -> None:
    def parts(*accuracy: float) -> list[dict[str, float]]:
        return [{"overall": a, "accuracy": a} for a in accuracy]

    check = BlindCheck()
    metrics, warning = check.metrics(parts(1, 0, 0, 0), parts(0, 0, 0, 0), parts(1, 1, 0, 0), val_score=0.3)
    assert warning is None  # the first validation only sets the baseline
    assert metrics == {"val/blind_accuracy": 0.0, "val/swapped_accuracy": 0.5, "val/blind_gap": 0.25,
                       "val/swapped_gap": -0.25}  # fmt: skip
    # the score rose by 0.5 and the blank images score as well as the real ones: the warning
    metrics, warning = check.metrics(parts(1, 1, 1, 0), parts(1, 1, 0, 1), parts(1, 1, 1, 1), val_score=0.8)
    assert metrics["val/blind_gap"] == 0.0 and warning is not None
    assert "rose from 0.300 to 0.800" in warning and "blanked it is 0.750" in warning
    # risen, but the images matter: no warning
    _, warning = check.metrics(parts(1, 1, 1, 1), parts(0, 0, 1, 0), parts(0, 1, 0, 0), val_score=0.9)
    assert warning is None
    only_overall = [{"overall": 0.5}]
    metrics, _ = BlindCheck().metrics(only_overall, only_overall, only_overall, 0.5)
    assert set(metrics) == {"val/blind_overall", "val/swapped_overall", "val/blind_gap", "val/swapped_gap"}
    assert metrics["val/blind_gap"] == pytest.approx(0.0)
