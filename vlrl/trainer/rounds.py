"""Filling a step's batch: generation rounds until `data.rollout_batch_size` groups are kept.

Without online filtering one round is enough (unless `data.mini_rollout_batch_size` splits it);
with it, groups whose `algorithm.filter_key` part has a mean at a bound are dropped and more rounds
are drawn. Where a round comes from (a synchronous generation, the asynchronous prefetch) is the
caller's: `BatchFiller.fill` takes it as a function, so this module knows no ranks and no Ray.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from vlrl.algorithms import filter_groups
from vlrl.batch.rows import PromptBatch
from vlrl.batch.samples import StepSamples

# round index (0 first) -> (its prompts, its scored batch, its metrics)
DrawRound = Callable[[int], tuple[PromptBatch, StepSamples, dict[str, float]]]
# (prompts, their scored batch, round index) -> each sample's baseline score [N] (ReMax)
Baselines = Callable[[PromptBatch, StepSamples, int], torch.Tensor]


@dataclass
class GroupOutcomes:
    """A step's generated groups (every round, before filtering) by what their rewards say:
    `mixed` when the `overall` rewards differ within the group (GRPO learns only from these);
    with an `accuracy` reward part, `all_correct` / `all_wrong` when it is 1 / 0 for every sample."""

    groups: int = 0
    samples: int = 0
    mixed: int = 0
    all_correct: int = 0
    all_wrong: int = 0
    has_accuracy: bool = False

    def add(self, batch: StepSamples) -> None:
        by_group: dict[int, list[dict[str, float]]] = defaultdict(list)
        for group, parts in zip(batch.group_ids.tolist(), batch.scored_parts()):
            by_group[group].append(parts)
        self.samples += len(batch)
        for members in by_group.values():
            self.groups += 1
            overall = [float(p["overall"]) for p in members]
            self.mixed += max(overall) - min(overall) > 1e-9
            if all("accuracy" in p for p in members):
                self.has_accuracy = True
                accuracy = [float(p["accuracy"]) for p in members]
                self.all_correct += all(a == 1.0 for a in accuracy)
                self.all_wrong += all(a == 0.0 for a in accuracy)

    def metrics(self) -> dict[str, float]:
        """`groups/*`: the samples generated (every round), shares of the generated groups, and the
        samples generated per mixed group (logged when there was one: it is the price of each group
        the update learns from)."""
        out = {
            "groups/generated_samples": float(self.samples),
            "groups/mixed_share": self.mixed / max(self.groups, 1),
        }
        if self.has_accuracy:
            out["groups/all_correct_share"] = self.all_correct / max(self.groups, 1)
            out["groups/all_wrong_share"] = self.all_wrong / max(self.groups, 1)
        if self.mixed:
            out["groups/samples_per_mixed_group"] = self.samples / self.mixed
        return out


@dataclass(frozen=True)
class BatchFiller:
    """`target_groups`: `data.rollout_batch_size`; `n`: `worker.rollout.n`; `algorithm`: the
    filtering keys (`online_filtering`, `filter_key`, `filter_low`, `filter_high`); `max_tries`:
    `trainer.max_try_make_batch` (-1: unlimited); `pad_token_id`: to merge rounds of different widths."""

    target_groups: int
    n: int
    algorithm: Any
    max_tries: int
    pad_token_id: int

    def fill(
        self, draw_round: DrawRound, baselines: Baselines | None = None
    ) -> tuple[StepSamples, torch.Tensor | None, dict[str, float]]:
        """Draw rounds until the kept groups reach the target; the excess is cut off. Returns the
        batch (`target_groups * n` rows), the baselines [N] (None without `baselines`) and the
        metrics: the first round's (what the policy does, before filtering), the filter's, and the
        outcomes of every generated group (`GroupOutcomes`)."""
        algo = self.algorithm
        kept: list[StepSamples] = []
        kept_baselines: list[torch.Tensor] = []
        metrics: dict[str, float] = {}
        outcomes = GroupOutcomes()
        n_groups = tries = 0
        while n_groups < self.target_groups:
            if tries > 0 and 0 <= self.max_tries <= tries:  # always one round
                raise RuntimeError(
                    f"kept {n_groups} of {self.target_groups} groups after {tries} generation rounds "
                    "(trainer.max_try_make_batch); with online filtering most groups have all-equal "
                    "rewards: widen algorithm.filter_low/filter_high, raise max_try_make_batch, or turn "
                    "online_filtering off"
                )
            prompts, batch, round_metrics = draw_round(tries)
            if tries == 0:
                metrics.update(round_metrics)
            outcomes.add(batch)
            keep = torch.ones(len(batch), dtype=torch.bool)
            if algo.online_filtering:
                keep = filter_groups(
                    self._filter_values(batch), batch.group_ids, algo.filter_low, algo.filter_high
                )
                metrics["filter/kept_ratio"] = keep.float().mean().item()
            if baselines is not None:
                kept_baselines.append(baselines(prompts, batch, tries)[keep])
            # group ids are unique within a round; rounds may repeat a prompt (a new epoch)
            batch.group_ids = batch.group_ids + (tries << 40)
            kept.append(batch if bool(keep.all()) else batch.select(keep))
            n_groups += len(set(batch.group_ids[keep].tolist()))
            tries += 1
        if algo.online_filtering:
            metrics["filter/tries"] = float(tries)
        metrics.update(outcomes.metrics())
        # what each group the update trains on cost (with online filtering, more than n)
        metrics["groups/samples_per_kept_group"] = outcomes.samples / self.target_groups
        size = self.target_groups * self.n
        merged = kept[0] if len(kept) == 1 else StepSamples.join(kept, self.pad_token_id)
        if len(merged) > size:
            merged = merged.select(list(range(size)))
        baseline = torch.cat(kept_baselines)[:size] if kept_baselines else None
        return merged, baseline, metrics

    def _filter_values(self, batch: StepSamples) -> torch.Tensor:
        """Each sample's `algorithm.filter_key` reward part; an error naming the parts the reward
        function returns when it has no such part (instead of filtering every group out)."""
        key, scored = self.algorithm.filter_key, batch.scored_parts()
        missing = [i for i, parts in enumerate(scored) if key not in parts]
        if missing:
            raise ValueError(
                f"algorithm.filter_key={key!r}: the reward function returned no {key!r} score (it returned "
                f"{sorted(scored[missing[0]])}); set algorithm.filter_key to one of them"
            )
        return torch.tensor([float(parts[key]) for parts in scored])
