"""Text data files that used to give raw errors (UnicodeDecodeError, StopIteration, "position 75"):
each is an error naming the file and line (row), and blank lines are counted in the logs."""

from __future__ import annotations

import logging
import re

import pytest

from vlrl.data import DataError
from vlrl.data.sources import load_sources

GOOD = b'{"problem": "a", "answer": "b"}\n'


def _load(path) -> list:
    return load_sources(str(path), None, "images")


def _raises(path, message: str) -> None:
    with pytest.raises(DataError, match=re.escape(f"{path}: {message}")):
        _load(path)


def test_non_utf8_byte_names_the_line_and_row(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(GOOD + b"\n" + b'{"problem": "\xff", "answer": "c"}\n')
    _raises(path, "line 3 (row 1) is not valid UTF-8 (byte 0xff at column 14); re-save the file as UTF-8")
    csv = tmp_path / "d.csv"
    csv.write_bytes(b"problem,answer\na,b\n\xfe,c\n")
    _raises(csv, "line 3 is not valid UTF-8 (byte 0xfe at column 1)")


@pytest.mark.parametrize("content", [b"", b"\n  \n"])
@pytest.mark.parametrize("name", ["d.jsonl", "d.csv", "d.json"])
def test_empty_file(tmp_path, content, name):
    path = tmp_path / name
    path.write_bytes(content)
    _raises(path, "the file is empty (no rows); add rows or leave it out of data.train_files / val_files")


def test_malformed_json_line_names_the_line_and_row(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(GOOD + b"\n" + b'{"problem": "a" "answer": "b"}\n' + GOOD)
    _raises(
        path, "line 3 (row 1) is not valid JSON: Expecting ',' delimiter (column 17); fix or remove the line"
    )
    path.write_bytes(GOOD + b"[1, 2]\n")
    _raises(path, "line 2 (row 1) is a JSON list, not an object (one row per line)")


def test_malformed_json_array(tmp_path):
    path = tmp_path / "d.json"
    path.write_bytes(b'[\n {"problem": "a", "answer": "b"},\n {"problem": }\n]\n')
    _raises(path, "line 3 is not valid JSON: Expecting value (column 14)")


def test_blank_lines_are_counted(tmp_path, caplog):
    path = tmp_path / "d.jsonl"
    path.write_bytes(GOOD + b"\n   \n" + GOOD)
    with caplog.at_level(logging.WARNING, logger="vlrl.data"):
        (source,) = _load(path)
    assert len(source.dataset) == 2
    assert f"{path}: ignored 2 blank lines (of 4 lines)" in caplog.text
