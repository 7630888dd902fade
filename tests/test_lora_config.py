"""worker.actor.model.lora at start-up: rank > 0 loads, bad values fail naming the key."""

from pathlib import Path

import pytest

from vlrl.config import ConfigError
from vlrl.config_loader import load_config


@pytest.fixture
def base(tmp_path: Path) -> list[str]:
    """Overrides that make a valid config (model folder and reward file need only exist)."""
    reward = tmp_path / "reward.py"
    reward.write_text("def main(inputs):\n    return [{'overall': 0.0} for _ in inputs]\n")
    data = tmp_path / "train.jsonl"
    data.write_text("")
    return [
        f"worker.actor.model.model_path={tmp_path}",
        f"worker.reward.reward_function={reward}:main",
        f"data.train_files={data}",
        "data.rollout_batch_size=8",
        "worker.actor.global_batch_size=4",
        "worker.actor.micro_batch_size_per_device_for_update=2",
        "worker.rollout.n=4",
        "trainer.n_gpus_per_node=2",
        "trainer.device=cpu",
    ]


def test_lora_rank_loads_with_easyr1_defaults(base: list[str]) -> None:
    lora = load_config([*base, "worker.actor.model.lora.rank=8"]).worker.actor.model.lora
    assert (lora.rank, lora.alpha, lora.target_modules, lora.exclude_modules) == (8, 64, "all-linear", None)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["worker.actor.model.lora.rank=-1"], r"lora.rank=-1 must be >= 0"),
        (["worker.actor.model.lora.rank=8", "worker.actor.model.lora.alpha=0"], r"lora.alpha=0 must be > 0"),
        (["worker.actor.model.lora.rank=8", "worker.actor.model.lora.target_modules=' , '"],
         r"lora.target_modules is empty"),
        (["worker.actor.model.lora.rank=8", "worker.actor.model.lora.exclude_modules='(unclosed'"],
         r"lora.exclude_modules='\(unclosed' is not a valid regex"),
    ],
)  # fmt: skip
def test_bad_lora_values_fail_at_start_up(base: list[str], overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config([*base, *overrides])
