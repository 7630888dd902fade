"""Policy losses and loss aggregation that stays exact under micro-batching and data parallelism.

Each policy loss maps per-token log-probs to a per-token loss matrix [B, T] (to be minimized) and
per-token indicator tensors for metrics. `aggregate_loss` reduces a loss matrix to a scalar using
totals of the whole mini-batch, so summing the scalars of all micro-batches on all ranks gives the
full mini-batch loss. `compute_policy_loss` is the entry point used by the actor.

Log-ratios log(pi / pi_old) are clamped to [-20, 20] before exp, so even absurd inputs (|diff| = 50)
give finite losses and gradients (a clamped token simply gets no gradient through the ratio).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from vlrl.algorithms.kl import LOW_VAR_KL_CLAMP, kl_estimate

PolicyLossFn = Callable[..., tuple[Tensor, dict[str, Tensor]]]

LOSS_AGG_MODES = ("token", "seq", "seq-mean-token-sum")
LOG_RATIO_CLAMP = 20.0
# Default SAPO temperatures (Gao et al. 2025, "Soft Adaptive Policy Optimization"; config keys
# worker.actor.tau_positive / tau_negative): the gate of tokens with negative advantages decays
# faster (tau_neg > tau_pos), which the paper found more stable.
SAPO_TAU_POS = 1.0
SAPO_TAU_NEG = 1.05


# ------------------------------------------------------------------------------- aggregation
def aggregate_loss(loss_mat: Tensor, mask: Tensor, mode: str, num_tokens: float, num_seqs: float) -> Tensor:
    """Reduce a per-token loss [B, T] to a scalar, normalized by totals of the WHOLE mini-batch.

    `num_tokens` / `num_seqs` are the valid tokens / sequences of the whole mini-batch summed over
    all its micro-batches and all data-parallel ranks (see `count_tokens_and_seqs`). Modes:

    - token: sum_{i,t} loss * mask / num_tokens (every token of the mini-batch weighs the same)
    - seq: sum_i (masked mean of loss over seq i) / num_seqs (every sequence weighs the same)
    - seq-mean-token-sum: sum_i (masked sum of loss over seq i) / num_seqs

    Because the denominators are global constants, the loss is a plain sum over micro-batches:
    accumulating gradients of the returned values over micro-batches gives exactly the gradient of
    the full mini-batch on each rank. FSDP/DDP then *average* gradients over the W ranks, so the
    caller multiplies the returned loss by W (world size) before backward to turn that average back
    into the sum. Fully masked rows contribute exactly 0 (never NaN); a non-positive denominator
    gives a zero loss that keeps the graph (so every rank still runs backward).
    """
    m = mask.to(loss_mat.dtype)
    # where() instead of a product keeps non-finite values at padded positions out of the sum.
    masked = torch.where(m > 0, loss_mat, torch.zeros_like(loss_mat))
    if mode == "token":
        return _divide(masked.sum(), num_tokens)
    token_sums = masked.sum(dim=-1)  # [B]
    if mode == "seq":
        return _divide((token_sums / m.sum(dim=-1).clamp(min=1)).sum(), num_seqs)
    if mode == "seq-mean-token-sum":
        return _divide(token_sums.sum(), num_seqs)
    raise ValueError(f"unknown loss_avg_mode {mode!r}; valid: {list(LOSS_AGG_MODES)}")


def _divide(total: Tensor, denominator: float) -> Tensor:
    return total / float(denominator) if denominator > 0 else total * 0.0


def count_tokens_and_seqs(response_mask: Tensor) -> tuple[int, int]:
    """(valid tokens, sequences with at least one valid token) of a [B, T] mask.

    Sum these over the micro-batches of a mini-batch and all-reduce them over ranks to get the
    `num_tokens` / `num_seqs` arguments of `aggregate_loss`.
    """
    tokens_per_seq = response_mask.sum(dim=-1)
    return int(tokens_per_seq.sum()), int((tokens_per_seq > 0).sum())


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of `values` over positions where mask is set; 0 when none is."""
    m = mask.to(values.dtype)
    return torch.where(m > 0, values, torch.zeros_like(values)).sum() / m.sum().clamp(min=1)


