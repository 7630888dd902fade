"""Checks of text data files (JSON lines, JSON, CSV) that `datasets` reports badly or not at all.

`datasets` loads a JSONL holding a non-UTF-8 byte and fails later, when that row is read, with a
bare `UnicodeDecodeError`; an empty file raises a bare `StopIteration`; a malformed JSON line is
reported by pyarrow without the file. `scan_text_file` reads the file once as bytes before loading
(text decoding runs at hundreds of MB/s) so these become errors naming the file and line, and
counts blank lines (which JSON-lines loading skips) so they can be logged.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from vlrl.data.errors import DataError


@dataclass
class TextScan:
    lines: int = 0
    blank_lines: int = 0
    json_lines: bool = False
    """True for JSON lines (not a single JSON array)."""


def _where(line: int, row: int | None) -> str:
    return f"line {line}" + (f" (row {row})" if row is not None else "")


def scan_text_file(path: str, kind: str) -> TextScan:
    """Line count, blank lines and JSON-lines-ness of `path`; DataError for non-UTF-8 bytes or no rows."""
    scan = TextScan()
    first_char = ""
    with open(path, "rb") as f:
        for line, raw in enumerate(f, 1):
            try:
                text = raw.decode("utf-8-sig" if line == 1 else "utf-8")
            except UnicodeDecodeError as err:
                row = line - 1 - scan.blank_lines if kind == "json" and first_char != "[" else None
                raise DataError(
                    f"{_where(line, row)} is not valid UTF-8 (byte 0x{raw[err.start]:02x} at column "
                    f"{err.start + 1}); re-save the file as UTF-8",
                    file=path,
                ) from None
            if not text.strip():
                scan.blank_lines += 1
            elif not first_char:
                first_char = text.lstrip()[0]
            scan.lines = line
    if not first_char:
        raise DataError(
            "the file is empty (no rows); add rows or leave it out of data.train_files / val_files", file=path
        )
    scan.json_lines = kind == "json" and first_char != "["
    return scan


def json_problem(path: str, scan: TextScan) -> DataError | None:
    """The first malformed record of a JSON(-lines) file as an error naming the line (and row), or None."""
    with open(path, encoding="utf-8-sig") as f:
        if not scan.json_lines:
            try:
                json.load(f)
            except json.JSONDecodeError as err:
                return DataError(
                    f"line {err.lineno} is not valid JSON: {err.msg} (column {err.colno})", file=path
                )
            return None
        row = 0
        for line, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as err:
                return DataError(
                    f"{_where(line, row)} is not valid JSON: {err.msg} (column {err.colno}); fix or remove the line",
                    file=path,
                )
            if not isinstance(record, dict):
                return DataError(
                    f"{_where(line, row)} is a JSON {type(record).__name__}, not an object (one row per line)",
                    file=path,
                )
            row += 1
    return None
