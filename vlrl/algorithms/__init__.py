"""Pure tensor functions of the RL algorithms: advantages, KL, policy losses, group filtering.

The registries map config names to functions: `ADV_ESTIMATORS` (`algorithm.adv_estimator`),
`KL_ESTIMATORS` (`algorithm.kl_penalty`), `POLICY_LOSSES` (`worker.actor.policy_loss`) and
`LOSS_AGG_MODES` (`worker.actor.loss_avg_mode`). `GROUP_ESTIMATORS` names the estimators that
compare samples of one prompt and so need `worker.rollout.n > 1`. `vlrl.algorithms.plan` derives
the step plan from what each estimator and correction declares it needs. See docs/algorithms.md.
"""

from vlrl.algorithms.advantages import (
    ADV_ESTIMATORS,
    GROUP_ESTIMATORS,
    compute_advantages,
)
from vlrl.algorithms.filtering import filter_groups
from vlrl.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    KLPenalty,
    PenalizedRewards,
    kl_estimate,
    low_var_kl_clamped,
    make_kl_controller,
    penalized_rewards,
)
from vlrl.algorithms.losses import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    aggregate_loss,
    compute_kl_loss,
    compute_policy_loss,
    count_tokens_and_seqs,
    masked_mean,
)

__all__ = [
    "ADV_ESTIMATORS",
    "GROUP_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "FixedKLController",
    "KLPenalty",
    "PenalizedRewards",
    "aggregate_loss",
    "penalized_rewards",
    "compute_advantages",
    "compute_kl_loss",
    "compute_policy_loss",
    "count_tokens_and_seqs",
    "filter_groups",
    "kl_estimate",
    "low_var_kl_clamped",
    "make_kl_controller",
    "masked_mean",
]
