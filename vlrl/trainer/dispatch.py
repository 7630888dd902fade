"""Splitting a step's batch over ranks and merging the results back, done in the open by the driver.

Generation: prompts are split over data-parallel groups (ranks sharing one tensor-parallel
engine get the same prompts) and each group's result is taken from its first rank.
Log-probs and updates: samples are split over the data-parallel groups with equal counts and
balanced token totals, and every rank of a Ulysses group (worker.actor.ulysses_size) gets its
group's rows; the index lists returned say where each sample went, so results are put back in
order (a group's ranks return identical values for the same rows).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F

from vlrl.batch.rows import RESPONSE_FIELDS, SEQUENCE_FIELDS, TOKEN_ID_FIELDS, PromptBatch, RolloutBatch


def split_prompts(prompts: PromptBatch, world_size: int, tp_size: int) -> list[PromptBatch]:
    """One PromptBatch per rank: contiguous slices per data-parallel group (sizes may differ by 1)."""
    dp_size = world_size // tp_size
    n = len(prompts)
    bounds = [n * g // dp_size for g in range(dp_size + 1)]
    groups = [prompts.select(list(range(bounds[g], bounds[g + 1]))) for g in range(dp_size)]
    return [groups[rank // tp_size] for rank in range(world_size)]


def merge_rollouts(per_rank: Sequence[RolloutBatch | None], tp_size: int, pad_token_id: int) -> RolloutBatch:
    """Concatenate the first rank of every tensor-parallel group (its peers return None),
    padding to common widths."""
    parts = [b for rank, b in enumerate(per_rank) if rank % tp_size == 0 and b is not None and len(b) > 0]
    width_p = max(b.prompt_length for b in parts)
    width_r = max(b.responses.shape[1] for b in parts)
    return RolloutBatch.concat([_pad_rollout(b, width_p, width_r, pad_token_id) for b in parts])


def _pad_rollout(batch: RolloutBatch, width_p: int, width_r: int, pad_id: int) -> RolloutBatch:
    """Left-pad the prompt part to `width_p` and right-pad the response part to `width_r`, in every
    tensor field (by its kind in `vlrl.batch.rows`: [..., P + R] or [N, R])."""
    left, right = width_p - batch.prompt_length, width_r - batch.responses.shape[1]
    if left == 0 and right == 0:
        return batch
    p = batch.prompt_length

    def both(x: torch.Tensor, value: float) -> torch.Tensor:  # [..., P + R] -> [..., P' + R']
        return torch.cat(
            [F.pad(x[..., :p], (left, 0), value=value), F.pad(x[..., p:], (0, right), value=value)], -1
        )

    padded: dict[str, Any] = {}
    for names, pad in (
        (SEQUENCE_FIELDS, both),
        (RESPONSE_FIELDS, lambda x, v: F.pad(x, (0, right), value=v)),
    ):
        for name in names:
            value = getattr(batch, name)
            if value is not None:
                padded[name] = pad(value, pad_id if name in TOKEN_ID_FIELDS else 0)
    return replace(batch, prompt_length=width_p, **padded)


def balanced_shards(batch: RolloutBatch, world_size: int, ulysses_size: int = 1) -> list[list[int]]:
    """Per-rank row indices: equal counts, similar token totals (so no rank waits on another).

    Consecutive groups of `ulysses_size` ranks get the same rows (they split them by tokens)."""
    from vlrl.workers.balance import balance_across_ranks

    lengths = batch.attention_mask.sum(-1).tolist()
    groups = balance_across_ranks(lengths, world_size // ulysses_size)
    return [groups[rank // ulysses_size] for rank in range(world_size)]


def gather_rows(shards: list[list[int]], values: list[torch.Tensor], n_rows: int) -> torch.Tensor:
    """Put per-rank results back in the batch's row order: values[r][i] belongs to row shards[r][i]."""
    out = values[0].new_zeros((n_rows, *values[0].shape[1:]))
    for index, value in zip(shards, values):
        out[torch.as_tensor(index, dtype=torch.long)] = value
    return out
