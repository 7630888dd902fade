"""Data file discovery and loading: json, jsonl, parquet, csv, folders, hub names, bad paths."""

from __future__ import annotations

import json
import os

import pytest
from data_helpers import write_jsonl

from vlrl.data.sources import DataError, load_sources, resolve_files

ROWS = [{"problem": "one plus one", "answer": "2", "level": 1}, {"problem": "two", "answer": "b", "level": 2}]


def _write(tmp_path, kind: str) -> str:
    import pandas as pd

    path = tmp_path / f"data.{kind}"
    if kind == "jsonl":
        return write_jsonl(path, ROWS)
    if kind == "json":
        path.write_text(json.dumps(ROWS))
    elif kind == "parquet":
        pd.DataFrame(ROWS).to_parquet(path)
    else:
        pd.DataFrame(ROWS).to_csv(path, index=False)
    return str(path)


@pytest.mark.parametrize("kind", ["json", "jsonl", "parquet", "csv"])
def test_each_file_type_loads(tmp_path, kind):
    path = _write(tmp_path, kind)
    (source,) = load_sources(path, None, "images")
    assert source.name == path and source.image_dir == str(tmp_path)
    assert source.dataset.to_list() == ROWS


def test_folder_and_comma_list(tmp_path):
    write_jsonl(tmp_path / "d" / "b.jsonl", ROWS)
    write_jsonl(tmp_path / "d" / "a" / "x.jsonl", ROWS[:1])
    (tmp_path / "d" / "notes.txt").write_text("ignored")
    found = resolve_files(str(tmp_path / "d"))
    assert [p.split("/d/")[1] for p in found] == ["a/x.jsonl", "b.jsonl"]
    sources = load_sources(f"{tmp_path / 'd'},{tmp_path / 'd' / 'b.jsonl'}", "/imgs", "images")
    assert [s.offset for s in sources] == [0, 1, 3]
    assert all(s.image_dir == "/imgs" for s in sources)


def test_bad_paths(tmp_path):
    (tmp_path / "data.txt").write_text("x")
    with pytest.raises(DataError, match=r"data.txt: unknown file type '.txt'; expected one of .json"):
        resolve_files(str(tmp_path / "data.txt"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"empty: folder has no data files"):
        resolve_files(str(tmp_path / "empty"))
    with pytest.raises(DataError, match=r"missing.jsonl: no such file or folder"):
        resolve_files(str(tmp_path / "missing.jsonl"))
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(
        DataError, match=r"broken.json: line 1 \(row 0\) is not valid JSON: Expecting property name"
    ):
        load_sources(str(tmp_path / "broken.json"), None, "images")


def test_hub_name_goes_to_load_dataset(monkeypatch):
    """`org/name@split` is passed to datasets.load_dataset (no network here: stubbed)."""
    import datasets

    calls = []

    def fake_load_dataset(name, split=None, **kwargs):
        calls.append((name, split))
        return datasets.Dataset.from_list(ROWS)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert resolve_files("org/name@test") == ["org/name@test"]
    (source,) = load_sources("org/name@test", None, "images")
    (other,) = load_sources("org/other", None, "images")
    assert calls == [("org/name", "test"), ("org/other", "train")]
    assert len(source.dataset) == 2 and other.name == "org/other"


def test_unreachable_hub_name_is_a_data_error(monkeypatch):
    import datasets

    def offline(name, split=None, **kwargs):
        raise ConnectionError("offline")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(
        DataError, match="org/name@train: is not a local file and cannot be loaded from the hub"
    ):
        load_sources("org/name@train", None, "images")


def test_splits_of_folders_and_files_as_datasets_names_them(tmp_path):
    """`FOLDER@split` picks files by split name; a folder alone is its train split; FILE@train."""
    for name in ("train-00000.jsonl", "train-00001.jsonl", "test-00000.jsonl"):
        write_jsonl(tmp_path / "d" / name, ROWS)
    folder = str(tmp_path / "d")
    names = lambda found: [os.path.basename(p) for p in found]  # noqa: E731
    assert names(resolve_files(folder)) == ["train-00000.jsonl", "train-00001.jsonl"]
    assert names(resolve_files(f"{folder}@train")) == ["train-00000.jsonl", "train-00001.jsonl"]
    assert names(resolve_files(f"{folder}@test")) == ["test-00000.jsonl"]
    with pytest.raises(DataError, match=r"folder has no 'validation' split; its splits: \['test', 'train'\]"):
        resolve_files(f"{folder}@validation")
    write_jsonl(tmp_path / "s" / "train" / "a.jsonl", ROWS)
    write_jsonl(tmp_path / "s" / "test" / "b.jsonl", ROWS)
    assert names(resolve_files(f"{tmp_path / 's'}@test")) == ["b.jsonl"]
    single = str(tmp_path / "d" / "test-00000.jsonl")
    assert resolve_files(f"{single}@train") == [single]
    with pytest.raises(DataError, match="a single file holds only the 'train' split"):
        resolve_files(f"{single}@test")
    (source,) = load_sources(f"{folder}@test", None, "images")
    assert source.dataset.to_list() == ROWS
