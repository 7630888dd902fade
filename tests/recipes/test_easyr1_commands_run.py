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
import subprocess
from pathlib import Path

import pytest
import yaml
from recipe_runs import MAX_RESPONSE, cpu_sizes, given, run_command

REPO = Path(__file__).resolve().parents[2]
COMMANDS: dict[str, list[str]] = yaml.safe_load((REPO / "tests/fixtures/easyr1/commands.yaml").read_text())

pytestmark = pytest.mark.slow


def check_run(workdir: Path, args: list[str], proc: subprocess.CompletedProcess[str]) -> list[dict]:
    """The run trained 2 steps on responses of varied lengths, validated and saved once."""
    assert proc.returncode == 0, proc.stderr[-6000:]
    chatter = [line for line in proc.stderr.splitlines() if "(RankWorker" in line]
    assert chatter == [], chatter  # other libraries' logs stay out (vlrl.utils.library_logs)
    run = (
        workdir / "checkpoints" / given(args, "trainer.project_name") / given(args, "trainer.experiment_name")
    )
    assert (run / "global_step_2" / "actor").is_dir() and not list(run.glob("*.tmp"))
    loggers = given(args, "trainer.logger")
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
    kl_loss = bool(given(args, "algorithm.use_kl_loss")) and not given(args, "algorithm.disable_kl")
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
