"""Splitting a step over ranks, done in the open by the driver.

Generation: prompts are split over data-parallel groups (ranks sharing one tensor-parallel
engine get the same prompts) and each group's samples are reported by its first rank.
Log-probs and updates: samples are split over the data-parallel groups with equal counts and
balanced token totals, and every rank of a Ulysses group (worker.actor.ulysses_size) gets its
group's rows; the index lists say where each sample went, so the driver's per-sample values go
to the right rank and any results come back in order (a group's ranks return identical values
for the same rows).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from vlrl.algorithms.kl import PenalizedRewards
from vlrl.batch.rows import KeptRows, PromptBatch, TokenRewards, one_value_per_row
from vlrl.batch.samples import StepSamples


def split_prompts(prompts: PromptBatch, world_size: int, tp_size: int) -> list[PromptBatch]:
    """One PromptBatch per rank: contiguous slices per data-parallel group (sizes may differ by 1)."""
    dp_size = world_size // tp_size
    n = len(prompts)
    bounds = [n * g // dp_size for g in range(dp_size + 1)]
    groups = [prompts.select(list(range(bounds[g], bounds[g + 1]))) for g in range(dp_size)]
    return [groups[rank // tp_size] for rank in range(world_size)]


def merge_samples(per_rank: Sequence[StepSamples | None], tp_size: int, pad_token_id: int) -> StepSamples:
    """The samples of every data-parallel group in order, from its first rank (its peers report None)."""
    parts = [s for rank, s in enumerate(per_rank) if rank % tp_size == 0 and s is not None]
    merged = StepSamples.join(parts, pad_token_id)
    merged.reward_failures = sum(p.reward_failures for p in parts)
    merged.reward_wait_s = max(p.reward_wait_s for p in parts)  # the ranks wait side by side
    return merged


def balanced_shards(lengths: torch.Tensor, world_size: int, ulysses_size: int = 1) -> list[list[int]]:
    """Per-rank row indices of samples with `lengths` [N] tokens: equal counts, similar token totals
    (so no rank waits on another).

    Consecutive groups of `ulysses_size` ranks get the same rows (they split them by tokens)."""
    from vlrl.workers.balance import balance_across_ranks

    groups = balance_across_ranks(lengths.tolist(), world_size // ulysses_size)
    return [groups[rank // ulysses_size] for rank in range(world_size)]


def gather_rows(shards: list[list[int]], values: list[torch.Tensor], n_rows: int, width: int) -> torch.Tensor:
    """Per-rank [rows, R_rank] results back in the batch's row order as [n_rows, width]: values[r][i]
    belongs to row shards[r][i]. A rank pads to its own widest response (R_rank <= width), the
    columns past it are padding (0)."""
    out = values[0].new_zeros((n_rows, width))
    for index, value in zip(shards, values):
        out[torch.as_tensor(index, dtype=torch.long), : value.shape[1]] = value
    return out


def gather_penalized(shards: list[list[int]], parts: list[PenalizedRewards], n_rows: int) -> PenalizedRewards:
    """The ranks' rewards with the KL penalty (`RankWorker.take_rows`) back in the batch's row order
    (parts[r] holds the values of rows shards[r]; a Ulysses group's ranks send the same ones)."""
    index = [torch.as_tensor(rows, dtype=torch.long) for rows in shards]

    def gather(name: str) -> torch.Tensor:
        first = getattr(parts[0], name)
        out = first.new_zeros(n_rows)
        for rows, part in zip(index, parts):
            out[rows] = getattr(part, name)
        return out

    return PenalizedRewards(
        gather("sequence_scores"), gather("sums"), gather("sequence_kl"), gather("has_tokens")
    )


def update_inputs(
    samples: StepSamples, shards: list[list[int]], token_rewards: TokenRewards | None = None
) -> list[KeptRows]:
    """Each rank's update input: its rows' ids and the advantages, one float per row where they
    are one value per response (the outcome estimators), else [rows, R]; the rest is on the rank.
    With `token_rewards` (a token-level estimator; its `scores` are the whole batch's [N]) the
    ranks compute the advantages: each gets its rows' scores."""
    if token_rewards is not None:
        return [
            KeptRows(rows, {}, token_rewards=replace(token_rewards, scores=token_rewards.scores[rows]))
            for rows in shards
        ]
    advantages = samples.tensor("advantages")
    per_row = one_value_per_row(advantages, samples.response_mask)
    inputs = []
    for rows in shards:
        index = torch.as_tensor(rows, dtype=torch.long)
        if per_row is not None:
            inputs.append(KeptRows(rows, {}, per_row={"advantages": per_row[index]}))
        else:
            inputs.append(KeptRows(rows, {"advantages": advantages[index]}))
    return inputs
