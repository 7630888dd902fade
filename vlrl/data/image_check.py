"""Start-up decoding of every image, once: threads, a progress bar, and a cache of images known good.

The header check (`probe_size`) misses truncated or corrupt pixel data, which would otherwise kill
the run when the row is drawn. So every image is decoded and converted to RGB once at start-up
(PIL releases the GIL while decoding and converting, so threads run in parallel). Images that
decode are remembered in a cache file, keyed by
- files: absolute path, size and modification time (a changed file is checked again);
- inline bytes: the SHA-256 of the bytes;
so a restart with unchanged data skips the work. Images already in memory (PIL objects) are always
converted (no decode). Failures are never cached.

Cache location: `data.image_check_cache_dir`, default `$XDG_CACHE_HOME/vlrl/image_checks`
(`~/.cache/vlrl/image_checks`), one small JSON file per data file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from PIL import Image

from vlrl.data.images import ImageProblem, image_path, load_image

logger = logging.getLogger("vlrl.data")

CACHE_VERSION = 1
"""Bump when the decoding / conversion rules change, so old verdicts are not trusted."""


def default_cache_dir() -> str:
    """`$XDG_CACHE_HOME/vlrl/image_checks`, else `~/.cache/vlrl/image_checks`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "vlrl", "image_checks")


def image_key(cell: Any, image_dir: str) -> str | None:
    """Cache key of an image cell; None for in-memory PIL images (never cached)."""
    if isinstance(cell, Image.Image):
        return None
    path = image_path(cell, image_dir)
    if path is not None:
        stat = os.stat(path)
        return f"file:{os.path.abspath(path)}:{stat.st_size}:{stat.st_mtime_ns}"
    data = cell["bytes"] if isinstance(cell, dict) else cell
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _decode(cell: Any, image_dir: str) -> None:
    load_image(cell, image_dir).close()


class ImageChecker:
    """Decodes the images of one data source; use as a context manager (saves the cache on exit)."""

    def __init__(self, source_name: str, cache_dir: str | None, threads: int | None = None) -> None:
        self.source_name = source_name
        cache_dir = default_cache_dir() if cache_dir is None else os.path.expanduser(cache_dir)
        ident = os.path.abspath(source_name) if os.path.exists(source_name) else source_name
        digest = hashlib.sha256(ident.encode()).hexdigest()[:24]
        self.cache_file = os.path.join(cache_dir, f"{digest}.json")
        self.known = self._read_cache()
        self.good: set[str] = set()  # keys that decoded (or were cached) this run
        self.num_decoded = 0
        self.num_cached = 0
        self.pool = ThreadPoolExecutor(threads or min(8, os.cpu_count() or 1), thread_name_prefix="vlrl-img")
        self._progress: Any = None  # a tqdm bar, opened when the first image is decoded

    def _advance(self, _: Future) -> None:
        self._progress.update()

    def _read_cache(self) -> set[str]:
        try:
            with open(self.cache_file, encoding="utf-8") as f:
                saved = json.load(f)
        except (OSError, ValueError):
            return set()
        return set(saved.get("good", ())) if saved.get("version") == CACHE_VERSION else set()

    def check(self, rows: list[tuple[int, list[Any]]], image_dir: str) -> dict[int, ImageProblem]:
        """Decode the images of `rows` ((row, cells) pairs); returns {row: first problem} for bad rows."""
        futures: dict[str, Future] = {}  # one decode per distinct image
        row_keys: list[tuple[int, list[tuple[str | None, Any]]]] = []
        problems: dict[int, ImageProblem] = {}
        for row, cells in rows:
            try:
                keyed = [(image_key(cell, image_dir), cell) for cell in cells]
            except OSError as err:  # removed or unreadable since the header check
                problems[row] = ImageProblem(f"image cannot be read ({err})")
                continue
            row_keys.append((row, keyed))
            for key, cell in keyed:
                if key in self.known or key in futures:
                    continue
                if self._progress is None:  # disable=None: no bar when stderr is not a terminal
                    from tqdm.auto import tqdm

                    self._progress = tqdm(
                        desc=f"decoding images of {self.source_name}", unit="img", disable=None
                    )
                future = self.pool.submit(_decode, cell, image_dir)
                future.add_done_callback(self._advance)
                if key is not None:
                    futures[key] = future
                else:  # PIL image: its own (uncached) future
                    futures[f"pil:{id(cell)}"] = future
        for row, keyed in row_keys:
            for key, cell in keyed:
                error = self._result(futures.get(key if key is not None else f"pil:{id(cell)}"), key)
                if error is not None:
                    problems[row] = error
                    break
        return problems

    def _result(self, future: Future | None, key: str | None) -> ImageProblem | None:
        if future is None:  # known good from the cache
            self.num_cached += 1
            self.good.add(key)  # type: ignore[arg-type]
            return None
        error = future.exception()
        if error is None:
            self.num_decoded += 1
            if key is not None:
                self.good.add(key)
            return None
        if isinstance(error, ImageProblem):
            return error
        raise error

    def save(self) -> None:
        """Write this run's good keys (atomically; a cache that cannot be written is only a warning)."""
        if self.good == self.known:
            return
        folder = os.path.dirname(self.cache_file)
        try:
            os.makedirs(folder, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=folder, delete=False, suffix=".tmp") as f:
                json.dump({"version": CACHE_VERSION, "good": sorted(self.good)}, f)
            os.replace(f.name, self.cache_file)
        except OSError as err:
            logger.warning("cannot write the image-check cache %s: %s", self.cache_file, err)

    def __enter__(self) -> ImageChecker:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            with contextlib.suppress(Exception):
                self._progress.close()
        self.pool.shutdown(wait=True, cancel_futures=True)
        if exc[0] is None:
            self.save()
