"""A rank's training side: the actor shard, the reference, and the rows a step keeps here.

`take_rows` fetches this rank's shard of the step's rows from where the generating ranks hold them
and keeps it, with the log-probs the step plan asks for, until `update` names the same rows with
the driver's advantages. On a training rank of asynchronous mode it also sends the weights to the
engines (`WeightSender`); on a hybrid rank the rank worker syncs them into its own engine side.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from vlrl.algorithms.importance import log_prob_drift, off_policy_weights
from vlrl.algorithms.kl import KLPenalty, PenalizedRewards, penalized_rewards
from vlrl.batch.held import TakePlan, take
from vlrl.batch.rows import KeptRows, RolloutBatch, spread_over_response
from vlrl.config import PPOConfig
from vlrl.rewards import scores_to_token_level
from vlrl.workers.token_advantages import token_level_advantages
from vlrl.workers.weight_exchange import WeightSender

if TYPE_CHECKING:
    from vlrl.workers.actor import Actor
    from vlrl.workers.reference import AdapterOffReference, Reference


class TrainingSide:
    """See the module docstring. `fetch_media`: images behind references, fetched in place;
    `release_images`: drop this rank's hold on the step's images."""

    def __init__(
        self,
        config: PPOConfig,
        rank: int,
        actor: Actor,
        reference: Reference | AdapterOffReference | None,
        pad_token_id: int,
        fetch_media: Callable[[RolloutBatch], None],
        release_images: Callable[[], None],
    ) -> None:
        self.config, self.rank, self.actor, self.reference = config, rank, actor, reference
        self.pad_token_id, self.fetch_media, self.release_images = pad_token_id, fetch_media, release_images
        # this step's shard and its log-probs, kept by `take_rows` for the update (which then gets
        # only row ids and advantages from the driver): the step's row id of each row, and the rows.
        # Emptied by the update.
        self.kept_rows: list[int] = []
        self.old_from_update: list[int] = []  # of kept_rows: the update computes their old log-probs
        self.kept: RolloutBatch | None = None
        self.sender: WeightSender | None = None  # asynchronous mode: weights to the engines

    def take_rows(
        self, plan: TakePlan, rows: list[int], kl_penalty: KLPenalty | None
    ) -> PenalizedRewards | None:
        """`RankWorker.take_rows`."""
        batch = take(plan, self.pad_token_id)
        self.fetch_media(batch)
        old = self._old_pass(batch)
        ref = self.reference.compute_log_probs(batch) if self.reference is not None else None
        batch.old_log_probs, batch.ref_log_probs = old, ref
        # the rows whose old log-probs the update's first mini-batch computes (none after a full pass)
        first = [] if self.config.plan.old_log_probs == "pass" else rows[: self.actor.samples_per_minibatch]
        self.old_from_update = list(first)
        self.kept_rows, self.kept = (
            list(rows),
            batch,
        )  # replaces what a step that failed before its update left
        if kl_penalty is None:
            return None
        if old is None or ref is None:
            raise RuntimeError("a KL penalty in the reward needs the old and reference log-probs")
        scores = scores_to_token_level(kl_penalty.scores, batch.response_mask)  # as the driver puts them
        return penalized_rewards(
            scores, old, ref, batch.response_mask, kl_penalty.coef, kl_penalty.kind, per_token=False,
            low_var_clamp=kl_penalty.low_var_clamp,
        )  # fmt: skip

    def _old_pass(self, batch: RolloutBatch) -> torch.Tensor | None:
        """[N, R] old log-probs of the rows the plan's pass covers (0 where the update computes
        them: the first mini-batch's, `mixed`), or None when it computes all (`update`)."""
        which = self.config.plan.old_log_probs
        if which == "update":
            return None
        if which == "pass":
            return self.actor.compute_log_probs(batch)
        first = min(self.actor.samples_per_minibatch, len(batch))
        old = torch.zeros(batch.responses.shape, dtype=torch.float32)  # [N, R]
        if first < len(batch):
            old[first:] = self.actor.compute_log_probs(batch.select(list(range(first, len(batch)))))
        return old

    def update(self, kept: KeptRows) -> tuple[dict[str, float], dict[str, float]]:
        """`RankWorker.update`, without the hybrid rank's sync into its engine."""
        batch = self._kept_batch(kept)
        algo, plan = self.config.algorithm, self.config.plan
        own_first = self.old_from_update != []  # the first mini-batch's old log-probs come from the update
        if own_first and kept.rows[: len(self.old_from_update)] != self.old_from_update:
            raise RuntimeError(
                f"rank {self.rank}: the update's first mini-batch (rows {kept.rows[:5]}...) is not the one "
                f"take_rows left without old log-probs ({self.old_from_update[:5]}...)"
            )
        stats: dict[str, float] = {}
        if kept.token_rewards is not None:  # before the old log-probs may give way to the engine's
            ulysses = self.config.worker.actor.ulysses_size
            batch.advantages, stats = token_level_advantages(batch, kept.token_rewards, ulysses)
        drift: dict[str, float] = {}
        if not own_first and batch.old_log_probs is not None and batch.rollout_log_probs is not None:
            drift = log_prob_drift(batch.rollout_log_probs, batch.old_log_probs, batch.response_mask)
        corrected: dict[str, float] = {}
        if plan.correction != "none":
            weights, corrected = off_policy_weights(
                plan.correction, batch.tensor("old_log_probs"), batch.tensor("rollout_log_probs"),
                batch.response_mask, algo.correction_bound,
            )  # fmt: skip
            batch.advantages = batch.tensor("advantages") * weights
        if plan.ratio_from == "rollout":  # the ratio from the policy that sampled
            batch.old_log_probs, own_first = batch.tensor("rollout_log_probs"), False
        try:
            metrics = self.actor.update_policy(batch, on_policy=own_first)
        finally:
            self.kept_rows, self.kept, self.old_from_update = [], None, []
            self.release_images()
        if own_first and batch.rollout_log_probs is not None:  # the old ones are complete now
            drift = log_prob_drift(
                batch.rollout_log_probs, batch.tensor("old_log_probs"), batch.response_mask
            )
        return {**metrics, **corrected, **stats}, drift

    def _kept_batch(self, kept: KeptRows) -> RolloutBatch:
        """The shard `take_rows` kept, in `kept.rows` order, with the driver's new columns."""
        position = {row: i for i, row in enumerate(self.kept_rows)}
        missing = [row for row in kept.rows if row not in position]
        if self.kept is None or missing:
            raise RuntimeError(
                f"rank {self.rank}: the update names rows {missing[:5] or kept.rows[:5]} that this step's "
                "take_rows did not keep here (take_rows must run first, with the same rows)"
            )
        batch = self.kept.select([position[row] for row in kept.rows])
        for name, value in kept.columns.items():
            setattr(batch, name, _to_width(value, batch.responses.shape[1]))
        for name, value in kept.per_row.items():
            setattr(batch, name, spread_over_response(value, batch.response_mask))
        return batch

    def send_weights(self, version: int, background: bool) -> dict[str, float]:
        """`RankWorker.send_weights`."""
        from vlrl.rollout.weight_sync import full_named_tensors

        assert self.sender is not None, "join_weight_broadcast first"
        named = full_named_tensors(self.actor.model.module, self.sender.dtype)  # cast before the all-gathers
        return self.sender.send(named, version, background)

    def save_checkpoint(self, path: str, model_only: bool) -> None:
        """`RankWorker.save_checkpoint`."""
        if model_only:
            self.actor.save_hf(os.path.join(path, "huggingface"))
            return
        self.actor.save_checkpoint(path)
        if self.rank == 0:
            self.actor.model.hf_config.save_pretrained(os.path.join(path, "hf_config"))
            self.actor.model.tokenizer_or_processor().save_pretrained(os.path.join(path, "hf_config"))
            self.actor.save_adapter_config(os.path.join(path, "hf_config"))


def _to_width(values: torch.Tensor, width: int) -> torch.Tensor:
    """[rows, R'] per-token values from the driver (R' = the step's widest response) cut or padded
    to this rank's widest response R (the columns past it are padding)."""
    if values.shape[1] >= width:
        return values[:, :width]
    return torch.nn.functional.pad(values, (0, width - values.shape[1]))
