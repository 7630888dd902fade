"""Running the real CLI in tests: tiny assets, the quickstart's config shrunk, a run as a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import shared_ray
import warm_cli

REPO = Path(__file__).resolve().parents[2]


def build_assets(root: Path) -> dict[str, Path]:
    """A tiny model, a colour dataset and a reward that always varies between samples."""
    from vlrl.data.synthetic import make_shapes_dataset
    from vlrl.models.tiny import build_tiny_model

    model = build_tiny_model(root / "model", arch="qwen2_5_vl", seed=0, min_pixels=3136, max_pixels=12544)
    train, val = make_shapes_dataset(root / "data", n_train=64, n_val=8, seed=0, task="colour")
    # A reward that always varies between samples, so every step has a learning signal (an
    # untrained model rarely names a colour, and all-equal rewards give zero advantages).
    reward = root / "vowels.py"
    reward.write_text(
        "def compute_score(inputs):\n"
        "    return [{'overall': sum(c in 'aeiou' for c in x.response) / max(len(x.response), 1)} for x in inputs]\n"
    )
    return {"model": model, "train": Path(train), "val": Path(val), "reward": reward}


def cli_args(assets: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return [
        f"config={REPO / 'examples' / 'quickstart.yaml'}",
        f"worker.actor.model.model_path={assets['model']}",
        f"data.train_files={assets['train']}",
        f"data.val_files={assets['val']}",
        f"trainer.save_checkpoint_path={out}",
        f"data.format_prompt={REPO / 'format_prompts' / 'shapes.jinja'}",
        f"worker.reward.reward_function={assets['reward']}:compute_score",
        "data.rollout_batch_size=4",
        "data.max_response_length=8",  # multi-token responses (the quickstart samples one token)
        "worker.actor.global_batch_size=2",
        "worker.actor.micro_batch_size_per_device_for_update=4",
        "worker.actor.micro_batch_size_per_device_for_experience=8",
        "worker.rollout.n=4",
        "trainer.plot_path=null",
        "trainer.logger=[console,file]",
        "trainer.find_last_checkpoint=true",  # the quickstart config turns it off
        *extra,
    ]


def joined_env() -> dict[str, str]:
    """A run's environment when it joins the suite's Ray cluster (shared_ray.py)."""
    address = shared_ray.address()  # first: it may set RAY_AUTH_MODE in this process's environment
    return {**os.environ, "PYTHONUNBUFFERED": "1", "VLRL_DEBUG": "1", "RAY_ADDRESS": address}


def run_cli(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    """The CLI, joined to the suite's Ray cluster; it must succeed."""
    proc = warm_cli.run(
        args, REPO, joined_env(), timeout
    )  # the real CLI, forked with the driver's imports done
    assert proc.returncode == 0, f"run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def read_metrics(out: Path) -> dict[int, dict[str, float]]:
    lines = (out / "logs" / "metrics.jsonl").read_text().splitlines()
    return {row["step"]: row for row in map(json.loads, lines)}


def start_cli(args: list[str], log: Path) -> subprocess.Popen:
    """The CLI as a user starts it: a process of its own that starts its own local Ray cluster."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "VLRL_DEBUG": "1"}
    with open(log, "w") as f:
        # A new session, so the kill below takes Ray's processes with the driver.
        return subprocess.Popen([sys.executable, "-m", "vlrl.trainer.main", *args], cwd=REPO, env=env,
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip


def safe_metrics(out: Path) -> dict[int, dict[str, float]]:
    try:
        return read_metrics(out)
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
