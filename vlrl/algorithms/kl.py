"""KL estimators between the policy and the reference policy, KL controllers and the reward penalty.

Per-token estimators take log-probabilities of the sampled tokens, logp = log pi(y_t) and
ref = log pi_ref(y_t), both [B, T], and estimate KL(pi || pi_ref) at each token (Schulman's
k1/k2/k3 estimators). `full` computes the exact KL and needs whole distributions [B, T, V].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from vlrl.algorithms.advantages import sequence_scores

KLFn = Callable[[Tensor, Tensor], Tensor]

LOG_RATIO_CLAMP = 20.0  # |log-ratio| bound before exp: e^20 ~ 5e8 stays finite in fp32/bf16
LOW_VAR_KL_CLAMP = 10.0  # EasyR1's bound of the k3 estimate itself (`algorithm.low_var_kl_clamp`)


def kl_k1(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """k1 = logp - ref: unbiased, high variance, can be negative per token."""
    return log_probs - ref_log_probs


def kl_abs(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """|logp - ref|."""
    return (log_probs - ref_log_probs).abs()


def kl_mse(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """k2 = 0.5 (logp - ref)^2: biased, low variance, >= 0."""
    return 0.5 * (log_probs - ref_log_probs).square()


def kl_low_var(log_probs: Tensor, ref_log_probs: Tensor, clamp: float | None = LOW_VAR_KL_CLAMP) -> Tensor:
    """k3 = exp(d) - d - 1 with d = ref - logp clamped to [-20, 20] (exp stays finite); the result
    clamped to [-clamp, clamp] (None: not clamped).

    Unbiased for KL(pi || pi_ref) when y ~ pi and always >= 0. Where the clamp binds the estimate is
    flat, so those tokens, the ones farthest from the reference, get no KL gradient.
    """
    d = (ref_log_probs - log_probs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    k3 = d.exp() - d - 1
    return k3 if clamp is None else k3.clamp(-clamp, clamp)


def low_var_kl_clamped(log_probs: Tensor, ref_log_probs: Tensor, clamp: float | None) -> Tensor:
    """bool [B, T]: the tokens whose k3 estimate the clamp binds (all False without one)."""
    if clamp is None:
        return torch.zeros(log_probs.shape, dtype=torch.bool, device=log_probs.device)
    return kl_low_var(log_probs.detach(), ref_log_probs.detach(), None) > clamp


def kl_full(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """Exact KL(pi || pi_ref) = sum_v p_v (logp_v - ref_v) from full log-distributions [B, T, V] -> [B, T].

    Vocabulary entries with p_v = 0 (logp_v = -inf) contribute 0.
    """
    if log_probs.dim() < 3 or log_probs.shape != ref_log_probs.shape:
        raise ValueError(
            "kl kind 'full' needs full log-probability distributions [B, T, V] for the policy and the "
            f"reference (got {tuple(log_probs.shape)} and {tuple(ref_log_probs.shape)}); with per-token "
            "log-probs use 'kl', 'abs', 'mse' or 'low_var_kl'"
        )
    p = log_probs.exp()
    # Select before multiplying so that -inf - -inf = nan never reaches the product or its gradient.
    diff = torch.where(p > 0, log_probs - ref_log_probs, torch.zeros_like(log_probs))
    return (p * diff).sum(dim=-1)


KL_ESTIMATORS: dict[str, KLFn] = {
    "kl": kl_k1,
    "abs": kl_abs,
    "mse": kl_mse,
    "low_var_kl": kl_low_var,
    "full": kl_full,
}


def kl_estimate(
    log_probs: Tensor, ref_log_probs: Tensor, kind: str, low_var_clamp: float | None = LOW_VAR_KL_CLAMP
) -> Tensor:
    """Per-token KL estimate of `kind` (config key `algorithm.kl_penalty`). [B, T] (or [B, T, V] for
    full) -> [B, T]. `low_var_clamp`: the k3 estimate's bound (`algorithm.low_var_kl_clamp`)."""
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; valid: {sorted(KL_ESTIMATORS)}")
    if kind == "low_var_kl":
        return kl_low_var(log_probs, ref_log_probs, low_var_clamp)
    return KL_ESTIMATORS[kind](log_probs, ref_log_probs)


