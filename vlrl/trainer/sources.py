"""Where a step's rows come from: the engines' calls, the rollout sources, ReMax's baseline.

A step reads fill -> take -> advantages -> update (`PPOTrainer.train_step`); `fill` asks a
`RolloutSource` for generation rounds until the batch holds `rollout_batch_size` groups
(`vlrl.trainer.rounds.BatchFiller`). Two sources, chosen once at start-up:

- `SynchronousRounds`: every round is generated now, by the engines on the training ranks (hybrid) or on
  their own ranks with `max_staleness=0`;
- `PrefetchedRounds` (asynchronous mode): the step's first round was submitted up to `max_staleness`
  steps earlier (`vlrl.trainer.async_rollout.AsyncRollout`); taking it syncs the engines and
  submits the steps ahead. Partial rollouts are the engines' side of this source (they take the
  sync between two engine steps, `vlrl.workers.weight_exchange`): nothing here changes with them.

`EngineCalls` is what both use: prompts sharded over the engines with the round's seed, scored on
the generating ranks (or here, for a whole-batch reward), merged into the driver's `StepSamples`.
`GreedyBaseline` is ReMax's baseline, the one strategy the step plan's `baseline="greedy"` names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Protocol

import torch

from vlrl.batch.image_refs import ImageRefs
from vlrl.batch.rows import PromptBatch
from vlrl.batch.samples import StepSamples
from vlrl.config import PPOConfig
from vlrl.rewards import RewardResult, scores_to_token_level
from vlrl.trainer.async_rollout import AsyncRollout, Prefetched, token_staleness
from vlrl.trainer.dispatch import merge_samples, split_prompts
from vlrl.trainer.metrics import PhaseTimer
from vlrl.trainer.ranks import Pending, Ranks
from vlrl.utils.busy_clock import IdleShares
from vlrl.workers.rank_worker import RankWorker
from vlrl.workers.scoring import BatchScorer

Round = tuple[PromptBatch, StepSamples, dict[str, float]]  # a round's prompts, scored samples, metrics


class EngineCalls:
    """The driver's generation calls to the engines' ranks."""

    def __init__(
        self,
        config: PPOConfig,
        engines: Ranks,
        rewards: Any,
        scorer: BatchScorer,
        pad_token_id: int,
        image_refs: ImageRefs | None,
    ) -> None:
        self.config, self.engines, self.rewards, self.scorer = config, engines, rewards, scorer
        self.pad_token_id, self.image_refs = pad_token_id, image_refs
        # the generating ranks score their rows, unless the reward must see the whole batch at once
        self.rank_scoring = not rewards.whole_batches

    def submit(
        self,
        prompts: PromptBatch,
        step: int,
        overrides: dict[str, Any] | None = None,
        round_: int = 0,
        keep: bool = True,
        responses_back: bool = False,
    ) -> Pending:
        """Start generating `prompts` for `step` and return at once (`merge` the result).
        `round_`: the generation round of the step (each gets its own seed); `keep`: the ranks
        publish the rows for training; `responses_back`: the samples carry the response ids."""
        rollout = self.config.worker.rollout
        overrides = {"seed": _step_seed(rollout.seed, step) + round_ * 1_000_003, **(overrides or {})}
        if self.image_refs is not None:
            prompts = replace(prompts)  # the loader's batch keeps its objects
            self.image_refs.refer(prompts)
        shards = split_prompts(prompts, self.config.rollout_world_size, rollout.tensor_parallel_size)
        return self.engines.submit(
            RankWorker.generate, shards, overrides=overrides, keep_for=step if keep else None,
            score=self.rank_scoring, responses_back=responses_back or not self.rank_scoring,
        )  # fmt: skip

    def merge(self, per_rank: Sequence[StepSamples | None]) -> StepSamples:
        return merge_samples(per_rank, self.config.worker.rollout.tensor_parallel_size, self.pad_token_id)

    def generate(self, prompts: PromptBatch, step: int, **kwargs: Any) -> StepSamples:
        """`submit`, wait and `merge`; not scored on the driver yet (`score`)."""
        return self.merge(self.submit(prompts, step, **kwargs).result())

    def generate_scored(
        self, prompts: PromptBatch, step: int, timer: PhaseTimer | None = None, **kwargs: Any
    ) -> tuple[StepSamples, dict[str, float]]:
        """Generate and score `prompts`. The ranks score while they generate (with
        `worker.reward.streaming`, each group as it finishes): `timing/reward` is only their wait
        after generation ended. A batch reward that has not declared `PARTIAL_BATCHES = True` gets
        the whole batch on the driver after generation instead. Returns the scored samples and
        the reward metrics."""
        timer = timer or PhaseTimer()
        with timer("gen"):
            batch = self.generate(prompts, step, **kwargs)
        timer.move(batch.reward_wait_s, "gen", "reward")
        with timer("reward"):
            return batch, self.score(batch)

    def score(self, batch: StepSamples) -> dict[str, float]:
        """Put each sample's overall score on its response's last token; the reward metrics. The
        ranks scored the samples, except for a whole-batch reward or rows read from a checkpoint
        (asynchronous resume), which the driver's reward workers score here."""
        if batch.reward_parts is None:
            result = self.rewards.score(self.scorer.inputs(batch))
            batch.reward_parts = result.scores
        else:
            result = RewardResult(batch.reward_parts, batch.reward_failures)
        overall = torch.tensor([s["overall"] for s in result.scores], dtype=torch.float32)
        batch.token_level_scores = scores_to_token_level(overall, batch.response_mask)
        return result.metrics()