# -------------------------------------------------------------------------------- policy losses
def _ratio(old_log_probs: Tensor, log_probs: Tensor) -> Tensor:
    """pi / pi_old per token, from the clamped log-ratio. [B, T]."""
    return (log_probs - old_log_probs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()


def _clipped_surrogate(ratio: Tensor, advantages: Tensor, low: float, high: float) -> tuple[Tensor, Tensor]:
    """PPO's pessimistic bound max(-A r, -A clip(r, 1-low, 1+high)) and where the clip is active."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - low, 1.0 + high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def ppo(
    old_log_probs: Tensor,
    log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_dual: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped PPO with separate low/high bounds (DAPO clip-higher) and dual clip (Ye et al. 2020).

    L = max(-A r, -A clip(r, 1-low, 1+high)); for A < 0 also L = min(L, -A * clip_ratio_dual), which
    bounds the loss of tokens whose ratio exploded. Indicators: `pg_clipfrac_higher` = the ratio clip
    is active, `pg_clipfrac_lower` = the dual clip is active.
    """
    ratio = _ratio(old_log_probs, log_probs)
    loss, clip_active = _clipped_surrogate(ratio, advantages, clip_ratio_low, clip_ratio_high)
    dual_bound = -advantages * clip_ratio_dual
    dual_active = (advantages < 0) & (loss > dual_bound)
    loss = torch.where(dual_active, dual_bound, loss)
    return loss, {"pg_clipfrac_higher": clip_active, "pg_clipfrac_lower": dual_active}


def _sequence_log_ratio(old_log_probs: Tensor, log_probs: Tensor, response_mask: Tensor) -> Tensor:
    """log s_i = masked mean over t of log(pi / pi_old), clamped; [B, 1] (0 for fully masked rows)."""
    m = response_mask.to(log_probs.dtype)
    diff = torch.where(m > 0, log_probs - old_log_probs, torch.zeros_like(log_probs))
    mean = diff.sum(dim=-1, keepdim=True) / m.sum(dim=-1, keepdim=True).clamp(min=1)
    return mean.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def gspo(
    old_log_probs: Tensor,
    log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_dual: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025): PPO clipping of the sequence ratio s_i = exp(mean_t log(pi/pi_old)).

    Every token of sequence i gets max(-A s_i, -A clip(s_i, 1-low, 1+high)); use small clip ranges
    (the paper: low 3e-4, high 4e-4). No dual clip (`clip_ratio_dual` is ignored).
    """
    seq_ratio = _sequence_log_ratio(old_log_probs, log_probs, response_mask).exp().expand_as(log_probs)
    loss, clip_active = _clipped_surrogate(seq_ratio, advantages, clip_ratio_low, clip_ratio_high)
    return loss, {"pg_clipfrac_higher": clip_active, "pg_clipfrac_lower": torch.zeros_like(clip_active)}


def gspo_token(
    old_log_probs: Tensor,
    log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_dual: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO-token: s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)], clipped like `gspo`.

    Its value equals s_i but the gradient flows through each token's own log-prob, which lets the
    advantage vary per token. With a per-sequence advantage it has the same gradient as `gspo`.
    """
    seq_log_ratio = _sequence_log_ratio(old_log_probs, log_probs, response_mask).detach()
    token_ratio = (seq_log_ratio + log_probs - log_probs.detach()).exp()  # value s_i, grad of pi(y_t)
    loss, clip_active = _clipped_surrogate(token_ratio, advantages, clip_ratio_low, clip_ratio_high)
    return loss, {"pg_clipfrac_higher": clip_active, "pg_clipfrac_lower": torch.zeros_like(clip_active)}


def cispo(
    old_log_probs: Tensor,
    log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_dual: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1): L = -sg(clip(r, 1-low, 1+high)) * A * logp.

    The importance weight is clipped and detached, so every token keeps a REINFORCE gradient
    (-w A grad logp) instead of being dropped as in PPO. `pg_clipfrac_higher` marks tokens whose
    weight was clipped; no dual clip.
    """
    ratio = _ratio(old_log_probs, log_probs)
    weight = ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high).detach()
    loss = -weight * advantages * log_probs
    clipped = (ratio > 1.0 + clip_ratio_high) | (ratio < 1.0 - clip_ratio_low)
    return loss, {"pg_clipfrac_higher": clipped, "pg_clipfrac_lower": torch.zeros_like(clipped)}


def sapo(
    old_log_probs: Tensor,
    log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_dual: float,
    tau_positive: float = SAPO_TAU_POS,
    tau_negative: float = SAPO_TAU_NEG,
) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO: L = -A * f(r) with the soft gate f(r) = sigmoid(tau (r - 1)) * 4 / tau.

    tau = tau_positive (default 1.0) if A > 0 else tau_negative (default 1.05). df/dr = 4 sigma (1 - sigma) is 1 at
    r = 1 (the plain policy gradient on-policy) and decays smoothly as r leaves 1, replacing the hard
    clip. The clip ratios are ignored and both clip-fraction indicators are 0.
    """
    ratio = _ratio(old_log_probs, log_probs)
    tau = torch.where(advantages > 0, tau_positive, tau_negative).to(ratio.dtype)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    no_clip = torch.zeros_like(ratio, dtype=torch.bool)
    return -advantages * gate, {"pg_clipfrac_higher": no_clip, "pg_clipfrac_lower": no_clip}


POLICY_LOSSES: dict[str, PolicyLossFn] = {
    "ppo": ppo,
    "gspo": gspo,
    "gspo_token": gspo_token,
    "cispo": cispo,
    "sapo": sapo,
}


# -------------------------------------------------------------------------------- entry points
def _zero_padding(response_mask: Tensor, *tensors: Tensor) -> tuple[Tensor, ...]:
    """Set padded positions to 0: padding may hold anything (even -inf log-probs), and a NaN there
    would reach the gradient through the backward of exp/square even though the loss masks it out.
    Tensors may have trailing dims beyond [B, T] (full distributions [B, T, V])."""
    valid = response_mask > 0
    out = []
    for x in tensors:
        v = valid.reshape(valid.shape + (1,) * (x.dim() - valid.dim()))
        out.append(torch.where(v, x, torch.zeros_like(x)))
    return tuple(out)


def compute_policy_loss(
    name: str,
    old_log_probs: Tensor,
    log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_dual: float,
    loss_avg_mode: str,
    num_tokens: float,
    num_seqs: float,
    tau_positive: float = SAPO_TAU_POS,
    tau_negative: float = SAPO_TAU_NEG,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Policy loss `name` (`worker.actor.policy_loss`) aggregated with `loss_avg_mode`; all inputs [B, T].
    `tau_positive` / `tau_negative` are SAPO's gate temperatures (used by sapo only).

    Returns the scalar loss of this micro-batch (see `aggregate_loss` for num_tokens / num_seqs and
    the world-size factor) and token-mean metrics over this micro-batch as 0-dim fp32 tensors on the
    inputs' device (no host sync here; `float()` reads one): pg_loss,
    pg_clipfrac_higher, pg_clipfrac_lower, ppo_kl (mean of logp_old - logp, a k1 estimate of
    KL(pi_old || pi)) and entropy_estimate (mean of -logp, a one-sample entropy estimate).
    """
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; valid: {sorted(POLICY_LOSSES)}")
    old_log_probs, log_probs, advantages = _zero_padding(response_mask, old_log_probs, log_probs, advantages)
    loss_mat, indicators = POLICY_LOSSES[name](
        old_log_probs,
        log_probs,
        advantages,
        response_mask,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        clip_ratio_dual=clip_ratio_dual,
        **({"tau_positive": tau_positive, "tau_negative": tau_negative} if name == "sapo" else {}),
    )
    loss = aggregate_loss(loss_mat, response_mask, loss_avg_mode, num_tokens, num_seqs)
    with torch.no_grad():
        values = {
            "pg_loss": loss_mat,
            "pg_clipfrac_higher": indicators["pg_clipfrac_higher"].to(loss_mat.dtype),
            "pg_clipfrac_lower": indicators["pg_clipfrac_lower"].to(loss_mat.dtype),
            "ppo_kl": old_log_probs - log_probs,
            "entropy_estimate": -log_probs,
        }
        # 0-dim tensors on the loss's device: reading them is the caller's one sync (the actor sums
        # them over a whole update and reads them once)
        means = {k: masked_mean(v.float(), response_mask) for k, v in values.items()}
    return loss, means


def compute_kl_loss(
    log_probs: Tensor,
    ref_log_probs: Tensor,
    response_mask: Tensor,
    kind: str,
    loss_avg_mode: str,
    num_tokens: float,
    num_seqs: float,
    low_var_clamp: float | None = LOW_VAR_KL_CLAMP,
    old_log_probs: Tensor | None = None,
) -> Tensor:
    """KL(pi || pi_ref) as a loss term (`algorithm.use_kl_loss`), aggregated like the policy loss.

    The caller adds `kl_coef * compute_kl_loss(...)` to the policy loss; `low_var_kl` is the usual
    kind, bounded by `low_var_clamp` (`algorithm.low_var_kl_clamp`). `old_log_probs` [B, T]
    (`algorithm.kl_loss_ratio_weighted`): each token's estimate is multiplied by its ratio
    exp(log_probs - old_log_probs) (`_ratio`), not detached. Its value is 1 on the policy that sampled, but its
    gradient adds kl * grad(log pi): E_pi[grad(r * k)] is then the gradient of KL(pi || pi_ref),
    where the k3 estimate alone gives -E_pi_ref[grad log pi], the gradient of KL(pi_ref || pi).
    """
    log_probs, ref_log_probs = _zero_padding(response_mask, log_probs, ref_log_probs)
    kl = kl_estimate(log_probs, ref_log_probs, kind, low_var_clamp)  # [B, T]
    if old_log_probs is not None:
        (old_log_probs,) = _zero_padding(response_mask, old_log_probs)
        kl = kl * _ratio(old_log_probs, log_probs)  # clamped like the policy losses' ratio: finite
    return aggregate_loss(kl, response_mask, loss_avg_mode, num_tokens, num_seqs)
