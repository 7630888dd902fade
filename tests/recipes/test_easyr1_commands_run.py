"""EasyR1's 20 launch commands run, as a user runs them from an EasyR1 checkout: through the real
CLI, 2 steps, one validation, one checkpoint save.

Each command's arguments are passed unchanged (tests/fixtures/easyr1/commands.yaml), from a folder
where every hub id they name is a local folder of the same name (`recipe_assets`). After them come
only the sizes a 2-core CPU needs (`cpu_sizes`): batch, length and pixel sizes, at most 2 ranks,
tensor- and sequence-parallel sizes of at most 2, and the DAPO reward's length arguments scaled
with the response length. Responses vary in length (up to 48 tokens) and some end at EOS.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from recipe_assets import easyr1_workdir

REPO = Path(__file__).resolve().parents[2]
COMMANDS: dict[str, list[str]] = yaml.safe_load((REPO / "tests/fixtures/easyr1/commands.yaml").read_text())
EASYR1_DEFAULTS = yaml.safe_load((REPO / "tests/fixtures/easyr1/examples/config.yaml").read_text())
MAX_RESPONSE = 48

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def ray_address() -> Iterator[str]:
    """One local Ray cluster that every run joins through RAY_ADDRESS, as runs on a cluster do: a
    run then skips the ~10 s of starting its own. Stopped with the session."""
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="session")
def easyr1_assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return easyr1_workdir(tmp_path_factory.getbasetemp() / "recipes")


@pytest.fixture
def easyr1_dir(easyr1_assets: Path, tmp_path: Path) -> Path:
    """This test's own EasyR1 folder (its checkpoints/ apart): links to the shared assets."""
    for entry in easyr1_assets.iterdir():
        (tmp_path / entry.name).symlink_to(entry, target_is_directory=True)
    return tmp_path


def _given(args: list[str], key: str) -> Any:
    """The value `args` give `key` (the last one wins), else EasyR1's config.yaml default."""
    values = [arg.split("=", 1)[1] for arg in args if arg.startswith(key + "=")]
    if values:
        return yaml.safe_load(values[-1])
    node: Any = EASYR1_DEFAULTS
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def cpu_sizes(args: list[str]) -> list[str]:
    """The overrides appended after a command's arguments: sizes only (see the module docstring)."""
    ranks = min(int(_given(args, "trainer.n_gpus_per_node")), 2)
    sizes = [
        f"trainer.n_gpus_per_node={ranks}",
        f"worker.rollout.tensor_parallel_size={min(int(_given(args, 'worker.rollout.tensor_parallel_size')), ranks)}",
        f"worker.actor.ulysses_size={min(int(_given(args, 'worker.actor.ulysses_size') or 1), ranks)}",
        "data.rollout_batch_size=4", "worker.actor.global_batch_size=2", "data.val_batch_size=4",
        "data.max_prompt_length=768", f"data.max_response_length={MAX_RESPONSE}",
        "data.min_pixels=4096", "data.max_pixels=16384",
        "trainer.max_steps=2", "trainer.val_before_train=false",
    ]  # fmt: skip
    if _given(args, "data.mini_rollout_batch_size") is not None:
        sizes.append("data.mini_rollout_batch_size=2")
    kwargs = _given(args, "worker.reward.reward_function_kwargs")
    if kwargs and "max_response_length" in kwargs:  # DAPO's overlong penalty, scaled with the length
        scaled = {**kwargs, "max_response_length": MAX_RESPONSE, "overlong_buffer_length": MAX_RESPONSE // 3}
        sizes.append(f"worker.reward.reward_function_kwargs={json.dumps(scaled)}")
    return sizes


def run_command(
    workdir: Path, args: list[str], ray_address: str, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "offline", "SWANLAB_MODE": "offline",
           "RAY_ADDRESS": ray_address}  # fmt: skip
    return subprocess.run(
        [sys.executable, "-m", "vlrl.trainer.main", *args], cwd=workdir, env=env,
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def check_run(workdir: Path, args: list[str], proc: subprocess.CompletedProcess[str]) -> list[dict]:
    """The run trained 2 steps on responses of varied lengths, validated and saved once."""
    assert proc.returncode == 0, proc.stderr[-6000:]
    run = (
        workdir
        / "checkpoints"
        / _given(args, "trainer.project_name")
        / _given(args, "trainer.experiment_name")
    )
    assert (run / "global_step_2" / "actor").is_dir() and not list(run.glob("*.tmp"))
    loggers = _given(args, "trainer.logger")
    if "file" not in loggers:  # console with wandb or swanlab (offline here): the console's step lines
        assert "[step 1] reward/overall=" in proc.stderr and "[step 2] reward/overall=" in proc.stderr
        assert "val/overall=" in proc.stderr.split("[step 2] reward/overall=", 1)[1]
        assert list(run.glob("logs/wandb/offline-run-*" if "wandb" in loggers else "logs/swanlog/run-*"))
        return []
    rows = [json.loads(line) for line in (run / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "reward/overall" in row]
    assert [row["step"] for row in steps] == [1, 2], rows
    assert sum("val/overall" in row for row in rows) == 1
    assert all(set(row) - {"step"} for row in rows), rows  # no empty rows
    kl_loss = bool(_given(args, "algorithm.use_kl_loss")) and not _given(args, "algorithm.disable_kl")
    for row in steps:
        assert row["response_length/min"] < row["response_length/max"] <= MAX_RESPONSE, row
        assert row["response_length/clip_ratio"] < 1.0, row  # some responses ended at EOS
        assert ("actor/kl_loss" in row) == kl_loss, row
    assert any(row["actor/grad_norm"] > 0 for row in steps), steps  # an update reached the weights
    return steps


@pytest.mark.parametrize("script", sorted(COMMANDS))
def test_easyr1_command_runs(script: str, easyr1_dir: Path, ray_address: str) -> None:
    args = COMMANDS[script] + cpu_sizes(COMMANDS[script])
    check_run(easyr1_dir, args, run_command(easyr1_dir, args, ray_address))
