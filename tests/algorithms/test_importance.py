"""Truncated importance sampling: weights by hand."""

from __future__ import annotations

import math

import pytest
import torch

from vlrl.algorithms.importance import truncated_importance_weighting


def test_weights_are_the_capped_ratio_on_response_tokens_only() -> None:
    old = torch.tensor([[math.log(0.5), math.log(0.2), 0.0]])
    rollout = torch.tensor([[math.log(0.25), math.log(0.4), 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    adv = torch.tensor([[1.0, -2.0, 3.0]])
    weighted, metrics = truncated_importance_weighting(adv, old, rollout, mask, cap=1.5)
    # ratios 2.0 (capped to 1.5) and 0.5; the padding token keeps its advantage
    assert torch.allclose(weighted, torch.tensor([[1.5, -1.0, 3.0]]))
    assert metrics["async/tis_weight_mean"] == pytest.approx(1.0)
    assert metrics["async/tis_clipped_frac"] == pytest.approx(0.5)
