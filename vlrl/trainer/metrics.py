"""Per-step metrics computed on the driver from the step's batch, and phase timing."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from vlrl.batch.samples import StepSamples


class PhaseTimer:
    """Wall time of each named phase of a step: `with timer("gen"): ...` -> timing/gen."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start

    def move(self, seconds: float, source: str, target: str) -> None:
        """Count `seconds` of phase `source` as `target`'s (a rank's reward wait inside generation)."""
        self.seconds[source] -= seconds
        self.seconds[target] += seconds

    def metrics(self) -> dict[str, float]:
        return {f"timing/{name}": value for name, value in self.seconds.items()}


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    values = values.float()
    if values.numel() == 0:
        return {}
    return {
        f"{prefix}/mean": values.mean().item(),
        f"{prefix}/max": values.max().item(),
        f"{prefix}/min": values.min().item(),
    }


def batch_metrics(batch: StepSamples, max_response_length: int) -> dict[str, float]:
    """Rewards, advantages and lengths of one step's samples (the engine-vs-actor log-prob drift
    comes from the ranks, which hold both: `vlrl.algorithms.importance.log_prob_drift`)."""
    mask = batch.response_mask.bool()  # [N, R]
    response_len = batch.response_mask.sum(-1)  # [N]
    prompt_len = batch.prompt_lengths  # [N]
    scores = batch.tensor("token_level_scores").sum(-1)  # [N]
    metrics = {
        **_stats("critic/score", scores),
        **_stats("critic/rewards", batch.tensor("sequence_rewards")),
        **_stats("response_length", response_len),
        **_stats("prompt_length", prompt_len),
        "response_length/clip_ratio": (response_len >= max_response_length).float().mean().item(),
    }
    if batch.advantages is not None:  # None for a token-level estimator: its ranks report critic/advantages/*
        metrics.update(_stats("critic/advantages", batch.advantages[mask]))
    metrics.update(multi_turn_metrics(batch.trajectories or [], "multi_turn"))
    return metrics


def multi_turn_metrics(trajectories: list[dict[str, Any]], prefix: str) -> dict[str, float]:
    """Turns and tool calls per sample, tool errors/timeouts/truncations and how trajectories ended
    ({} for single-turn batches)."""
    if not trajectories:
        return {}
    n = len(trajectories)
    out = {
        f"{prefix}/turns_mean": sum(t["num_turns"] for t in trajectories) / n,
        f"{prefix}/tool_calls_mean": sum(t["num_tool_calls"] for t in trajectories) / n,
        f"{prefix}/tool_call_rate": sum(t["num_tool_calls"] > 0 for t in trajectories) / n,
        f"{prefix}/user_turns_mean": sum(t["num_user_turns"] for t in trajectories) / n,
        f"{prefix}/tool_errors": float(sum(t["tool_errors"] for t in trajectories)),
        f"{prefix}/tool_timeouts": float(sum(t["tool_timeouts"] for t in trajectories)),
        f"{prefix}/tool_truncated": float(sum(t["tool_truncated"] for t in trajectories)),
    }
    for reason in ("overflow", "turn_limit", "length"):
        out[f"{prefix}/stop_{reason}"] = float(sum(t["stop_reason"] == reason for t in trajectories))
    return out


def drift_warning(metrics: dict[str, float], limit: float) -> str | None:
    """A warning when the step's mean |engine - actor| log-prob exceeds `limit` (else None)."""
    drift = metrics.get("rollout/log_prob_diff_mean")
    if drift is None or drift <= limit:
        return None
    return (
        f"engine and actor log-probs differ by {drift:.4f} nats per token on average (max "
        f"{metrics['rollout/log_prob_diff_max']:.3f}), above worker.rollout.log_prob_diff_warn={limit:g}: "
        "the actor is not scoring the policy that sampled (stale weights or another sampling distribution)"
    )


class SignalWatch:
    """Counts the steps in a row whose advantages are all zero: every group's rewards were equal
    (and no KL in the reward), so the update has nothing to learn from. A run stuck there (a policy
    that collapsed to one answer or to noise, a reward that always returns the same value) would
    otherwise go on silently to its last step; every `warn_every`-th such step in a row is logged."""

    def __init__(self, warn_every: int = 10) -> None:
        self.warn_every, self.in_a_row = warn_every, 0

    def update(self, signal: bool, metrics: dict[str, float]) -> str | None:
        """After a step (`signal`: some advantage is not 0): the warning to log, or None."""
        if signal:
            self.in_a_row = 0
            return None
        self.in_a_row += 1
        if self.in_a_row % self.warn_every:
            return None
        entropy = metrics.get("actor/entropy")
        return (
            f"{self.in_a_row} steps in a row without a learning signal: in every group all samples got the "
            f"same reward (mean reward {metrics.get('reward/overall', float('nan')):.3f}"
            + (f", actor entropy {entropy:.3f}" if entropy is not None else "")
            + "), so every advantage is 0 and the updates change nothing; look at a few responses and their "
            "rewards (trainer.val_generations_to_log), and at whether the policy collapsed (actor/entropy)"
        )


def has_signal(advantages: torch.Tensor | None, metrics: dict[str, float]) -> bool:
    """Whether some advantage of the step is not 0: from the driver's advantages [N, R], or, for a
    token-level estimator the ranks computed, from their `critic/advantages/max|min`."""
    if advantages is not None:
        return bool(advantages.abs().max() > 0) if advantages.numel() else False
    return (
        metrics.get("critic/advantages/max", 0.0) != 0.0 or metrics.get("critic/advantages/min", 0.0) != 0.0
    )


def throughput_metrics(batch: StepSamples, step_seconds: float, world_size: int) -> dict[str, float]:
    tokens = batch.sequence_lengths.sum().item()
    return {
        "perf/total_tokens": float(tokens),
        "perf/tokens_per_s": tokens / max(step_seconds, 1e-9),
        "perf/tokens_per_s_per_rank": tokens / max(step_seconds, 1e-9) / world_size,
        "perf/step_time_s": step_seconds,
    }


def mean_reward_parts(parts: list[dict[str, float]], prefix: str) -> dict[str, float]:
    """`prefix/<name>` means of every reward part over the samples."""
    sums: dict[str, float] = defaultdict(float)
    for sample in parts:
        for name, value in sample.items():
            sums[name] += value
    return {f"{prefix}/{name}": total / max(len(parts), 1) for name, total in sums.items()}
