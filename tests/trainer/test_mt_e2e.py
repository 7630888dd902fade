"""Multi-turn end to end through the real CLI on two ranks (Ray, vLLM SPMD, FSDP2, tool workers per
rank): the demo's data and tool, a briefly warmed-up tiny model, two steps and a validation."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import shared_ray
import warm_cli
from example_scripts import load_example

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_multi_turn_demo_runs(tmp_path: Path) -> None:
    from vlrl.models.tiny import build_tiny_model

    demo = load_example("prepare_multi_turn_demo")
    demo.build_data(tmp_path, n_train=32, n_val=8)
    model = build_tiny_model(tmp_path / "model", "qwen2_5_vl", seed=0, min_pixels=demo.PIXELS,
                             max_pixels=demo.PIXELS, tool_tokens=True)  # fmt: skip
    os.chdir(REPO)  # the warm-up reads format_prompts/ relative to the repository
    demo.warm_up(model, tmp_path / "data" / "train_mt.jsonl", steps=30, batch_size=8)
    out = tmp_path / "run"
    args = [
        f"config={REPO / 'examples' / 'multi_turn_demo.yaml'}",
        f"worker.actor.model.model_path={model}",
        f"data.train_files={tmp_path / 'data' / 'train_mt.jsonl'}",
        f"data.val_files={tmp_path / 'data' / 'val_mt.jsonl'}",
        f"trainer.save_checkpoint_path={out}",
        f"worker.rollout.multi_turn.tools=[{REPO / 'examples' / 'tools' / 'reveal.py'}:reveal]",
        "data.rollout_batch_size=8",
        "worker.actor.global_batch_size=4",
        "worker.rollout.n=4",
        "worker.actor.micro_batch_size_per_device_for_update=8",
        "trainer.n_gpus_per_node=2",  # two ranks, each its own engine and tool workers
        "worker.rollout.dtype=fp32",
        "trainer.max_steps=2",
        "trainer.val_before_train=false",
        "trainer.logger=[console,file]",
    ]
    address = shared_ray.address()  # first: it may set RAY_AUTH_MODE in this process's environment
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_ADDRESS": address}
    proc = warm_cli.run(args, REPO, env, timeout=900)
    assert proc.returncode == 0, f"run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    rows = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    assert last["step"] == 2
    # the briefly warmed-up model attempts calls on some samples: tool turns sit inside the responses
    assert 0 < last["multi_turn/tool_call_rate"] <= 1
    assert last["multi_turn/turns_mean"] > 1
    assert "val_multi_turn/tool_calls_mean" in last and "val/overall" in last
    # the demo's reward reads the trajectory: accuracy of the final answer and whether a call ran
    # (a call that ran is a call: at most the share of samples that attempted one)
    assert 0 <= last["reward/accuracy"] <= 1
    assert 0 <= last["reward/called"] <= last["multi_turn/tool_call_rate"]
    # engine and actor score the same tokens of the same trajectories (fp32 engine). This also checks
    # the masks: the engine's log-prob of a tool-turn token is 0, the actor's is not, so a tool token
    # inside response_mask would show here as a difference of several nats.
    assert last["rollout/log_prob_diff_mean"] < 1e-3, last["rollout/log_prob_diff_mean"]
