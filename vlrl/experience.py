"""`ExperienceStore`: rows of experience by sample id, with columns written as they become ready.

A step's experience is a table: one row per sample, one column per quantity (input ids, images,
old and reference log-probs, advantages, ...). Stages finish at different times and in different
places, so each (row, column) cell has its own ready flag: a producer writes cells as it computes
them; a consumer asks which rows have every column it needs (`ready`) and reads just those
(`read`). Nothing waits for a whole step.

Each rank keeps one for the rows of its shard (`RankWorker`): the log-prob pass writes the rows and
their old/reference log-probs; the update reads them back, so the driver sends it only what it
computed itself (the advantages). A cell holds one row's value: a tensor row, a list entry, any object.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any


class ExperienceStore:
    """Rows keyed by int ids, kept in the order they were first written; columns fixed at creation."""

    def __init__(self, columns: Iterable[str]) -> None:
        self.columns = tuple(columns)
        self._rows: dict[int, dict[str, Any]] = {}  # id -> {column: value} of its ready cells

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, row: int) -> bool:
        return row in self._rows

    def write(self, rows: Sequence[int], **columns: Sequence[Any]) -> None:
        """Set `columns[c][i]` as the value of row `rows[i]` in column `c`; unknown rows are added."""
        for name, values in columns.items():
            if name not in self.columns:
                raise KeyError(f"no column {name!r} in this store; its columns are {list(self.columns)}")
            if len(values) != len(rows):
                raise ValueError(f"column {name!r}: {len(values)} values for {len(rows)} rows")
        for i, row in enumerate(rows):
            cells = self._rows.setdefault(int(row), {})
            for name, values in columns.items():
                cells[name] = values[i]

    def ready(self, columns: Iterable[str], limit: int | None = None) -> list[int]:
        """Ids of the rows whose `columns` are all written, oldest first; at most `limit` of them."""
        needed = tuple(columns)
        found = [row for row, cells in self._rows.items() if all(c in cells for c in needed)]
        return found if limit is None else found[:limit]

    def written_columns(self, rows: Sequence[int]) -> list[str]:
        """The columns written for every one of `rows`, in column order."""
        return [name for name in self.columns if all(name in self._rows.get(int(r), ()) for r in rows)]

    def read(self, rows: Sequence[int], columns: Iterable[str]) -> dict[str, list[Any]]:
        """{column: [value of each row, in `rows` order]}; an error names the first cell not ready."""
        out: dict[str, list[Any]] = {}
        for name in columns:
            values = []
            for row in rows:
                cells = self._rows.get(int(row))
                if cells is None:
                    raise KeyError(f"row {row} is not in the store")
                if name not in cells:
                    raise KeyError(f"row {row} has no {name!r} yet: the stage that writes it has not run")
                values.append(cells[name])
            out[name] = values
        return out

    def drop(self, rows: Iterable[int] | None = None) -> None:
        """Forget `rows` (all rows when None): a consumed step frees its memory."""
        if rows is None:
            self._rows.clear()
            return
        for row in rows:
            self._rows.pop(int(row), None)

    def state_dict(self) -> dict[str, Any]:
        """Every row and ready cell, in order (for a checkpoint of rows still in flight)."""
        return {
            "columns": list(self.columns),
            "rows": [(row, dict(cells)) for row, cells in self._rows.items()],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if tuple(state["columns"]) != self.columns:
            raise ValueError(
                f"saved columns {state['columns']} differ from this store's {list(self.columns)}"
            )
        self._rows = {int(row): dict(cells) for row, cells in state["rows"]}
