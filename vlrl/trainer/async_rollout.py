"""Asynchronous mode's generation (`worker.rollout.async_ranks`): engines on their own ranks, a step ahead.

With `max_staleness=1`, step k runs
    take the batch generated during step k-1 (or generate it now: step 1, after a resume without one)
    sync    training ranks -> engines: the trainer's weights after update k-1 (vlrl.rollout.weight_broadcast)
    submit  step k+1's first generation round, which runs while the driver scores step k's batch
            and the training ranks compute its log-probs and update
so a batch is sampled by the policy one update older than the one it trains (`async/staleness`),
and the gap shows in `rollout/log_prob_diff_*` (engine vs actor log-probs of the sampled tokens;
`algorithm.tis_cap` corrects for it). With `max_staleness=0` nothing is submitted ahead: sync,
generate, train, in turn, on separate ranks.

The prompts of step k+1 are drawn from the loader when its generation is submitted (during step
k). A checkpoint at step k waits for that generation and saves it (`prefetched.pt`), so a resumed
run trains on exactly the batch the uninterrupted run would have.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from vlrl.batch.rows import PromptBatch, RolloutBatch
from vlrl.batch.samples import StepSamples
from vlrl.trainer.ranks import Pending, RankRoles
from vlrl.workers.rank_worker import RankWorker

PREFETCHED = "prefetched.pt"


@dataclass
class Prefetched:
    step: int
    prompts: PromptBatch
    version: int  # the trainer weights' version (updates done) the engines generated with
    pending: Pending | None = None  # None once `batch` is in
    batch: StepSamples | None = None  # the rows stay on the rollout ranks (vlrl.batch.held)
    merge: Callable[[list[StepSamples | None]], StepSamples] | None = None

    def result(self) -> StepSamples:
        if self.batch is None:
            assert self.pending is not None and self.merge is not None
            self.batch, self.pending = self.merge(self.pending.result()), None
        return self.batch


class AsyncRollout:
    """Keeps the engines' weights and the generation one step ahead of the trainer (module docstring)."""

    def __init__(self, roles: RankRoles, staleness: int) -> None:
        self.roles, self.staleness = roles, staleness
        self.engine_version = -1  # weights the engines hold: -1 before the first sync
        self.prefetched: Prefetched | None = None

    def connect(self, free_address: Callable[[], tuple[str, int]]) -> None:
        """Training rank 0 and the rollout ranks form the broadcast group (all join at once)."""
        host, port = free_address()
        train_ranks, engines = self.roles.train, self.roles.generate
        n_train, n_engines = len(train_ranks.workers), len(engines.workers)
        members = 1 + n_engines
        joins = [
            train_ranks.submit(RankWorker.join_weight_broadcast, [host] * n_train, [port] * n_train,
                               [0] + [None] * (n_train - 1), [members] * n_train),
            engines.submit(RankWorker.join_weight_broadcast, [host] * n_engines, [port] * n_engines,
                           list(range(1, members)), [members] * n_engines),
        ]  # fmt: skip
        for join in joins:
            join.result()

    def sync_engines(self, version: int) -> dict[str, float]:
        """Broadcast the trainer's weights (`version`: updates done) unless the engines hold them."""
        if self.engine_version == version:
            return {}
        sent = self.roles.train.submit(RankWorker.send_weights)
        received = self.roles.generate.submit(RankWorker.receive_weights)
        received.result()
        metrics = sent.result()[0]
        self.engine_version = version
        return metrics

    def take(self, step: int) -> Prefetched | None:
        """The generation submitted for `step`, if there is one (its `result()` waits for it)."""
        found, self.prefetched = self.prefetched, None
        if found is not None and found.step != step:
            raise RuntimeError(f"the prefetched generation is for step {found.step}, not {step}")
        return found

    def submit(self, step: int, prompts: PromptBatch, pending: Pending, merge: Callable) -> None:
        self.prefetched = Prefetched(step, prompts, self.engine_version, pending, merge=merge)

    # ------------------------------------------------------------------ checkpoints
    def save(
        self,
        folder: str,
        fetch_images: Callable[[list[list[Any]]], list[list[Any]]],
        rows_of: Callable[[StepSamples], RolloutBatch],
    ) -> None:
        """Wait for the generation in flight and write it (its rows, fetched by `rows_of` from the
        rollout ranks, with its images' pixels) to `folder`."""
        if self.prefetched is None:
            return
        found = self.prefetched
        batch, prompts = rows_of(found.result()), replace(found.prompts)
        for media in (batch, prompts):
            media.images = fetch_images(media.images)
            if media.videos is not None:
                media.videos = fetch_images(media.videos)
        torch.save({"step": found.step, "version": found.version, "prompts": prompts, "batch": batch},
                   os.path.join(folder, PREFETCHED))  # fmt: skip

    def load(self, folder: str, publish: Callable[[RolloutBatch], StepSamples]) -> None:
        """The generation a checkpoint saved, its rows `publish`ed for the training ranks."""
        path = os.path.join(folder, PREFETCHED)
        if os.path.isfile(path):
            saved = torch.load(path, weights_only=False)
            self.prefetched = Prefetched(
                saved["step"], saved["prompts"], saved["version"], batch=publish(saved["batch"])
            )
