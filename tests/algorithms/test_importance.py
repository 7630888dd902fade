"""Off-policy corrections (vlrl.algorithms.importance): each preset's weights and metrics by hand."""

from __future__ import annotations

import math

import pytest
import torch

from vlrl.algorithms.importance import off_policy_weights

# two responses; row 0 has token ratios pi_old / pi_rollout 2.0, 0.5 and a padding slot; row 1 has
# 1.2, 1.5, 1.6 (row 0's product 1.0, geometric mean 1.0; row 1's product 2.88, geometric mean 1.4236)
OLD = torch.tensor([[math.log(0.5), math.log(0.2), 0.0], [math.log(0.6), math.log(0.3), math.log(0.8)]])
ROLLOUT = torch.tensor([[math.log(0.25), math.log(0.4), -7.0], [math.log(0.5), math.log(0.2), math.log(0.5)]])
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])


def _weights(kind: str, bound: float) -> tuple[list[float], dict[str, float]]:
    """The weights flattened row by row, and the metrics."""
    weights, metrics = off_policy_weights(kind, OLD, ROLLOUT, MASK, bound)
    return weights.flatten().tolist(), metrics


def test_token_tis_caps_each_token() -> None:
    weights, metrics = _weights("token_tis", 1.5)
    assert weights == pytest.approx([1.5, 0.5, 1.0, 1.2, 1.5, 1.5])  # padding keeps 1
    assert metrics["off_policy/truncated_frac"] == pytest.approx(2 / 5)  # 2.0 and 1.6
    assert metrics["off_policy/weight_mean"] == pytest.approx((1.5 + 0.5 + 1.2 + 1.5 + 1.5) / 5)
    assert metrics["off_policy/ratio_mean"] == pytest.approx((2.0 + 0.5 + 1.2 + 1.5 + 1.6) / 5)
    assert metrics["off_policy/ratio_max"] == pytest.approx(2.0)


def test_seq_tis_caps_the_product_over_the_sequence() -> None:
    weights, metrics = _weights("seq_tis", 2.0)
    assert weights == pytest.approx([1.0, 1.0, 1.0, 2.0, 2.0, 2.0])  # 1.0; 2.88 capped at 2
    assert metrics["off_policy/truncated_frac"] == pytest.approx(1 / 2)


def test_token_mask_drops_tokens_outside_the_band() -> None:
    weights, metrics = _weights("token_mask", 1.55)  # band [0.645, 1.55]
    assert weights == pytest.approx([0.0, 0.0, 1.0, 1.0, 1.0, 0.0])
    assert metrics["off_policy/masked_frac"] == pytest.approx(3 / 5)


def test_seq_mask_drops_sequences_by_their_geometric_mean_ratio() -> None:
    weights, metrics = _weights("seq_mask", 1.4)  # row 1's 1.4236 is outside [1/1.4, 1.4]
    assert weights == pytest.approx([1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    assert metrics["off_policy/masked_frac"] == pytest.approx(1 / 2)
    assert _weights("seq_mask", 1.5)[0] == pytest.approx([1.0, 1.0, 1.0, 1.0, 1.0, 1.0])


def test_a_long_sequence_product_that_overflows_is_truncated_not_nan() -> None:
    old, rollout, mask = torch.zeros(1, 400), torch.full((1, 400), -3.0), torch.ones(1, 400)  # prod e^1200
    weights, _ = off_policy_weights("seq_tis", old, rollout, mask, 2.0)
    assert torch.equal(weights, torch.full((1, 400), 2.0))


def test_an_unknown_preset_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown off-policy correction 'tis'"):
        off_policy_weights("tis", OLD, ROLLOUT, MASK, 2.0)
