"""A token-level estimator's advantages (REINFORCE++), computed on the training ranks that hold the
rows: the driver sends each rank its rows' scores (`TokenRewards`), and the whitening's sums are
added up over the ranks, so no [rows, R] tensor crosses the driver."""

from __future__ import annotations

import torch

from vlrl.algorithms.advantages import compute_advantages
from vlrl.algorithms.kl import penalized_rewards
from vlrl.batch.rows import RolloutBatch, TokenRewards
from vlrl.rewards import scores_to_token_level


def token_level_advantages(
    batch: RolloutBatch, spec: TokenRewards, ulysses_size: int
) -> tuple[torch.Tensor, dict[str, float]]:
    """This rank's rows' advantages [rows, R], from their scores (minus the KL penalty when it is in
    the reward) and whitened with the whole step's sums over the training ranks; and their
    statistics over the whole step (`critic/advantages/*`), the same on every rank. Every training
    rank must call it (collectives)."""
    mask = batch.response_mask

    def sum_over_ranks(local: torch.Tensor) -> torch.Tensor:
        # CPU tensors: gloo, on GPU machines too (the default group has a CPU backend, see
        # rank_worker.process_group_backend); a Ulysses group's ranks hold the same rows
        total = local.clone()
        torch.distributed.all_reduce(total)
        return total / ulysses_size

    rewards = scores_to_token_level(spec.scores, mask)
    if spec.kl_coef is not None:
        old, ref = batch.tensor("old_log_probs"), batch.tensor("ref_log_probs")
        rewards = penalized_rewards(
            rewards, old, ref, mask, spec.kl_coef, spec.kl_kind, low_var_clamp=spec.kl_low_var_clamp
        ).tensor_rewards()
    advantages = compute_advantages(
        spec.estimator, rewards, mask, batch.group_ids, gamma=spec.gamma, sum_over_ranks=sum_over_ranks
    )[0]
    valid = advantages[mask.bool()].double()  # [tokens]
    total, count = sum_over_ranks(torch.stack([valid.sum(), torch.tensor(float(valid.numel()))]))
    if count == 0:
        return advantages, {}
    extremes = torch.stack([valid.max(), -valid.min()]) if valid.numel() else torch.full((2,), -torch.inf)
    torch.distributed.all_reduce(extremes, op=torch.distributed.ReduceOp.MAX)
    stats = {"mean": (total / count).item(), "max": extremes[0].item(), "min": -extremes[1].item()}
    return advantages, {f"critic/advantages/{k}": v for k, v in stats.items()}
