"""DAPO dynamic sampling: drop prompt groups whose samples all score alike (they carry no signal)."""

from __future__ import annotations

import torch
from torch import Tensor

from vlrl.algorithms.advantages import group_stats


def filter_groups(scores: Tensor, group_ids: Tensor, low: float, high: float) -> Tensor:
    """Keep-mask [N] (bool) selecting whole groups whose mean score lies strictly in (low, high).

    `scores` [N] is one reward per sample (config `algorithm.filter_key`), `group_ids` [N] any long
    ids (samples of one prompt share an id). With 0/1 rewards and (low, high) = (0.01, 0.99) this
    drops the groups that are all wrong or all right, whose group-relative advantages are all 0.
    """
    if scores.shape != group_ids.shape or scores.dim() != 1:
        raise ValueError(
            f"scores {tuple(scores.shape)} and group_ids {tuple(group_ids.shape)} must both be [N]"
        )
    if scores.numel() == 0:
        return torch.zeros(0, dtype=torch.bool, device=scores.device)
    _, mean, _ = group_stats(scores, group_ids)  # [N], each sample's group mean (float64)
    return (mean > low) & (mean < high)
