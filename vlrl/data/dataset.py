"""`RLDataset`: loads data files, validates every row up front, filters overlong prompts.

Construction reads only the columns it needs: each row's keys, `<image>` marker count, image
existence and headers, and expanded prompt length are checked, and every image is decoded once
(`vlrl.data.image_check`: threads, cached across restarts), so a long run cannot die at step 500 on
a bad row. `__getitem__` returns a model-ready `PromptSample` whose images are their encoded
files and the size the model sees (`vlrl.data.encoded_images`: the ranks decode and resize them);
an image the check did not see as it is now is decoded there too, and a row that fails there (a
file changed after start-up) is skipped by `sample_or_skip` when `data.skip_bad_rows` is set.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from vlrl.data.collate import PromptSample
from vlrl.data.image_check import ImageChecker
from vlrl.data.images import ImageProblem
from vlrl.data.prepare import RowPreparer, RowProblem
from vlrl.data.prompts import PromptTemplateError
from vlrl.data.sources import DataError, Source, load_sources

logger = logging.getLogger("vlrl.data")

_CHUNK = 512  # rows read, image-checked and tokenized together while validating
SKIP_HINT = "; set data.skip_bad_rows=true to skip (and count) such rows"

_Pending = tuple[int, str, int, list[Any]]
"""A row that passed the cheap checks: (row, prompt, extra tokens from image expansion, image cells)."""


class RLDataset(torch.utils.data.Dataset):
    """Prompts of `files` (see `vlrl.data.sources`) prepared for `tokenizer` / `processor`.

    Attributes after construction:
      num_rows: rows in the files; `len(self)`: rows kept;
      num_filtered_overlong: rows dropped by `filter_overlong_prompts`;
      num_skipped / bad_rows: rows skipped by `skip_bad_rows` (each a DataError naming file and row);
      skipped_reasons: Counter of the skip reasons.

    Image placeholders are expanded from the predicted grids (default, `use_processor=False`) or
    by `processor(text=..., images=..., do_resize=False)` (`use_processor=True`, which also checks
    the processor's grid equals the prediction). Tests assert both give identical ids for
    Qwen2/2.5/3-VL; the default is 3-25x faster on a 2-core CPU (see benchmarks/bench_data.py).
    """

    def __init__(
        self,
        files: str | Sequence[str],
        config: Any,
        tokenizer: Any,
        processor: Any | None = None,
        *,
        hf_config: Any | None = None,
        use_processor: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.processor = processor
        self.use_processor = use_processor
        self.prep = RowPreparer(config, tokenizer, processor, hf_config, tools=tools)
        self.sources: list[Source] = load_sources(files, config.image_dir, config.image_key)
        self.num_rows = sum(len(s.dataset) for s in self.sources)
        self.num_filtered_overlong = 0
        self.bad_rows: list[DataError] = []
        self.skipped_reasons: Counter[str] = Counter()
        self._index: list[tuple[int, int]] = []  # kept rows: (source index, row within source)
        self.num_images_decoded = 0  # images decoded by the start-up check
        self.num_images_cached = 0  # images the check's cache already knew to be good
        # the check's keys of the images it found good: `__getitem__` reads only their headers
        self.good_images: set[str] = set()
        self.late_bad_rows: list[DataError] = []  # rows that failed when drawn (skip_bad_rows=true)
        self._late_bad: set[int] = set()  # their dataset indices
        for source_idx, source in enumerate(self.sources):
            with ImageChecker(source.name, config.image_check_cache_dir) as checker:
                self._validate_source(source_idx, source, checker)
            self.num_images_decoded += checker.num_decoded
            self.good_images |= checker.good
            self.num_images_cached += checker.num_cached
        self._log_summary()

    @property
    def num_skipped(self) -> int:
        """Bad rows skipped (with `data.skip_bad_rows`)."""
        return len(self.bad_rows)

    @property
    def pad_token_id(self) -> int:
        """Pad id for collation (the EOS id when the tokenizer has no pad token)."""
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else self.tokenizer.eos_token_id)

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, index: int) -> PromptSample:
        source_idx, row_idx = self._index[index]
        source = self.sources[source_idx]
        row = source.dataset[row_idx]
        try:
            return self.prep.sample(
                row, source.image_dir, source.offset + row_idx, self.use_processor, self.good_images
            )
        except (RowProblem, ImageProblem) as err:
            message = f"{err} (found when the row was drawn, after the start-up check passed: was the file changed?){SKIP_HINT}"
            raise DataError(message, file=source.name, row=row_idx) from err
        except PromptTemplateError as err:
            raise DataError(str(err), file=source.name, row=row_idx) from err

    def row_uids(self) -> list[int]:
        """Each kept row's uid (`PromptSample.uid`), by dataset index."""
        return [self.sources[source].offset + row for source, row in self._index]

    def row_entries(self) -> list[int]:
        """Each kept row's entry of `data.train_files` (`Source.entry`), by dataset index."""
        return [self.sources[source].entry for source, _ in self._index]

    def column_values(self, column: str) -> list[float]:
        """Each kept row's number in `column`, by dataset index (`data.curriculum=column:NAME`); a
        DataError naming the file and row where the column is missing or not a number."""
        values = []
        for source_idx, row in self._index:
            source = self.sources[source_idx]
            if column not in source.dataset.column_names:
                raise DataError(
                    f"data.curriculum names column {column!r}, which this file lacks", file=source.name
                )
            value = source.dataset[row][column]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise DataError(
                    f"data.curriculum's column {column!r} must hold numbers (low: easy), got {value!r}",
                    file=source.name,
                    row=row,
                )
            values.append(float(value))
        return values

    def sample_or_skip(self, index: int) -> PromptSample | None:
        """`self[index]`, or None (logged and counted) when it fails and `data.skip_bad_rows` is set."""
        if index in self._late_bad:
            return None
        try:
            return self[index]
        except DataError as err:
            if not self.config.skip_bad_rows or isinstance(err.__cause__, PromptTemplateError):
                raise
            self._late_bad.add(index)
            self.late_bad_rows.append(err)
            logger.warning(
                "skipped a row that failed when drawn (data.skip_bad_rows=true; %d such rows so far): %s",
                len(self.late_bad_rows),
                err,
            )
            return None

    def location(self, index: int) -> tuple[str, int]:
        """(file, row within file) of sample `index`."""
        source_idx, row_idx = self._index[index]
        return self.sources[source_idx].name, row_idx

    # ---- validation
    def _columns(self, source: Source) -> list[str]:
        keys = (self.config.prompt_key, self.config.answer_key, self.config.image_key, self.config.video_key)
        return [k for k in keys if k in source.dataset.column_names]

    def _rows(self, source: Source):
        """(row index, row dict with only the checked columns), read in chunks."""
        columns = self._columns(source)
        if not columns:  # neither prompt nor answer column: every row fails the key check
            yield from ((i, {}) for i in range(len(source.dataset)))
            return
        start = 0
        for chunk in source.dataset.select_columns(columns).iter(batch_size=_CHUNK):
            values = [chunk[c] for c in columns]
            for offset, cells in enumerate(zip(*values)):
                yield start + offset, dict(zip(columns, cells))
            start += len(values[0])

    def _bad_row(self, source: Source, row_idx: int, err: Exception, reason: str | None = None) -> None:
        """Raise a DataError naming the row, or record it when skipping bad rows."""
        message = str(err)
        if not self.config.skip_bad_rows:
            if isinstance(err, RowProblem) and err.reason in ("missing_prompt", "missing_answer"):
                message += f" (columns: {', '.join(source.dataset.column_names)})"
            raise DataError(message + SKIP_HINT, file=source.name, row=row_idx) from err
        self.bad_rows.append(DataError(message, file=source.name, row=row_idx))
        self.skipped_reasons[reason or str(getattr(err, "reason", None) or "image")] += 1

    def _decoded_rows(self, source: Source, checker: ImageChecker, pending: list[_Pending]) -> list[_Pending]:
        """`pending` without the rows whose images do not decode (an error unless skipping)."""
        with_images = [(row_idx, cells) for row_idx, _, _, cells in pending if cells]
        problems = checker.check(with_images, source.image_dir)
        for row_idx, problem in sorted(problems.items()):
            self._bad_row(source, row_idx, problem, reason="image_decode")
        return [p for p in pending if p[0] not in problems]

    def _validate_source(self, source_idx: int, source: Source, checker: ImageChecker) -> None:
        pending: list[_Pending] = []
        for row_idx, row in self._rows(source):
            try:
                prompt, cells = self.prep.text(row)
                extra = 0
                if cells:
                    tokens = self.prep.tokens_per_image(self.prep.target_sizes(cells, source.image_dir))
                    extra = sum(tokens) - len(tokens)  # each image's one placeholder becomes n tokens
                video_cells = self.prep.video_cells(row)
                if video_cells:  # decoded here: a bad video fails now, naming its row
                    extra += self.prep.video_extra_tokens(
                        self.prep.load_videos(video_cells, source.image_dir)
                    )
            except (RowProblem, ImageProblem) as err:
                self._bad_row(source, row_idx, err)
                continue
            except PromptTemplateError as err:  # a broken template is not the row's fault: always fatal
                raise DataError(str(err), file=source.name, row=row_idx) from err
            pending.append((row_idx, prompt, extra, cells))
            if len(pending) >= _CHUNK:
                self._keep_short(source_idx, source, self._decoded_rows(source, checker, pending))
                pending = []
        self._keep_short(source_idx, source, self._decoded_rows(source, checker, pending))

    def _keep_short(self, source_idx: int, source: Source, pending: list[_Pending]) -> None:
        """Index the rows whose expanded prompt fits `max_prompt_length` (batch tokenization)."""
        if not pending:
            return
        limit = self.config.max_prompt_length
        encoded = self._token_ids([p[1] for p in pending])
        for (row_idx, _, extra, _), ids in zip(pending, encoded):
            length = len(ids) + extra
            if length <= limit:
                self._index.append((source_idx, row_idx))
            elif self.config.filter_overlong_prompts:
                self.num_filtered_overlong += 1
            else:
                raise DataError(
                    f"prompt is {length} tokens (images and videos expanded), longer than data.max_prompt_length={limit}; "
                    "raise the limit, lower data.max_pixels, or set data.filter_overlong_prompts=true",
                    file=source.name,
                    row=row_idx,
                )

    def _token_ids(self, texts: list[str]) -> list[list[int]]:
        """Token ids of `texts`, in `data.filter_overlong_prompts_workers` threads (a fast tokenizer
        releases the GIL while it encodes)."""
        workers = min(self.config.filter_overlong_prompts_workers, max(len(texts) // 64, 1))
        if workers <= 1:
            return self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        size = -(-len(texts) // workers)
        pieces = [texts[i : i + size] for i in range(0, len(texts), size)]
        with ThreadPoolExecutor(workers) as pool:
            parts = pool.map(
                lambda piece: self.tokenizer(piece, add_special_tokens=False)["input_ids"], pieces
            )
            return [ids for part in parts for ids in part]

    def _log_summary(self) -> None:
        names = ", ".join(s.name for s in self.sources[:3]) + (" ..." if len(self.sources) > 3 else "")
        logger.info("loaded %d rows from %s; kept %d", self.num_rows, names, len(self))
        if self.num_images_decoded or self.num_images_cached:
            logger.info(
                "start-up image check: %d images decoded, %d known good from the cache",
                self.num_images_decoded,
                self.num_images_cached,
            )
        if self.num_filtered_overlong:
            logger.warning(
                "filtered %d prompts longer than max_prompt_length=%d",
                self.num_filtered_overlong,
                self.config.max_prompt_length,
            )
        if self.bad_rows:
            examples = "; ".join(str(e) for e in self.bad_rows[:3])
            logger.warning(
                "skipped %d bad rows %s, e.g. %s", self.num_skipped, dict(self.skipped_reasons), examples
            )
        if not len(self):
            raise DataError(f"no usable rows left in {names} (all filtered or skipped)")
