"""Micro-batching keys: token budgets by default, and a budget that would be ignored fails at start-up."""

from __future__ import annotations

import pytest

from vlrl.config import ConfigError, PPOConfig
from vlrl.config.loader import load_config


def test_token_budget_micro_batches_by_default() -> None:
    actor = PPOConfig().worker.actor
    assert actor.dynamic_batching and actor.max_token_len_per_device is None


def test_default_budget_loads(base: list[str]) -> None:
    config = load_config(base)
    assert config.worker.actor.dynamic_batching


def test_budget_loads_with_dynamic_batching(base: list[str]) -> None:
    assert (
        load_config(
            [*base, "worker.actor.max_token_len_per_device=4096"]
        ).worker.actor.max_token_len_per_device
        == 4096
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["worker.actor.dynamic_batching=false", "worker.actor.max_token_len_per_device=4096"],
            "max_token_len_per_device=4096 is a dynamic-batching budget, but worker.actor.dynamic_batching=false",
        ),
        (["worker.actor.max_token_len_per_device=0"], "max_token_len_per_device=0 must be >= 1"),
    ],
)
def test_ignored_or_invalid_budget_fails_at_start_up(
    base: list[str], overrides: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config([*base, *overrides])


def test_fixed_micro_batches_still_need_a_divisor(base: list[str]) -> None:
    """With dynamic_batching=false the micro-batch size must divide each rank's mini-batch rows."""
    with pytest.raises(
        ConfigError, match="must be divisible by\\s+worker.actor.micro_batch_size_per_device_for_update=3"
    ):
        load_config(
            [
                *base,
                "worker.actor.dynamic_batching=false",
                "worker.actor.micro_batch_size_per_device_for_update=3",
            ]
        )
    load_config(
        [*base, "worker.actor.micro_batch_size_per_device_for_update=3"]
    )  # a budget: no divisor needed
