"""Does the model look at the image? Validation scored again with the images taken away.

A VLM can raise its reward through text shortcuts while ignoring the picture, or train on images it
cannot see; a benchmark after training is the usual first sign. Here, at every validation, a slice
of the validation prompts that have images (`trainer.val_blind_rows`, the first ones in file order)
is generated twice more, greedily as validation is:
    blind    each image replaced by a uniform grey image of the same size;
    swapped  each image replaced by an image of the next row in the slice, resized to this one's size.
The sizes stay, so the prompt's image tokens and positions are unchanged: only the pixels differ.
Logged: `val/blind_<part>` and `val/swapped_<part>` (part: `accuracy` when the reward returns it,
else `overall`) and the gaps `val/blind_gap`, `val/swapped_gap` = the slice's score with its real
images minus that score. A model that uses the image has a blind score near chance and a gap that
grows with its accuracy; a warning fires when the validation score has risen by `RISE` since the
first validation but the blind gap is under `SMALL_GAP`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from PIL import Image

from vlrl.batch.rows import PromptBatch
from vlrl.data.encoded_images import EncodedImage, from_pixels

RISE = 0.1  # validation score gained since the first validation
SMALL_GAP = 0.05  # real minus blind score under which the warning fires
GREY = (128, 128, 128)


def image_slice(prompts: PromptBatch, rows: int) -> PromptBatch | None:
    """The first `rows` prompts of `prompts` that have images (None: none has)."""
    with_images = [i for i, images in enumerate(prompts.images) if images][:rows]
    return prompts.select(with_images) if with_images else None


def blanked(prompts: PromptBatch) -> PromptBatch:
    """`prompts` with each image replaced by a grey one of the size the model sees."""
    return replace(prompts, images=[[_grey(image) for image in row] for row in prompts.images])


def swapped(prompts: PromptBatch) -> PromptBatch:
    """`prompts` with row i's images taken from row i+1 (cyclically; image k from that row's image k
    modulo its count), each resized to the size of the image it replaces. One row keeps its own."""
    rows = prompts.images
    return replace(
        prompts,
        images=[
            [
                _resized(rows[(i + 1) % len(rows)][k % len(rows[(i + 1) % len(rows)])], image)
                for k, image in enumerate(row)
            ]
            for i, row in enumerate(rows)
        ],
    )


def _grey(image: EncodedImage) -> EncodedImage:
    return from_pixels(Image.new("RGB", image.size, GREY), lambda h, w: (h, w))


def _resized(source: EncodedImage, like: EncodedImage) -> EncodedImage:
    return from_pixels(source.pixels(), lambda h, w: (like.height, like.width))


def score_part(parts: Sequence[dict[str, float]]) -> str:
    """The reward part the check reads: `accuracy` when every sample has it, else `overall`."""
    return "accuracy" if parts and all("accuracy" in p for p in parts) else "overall"


def mean_part(parts: Sequence[dict[str, float]], part: str) -> float:
    return sum(float(p[part]) for p in parts) / max(len(parts), 1)


class BlindCheck:
    """The metrics of one validation's check, and the warning (kept: the first validation's score)."""

    def __init__(self) -> None:
        self.first_score: float | None = None

    def metrics(
        self,
        real: Sequence[dict[str, float]],
        blind: Sequence[dict[str, float]],
        swap: Sequence[dict[str, float]],
        val_score: float,
    ) -> tuple[dict[str, float], str | None]:
        """(metrics, warning or None) from the slice's samples with real, blank and swapped images,
        and the whole validation's score (same part) `val_score`."""
        part = score_part(real)
        real_score, blind_score, swapped_score = (mean_part(p, part) for p in (real, blind, swap))
        metrics = {
            f"val/blind_{part}": blind_score,
            f"val/swapped_{part}": swapped_score,
            "val/blind_gap": real_score - blind_score,
            "val/swapped_gap": real_score - swapped_score,
        }
        if self.first_score is None:
            self.first_score = val_score
            return metrics, None
        if val_score - self.first_score >= RISE and real_score - blind_score < SMALL_GAP:
            return metrics, (
                f"validation {part} rose from {self.first_score:.3f} to {val_score:.3f}, but with the images "
                f"blanked it is {blind_score:.3f} on the same prompts (gap {real_score - blind_score:.3f}): the "
                "model may answer from the text alone (docs/data.md, 'Does the model look at the image?')"
            )
        return metrics, None
