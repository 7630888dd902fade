"""Advantage estimators: turn token-level rewards into per-token advantages and returns.

Every estimator has the same signature (see `grpo`) so the trainer can pick one by name with
`compute_advantages(config.algorithm.adv_estimator, ...)`. Shapes: B sequences, T response tokens.

Outcome estimators (grpo, dr_grpo, rloo, remax, grpo_passk) reduce each response to one score,
score_i = sum_t reward_i,t * mask_i,t, compute one advantage per sequence and broadcast it over the
response tokens (times the mask); their returns equal their advantages. Group statistics use
`torch.unique(return_inverse=True)` + `index_add_`/`scatter_reduce` so group ids may be any long
values, in any order, and no Python loop runs over samples. Group statistics are computed in
float64 (the [B] vectors are tiny) so that groups of equal scores give advantages of ~0, not
rounding noise divided by eps.

The token-level estimator (reinforce_plus_plus) runs one reverse loop over the T time steps,
vectorized over the batch. Positions where `response_mask` is 0 are skipped: they get advantage and
return 0 and the running return passes through them unchanged (so a masked hole, e.g. a tool
output in a multi-turn response, neither ends the episode nor counts as a discount step).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from vlrl.algorithms.plan import ESTIMATOR_NEEDS

AdvantageFn = Callable[..., tuple[Tensor, Tensor]]
SumOverRanks = Callable[[Tensor], Tensor]  # a float64 tensor's sum over the ranks that split a batch

# Names whose advantage compares the samples of one prompt, so they need worker.rollout.n > 1
# (each estimator's needs are declared in vlrl.algorithms.plan.ESTIMATOR_NEEDS).
GROUP_ESTIMATORS = frozenset(name for name, needs in ESTIMATOR_NEEDS.items() if needs.groups)


# --------------------------------------------------------------------------------- helpers
def _check_inputs(token_level_rewards: Tensor, response_mask: Tensor, group_ids: Tensor) -> None:
    if token_level_rewards.dim() != 2 or token_level_rewards.shape != response_mask.shape:
        raise ValueError(
            f"token_level_rewards {tuple(token_level_rewards.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must both be [B, T]"
        )
    if group_ids.shape != token_level_rewards.shape[:1]:
        raise ValueError(
            f"group_ids {tuple(group_ids.shape)} must be [B] with B={token_level_rewards.shape[0]}"
        )


def sequence_scores(token_level_rewards: Tensor, response_mask: Tensor) -> Tensor:
    """Score of each response: the masked sum of its token rewards. [B, T] -> [B]."""
    # A batched dot product: no [B, T] temporary (this is the estimators' largest memory pass).
    return torch.einsum("bt,bt->b", token_level_rewards, response_mask.to(token_level_rewards.dtype))


def group_index(group_ids: Tensor) -> tuple[Tensor, int]:
    """Map arbitrary long group ids [B] to dense indices in [0, G) and return (inverse [B], G)."""
    uniques, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, uniques.numel()


def _group_sum(values: Tensor, inverse: Tensor, num_groups: int) -> Tensor:
    """Sum of `values` [B] per group -> [G]."""
    return values.new_zeros(num_groups).index_add_(0, inverse, values)


def group_stats(scores: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample (group size, group mean, group std), each [B] float64; see `_indexed_group_stats`."""
    inverse, num_groups = group_index(group_ids)
    return _indexed_group_stats(scores, inverse, num_groups)


