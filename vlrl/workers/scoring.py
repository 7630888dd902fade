"""Scoring a batch's rows: reading them as `RewardInput`s, and scoring them next to where they were
generated.

A generating rank scores its own rows (`RankScoring`), so the response ids never cross to the
driver: it gets per-sample scores. With `worker.reward.streaming` each group is handed to the
reward workers as soon as the engine reports it finished (`RolloutEngine.generate_stream`), so the
rank's reward time hides behind its generation time; what an engine does not report early (the HF
engine, multi-turn rollouts) is scored from the batch after generation. Scores do not depend on
the order samples are scored in, so the batch is the same either way.

A batch reward that must see the whole step's batch (`RewardRunner.whole_batches`) cannot be
scored in parts: the driver scores it with the same `BatchScorer` on `StepSamples` that carry the
response ids.
"""

from __future__ import annotations

import time
from typing import Any

from vlrl.batch.rows import FinishedGroups, PromptBatch, RolloutBatch
from vlrl.batch.samples import StepSamples
from vlrl.rewards import RewardInput, RewardResult, build_reward_inputs
from vlrl.rewards.runner import RewardRunner, RewardStream
from vlrl.rollout.output import assemble_rollout_batch


class BatchScorer:
    """A batch's rows as `RewardInput`s. `pad_token_id` and `eos_token_ids` are the engines'
    (streamed groups are read as the engines assemble rows)."""

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
            if batch.responses is None:
                raise ValueError("the samples carry no response ids: their ranks scored them")
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


class RankScoring:
    """One generation call's scoring on its rank: `add_groups` as the engine reports them (with
    `streaming`), then `finish` with the whole batch scores the rest and waits."""

    def __init__(
        self, runner: RewardRunner, scorer: BatchScorer, prompts: PromptBatch, streaming: bool
    ) -> None:
        self.scorer, self.prompts, self.streaming = scorer, prompts, streaming
        self.stream: RewardStream = runner.stream()
        self.added: set[int] = set()

    def add_groups(self, groups: FinishedGroups) -> None:
        """Start scoring `groups` at their rows in the batch (sample j of prompt p: row p * n + j)."""
        if not self.streaming:
            return
        rows = batch_rows(groups)
        self.stream.add(
            self.scorer.group_inputs(self.prompts.select(groups.prompt_rows), groups.responses), rows
        )
        self.added.update(rows)
        self.stream.pump(0.0)

    def finish(self, batch: RolloutBatch) -> tuple[RewardResult, float]:
        """Score the rows nobody streamed and wait for all: the result in row order, and the seconds
        waited (the reward time generation did not hide)."""
        start = time.perf_counter()
        with self.stream:  # leaving early (a failure) stops the workers still busy
            missing = [row for row in range(len(batch)) if row not in self.added]
            if missing:
                every = self.scorer.inputs(batch)
                self.stream.add([every[row] for row in missing], missing)
            result = self.stream.finish(len(batch))
        return result, time.perf_counter() - start

    def abort(self) -> None:
        """Generation failed: stop the workers still scoring this call's groups."""
        self.stream.__exit__(None, None, None)


def batch_rows(groups: FinishedGroups) -> list[int]:
    """The batch rows of streamed `groups` (`n` samples per prompt, prompt-major)."""
    n = len(groups.responses) // max(len(groups.prompt_rows), 1)
    return [p * n + j for p in groups.prompt_rows for j in range(n)]
