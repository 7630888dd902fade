"""Streamed rewards: score each group as soon as its samples are generated (`worker.reward.streaming`).

The engines report finished groups while the rest of their shard is still generating
(`RolloutEngine.generate_stream`); the driver hands each group to the reward workers at once, at
the rows the group will have in the merged batch, so a step's reward time hides behind its
generation time. What an engine does not report early (the HF engine, multi-turn rollouts) is
scored from the merged batch, as without streaming. Scores do not depend on the order samples
are scored in, so the batch is the same either way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vlrl.protocol import FinishedGroups, PromptBatch, RolloutBatch
from vlrl.rewards.runner import RewardStream
from vlrl.rewards.types import RewardInput
from vlrl.trainer.ranks import RankStream

POLL_S = 0.02
"""How long the driver waits for the engines before it takes in finished rewards again."""

GroupInputs = Callable[[PromptBatch, list[list[int]]], list[RewardInput]]
"""(the groups' prompts, their samples' token ids) -> the reward inputs of those samples."""


def prompt_offsets(shards: list[PromptBatch], tp_size: int) -> list[int]:
    """Per rank: how many prompts the data-parallel groups before its own hold (its first
    prompt's index in the merged batch; `merge_rollouts` concatenates the groups in order)."""
    offsets, total = [], 0
    for rank, shard in enumerate(shards):
        offsets.append(total)
        if rank % tp_size == tp_size - 1:  # the group's last rank: the next group starts after it
            total += len(shard)
    return offsets


def stream_and_score(
    stream: RankStream,
    shards: list[PromptBatch],
    tp_size: int,
    scorer: RewardStream,
    group_inputs: GroupInputs,
) -> tuple[list[RolloutBatch], set[int]]:
    """Drain the ranks' `generate_stream` calls, adding each finished group to `scorer` at its
    rows in the merged batch (sample j of the shard's prompt p -> (offset + p) * n + j).

    Returns every rank's batch and the rows added (first rank of each tensor-parallel group only:
    its peers report the same groups)."""
    offsets = prompt_offsets(shards, tp_size)
    batches: dict[int, RolloutBatch] = {}
    added: set[int] = set()
    while not stream.done:
        for rank, item in stream.poll(POLL_S):
            if isinstance(item, RolloutBatch):
                batches[rank] = item
            elif rank % tp_size == 0:
                rows = _rows(item, offsets[rank])
                scorer.add(group_inputs(shards[rank].select(item.prompt_rows), item.responses), rows)
                added.update(rows)
        scorer.pump(0.0)
    return [batches[rank] for rank in range(len(shards))], added


def _rows(groups: FinishedGroups, offset: int) -> list[int]:
    n = len(groups.responses) // max(len(groups.prompt_rows), 1)
    return [(offset + p) * n + j for p in groups.prompt_rows for j in range(n)]


def score_the_rest(
    scorer: RewardStream, batch: RolloutBatch, added: set[int], inputs: Callable[[], Any]
) -> None:
    """Add the rows of the merged `batch` nobody streamed (`inputs()`: all of its reward inputs)."""
    missing = [row for row in range(len(batch)) if row not in added]
    if missing:
        every = inputs()
        scorer.add([every[row] for row in missing], missing)
