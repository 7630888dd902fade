"""The trainer on a Ray cluster: the driver's data and reward runner, and one Ray actor per rank."""

from __future__ import annotations

from vlrl.batch.image_refs import ImageRefs
from vlrl.config import PPOConfig
from vlrl.rewards import RewardRunner
from vlrl.trainer.checkpoint import open_run_folder
from vlrl.trainer.data_setup import TrainingData
from vlrl.trainer.ppo_trainer import PPOTrainer
from vlrl.trainer.ranks import RankRoles
from vlrl.trainer.ray_workers import start_rank_groups, start_ray
from vlrl.utils.phase_times import PhaseTimes


def build_trainer(config: PPOConfig) -> PPOTrainer:
    """The checkpoint folder's lock and use first (a second run on it, or a new run over an earlier
    run's checkpoints, stops at once), data and rewards next (a bad dataset or reward file fails
    before Ray starts), then Ray and the rank workers, started by the trainer once its own checks passed."""
    startup = PhaseTimes("startup")  # printed once the ranks are set up (`PPOTrainer`)
    with startup.phase("run_folder"):
        checkpoints = open_run_folder(config.trainer)
    with startup.phase("data"):
        data = TrainingData(config)
    with startup.phase("reward_workers"):
        rewards = RewardRunner(config.worker.reward)

    def start_ranks() -> RankRoles:
        with startup.phase("ray"):
            start_ray(config)
        with startup.phase("rank_workers"):
            return start_rank_groups(config)

    return PPOTrainer(
        config,
        data,
        rewards,
        start_ranks,
        image_refs=ImageRefs.ray(),
        checkpoints=checkpoints,
        startup=startup,
    )
