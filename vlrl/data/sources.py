"""Finding and loading data files with `datasets`: one `Source` per file so errors can name it.

`data.train_files` / `val_files` accept
- a .json (a list of records, or JSON lines), .jsonl, .parquet or .csv file,
- a folder: the files of one split under it (recursively, sorted by path), found by the rules of
  `datasets` (names such as `train-00000.parquet`, `test.jsonl` or folders `train/`, `test/`); a
  folder without split names is all `train`,
- `FILE@split` / `FOLDER@split` picks the split (default `train`; a single file only has `train`),
- several of the above separated by commas,
- a hub dataset `org/name@split` (split defaults to `train`; needs network access or the local
  cache); an entry that looks local (see `vlrl.config.paths.looks_local`) is never sent to the hub.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from vlrl.config.paths import closest_existing, hub_dataset_problem, looks_local
from vlrl.data.errors import DataError
from vlrl.data.text_files import json_problem, scan_text_file

logger = logging.getLogger("vlrl.data")

DATA_EXTENSIONS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
_HUB_NAME = re.compile(r"^[\w.-]+/[\w.-]+(@[\w.\-\[\]:%]+)?$")


@dataclass
class Source:
    """One loaded file (or hub split)."""

    name: str  # the file path or hub name, as shown in errors
    dataset: Any  # datasets.Dataset
    image_dir: str  # folder relative image paths are joined to
    offset: int = 0  # uid of this source's first row (rows of all sources numbered consecutively)
    entry: int = 0  # which entry of the spec (comma item or list item) named it: data mixing's unit


def _split_spec(spec: str | Sequence[str]) -> list[str]:
    items = [spec] if isinstance(spec, str) else list(spec)
    return [part.strip() for item in items for part in item.split(",") if part.strip()]


def _folder_files(folder: str, split: str) -> list[str]:
    """Data files of `split` under `folder`, split by file and folder names as `datasets` does."""
    from datasets.data_files import DataFilesDict, get_data_patterns

    def usable(path: str) -> bool:
        parts = os.path.relpath(path, folder).split(os.sep)
        return os.path.splitext(path)[1].lower() in DATA_EXTENSIONS and not any(
            p.startswith(".") for p in parts
        )

    try:
        by_split = DataFilesDict.from_patterns(get_data_patterns(folder), base_path=folder)
    except FileNotFoundError:  # datasets: no files at all
        by_split = DataFilesDict()
    splits = {str(name): sorted(p for p in files if usable(p)) for name, files in by_split.items()}
    splits = {name: files for name, files in splits.items() if files}
    if not splits:
        kinds = ", ".join(DATA_EXTENSIONS)
        raise DataError(f"folder has no data files ({kinds})", file=folder)
    if split not in splits:
        raise DataError(f"folder has no {split!r} split; its splits: {sorted(splits)}", file=folder)
    return splits[split]


def _local_split(entry: str) -> tuple[str, str]:
    """(path, split) of a local `PATH@split` entry; (entry, "train") when it names no split."""
    path, at, split = entry.rpartition("@")
    if at and split and os.path.exists(path) and not os.path.exists(entry):
        return path, split
    return entry, "train"


def _is_hub_name(entry: str) -> bool:
    """`org/name[@split]` that is not a local path (vlrl.config.paths rule) and has no data-file extension."""
    name = entry.split("@")[0]
    return (
        bool(_HUB_NAME.match(entry))
        and not looks_local(name)
        and os.path.splitext(name)[1].lower() not in DATA_EXTENSIONS
    )


def resolve_files(spec: str | Sequence[str], check_hub: bool = False) -> list[str]:
    """Data files (and hub names) named by `spec`, in order; raises DataError for unusable entries.

    `check_hub`: also check that hub datasets are cached or reachable (a few seconds at most)."""
    out: list[str] = []
    for item in _split_spec(spec):
        entry, split = _local_split(item)
        if os.path.isdir(entry):
            out += _folder_files(entry, split)
        elif os.path.isfile(entry) and split != "train":
            raise DataError(
                f"a single file holds only the 'train' split (as in `datasets`), not {split!r}; name the "
                "file of that split, or a folder with split-named files",
                file=item,
            )
        elif os.path.isfile(entry):
            ext = os.path.splitext(entry)[1].lower()
            if ext not in DATA_EXTENSIONS:
                kinds = ", ".join(DATA_EXTENSIONS)
                raise DataError(f"unknown file type {ext or '(none)'!r}; expected one of {kinds}", file=entry)
            out.append(entry)
        elif _is_hub_name(entry):
            problem = hub_dataset_problem(entry) if check_hub else None
            if problem is not None:
                raise DataError(problem)
            out.append(entry)  # hub dataset
        else:
            raise DataError(f"no such file or folder{closest_existing(entry)}", file=entry)
    if not out:
        raise DataError(f"no data files given ({spec!r})")
    return out


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    """Hide datasets' progress bars while loading (restored afterwards)."""
    import datasets

    enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if enabled:
            datasets.enable_progress_bars()


def _undecoded_images(dataset: Any, column: str) -> Any:
    """Cast an `Image` (or list-of-Image) column to decode=False: rows then hold {bytes, path}
    dicts, so validation can read sizes from headers instead of decoding every image."""
    from datasets import Image

    feature = dataset.features.get(column)
    if isinstance(feature, Image) and feature.decode:
        return dataset.cast_column(column, Image(decode=False))
    inner = getattr(feature, "feature", None)
    if isinstance(inner, Image) and inner.decode:
        return dataset.cast_column(column, type(feature)(Image(decode=False)))
    return dataset


def load_source(entry: str, image_dir: str | None, image_key: str) -> Source:
    """Load one file or hub split with `datasets` (errors name the entry)."""
    from datasets import load_dataset

    is_file = os.path.isfile(entry)
    kind = DATA_EXTENSIONS[os.path.splitext(entry)[1].lower()] if is_file else "hub"
    scan = scan_text_file(entry, kind) if kind in ("json", "csv") else None
    try:
        with _quiet_datasets():
            if is_file:
                dataset = load_dataset(kind, data_files=entry, split="train")
            else:
                name, _, split = entry.partition("@")
                dataset = load_dataset(name, split=split or "train")
            dataset = _undecoded_images(dataset, image_key)
    except Exception as err:  # datasets raises many types; all mean "cannot load this entry"
        problem = json_problem(entry, scan) if kind == "json" and scan is not None else None
        if problem is not None:
            raise problem from err
        what = "cannot be loaded" if is_file else "is not a local file and cannot be loaded from the hub"
        raise DataError(f"{what}: {type(err).__name__}: {err}", file=entry) from err
    if scan is not None and scan.json_lines and scan.blank_lines:
        logger.warning("%s: ignored %d blank lines (of %d lines)", entry, scan.blank_lines, scan.lines)
    if image_dir is None:
        image_dir = os.path.dirname(os.path.abspath(entry)) if is_file else os.getcwd()
    return Source(name=entry, dataset=dataset, image_dir=image_dir)


def spec_entries(spec: str | Sequence[str]) -> list[str]:
    """The entries of a data spec (its comma items, or list items): `data.train_weights` weighs these."""
    return _split_spec(spec)


def load_sources(spec: str | Sequence[str], image_dir: str | None, image_key: str) -> list[Source]:
    """All sources of `spec`, with consecutive uid offsets, each knowing its entry."""
    sources, offset = [], 0
    for entry, item in enumerate(_split_spec(spec)):
        for name in resolve_files(item):
            source = load_source(name, image_dir, image_key)
            source.offset, source.entry = offset, entry
            offset += len(source.dataset)
            sources.append(source)
    return sources