# ----------------------------------------------------------------------------------- controllers
class FixedKLController:
    """A constant KL coefficient (`algorithm.kl_type=fixed`)."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt."""


class AdaptiveKLController:
    """Proportional controller (Ziegler et al. 2019) steering the measured KL towards `target_kl`.

    error = clip(current_kl / target_kl - 1, -0.2, 0.2); value *= 1 + error * n_steps / horizon.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"target_kl={target_kl} and horizon={horizon} must be > 0")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Scale the coefficient up when the KL is above target, down when below; n_steps = samples seen."""
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def make_kl_controller(
    kl_type: str, kl_coef: float, kl_target: float = 0.1, kl_horizon: float = 10000.0
) -> FixedKLController | AdaptiveKLController:
    """Controller from `algorithm.kl_type` (fixed | adaptive), `kl_coef`, `kl_target`, `kl_horizon`."""
    if kl_type == "fixed":
        return FixedKLController(kl_coef)
    if kl_type == "adaptive":
        return AdaptiveKLController(kl_coef, kl_target, kl_horizon)
    raise ValueError(f"unknown kl_type {kl_type!r}; valid: ['adaptive', 'fixed']")


# ------------------------------------------------------------------------------------ penalty
@dataclass(frozen=True)
class KLPenalty:
    """The KL penalty in the reward, asked of the ranks that hold the rows' log-probs
    (`RankWorker.take_rows`): the step's coefficient, the estimator (`algorithm.kl_penalty`) and
    each row's score [rows]."""

    coef: float
    kind: str
    scores: Tensor  # [rows] each row's overall score
    low_var_clamp: float | None = LOW_VAR_KL_CLAMP  # algorithm.low_var_kl_clamp


@dataclass
class PenalizedRewards:
    """Rewards with the KL penalty in them, reduced to what the driver needs: [B] each, plus the
    [B, T] token rewards when asked for (`penalized_rewards(per_token=True)`)."""

    sequence_scores: Tensor  # sum_t reward_t * mask_t: what an outcome estimator reduces a response to
    sums: Tensor  # sum_t reward_t (logged as critic/rewards)
    sequence_kl: Tensor  # each sequence's masked-mean KL
    has_tokens: Tensor  # bool: the sequence has a response token
    token_rewards: Tensor | None = None  # [B, T]

    def tensor_rewards(self) -> Tensor:
        """The [B, T] token rewards (asked for with `per_token=True`)."""
        if self.token_rewards is None:
            raise ValueError("the token rewards were not kept: penalized_rewards(per_token=True) keeps them")
        return self.token_rewards

    def current_kl(self) -> float:
        """The mean over sequences with a response token of their masked-mean KL (for the
        controller's `update`)."""
        return (self.sequence_kl.sum() / self.has_tokens.sum().clamp(min=1)).item()


def penalized_rewards(
    token_level_scores: Tensor,
    log_probs: Tensor,
    ref_log_probs: Tensor,
    response_mask: Tensor,
    kl_coef: float,
    kind: str,
    per_token: bool = True,
    low_var_clamp: float | None = LOW_VAR_KL_CLAMP,
) -> PenalizedRewards:
    """Rewards = scores - kl_coef * KL * mask (scores, log-probs and mask [B, T]), detached: they
    are targets, not part of the policy's graph."""
    mask = response_mask.to(token_level_scores.dtype)
    kl = kl_estimate(log_probs.detach(), ref_log_probs.detach(), kind, low_var_clamp)
    kl = kl.to(mask.dtype) * mask  # [B, T]
    rewards = token_level_scores - kl_coef * kl
    tokens_per_seq = mask.sum(dim=-1)  # [B]
    return PenalizedRewards(
        sequence_scores=sequence_scores(rewards, response_mask),
        sums=rewards.sum(-1),
        sequence_kl=kl.sum(dim=-1) / tokens_per_seq.clamp(min=1),
        has_tokens=tokens_per_seq > 0,
        token_rewards=rewards if per_token else None,
    )
