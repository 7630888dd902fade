"""End to end with video prompts through the real CLI: Ray, a rank worker with a vLLM SPMD engine,
an FSDP2 actor with a reference, the moving-square video task (MPEG-4 files read with PyAV)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import warm_cli
from e2e_helpers import joined_env

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_trains_on_videos(tmp_path: Path) -> None:
    from vlrl.data.synthetic import make_moving_square_dataset
    from vlrl.models.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "model", arch="qwen2_5_vl", seed=0, min_pixels=3136, max_pixels=12544)
    train, val = make_moving_square_dataset(tmp_path / "data", n_train=16, n_val=4, seed=0)
    # A reward that varies between samples, so each step has a learning signal (an untrained model
    # rarely says left or right; reward_functions/shapes.py, which scores the task, is unit-tested).
    reward = tmp_path / "vowels.py"
    reward.write_text(
        "def compute_score(inputs):\n"
        "    return [{'overall': sum(c in 'aeiou' for c in x.response) / max(len(x.response), 1)} for x in inputs]\n"
    )
    out = tmp_path / "run"
    args = [
        f"config={REPO / 'examples' / 'quickstart.yaml'}",
        f"worker.actor.model.model_path={model}",
        f"data.train_files={train}",
        f"data.val_files={val}",
        f"trainer.save_checkpoint_path={out}",
        "data.min_pixels=3136",  # 56x56 frames: 4 tokens per 2-frame patch, 8 per video
        "data.max_pixels=3136",
        "data.video_fps=2.0",
        f"worker.reward.reward_function={reward}:compute_score",
        "data.rollout_batch_size=4",
        "data.max_response_length=4",
        "worker.rollout.n=4",
        "worker.actor.global_batch_size=4",
        "worker.actor.micro_batch_size_per_device_for_update=8",
        "worker.actor.micro_batch_size_per_device_for_experience=16",
        "algorithm.disable_kl=false",  # the reference model scores the videos too
        "algorithm.use_kl_loss=true",
        "algorithm.kl_penalty=low_var_kl",
        "trainer.max_steps=2",
        "trainer.val_before_train=false",
        "trainer.val_freq=2",
        "trainer.save_freq=-1",
        "trainer.plot_path=null",
        "trainer.logger=[console,file]",
    ]
    proc = warm_cli.run(args, REPO, joined_env(), timeout=600)
    assert proc.returncode == 0, f"run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    lines = (out / "logs" / "metrics.jsonl").read_text().splitlines()
    metrics = {row["step"]: row for row in map(json.loads, lines)}
    assert sorted(metrics) == [1, 2]
    for row in metrics.values():
        assert 0.0 <= row["reward/overall"] <= 1.0
        assert row["actor/grad_norm"] > 0 and row["actor/kl_loss"] >= 0
        assert abs(row["rollout/log_prob_diff_mean"]) < 0.05  # the actor scores what vLLM sampled
    assert "val/overall" in metrics[2]
