"""A rank's engine side: its rollout engine and what serves it.

Sampling a shard of prompts, scoring the rows in this rank's reward workers as the groups finish,
publishing the rows for the training ranks and holding them until their step took them
(`Holdings`), and, on a rollout rank (asynchronous mode), taking the broadcast weights
(`WeightIntake`). A hybrid rank holds this side and a training side (`vlrl.workers.training_side`);
they share the device, so the rank worker makes room for the engine around each generation (the
`room` it passes in: the actor offloaded, the engine woken and put back to sleep).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from vlrl.batch.held import Holdings, publish
from vlrl.batch.image_refs import ImageRefs
from vlrl.batch.rows import FinishedGroups, PromptBatch, RolloutBatch
from vlrl.batch.samples import StepSamples
from vlrl.config import PPOConfig
from vlrl.rewards.runner import RewardRunner
from vlrl.rollout.base import RolloutEngine
from vlrl.workers.scoring import BatchScorer, RankScoring
from vlrl.workers.weight_exchange import WeightIntake

Room = Callable[[bool], AbstractContextManager[Any]]  # (the rows are for training) -> context


class EngineSide:
    """See the module docstring. `rollout_only`: a rollout rank of asynchronous mode (its rows are
    taken up to `max_staleness` steps later; it reports its own rollouts whatever its rank)."""

    def __init__(
        self,
        config: PPOConfig,
        rank: int,
        engine: RolloutEngine,
        scorer: BatchScorer,
        image_refs: ImageRefs | None,
        fetch_media: Callable[[PromptBatch], None],
        rollout_only: bool,
    ) -> None:
        self.config, self.engine, self.scorer = config, engine, scorer
        self.image_refs, self.fetch_media = image_refs, fetch_media
        self.holdings = Holdings(max(config.worker.rollout.max_staleness, 1) if rollout_only else 0)
        self.reports_rollouts = reports_rollouts(config, rank, rollout_only)
        self.rewards: RewardRunner | None = None  # this rank's reward workers (`generate(score=True)`)
        self.intake: WeightIntake | None = None  # asynchronous mode: the broadcast weights

    def generate(
        self,
        prompts: PromptBatch,
        overrides: dict[str, Any] | None,
        keep_for: int | None,
        score: bool,
        responses_back: bool,
        room: Room,
    ) -> StepSamples | None:
        """`RankWorker.generate`: this rank's samples for its shard, or None on a tensor-parallel
        peer that is not its group's first rank."""
        self.fetch_media(prompts)
        scoring = self._scoring(prompts) if score and self.reports_rollouts else None
        try:
            batch = self._run_engine(prompts, overrides, scoring, room(keep_for is not None))
        except BaseException:
            if scoring is not None:
                scoring.abort()
            raise
        if not self.reports_rollouts:
            return None
        if self.image_refs is not None:  # the batch holds references (tool images are stored here)
            self.image_refs.refer(batch)
        # The engines assemble rows on the CPU (vlrl.rollout.output.assemble_rollout_batch), on GPU
        # machines too, so what goes into the object store is host memory; the actor moves the rows
        # it takes to its device (tests/gpu/test_actor_gpu.py runs take_rows + update on CUDA).
        held = None if keep_for is None else self.holdings.keep(publish(batch), keep_for)
        samples = StepSamples.of(batch, held, with_responses=responses_back)
        if scoring is not None:
            result, samples.reward_wait_s = scoring.finish(batch)
            samples.reward_parts, samples.reward_failures = result.scores, result.failures
        return samples

    def _run_engine(
        self,
        prompts: PromptBatch,
        overrides: dict[str, Any] | None,
        scoring: RankScoring | None,
        room: AbstractContextManager[Any],
    ) -> RolloutBatch:
        """The engine's batch for `prompts`, inside `room`; the groups it reports finished early go
        to `scoring`."""
        with room:
            for item in self.engine.generate_stream(prompts, overrides):
                if not isinstance(item, FinishedGroups):
                    batch = item
                elif scoring is not None:
                    scoring.add_groups(item)
        return batch

    def _scoring(self, prompts: PromptBatch) -> RankScoring:
        """Scoring for one generation call, in this rank's reward workers (`RankWorker.setup` starts
        them; else the first call does)."""
        if self.rewards is None:
            self.rewards = RewardRunner(self.config.worker.reward)
        return RankScoring(self.rewards, self.scorer, prompts, self.config.worker.reward.streaming)


def reports_rollouts(config: PPOConfig, rank: int, rollout_only: bool) -> bool:
    """Whether a rank returns its engine's rollouts: the first rank of its tensor-parallel group (a
    rollout-only rank has an engine of its own)."""
    return rollout_only or rank % config.worker.rollout.tensor_parallel_size == 0
