"""Scoring a step's samples: reading rows for the reward function, putting the scores back, and
streaming (`worker.reward.streaming`): each group scored as soon as its samples are generated.

Streaming: the engines report finished groups while the rest of their shard is still generating
(`RolloutEngine.generate_stream`); the driver hands each group to the reward workers at once, at
the rows the group will have in the merged batch, so a step's reward time hides behind its
generation time. What an engine does not report early (the HF engine, multi-turn rollouts) is
scored from the merged batch, as without streaming. Scores do not depend on the order samples are
scored in, so the batch is the same either way.
"""

from __future__ import annotations

from typing import Any

import torch

from vlrl.batch.rows import FinishedGroups, PromptBatch, RolloutBatch
from vlrl.batch.samples import StepSamples
from vlrl.rewards import RewardInput, RewardResult, build_reward_inputs, scores_to_token_level
from vlrl.rewards.runner import RewardStream
from vlrl.rollout.output import assemble_rollout_batch
from vlrl.trainer.ranks import RankStream

POLL_S = 0.02
"""How long the driver waits for the engines before it takes in finished rewards again."""


class BatchScorer:
    """A batch's rows as `RewardInput`s and the scores back on the batch. `pad_token_id` and
    `eos_token_ids` are the engines' (streamed groups are read as the engines assemble rows)."""

    def __init__(
        self, tokenizer: Any, pad_token_id: int, eos_token_ids: list[int], skip_special_tokens: bool
    ) -> None:
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.pad_token_id, self.eos_token_ids = pad_token_id, eos_token_ids

    def inputs(self, batch: RolloutBatch | StepSamples) -> list[RewardInput]:
        """Each row's `RewardInput`: the decoded response (multi-turn: the final answer, with the
        whole trajectory in the extras), its length, prompt, ground truth and extras."""
        lengths = batch.response_mask.sum(-1).tolist()
        extras = batch.extras
        if batch.trajectories is not None:  # multi-turn: the final answer, and the whole trajectory
            texts = [info["final_response"] for info in batch.trajectories]
            extras = [{**extra, "trajectory": info} for extra, info in zip(batch.extras, batch.trajectories)]
        else:
            texts = [self.tokenizer.decode(row[:length], skip_special_tokens=self.skip_special_tokens)
                     for row, length in zip(batch.responses.tolist(), lengths)]  # fmt: skip
        return build_reward_inputs(texts, lengths, batch.prompts, batch.ground_truths, extras)

    def group_inputs(self, prompts: PromptBatch, responses: list[list[int]]) -> list[RewardInput]:
        """The inputs of streamed groups (`prompts`, their samples' token ids, prompt-major): their
        rows assembled as the engine assembles the batch, then read as from the batch."""
        n = len(responses) // len(prompts)
        return self.inputs(
            assemble_rollout_batch(prompts, responses, n, self.pad_token_id, self.eos_token_ids)
        )

    @staticmethod
    def apply(batch: StepSamples, result: RewardResult) -> dict[str, float]:
        """Put the scores on `batch` (the overall one on each response's last token); the metrics."""
        batch.reward_parts = result.scores
        overall = torch.tensor([s["overall"] for s in result.scores], dtype=torch.float32)
        batch.token_level_scores = scores_to_token_level(overall, batch.response_mask)
        return result.metrics()

    def stream(
        self, calls: RankStream, shards: list[PromptBatch], tp_size: int, scorer: RewardStream
    ) -> tuple[list[StepSamples | None], set[int]]:
        """Drain the ranks' `generate_stream` calls, adding each finished group to `scorer` at its
        rows in the merged batch (sample j of the shard's prompt p -> (offset + p) * n + j).

        Returns every rank's samples (None from the tensor-parallel peers that are not their group's
        first rank: they report nothing) and the rows added."""
        offsets = prompt_offsets(shards, tp_size)
        batches: dict[int, StepSamples] = {}
        added: set[int] = set()
        while not calls.done:
            for rank, item in calls.poll(POLL_S):
                if isinstance(item, StepSamples):
                    batches[rank] = item
                elif rank % tp_size == 0:
                    rows = merged_rows(item, offsets[rank])
                    scorer.add(self.group_inputs(shards[rank].select(item.prompt_rows), item.responses), rows)
                    added.update(rows)
            scorer.pump(0.0)
        return [batches.get(rank) for rank in range(len(shards))], added

    def finish(self, scorer: RewardStream, batch: StepSamples, added: set[int]) -> dict[str, float]:
        """Score the rows of the merged `batch` nobody streamed, wait for all, apply; the metrics."""
        missing = [row for row in range(len(batch)) if row not in added]
        if missing:
            every = self.inputs(batch)
            scorer.add([every[row] for row in missing], missing)
        return self.apply(batch, scorer.finish(len(batch)))


def prompt_offsets(shards: list[PromptBatch], tp_size: int) -> list[int]:
    """Per rank: how many prompts the data-parallel groups before its own hold (its first
    prompt's index in the merged batch; `PPOTrainer._merge` joins the groups in order)."""
    offsets, total = [], 0
    for rank, shard in enumerate(shards):
        offsets.append(total)
        if rank % tp_size == tp_size - 1:  # the group's last rank: the next group starts after it
            total += len(shard)
    return offsets


def merged_rows(groups: FinishedGroups, offset: int) -> list[int]:
    """The merged-batch rows of `groups` reported by a rank whose first prompt is row `offset`."""
    n = len(groups.responses) // max(len(groups.prompt_rows), 1)
    return [(offset + p) * n + j for p in groups.prompt_rows for j in range(n)]