def _indexed_group_stats(scores: Tensor, inverse: Tensor, num_groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample (group size, group mean, group std) from dense group indices, in float64.

    The std is the unbiased one (Bessel's correction, divisor n - 1, like `torch.std`); it is 0 for
    groups of one sample (whose deviation from the mean is exactly 0, so advantages stay 0).
    """
    x = scores.double()
    count = torch.bincount(inverse, minlength=num_groups).double()  # [G], every entry >= 1
    mean = _group_sum(x, inverse, num_groups) / count  # [G]
    deviation = x - mean[inverse]  # [B]; two-pass variance avoids cancellation
    var = _group_sum(deviation**2, inverse, num_groups) / (count - 1).clamp(min=1)  # [G]
    return count[inverse], mean[inverse], var.sqrt()[inverse]


def _broadcast(seq_advantages: Tensor, response_mask: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Spread one advantage per sequence [B] over its response tokens -> (advantages, returns) [B, T].

    Returns equal advantages but are a separate tensor, so in-place edits of one never alter the other.
    """
    adv = seq_advantages.to(dtype).unsqueeze(-1) * response_mask.to(dtype)
    return adv, adv.clone()


def masked_whiten(
    values: Tensor, mask: Tensor, eps: float = 1e-6, sum_over_ranks: SumOverRanks | None = None
) -> Tensor:
    """(x - mean) / (std + eps) over all valid tokens of the batch; population std (divisor N).

    Masked positions are set to 0. A batch without valid tokens gives all zeros. The statistics
    are computed in float64 (like the group statistics): in float32 the mean of equal values that
    are not exactly representable (all 0.9) is off by ~1e-8, and dividing that residue by a std
    of the same size plus eps turned "all equal" into advantages of up to ~0.15 instead of 0.
    `sum_over_ranks`: the batch is split over ranks, each holding `values` of its rows; the sums
    the statistics need are added up over them (an all-reduce), so every rank whitens its rows with
    the whole batch's mean and std.
    """
    add = sum_over_ranks or (lambda local: local)
    m = mask.to(torch.float64)
    x = values.to(torch.float64)  # [B, T]
    total, count = add(torch.stack([torch.dot(x.flatten(), m.flatten()), m.sum()]))
    n = count.clamp(min=1)
    mean = total / n
    centered = (x - mean).mul_(m)  # [B, T]
    std = (add(torch.dot(centered.flatten(), centered.flatten())) / n).sqrt()
    return centered.div_(std + eps).to(values.dtype)


# ------------------------------------------------------------------------ outcome estimators
def grpo(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    group_ids: Tensor,
    *,
    gamma: float = 1.0,
    eps: float = 1e-6,
    norm_by_std: bool = True,
    baseline_scores: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """GRPO: A_i = (s_i - mean_g) / (std_g + eps), std unbiased; `norm_by_std=False`: s_i - mean_g.

    Groups of one sample and groups of equal scores get advantage 0. Requires eps > 0.
    """
    _check_inputs(token_level_rewards, response_mask, group_ids)
    scores = sequence_scores(token_level_rewards, response_mask)
    _, mean, std = group_stats(scores, group_ids)
    adv = scores.double() - mean
    if norm_by_std:
        adv = adv / (std + eps)
    return _broadcast(adv, response_mask, token_level_rewards.dtype)


def dr_grpo(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    group_ids: Tensor,
    *,
    gamma: float = 1.0,
    eps: float = 1e-6,
    norm_by_std: bool = True,
    baseline_scores: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Dr. GRPO: A_i = s_i - mean_g (GRPO without the std division, whatever `norm_by_std` says)."""
    return grpo(token_level_rewards, response_mask, group_ids, eps=eps, norm_by_std=False)


def rloo(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    group_ids: Tensor,
    *,
    gamma: float = 1.0,
    eps: float = 1e-6,
    norm_by_std: bool = True,
    baseline_scores: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """RLOO: A_i = s_i - (sum_g - s_i) / (n_g - 1), the leave-one-out mean; 0 for groups of one."""
    _check_inputs(token_level_rewards, response_mask, group_ids)
    scores = sequence_scores(token_level_rewards, response_mask).double()
    count, mean, _ = group_stats(scores, group_ids)
    others_mean = (mean * count - scores) / (count - 1).clamp(min=1)  # [B]
    adv = torch.where(count > 1, scores - others_mean, torch.zeros_like(scores))
    return _broadcast(adv, response_mask, token_level_rewards.dtype)


def remax(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    group_ids: Tensor,
    *,
    gamma: float = 1.0,
    eps: float = 1e-6,
    norm_by_std: bool = True,
    baseline_scores: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """ReMax: A_i = s_i - b_i where b_i (`baseline_scores`, [B]) is the score of the greedy response."""
    _check_inputs(token_level_rewards, response_mask, group_ids)
    if baseline_scores is None or baseline_scores.shape != group_ids.shape:
        raise ValueError("remax needs baseline_scores [B]: the score of each prompt's greedy response")
    scores = sequence_scores(token_level_rewards, response_mask)
    return _broadcast(scores.double() - baseline_scores.double(), response_mask, token_level_rewards.dtype)


def grpo_passk(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    group_ids: Tensor,
    *,
    gamma: float = 1.0,
    eps: float = 1e-6,
    norm_by_std: bool = True,
    baseline_scores: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Pass@k GRPO: only the best sample of a group learns; A_best = (s_max - s_second) / (std_g + eps).

    Every other sample gets 0 (so does a group of one). With `norm_by_std=False` the gap is not
    divided. Ties for the best give a gap of 0; the lowest batch index counts as the best then.
    """
    _check_inputs(token_level_rewards, response_mask, group_ids)
    scores = sequence_scores(token_level_rewards, response_mask).double()  # [B]
    inverse, num_groups = group_index(group_ids)
    count, _, std = _indexed_group_stats(scores, inverse, num_groups)
    neg_inf = scores.new_full((num_groups,), float("-inf"))
    best = neg_inf.scatter_reduce(0, inverse, scores, "amax")  # [G]
    # The first (lowest index) sample reaching the group maximum is the best one.
    index = torch.arange(scores.numel(), device=scores.device)
    candidates = torch.where(scores == best[inverse], index, scores.numel())
    first_best = torch.full_like(best, scores.numel(), dtype=torch.long).scatter_reduce(
        0, inverse, candidates, "amin"
    )
    is_best = index == first_best[inverse]  # [B], one True per group
    second = neg_inf.scatter_reduce(0, inverse, scores.masked_fill(is_best, float("-inf")), "amax")
    gap = (best - second)[inverse]  # [B]; +inf for groups of one, masked below
    if norm_by_std:
        gap = gap / (std + eps)
    adv = torch.where(is_best & (count > 1), gap, torch.zeros_like(gap))
    return _broadcast(adv, response_mask, token_level_rewards.dtype)


# --------------------------------------------------------------------- token-level estimators
def discounted_returns(token_level_rewards: Tensor, response_mask: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + gamma * G_next over valid tokens (masked positions skipped, set to 0). [B, T]."""
    m = response_mask.to(token_level_rewards.dtype)
    rewards = token_level_rewards * m
    if gamma == 1.0:  # undiscounted: a reverse cumulative sum, no time loop
        return rewards.flip(-1).cumsum_(-1).flip(-1).mul_(m)
    # Time-major copies make each step's column a contiguous row (much faster than strided [:, t]).
    rewards_tb, m_tb = rewards.t().contiguous(), m.t().contiguous()  # [T, B]
    returns_tb = torch.empty_like(rewards_tb)
    running = rewards.new_zeros(rewards.shape[0])  # [B], return from the next valid token on
    for t in reversed(range(rewards_tb.shape[0])):
        running = torch.where(m_tb[t] > 0, rewards_tb[t] + gamma * running, running)
        returns_tb[t] = running * m_tb[t]
    return returns_tb.t().contiguous()


def reinforce_plus_plus(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    group_ids: Tensor,
    *,
    gamma: float = 1.0,
    eps: float = 1e-6,
    norm_by_std: bool = True,
    baseline_scores: Tensor | None = None,
    sum_over_ranks: SumOverRanks | None = None,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++: discounted token returns G, whitened over all valid tokens of the batch (split
    over ranks with `sum_over_ranks`, see `masked_whiten`)."""
    _check_inputs(token_level_rewards, response_mask, group_ids)
    returns = discounted_returns(token_level_rewards, response_mask, gamma)
    return masked_whiten(returns, response_mask, eps, sum_over_ranks), returns


# ----------------------------------------------------------------------------------- registry
ADV_ESTIMATORS: dict[str, AdvantageFn] = {
    "grpo": grpo,
    "dr_grpo": dr_grpo,
    "rloo": rloo,
    "reinforce_plus_plus": reinforce_plus_plus,
    "remax": remax,
    "grpo_passk": grpo_passk,
}


def compute_advantages(
    name: str, token_level_rewards: Tensor, response_mask: Tensor, group_ids: Tensor, **kwargs
) -> tuple[Tensor, Tensor]:
    """Run the estimator `name` (config key `algorithm.adv_estimator`); returns (advantages, returns) [B, T]."""
    if name not in ADV_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; valid: {sorted(ADV_ESTIMATORS)}")
    return ADV_ESTIMATORS[name](token_level_rewards, response_mask, group_ids, **kwargs)
