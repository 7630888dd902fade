"""The start-up image check: every image decoded once (truncated files and bytes are bad rows), its
cache across restarts, and rows that fail later following `data.skip_bad_rows`."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import pytest
from data_helpers import png_bytes, write_jsonl, write_png
from PIL import Image

from vlrl.data import DataError, RLDataset, StatefulPromptLoader, create_dataloaders


def _row(image: object) -> dict:
    return {"problem": "<image>What colour?", "answer": "red", "images": [image]}


@pytest.fixture
def qwen(tokenizer_processor):
    return tokenizer_processor("qwen2_5_vl")


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-40])


def _data(tmp_path, n: int = 4, cut: int | None = None) -> str:
    for i in range(n):
        write_png(tmp_path / f"{i}.png", "red", (64, 64))
    if cut is not None:
        _truncate(tmp_path / f"{cut}.png")
    return write_jsonl(tmp_path / "d.jsonl", [_row(f"{i}.png") for i in range(n)])


def test_truncated_file_is_a_start_up_error(qwen, make_config, tmp_path):
    path = _data(tmp_path, cut=2)
    expected = f"{path} row 2: image '2.png' could not be decoded (image file is truncated"
    with pytest.raises(DataError, match=re.escape(expected) + ".*set data.skip_bad_rows=true"):
        RLDataset(path, make_config(), *qwen)


def test_truncated_inline_bytes_are_a_start_up_error(qwen, make_config, tmp_path):
    import datasets

    rows = [_row({"bytes": png_bytes("red", (64, 64)), "path": None}) for _ in range(3)]
    rows[1]["images"][0]["bytes"] = rows[1]["images"][0]["bytes"][:-40]
    path = str(tmp_path / "d.parquet")
    datasets.Dataset.from_list(rows).to_parquet(path)
    with pytest.raises(
        DataError, match=r"d.parquet row 1: image dict\(path=None, bytes=yes\) could not be decoded"
    ):
        RLDataset(path, make_config(), *qwen)


def test_truncated_images_are_skipped_and_counted(qwen, make_config, tmp_path, caplog):
    path = _data(tmp_path, cut=1)
    with caplog.at_level(logging.WARNING, logger="vlrl.data"):
        dataset = RLDataset(path, make_config(skip_bad_rows=True), *qwen)
    assert len(dataset) == 3 and dataset.skipped_reasons == {"image_decode": 1}
    assert dataset.bad_rows[0].row == 1 and "skipped 1 bad rows {'image_decode': 1}" in caplog.text


def test_validation_set_is_checked_at_start_up(qwen, make_config, tmp_path):
    train = _data(tmp_path / "train")
    val = _data(tmp_path / "val", n=2, cut=0)
    with pytest.raises(DataError, match=r"val/d.jsonl row 0: image '0.png' could not be decoded"):
        create_dataloaders(make_config(train_files=train, val_files=val, rollout_batch_size=2), *qwen)


def test_restart_with_unchanged_files_skips_the_check(qwen, make_config, tmp_path, monkeypatch):
    path = _data(tmp_path, n=4)
    first = RLDataset(path, make_config(), *qwen)
    assert (first.num_images_decoded, first.num_images_cached) == (4, 0)

    def no_decoding(cell, image_dir):
        raise AssertionError("decoded again")

    monkeypatch.setattr("vlrl.data.image_check._decode", no_decoding)
    again = RLDataset(path, make_config(), *qwen)
    assert (again.num_images_decoded, again.num_images_cached) == (0, 4)
    monkeypatch.undo()  # (also undoes the per-test cache folder: name one explicitly below)
    cache = tmp_path / "cache"
    RLDataset(path, make_config(image_check_cache_dir=str(cache)), *qwen)
    # A changed file (size and mtime) is checked again and its truncation found.
    _truncate(tmp_path / "3.png")
    with pytest.raises(DataError, match="row 3: image '3.png' could not be decoded"):
        RLDataset(path, make_config(image_check_cache_dir=str(cache)), *qwen)


def test_inline_bytes_are_cached_by_content(qwen, make_config, tmp_path):
    import datasets

    rows = [_row({"bytes": png_bytes(colour, (64, 64)), "path": None}) for colour in ("red", "blue")]
    path = str(tmp_path / "d.parquet")
    datasets.Dataset.from_list(rows).to_parquet(path)
    cache = str(tmp_path / "cache")
    assert RLDataset(path, make_config(image_check_cache_dir=cache), *qwen).num_images_decoded == 2
    assert RLDataset(path, make_config(image_check_cache_dir=cache), *qwen).num_images_cached == 2


def test_row_failing_later_is_an_error_without_skipping(qwen, make_config, tmp_path):
    path = _data(tmp_path, n=4)
    dataset = RLDataset(path, make_config(), *qwen)
    _truncate(tmp_path / "2.png")  # changed after start-up
    loader = StatefulPromptLoader(dataset, 4, shuffle=False)
    with pytest.raises(
        DataError, match=r"row 2: image '2.png' could not be decoded .*after the start-up check"
    ):
        next(iter(loader))


def test_row_failing_later_is_skipped_and_replaced(qwen, make_config, tmp_path, caplog):
    path = _data(tmp_path, n=6)
    dataset = RLDataset(path, make_config(skip_bad_rows=True), *qwen)
    os.remove(tmp_path / "1.png")
    loader = StatefulPromptLoader(dataset, 3, shuffle=False)
    with caplog.at_level(logging.WARNING, logger="vlrl.data"):
        batches = list(loader)
    assert [b.uids for b in batches] == [[0, 2, 3], [3, 4, 5]]  # row 1 replaced by the next row
    assert len(dataset.late_bad_rows) == 1 and "skipped a row that failed when drawn" in caplog.text


def test_directory_and_decompression_bomb(qwen, make_config, tmp_path, monkeypatch):
    (tmp_path / "folder.png").mkdir()
    path = write_jsonl(tmp_path / "d.jsonl", [_row("folder.png")])
    with pytest.raises(DataError, match=r"row 0: image path .*folder.png is a directory, not an image file"):
        RLDataset(path, make_config(), *qwen)
    write_png(tmp_path / "big.png", "red", (100, 100))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 10,000 pixels > 2 x 1000: a "bomb"
    path = write_jsonl(tmp_path / "e.jsonl", [_row("big.png")])
    with pytest.raises(DataError, match=r"e.jsonl row 0: image .*big.png' is too large to decode safely"):
        RLDataset(path, make_config(), *qwen)
