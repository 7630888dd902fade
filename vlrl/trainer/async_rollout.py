"""Asynchronous mode's generation (`worker.rollout.async_ranks`): engines on their own ranks, ahead.

With `max_staleness=k` (k >= 1), step t runs
    take the batch generated for step t (or generate it now: step 1, after a resume without one)
    sync    training ranks -> engines: the trainer's weights after update t-1 (vlrl.rollout.weight_broadcast)
    submit  generation for the steps up to t+k not yet submitted, which run while the driver scores
            step t's batch and the training ranks compute its log-probs and update
so a batch is sampled by a policy at most k updates older than the one it trains
(`async/staleness`), and the gap shows in `rollout/log_prob_diff_*` (engine vs actor log-probs of
the sampled tokens; an off-policy correction, `algorithm.off_policy_correction`, weights for it).
With k = 1 the sync waits for the engines (nothing is in flight then). With k >= 2 a generation is
always in flight when the sync comes: training rank 0 packs a host copy of the weights and
broadcasts it from a thread (`RankWorker.send_weights(background=True)`), and each rollout rank
loads it when the generation it is running ends, before the next one, which the sync precedes
in its queue. With `max_staleness=0` nothing is submitted ahead: sync, generate, train, in turn,
on separate ranks.

The prompts of step t+k are drawn from the loader when its generation is submitted (during step
t). A checkpoint at step t waits for the generations in flight and saves them (`prefetched.pt`),
so a resumed run trains on exactly the batches the uninterrupted run would have.
"""

from __future__ import annotations

import os
from collections import deque
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


def token_staleness(batch: StepSamples, version: int) -> dict[str, float]:
    """How old the policies that sampled `batch`'s tokens are against the trainer's `version`
    (updates done), from the versions the engines labelled every token with ({} without them):
    `async/token_staleness_mean` (token mean) and `_max` (the oldest); with partial rollouts,
    `async/tokens_newer_frac`, the share of tokens sampled by weights that arrived inside their
    response's generation, and `async/rows_updated_frac`, the share of responses that saw a switch."""
    if batch.version_stats is None:
        return {}
    first, mean, newer = batch.version_stats.double().unbind(-1)  # [N] each
    tokens = batch.response_mask.sum(-1).double()  # [N]
    total = float(tokens.sum().clamp(min=1))
    return {
        "async/token_staleness_mean": version - float((mean * tokens).sum()) / total,
        "async/token_staleness_max": version - float(first.min()),
        "async/tokens_newer_frac": float(newer.sum()) / total,
        "async/rows_updated_frac": float((newer > 0).double().mean()),
    }


class AsyncRollout:
    """Keeps the engines' weights and the generation up to `staleness` steps ahead of the trainer
    (module docstring)."""

    def __init__(self, roles: RankRoles, staleness: int) -> None:
        self.roles, self.staleness = roles, staleness
        self.engine_version = -1  # weights the engines hold (or will, once queued): -1 before the first sync
        self.queue: deque[Prefetched] = deque()  # generations submitted, oldest (next step's) first
        self.receiving: Pending | None = None  # the rollout ranks' queued receive of a background sync

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
        """Broadcast the trainer's weights (`version`: updates done) unless the engines hold them.
        With a staleness bound above 1 the send runs in the background (module docstring): the
        rollout ranks' receive is queued behind their generation in flight, and the metrics are
        the previous background send's."""
        if self.engine_version == version:
            return {}
        background = self.staleness > 1
        self.wait_for_receive()  # one background send at a time (rank 0 waits for its own too)
        train_ranks, engines = self.roles.train, self.roles.generate
        sent = train_ranks.submit(
            RankWorker.send_weights, [version] * len(train_ranks.workers), background=background
        )
        received = engines.submit(RankWorker.receive_weights, [version] * len(engines.workers))
        self.engine_version = version
        if background:
            self.receiving = received
            return sent.result()[0]
        received.result()
        return sent.result()[0]

    def wait_for_receive(self) -> None:
        """Until the rollout ranks loaded the last background send (the generations queued before
        it finish first)."""
        receiving, self.receiving = self.receiving, None
        if receiving is not None:
            receiving.result()

    def take(self, step: int) -> Prefetched | None:
        """The generation submitted for `step`, if there is one (its `result()` waits for it)."""
        if not self.queue:
            return None
        found = self.queue.popleft()
        if found.step != step:
            raise RuntimeError(f"the prefetched generation is for step {found.step}, not {step}")
        return found

    def next_steps(self, step: int, last: int) -> list[int]:
        """The steps whose generation to submit during `step` (up to `step + staleness`, at most
        `last`): those after the newest one submitted."""
        newest = self.queue[-1].step if self.queue else step
        return list(range(newest + 1, min(step + self.staleness, last) + 1))

    def submit(self, step: int, prompts: PromptBatch, pending: Pending, merge: Callable) -> None:
        self.queue.append(Prefetched(step, prompts, self.engine_version, pending, merge=merge))

    # ------------------------------------------------------------------ checkpoints
    def save(
        self,
        folder: str,
        fetch_images: Callable[[list[list[Any]]], list[list[Any]]],
        rows_of: Callable[[StepSamples], RolloutBatch],
    ) -> None:
        """Wait for the generations in flight and write them (their rows, fetched by `rows_of` from
        the rollout ranks, with their images' pixels) to `folder`."""
        if not self.queue:
            return
        saved = []
        for found in self.queue:
            batch, prompts = rows_of(found.result()), replace(found.prompts)
            for media in (batch, prompts):
                media.images = fetch_images(media.images)
                if media.videos is not None:
                    media.videos = fetch_images(media.videos)
            saved.append({"step": found.step, "version": found.version, "prompts": prompts, "batch": batch})
        torch.save(saved, os.path.join(folder, PREFETCHED))

    def load(self, folder: str, publish: Callable[[RolloutBatch], StepSamples]) -> None:
        """The generations a checkpoint saved, their rows `publish`ed for the training ranks."""
        path = os.path.join(folder, PREFETCHED)
        if not os.path.isfile(path):
            return
        saved = torch.load(path, weights_only=False)
        for item in saved if isinstance(saved, list) else [saved]:  # one dict: written before k > 1
            self.queue.append(
                Prefetched(item["step"], item["prompts"], item["version"], batch=publish(item["batch"]))
            )
