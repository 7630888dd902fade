"""`worker.actor.fsdp.fsdp_size` / `worker.ref.fsdp.fsdp_size`: start-up checks and the multi-node default
(hybrid sharding itself: tests/actor/test_hybrid_shard.py)."""

from __future__ import annotations

import pytest

from vlrl.config import ConfigError
from vlrl.config.loader import load_config


def test_fsdp_size_must_divide_the_training_ranks(base: list[str]) -> None:
    with pytest.raises(ConfigError, match=r"worker.actor.fsdp.fsdp_size=3 must divide the 4 training ranks"):
        load_config([*base, "trainer.n_gpus_per_node=4", "worker.actor.fsdp.fsdp_size=3"])
    with pytest.raises(ConfigError, match=r"worker.ref.fsdp.fsdp_size=8 must divide the 4 training ranks"):
        load_config([*base, "trainer.n_gpus_per_node=4", "worker.ref.fsdp.fsdp_size=8"])


def test_fsdp_size_dividing_the_world_is_kept(base: list[str]) -> None:
    config = load_config([*base, "trainer.n_gpus_per_node=4", "worker.actor.fsdp.fsdp_size=2"])
    assert config.worker.actor.fsdp.fsdp_size == 2
    assert config.worker.ref.fsdp.fsdp_size == -1  # one node: flat


def test_default_is_one_group_per_node_on_several_nodes(base: list[str]) -> None:
    config = load_config([*base, "trainer.nnodes=2", "worker.actor.global_batch_size=8"])
    assert config.worker.actor.fsdp.fsdp_size == 2  # trainer.n_gpus_per_node
    assert config.worker.ref.fsdp.fsdp_size == 2
    explicit = load_config(
        [*base, "trainer.nnodes=2", "worker.actor.global_batch_size=8", "worker.actor.fsdp.fsdp_size=4"]
    )
    assert explicit.worker.actor.fsdp.fsdp_size == 4  # a set value wins


def test_default_stays_flat_when_a_node_does_not_divide_the_training_ranks() -> None:
    from vlrl.config import PPOConfig

    config = PPOConfig()
    config.trainer.nnodes, config.trainer.n_gpus_per_node, config.trainer.device = 2, 4, "cpu"
    config.worker.rollout.async_ranks = 2  # 6 training ranks: 4 on node 0, 2 on node 1
    config.derive()
    assert config.worker.actor.fsdp.fsdp_size == -1


def test_build_mesh_refuses_a_size_that_does_not_divide() -> None:
    from vlrl.workers.fsdp import shard_group_size

    assert shard_group_size(-1, 4) == 4
    assert shard_group_size(2, 4) == 2
    with pytest.raises(ValueError, match="fsdp_size=3 .* must be -1 or divide the world size 4"):
        shard_group_size(3, 4)
