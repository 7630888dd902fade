"""`StatefulPromptLoader`: seeded per-epoch shuffling, fixed batches, exact resume.

An in-process loader: `__getitem__` (image decode + resize + tokenize) runs in the training
process when a batch is requested. Prompt preparation costs milliseconds per prompt, small next
to generation, so worker processes are not worth their pickling and start-up costs.

Resume semantics: `state_dict()` is updated *before* each batch is handed out, so a state saved
after consuming k batches restores to batch k+1; after the last batch of an epoch it points at
the first batch of the next epoch. Order in epoch e is a permutation seeded by `seed + e`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch

from vlrl.batch.rows import PromptBatch
from vlrl.data.collate import collate_prompts
from vlrl.data.prompt_stats import PromptStats
from vlrl.data.samplers import Curriculum, PassRateSampler, SourceMix, epoch_order
from vlrl.data.sources import DataError

Picker = PassRateSampler | SourceMix | Curriculum


class StatefulPromptLoader:
    """Yields `PromptBatch`es of `batch_size` prompts from `dataset` (an `RLDataset` or any
    sequence of `PromptSample`s). Iterating runs the rest of the current epoch; iterate again for
    the next epoch. `batch_size <= 0` means the whole dataset in one batch."""

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 1,
        drop_last: bool = True,
        pad_token_id: int | None = None,
        picker: Picker | None = None,
        stats: PromptStats | None = None,
    ) -> None:
        self.dataset = dataset
        self.batch_size = batch_size if batch_size > 0 else len(dataset)
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.pad_token_id = pad_token_id if pad_token_id is not None else dataset.pad_token_id
        self.picker = picker  # None: the per-epoch order of `order()`
        self.stats = stats  # marks the prompts handed out as pending (their scores come later)
        self.epoch = 0
        self.batch_index = 0  # batches already handed out in `epoch`
        if len(self) == 0:
            raise ValueError(
                f"dataset of {len(dataset)} prompts gives no batch of {self.batch_size} (drop_last={drop_last}); "
                "lower the batch size or add data"
            )

    def __len__(self) -> int:
        """Batches per epoch."""
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def order(self, epoch: int) -> list[int]:
        """Dataset indices in the order of `epoch`."""
        return epoch_order(len(self.dataset), self.seed, epoch, self.shuffle).tolist()

    def __iter__(self) -> Iterator[PromptBatch]:
        epoch, order = self.epoch, self.order(self.epoch) if self.picker is None else []
        while self.epoch == epoch and self.batch_index < len(self):
            start = self.batch_index * self.batch_size
            if self.picker is None:
                wanted, spares = (
                    order[start : start + self.batch_size],
                    order[start + self.batch_size :] + order[:start],
                )
            else:
                ranked = self._ranked(epoch * len(self) + self.batch_index)
                wanted, spares = ranked[: self.batch_size], ranked[self.batch_size :]
            samples = self._samples(wanted, spares)
            if self.stats is not None:
                self.stats.mark_pending([s.uid for s in samples])
            # Advance the state before handing the batch out (see the module docstring).
            self.batch_index += 1
            if self.batch_index == len(self):
                self.epoch, self.batch_index = epoch + 1, 0
            yield collate_prompts(samples, self.pad_token_id)

    def _ranked(self, draw: int) -> list[int]:
        """Dataset indices for batch number `draw` of the run, then spares (`picker`)."""
        if isinstance(self.picker, PassRateSampler):
            return self.picker.rank(torch.arange(len(self.dataset)), self.batch_size, draw)
        assert self.picker is not None
        return self.picker.rank(self.batch_size, draw)

    def _samples(self, wanted: list[int], spares: list[int]) -> list[Any]:
        """The samples of rows `wanted`. With `data.skip_bad_rows`, a row that fails when drawn
        (`dataset.sample_or_skip` returns None) is replaced by the next of `spares` (the rest of the
        epoch order, cyclically, or the sampler's next choices), so the batch keeps its size."""
        fetch = getattr(self.dataset, "sample_or_skip", self.dataset.__getitem__)
        samples = [s for s in map(fetch, wanted) if s is not None]
        spare_rows = iter(spares)
        while len(samples) < len(wanted):
            index = next(spare_rows, None)
            if index is None:
                raise DataError(f"no loadable rows left to fill a batch of {len(wanted)} (every row failed)")
            sample = fetch(index)
            if sample is not None:
                samples.append(sample)
        return samples

    def state_dict(self) -> dict[str, Any]:
        """Position to resume from (plus what must match on resume); with data mixing, the mix's
        position in each entry."""
        state: dict[str, Any] = {
            "epoch": self.epoch,
            "batch_index": self.batch_index,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "dataset_size": len(self.dataset),
        }
        if isinstance(self.picker, SourceMix):
            state["mix"] = self.picker.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at `state`'s position; refuses a state from a different seed, batch size or dataset size."""
        for key in ("seed", "batch_size", "dataset_size"):
            mine = self.state_dict()[key]
            if key in state and state[key] != mine:
                raise ValueError(f"cannot resume: saved {key}={state[key]} but this loader has {key}={mine}")
        if not 0 <= state["batch_index"] < len(self):
            raise ValueError(f"saved batch_index {state['batch_index']} out of range (0..{len(self) - 1})")
        self.epoch, self.batch_index = int(state["epoch"]), int(state["batch_index"])
        if isinstance(self.picker, SourceMix):
            if "mix" not in state:
                raise ValueError("cannot resume: the checkpoint was saved without data.train_weights")
            self.picker.load_state_dict(state["mix"])


def create_dataloaders(
    config: Any,
    tokenizer: Any,
    processor: Any | None,
    hf_config: Any | None = None,
    tools: list[dict[str, Any]] | None = None,
    samples_per_prompt: int = 1,
) -> tuple[StatefulPromptLoader, StatefulPromptLoader | None]:
    """(train loader, validation loader or None) from a `DataConfig`.

    `tools`: function schemas the chat template shows the model (multi-turn rollouts);
    `samples_per_prompt`: `worker.rollout.n` (the pass-rate sampler's group size).

    Training: batches of `data.mini_rollout_batch_size` prompts (when set; the trainer draws batches
    until a step is full) or `data.rollout_batch_size`, drop_last, drawn as `data.sampler` and
    `data.train_weights` say (default: shuffled by `data.seed`); the loader keeps the prompts'
    statistics (`loader.stats`). Validation: file order, `data.val_batch_size` prompts (-1: all),
    nothing dropped.
    """
    from vlrl.data.dataset import RLDataset

    train_set = RLDataset(config.train_files, config, tokenizer, processor, hf_config=hf_config, tools=tools)
    stats = PromptStats(train_set.row_uids())
    train = StatefulPromptLoader(
        train_set,
        config.mini_rollout_batch_size or config.rollout_batch_size,
        shuffle=config.shuffle,
        seed=config.seed,
        drop_last=True,
        picker=_picker(config, train_set, stats, samples_per_prompt),
        stats=stats,
    )
    if not config.val_files:
        return train, None
    val_set = RLDataset(config.val_files, config, tokenizer, processor, hf_config=hf_config, tools=tools)
    val = StatefulPromptLoader(val_set, config.val_batch_size, shuffle=False, drop_last=False)
    return train, val


def _picker(config: Any, dataset: Any, stats: PromptStats, n: int) -> Picker | None:
    """The training loader's sampler for `data.sampler`, `data.train_weights` and `data.curriculum`
    (None: the plain shuffle)."""
    by_pass_rate = (
        PassRateSampler(
            stats,
            n,
            config.seed,
            config.revisit_share,
            epoch_order(len(dataset), config.seed, 0, config.shuffle),
        )
        if config.sampler == "pass_rate"
        else None
    )
    if config.curriculum is not None:
        column = config.curriculum.removeprefix("column:") if config.curriculum != "pass_rate" else None
        difficulty = torch.tensor(dataset.column_values(column), dtype=torch.float64) if column else None
        per_step = config.rollout_batch_size / (config.mini_rollout_batch_size or config.rollout_batch_size)
        ramp = math.ceil(config.curriculum_steps * per_step)
        return Curriculum(difficulty, stats, config.curriculum_start, ramp, config.seed, by_pass_rate)
    if config.train_weights is None:
        return by_pass_rate
    entries = torch.tensor(dataset.row_entries())
    rows = [torch.nonzero(entries == e).flatten() for e in range(len(config.train_weights))]
    empty = [e for e, r in enumerate(rows) if len(r) == 0 and config.train_weights[e] > 0]
    if empty:
        raise DataError(
            f"data.train_files entry {empty[0]} has no usable rows but data.train_weights gives it a weight"
        )
    return SourceMix(rows, list(config.train_weights), config.seed, by_pass_rate)
