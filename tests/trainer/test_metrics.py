"""Per-step metrics: the engine-vs-actor drift, measured on the ranks and combined on the driver."""

from __future__ import annotations

import torch

from vlrl.algorithms.importance import combine_drift, log_prob_drift
from vlrl.trainer.metrics import drift_warning


def test_log_prob_diff_covers_response_tokens_only_and_warns_above_the_limit():
    # |diff| on valid tokens: 0.01, 0.03, 0.2 (mean 0.08); the masked 5.0 gap is padding
    engine, actor = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]]), torch.tensor([[-1.01, -2.03], [-0.7, 2.0]])
    drift = log_prob_drift(engine, actor, torch.tensor([[1, 1], [1, 0]]))
    metrics = combine_drift([drift])
    assert abs(metrics["rollout/log_prob_diff_mean"] - 0.08) < 1e-6
    assert metrics["rollout/log_prob_diff_mean"] == drift["mean"]  # one rank: its mean, unchanged
    assert abs(metrics["rollout/log_prob_diff_max"] - 0.2) < 1e-6
    message = drift_warning(metrics, limit=0.05)
    assert message is not None and "0.0800" in message and "log_prob_diff_warn=0.05" in message
    assert drift_warning(metrics, limit=0.1) is None
    assert drift_warning({}, limit=0.05) is None  # no engine log-probs: nothing to compare
    assert combine_drift([{}, {}]) == {}


def test_the_ranks_drifts_combine_weighted_by_their_tokens() -> None:
    """Each rank measures its own rows; the step's mean weighs each rank by its tokens (3 and 1)."""
    ones = torch.ones(1, 3, dtype=torch.long)
    a = log_prob_drift(torch.zeros(1, 3), torch.full((1, 3), 0.1), ones)
    b = log_prob_drift(torch.zeros(1, 3), torch.full((1, 3), 0.5), torch.tensor([[1, 0, 0]]))
    metrics = combine_drift([a, b])
    assert abs(metrics["rollout/log_prob_diff_mean"] - (3 * 0.1 + 0.5) / 4) < 1e-6
    assert abs(metrics["rollout/log_prob_diff_max"] - 0.5) < 1e-6


def test_signal_watch_warns_every_tenth_step_in_a_row_without_advantages() -> None:
    """A collapsed policy (every reward 0, every advantage 0) once trained on silently for 57 steps."""
    from vlrl.trainer.metrics import SignalWatch, has_signal

    zero, some = torch.zeros(4, 3), torch.tensor([[0.0, 0.5], [-0.5, 0.0]])
    assert not has_signal(zero, {}) and has_signal(some, {})
    # a token-level estimator: the ranks report the step's extremes instead of advantages
    assert not has_signal(None, {"critic/advantages/max": 0.0, "critic/advantages/min": 0.0})
    assert has_signal(None, {"critic/advantages/max": 0.0, "critic/advantages/min": -0.1})
    watch = SignalWatch(warn_every=10)
    step_metrics = {"reward/overall": 0.0, "actor/entropy": 6.404}
    warnings = [watch.update(has_signal(zero, {}), step_metrics) for _ in range(25)]
    assert [i + 1 for i, w in enumerate(warnings) if w] == [10, 20] and watch.in_a_row == 25
    assert "10 steps in a row without a learning signal" in warnings[9]
    assert "mean reward 0.000, actor entropy 6.404" in warnings[9]
    assert (
        watch.update(has_signal(some, {}), step_metrics) is None and watch.in_a_row == 0
    )  # a signal resets the count
