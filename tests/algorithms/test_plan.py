"""The step plan (vlrl.algorithms.plan): derived from the keys as written out by hand here, for the
modes users run; every registered estimator declares its needs; a plan whose needs the engines
cannot meet fails at start-up."""

from __future__ import annotations

from typing import Any

import pytest

from vlrl.algorithms import ADV_ESTIMATORS
from vlrl.algorithms.plan import ESTIMATOR_NEEDS, StepPlan
from vlrl.config import ConfigError, PPOConfig


def _config(**keys: Any) -> PPOConfig:
    """PPOConfig defaults (EasyR1's: grpo, KL in the reward, rollout 512 / global 256 prompts) with
    dotted `keys` ('__' for '.'), derived."""
    config = PPOConfig()
    for key, value in keys.items():
        *path, last = key.split("__")
        node = config
        for name in path:
            node = getattr(node, name)
        setattr(node, last, value)
    config.derive()
    return config


ON_POLICY = {"worker__actor__global_batch_size": 512}  # one optimizer step per generation step
NO_KL = {"algorithm__disable_kl": True}
KL_LOSS = {"algorithm__use_kl_loss": True}
ASYNC = {"worker__rollout__async_ranks": 1, "trainer__n_gpus_per_node": 2}

# (keys, expected plan fields: old_log_probs, ratio_from, reference, kl, advantages, baseline, correction)
CASES: dict[str, tuple[dict[str, Any], tuple[Any, ...]]] = {
    "defaults: KL in the reward, 2 mini-batches": (
        {},
        ("pass", "actor", True, "reward", "driver", "group", "none"),
    ),
    # the first mini-batch's old log-probs come from the update's first forward, the pass does the rest
    "KL loss, 2 mini-batches": (KL_LOSS, ("mixed", "actor", True, "loss", "driver", "group", "none")),
    "KL loss, 2 mini-batches, ratio from the engine": (
        {**KL_LOSS, "algorithm__old_policy": "rollout"},
        ("pass", "rollout", True, "loss", "driver", "group", "none"),
    ),
    "KL loss, one step": (
        {**KL_LOSS, **ON_POLICY},
        ("update", "actor", True, "loss", "driver", "group", "none"),
    ),
    "no KL, one step": (
        {**NO_KL, **ON_POLICY},
        ("update", "actor", False, "none", "driver", "group", "none"),
    ),
    # the penalty is computed from the old log-probs before the advantages: the pass stays
    "KL in the reward, one step": (ON_POLICY, ("pass", "actor", True, "reward", "driver", "group", "none")),
    # the first epoch's forward gives the old log-probs, the second reads them
    "no KL, one mini-batch, 2 epochs": (
        {**NO_KL, **ON_POLICY, "worker__actor__ppo_epochs": 2},
        ("update", "actor", False, "none", "driver", "group", "none"),
    ),
    "truncated IS, one step": (
        {**NO_KL, **ON_POLICY, "algorithm__tis_cap": 2.0},
        ("pass", "actor", False, "none", "driver", "group", "token_tis"),
    ),
    "asynchronous (auto: the engine's ratio)": (
        {**NO_KL, **ON_POLICY, **ASYNC},
        ("pass", "rollout", False, "none", "driver", "group", "none"),
    ),
    "asynchronous with truncated IS": (
        {**NO_KL, **ON_POLICY, **ASYNC, "algorithm__tis_cap": 2.0},
        ("pass", "actor", False, "none", "driver", "group", "token_tis"),
    ),
    "REINFORCE++ (token-level)": (
        {**KL_LOSS, "algorithm__adv_estimator": "reinforce_plus_plus"},
        ("mixed", "actor", True, "loss", "ranks", "group", "none"),
    ),
    "sequence-level masked IS": (
        {**NO_KL, **ON_POLICY, "algorithm__off_policy_correction": "seq_mask"},
        ("pass", "actor", False, "none", "driver", "group", "seq_mask"),
    ),
    "ReMax (greedy baseline), one step": (
        {**NO_KL, **ON_POLICY, "algorithm__adv_estimator": "remax"},
        ("update", "actor", False, "none", "driver", "greedy", "none"),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_plan_of_each_mode(case: str) -> None:
    keys, expected = CASES[case]
    plan = _config(**keys).plan
    fields = ("old_log_probs", "ratio_from", "reference", "kl", "advantages", "baseline", "correction")
    assert tuple(getattr(plan, name) for name in fields) == expected, plan.describe()


def test_every_estimator_declares_its_needs() -> None:
    assert set(ESTIMATOR_NEEDS) == set(ADV_ESTIMATORS)
    for name in ADV_ESTIMATORS:  # each one derives a plan
        assert _config(algorithm__adv_estimator=name).plan.advantages in ("driver", "ranks")


def test_the_plan_is_frozen_and_described() -> None:
    plan = _config(**KL_LOSS).plan
    assert isinstance(plan, StepPlan)
    with pytest.raises(AttributeError):
        plan.kl = "none"  # type: ignore[misc]
    assert plan.describe().startswith("old log-probs: mixed; ratio from: actor; reference: yes; KL: loss")


@pytest.mark.parametrize(
    "keys, message",
    [
        (
            {"algorithm__tis_cap": 2.0},
            "algorithm.off_policy_correction=token_tis \\(or tis_cap\\) divides by",
        ),
        (
            {"algorithm__off_policy_correction": "seq_mask"},
            "off_policy_correction=seq_mask \\(or tis_cap\\) divides",
        ),
        (
            {"algorithm__old_policy": "rollout"},
            "algorithm.old_policy=rollout measures the ratio from the engine",
        ),
    ],
)
def test_a_plan_the_engines_cannot_serve_fails_at_start_up(keys: dict[str, Any], message: str) -> None:
    config = _config(**keys, worker__rollout__calculate_log_probs=False, worker__actor__model__model_path="m")
    with pytest.raises(ConfigError, match=message):
        config.validate()
