"""Off-policy corrections between the policy that sampled and the policy being trained.

The engine samples from pi_rollout (in asynchronous mode, the weights of one or more updates ago;
always, the engine's numerics); the update's ratio is taken against pi_old (the actor's log-probs
before the update). With r_t = pi_old(y_t) / pi_rollout(y_t) per response token, each preset
(`algorithm.off_policy_correction`, bound C = `algorithm.correction_bound`) scales the advantages
by a detached weight:

    token_tis    w_t = min(r_t, C)                       truncated importance sampling per token
    seq_tis      w_t = min(prod_s r_s, C)                the same over the whole sequence
    token_mask   w_t = [1/C <= r_t <= C]                 drop tokens whose ratio left the band
    seq_mask     w_t = [1/C <= exp(mean_s log r_s) <= C] drop sequences whose per-token (geometric
                                                          mean) ratio left it: the product of a long
                                                          response leaves any band on engine noise alone

Truncated IS makes the policy-gradient estimate unbiased for pi_old up to the truncation at C;
masking drops the samples where the two policies disagree most instead of down-weighting them. For
the PPO-family token losses a weight on the advantage equals a weight on the token's loss (the
clipped surrogate is linear in the advantage for w > 0; for the sequence-level GSPO ratio it is an
approximation). A masked token still counts in the loss's token normalisation and keeps its KL and
entropy terms: only its policy gradient goes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vlrl.algorithms.plan import CORRECTION_NEEDS

CORRECTIONS = tuple(CORRECTION_NEEDS)  # the presets' names


def off_policy_weights(
    kind: str, old_log_probs: Tensor, rollout_log_probs: Tensor, response_mask: Tensor, bound: float
) -> tuple[Tensor, dict[str, float]]:
    """(weights [N, R], metrics) of the preset `kind` (module docstring); 1 off the response mask.

    Metrics: the token ratio's mean and max (`off_policy/ratio_*`), the weights' token mean, and the
    share of units (tokens, or sequences with a response token) truncated (`*_tis`) or masked (`*_mask`)."""
    if kind not in CORRECTIONS:
        raise ValueError(f"unknown off-policy correction {kind!r}; choose one of {CORRECTIONS}")
    mask = response_mask.bool()  # [N, R]
    log_ratio = torch.where(mask, old_log_probs - rollout_log_probs, 0.0)  # [N, R]
    if kind.startswith("token"):
        unit_log_ratio, units = log_ratio, mask  # [N, R]
    else:
        tokens = mask.sum(-1)  # [N]
        seq = log_ratio.sum(-1)  # [N] log of the product of the token ratios
        unit_log_ratio = seq if kind == "seq_tis" else seq / tokens.clamp(min=1)
        units = tokens > 0
    ratio = unit_log_ratio.exp()  # the product may overflow to inf: truncated to C, or masked
    if kind.endswith("tis"):
        unit_weights, cut = ratio.clamp(max=bound), ratio > bound
    else:
        keep = (ratio >= 1.0 / bound) & (ratio <= bound)
        unit_weights, cut = keep.to(ratio.dtype), ~keep
    weights = unit_weights if unit_weights.dim() == 2 else unit_weights[:, None].expand_as(log_ratio)
    weights = torch.where(mask, weights, torch.ones_like(weights))
    token_ratio = log_ratio.exp()[mask]
    share = "truncated_frac" if kind.endswith("tis") else "masked_frac"
    metrics = {
        "off_policy/ratio_mean": float(token_ratio.mean()) if token_ratio.numel() else 1.0,
        "off_policy/ratio_max": float(token_ratio.max()) if token_ratio.numel() else 1.0,
        "off_policy/weight_mean": float(weights[mask].mean()) if mask.any() else 1.0,
        f"off_policy/{share}": float(cut[units].float().mean()) if units.any() else 0.0,
    }
    return weights, metrics


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