class RolloutSource(Protocol):
    """Generation rounds for the steps (module docstring)."""

    def round(self, round_: int, step: int, timer: PhaseTimer) -> Round: ...

    def before_validation(self, step: int) -> None: ...

    def save(self, folder: str, fetch_images: Any, rows_of: Any) -> None: ...

    def load(self, folder: str, publish: Any) -> None: ...

    def close(self) -> None: ...


class SynchronousRounds:
    """Every round is drawn from the loader and generated now, with the engines' current weights."""

    def __init__(self, calls: EngineCalls, next_prompts: Any) -> None:
        self.calls, self.next_prompts = calls, next_prompts

    def round(self, round_: int, step: int, timer: PhaseTimer) -> Round:
        prompts = self.next_prompts()
        batch, metrics = self.calls.generate_scored(prompts, step, round_=round_, timer=timer)
        return prompts, batch, metrics

    def before_validation(self, step: int) -> None:
        return None

    def save(self, folder: str, fetch_images: Any, rows_of: Any) -> None:
        return None

    def load(self, folder: str, publish: Any) -> None:
        return None

    def close(self) -> None:
        return None


class PrefetchedRounds(SynchronousRounds):
    """Asynchronous mode: the step's first round is the generation submitted up to `max_staleness`
    steps earlier (step 1, and every step with `max_staleness=0`, generate it now); later rounds
    of a step (online filtering, ReMax) are generated now, as `SynchronousRounds` does."""

    def __init__(
        self, calls: EngineCalls, next_prompts: Any, flow: AsyncRollout, total_steps: int, idle: IdleShares
    ) -> None:
        super().__init__(calls, next_prompts)
        self.flow, self.total_steps, self.idle = flow, total_steps, idle

    def round(self, round_: int, step: int, timer: PhaseTimer) -> Round:
        if round_ > 0:
            return super().round(round_, step, timer)
        with timer("gen"):
            prompts, batch, metrics = self._take(step)
        with timer("reward"):
            metrics.update(self.calls.score(batch))
        return prompts, batch, metrics

    def _take(self, step: int) -> Round:
        """The step's first round, not scored yet; then the engines get the trainer's weights and
        the generations of the steps up to `max_staleness` ahead start."""
        flow, version = self.flow, step - 1  # updates done: the trainer's weights
        ahead = flow.take(step)
        metrics = {}
        if ahead is None:  # step 1, or a staleness bound of 0: generate now, with the current weights
            metrics.update(flow.sync_engines(version))
            prompts = self.next_prompts()
            ahead = Prefetched(step, prompts, version, batch=self.calls.generate(prompts, step))
        batch = ahead.result()
        metrics["async/staleness"] = float(version - ahead.version)
        metrics.update(token_staleness(batch, version))
        metrics.update(self.idle.metrics("rollout", batch.busy_clock))
        ahead_steps = flow.next_steps(step, self.total_steps)
        if ahead_steps:
            metrics.update(flow.sync_engines(version))
        for later in ahead_steps:
            prompts_next = self.next_prompts()
            flow.submit(later, prompts_next, self.calls.submit(prompts_next, later), self.calls.merge)
        return ahead.prompts, batch, metrics

    def before_validation(self, step: int) -> None:
        self.flow.sync_engines(step)  # validate the policy trained so far, not the engines' lag

    def save(self, folder: str, fetch_images: Any, rows_of: Any) -> None:
        self.flow.save(folder, fetch_images, rows_of)  # the generations in flight, for an exact resume

    def load(self, folder: str, publish: Any) -> None:
        self.flow.load(folder, publish)

    def close(self) -> None:
        self.flow.wait_for_receive()  # no weight broadcast left half done


class GreedyBaseline:
    """ReMax: each sample's baseline is the reward of a greedy response to its prompt."""

    def __init__(self, calls: EngineCalls) -> None:
        self.calls = calls

    def baselines(self, prompts: PromptBatch, batch: StepSamples, round_: int, step: int) -> torch.Tensor:
        """[N] for `batch`'s samples: the greedy response's reward for each one's prompt."""
        greedy, _ = self.calls.generate_scored(prompts, step, overrides={"n": 1, "temperature": 0.0},
                                               round_=round_, keep=False)  # fmt: skip
        by_uid = {
            uid: parts["overall"] for uid, parts in zip(greedy.group_ids.tolist(), greedy.scored_parts())
        }
        return torch.tensor([by_uid[uid] for uid in batch.group_ids.tolist()])


def _step_seed(seed: int, step: int) -> int:
    """Sampling seed of a step: a function of (seed, step) only, so a resumed run samples the same."""
    return (seed * 1_000_003 + step) % (2**31 - 1)
