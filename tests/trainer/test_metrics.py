"""Per-step metrics on the driver: the engine-vs-actor drift warning."""

from __future__ import annotations

import torch

from vlrl.batch.rows import RolloutBatch
from vlrl.trainer.metrics import batch_metrics, drift_warning


def _batch(engine: list[list[float]], actor: list[list[float]], mask: list[list[int]]) -> RolloutBatch:
    n, r = len(mask), len(mask[0])
    response_mask = torch.tensor(mask)
    batch = RolloutBatch(
        input_ids=torch.zeros(n, 1 + r, dtype=torch.long),
        attention_mask=torch.cat([torch.ones(n, 1, dtype=torch.long), response_mask], 1),
        position_ids=torch.zeros(n, 1 + r, dtype=torch.long),
        responses=torch.zeros(n, r, dtype=torch.long),
        response_mask=response_mask,
        group_ids=torch.arange(n),
        prompt_length=1,
        images=[[] for _ in range(n)],
        prompts=["p"] * n,
        ground_truths=[None] * n,
        extras=[{} for _ in range(n)],
    )
    batch.rollout_log_probs, batch.old_log_probs = torch.tensor(engine), torch.tensor(actor)
    batch.token_level_scores = batch.token_level_rewards = torch.zeros(n, r)
    batch.advantages = torch.zeros(n, r)
    return batch


def test_log_prob_diff_covers_response_tokens_only_and_warns_above_the_limit():
    # |diff| on valid tokens: 0.01, 0.03, 0.2 (mean 0.08); the masked 5.0 gap is padding
    batch = _batch([[-1.0, -2.0], [-0.5, -3.0]], [[-1.01, -2.03], [-0.7, 2.0]], [[1, 1], [1, 0]])
    metrics = batch_metrics(batch, max_response_length=2)
    assert abs(metrics["rollout/log_prob_diff_mean"] - 0.08) < 1e-6
    assert abs(metrics["rollout/log_prob_diff_max"] - 0.2) < 1e-6
    message = drift_warning(metrics, limit=0.05)
    assert message is not None and "0.0800" in message and "log_prob_diff_warn=0.05" in message
    assert drift_warning(metrics, limit=0.1) is None
    assert drift_warning({}, limit=0.05) is None  # no engine log-probs: nothing to compare


def test_signal_watch_warns_every_tenth_step_in_a_row_without_advantages() -> None:
    """A collapsed policy (every reward 0, every advantage 0) once trained on silently for 57 steps."""
    from vlrl.trainer.metrics import SignalWatch

    watch, zero, some = SignalWatch(warn_every=10), torch.zeros(4, 3), torch.tensor([[0.0, 0.5], [-0.5, 0.0]])
    step_metrics = {"reward/overall": 0.0, "actor/entropy": 6.404}
    warnings = [watch.update(zero, step_metrics) for _ in range(25)]
    assert [i + 1 for i, w in enumerate(warnings) if w] == [10, 20] and watch.in_a_row == 25
    assert "10 steps in a row without a learning signal" in warnings[9]
    assert "mean reward 0.000, actor entropy 6.404" in warnings[9]
    assert watch.update(some, step_metrics) is None and watch.in_a_row == 0  # a signal resets the count
