"""Shared test setup: offline, in-process vLLM engines, quiet logs."""

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import warm_ranks

# Nothing may be downloaded: every model and dataset is built by the tests themselves.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# One vLLM engine in the test process instead of a background engine process.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def _warm_rank_workers() -> None:
    """Ray's rank workers start forked from a process that imported their modules once
    (tests/warm_ranks.py): every driver's `ray.init` calls the hook, which needs this folder on the
    path. VLRL_TEST_COLD_RANKS=1 starts them as Ray does by default."""
    if os.environ.get("VLRL_TEST_COLD_RANKS") == "1" or sys.platform != "linux":
        return
    tests = str(Path(__file__).parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))
    folder = tempfile.mkdtemp(prefix="vlrl-rz-")  # short: a Unix socket's path has at most 107 bytes
    atexit.register(shutil.rmtree, folder, True)
    os.environ[warm_ranks.SOCKET_ENV] = os.path.join(folder, "zygote.sock")
    os.environ[warm_ranks.OWNER_ENV] = str(os.getpid())
    os.environ["RAY_RUNTIME_ENV_HOOK"] = "warm_ranks.hook"


_warm_rank_workers()


@pytest.fixture
def base(tmp_path: Path) -> list[str]:
    """Config overrides that make a valid 2-rank CPU config (model folder and reward file need only exist)."""
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
