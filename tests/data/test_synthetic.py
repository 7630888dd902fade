"""Synthetic shape datasets: deterministic, well-formed, loadable by RLDataset."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from vlrl.data import RLDataset
from vlrl.data.encoded_images import decoded
from vlrl.data.synthetic import COLOURS, make_multi_image_dataset, make_shapes_dataset


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


@pytest.mark.parametrize("task", ["colour", "shape", "count", "mixed"])
def test_shapes_dataset(tmp_path, task):
    train, val = make_shapes_dataset(tmp_path / "a", n_train=12, n_val=4, seed=3, task=task, image_size=48)
    rows = _rows(train)
    assert len(rows) == 12 and len(_rows(val)) == 4
    for row in rows:
        assert row["problem"].startswith("<image>") and len(row["images"]) == 1
        assert row["answer"] == row["answer"].strip().lower() and " " not in row["answer"]
        assert Image.open(tmp_path / "a" / row["images"][0]).size == (48, 48)
    if task == "colour":
        assert {row["answer"] for row in rows} <= set(COLOURS)
        # the answer colour is the colour drawn
        image = Image.open(tmp_path / "a" / rows[0]["images"][0]).convert("RGB")
        assert COLOURS[rows[0]["answer"]] in {colour for _, colour in image.getcolors(4096)}
    if task == "count":
        assert {row["answer"] for row in rows} <= {"1", "2", "3", "4"}
    # deterministic: same seed, same files
    train2, _ = make_shapes_dataset(tmp_path / "b", n_train=12, n_val=4, seed=3, task=task, image_size=48)
    assert _rows(train2) == rows
    assert (tmp_path / "a" / rows[5]["images"][0]).read_bytes() == (
        tmp_path / "b" / rows[5]["images"][0]
    ).read_bytes()


def test_multi_image_dataset_loads(tmp_path, tokenizer_processor, make_config):
    train, _ = make_multi_image_dataset(tmp_path, n_train=6, n_val=2)
    rows = _rows(train)
    assert all(len(r["images"]) == 2 and r["answer"] in ("first", "second") for r in rows)
    dataset = RLDataset(str(train), make_config(), *tokenizer_processor("qwen2_5_vl"))
    sample = dataset[0]
    red_index = 0 if sample.ground_truth == "first" else 1
    assert COLOURS["red"] in {c for _, c in decoded(sample.images[red_index]).getcolors(100000)}
    assert sample.extras == {"task": "multi_image"}


def test_bad_task(tmp_path):
    with pytest.raises(ValueError, match="unknown task"):
        make_shapes_dataset(tmp_path, task="size")


def test_moving_square_videos(tmp_path, tokenizer_processor, make_config):
    import numpy as np

    from vlrl.data.dataset import RLDataset
    from vlrl.data.synthetic import make_moving_square_dataset

    train, _ = make_moving_square_dataset(tmp_path, n_train=8, n_val=2, seed=0)
    tokenizer, processor = tokenizer_processor("qwen2_5_vl")
    dataset = RLDataset(str(train), make_config(), tokenizer, processor)
    answers = []
    for k in range(len(dataset)):
        sample = dataset[k]
        video = sample.videos[0]
        assert len(video.frames) == 4 and video.fps == 2.0
        # the square's centre column (dark pixels on the light background) moves towards the answer
        xs = [np.nonzero(np.asarray(f).min(-1) < 200)[1].mean() for f in video.frames]
        moves = "right" if xs[-1] > xs[0] else "left"
        assert moves == sample.ground_truth and all(np.diff(xs) != 0)
        answers.append(sample.ground_truth)
    assert set(answers) == {"left", "right"}
