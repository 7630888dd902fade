"""Truncated importance sampling between the policy that sampled and the policy being trained.

The engine samples from pi_rollout (in asynchronous mode, the weights of one update ago; always,
the engine's numerics), the update's ratio is taken against pi_old (the actor's log-probs before
the update). Each token's advantage is scaled by

    w = min(exp(log pi_old - log pi_rollout), cap)        (detached)

which makes the policy-gradient estimate unbiased for pi_old up to the truncation at `cap`. For
the PPO-family token losses this equals weighting each token's loss by w (the clipped surrogate
is linear in the advantage for w > 0); for the sequence-level GSPO ratio it is an approximation.
"""

from __future__ import annotations

import torch
from torch import Tensor


def truncated_importance_weighting(
    advantages: Tensor, old_log_probs: Tensor, rollout_log_probs: Tensor, response_mask: Tensor, cap: float
) -> tuple[Tensor, dict[str, float]]:
    """(advantages x w [N, R], metrics); w as in the module docstring, 1 off the response mask."""
    mask = response_mask.bool()
    weights = torch.exp(old_log_probs - rollout_log_probs).clamp(max=cap)
    weights = torch.where(mask, weights, torch.ones_like(weights))
    tokens = weights[mask]
    raw = torch.exp(old_log_probs - rollout_log_probs)[mask]
    metrics = {
        "async/tis_weight_mean": float(tokens.mean()) if tokens.numel() else 1.0,
        "async/tis_clipped_frac": float((raw > cap).float().mean()) if raw.numel() else 0.0,
    }
    return advantages * weights, metrics


def log_prob_drift(
    rollout_log_probs: Tensor, old_log_probs: Tensor, response_mask: Tensor
) -> dict[str, float]:
    """How far the engine's log-probs of the sampled tokens are from the actor's (numerics, stale
    weights): |rollout - old| over the response tokens, its mean and max, and how many tokens. [N, R] in."""
    diff = (rollout_log_probs - old_log_probs).abs()[response_mask.bool()]
    if diff.numel() == 0:
        return {"mean": 0.0, "max": 0.0, "tokens": 0.0}
    return {"mean": diff.mean().item(), "max": diff.max().item(), "tokens": float(diff.numel())}


def combine_drift(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """The ranks' `log_prob_drift`s as one step's metrics: the token-weighted mean and the max."""
    parts = [d for d in per_rank if d]
    tokens = sum(d["tokens"] for d in parts)
    if not parts:
        return {}
    return {
        "rollout/log_prob_diff_max": max(d["max"] for d in parts),
        # weights tokens/total are exactly 1.0 for a single rank, so its mean comes through unchanged
        "rollout/log_prob_diff_mean": sum(d["mean"] * (d["tokens"] / max(tokens, 1.0)) for d in parts),
    }
