"""The data layer's error: bad data, naming the file and row when known."""

from __future__ import annotations


class DataError(ValueError):
    """Bad data. `file` and `row` (0-based row within that file) say where, when known."""

    def __init__(self, message: str, file: str | None = None, row: int | None = None) -> None:
        where = file if row is None else f"{file} row {row}"
        super().__init__(f"{where}: {message}" if file else message)
        self.file, self.row, self.problem = file, row, message
