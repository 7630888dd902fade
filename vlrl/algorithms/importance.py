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
