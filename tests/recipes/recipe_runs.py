"""Running a recipe as a user does: its arguments, then only the sizes a 2-core CPU needs."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import warm_cli
import yaml

REPO = Path(__file__).resolve().parents[2]
EASYR1_DEFAULTS = yaml.safe_load((REPO / "tests/fixtures/easyr1/examples/config.yaml").read_text())
MAX_RESPONSE = 48


def given(args: list[str], key: str, defaults: dict[str, Any] = EASYR1_DEFAULTS) -> Any:
    """The value `args` give `key` (the last one wins), else its value in `defaults` (a config
    tree; EasyR1's config.yaml unless said)."""
    values = [arg.split("=", 1)[1] for arg in args if arg.startswith(key + "=")]
    if values:
        return yaml.safe_load(values[-1])
    node: Any = defaults
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def cpu_sizes(args: list[str], defaults: dict[str, Any] = EASYR1_DEFAULTS, lengths: bool = True) -> list[str]:
    """The overrides appended after a recipe's arguments: sizes only. At most 2 ranks, and
    tensor- and sequence-parallel sizes that fit them; 4 prompts, 2 per optimizer step, micro-batches
    of 1 (EasyR1's default), 2 steps, no validation before training; with `lengths`, prompt, response (MAX_RESPONSE) and pixel sizes."""

    def value(key: str) -> Any:
        return given(args, key, defaults)

    ranks = min(int(value("trainer.n_gpus_per_node")), 2)
    sizes = [
        f"trainer.n_gpus_per_node={ranks}",
        f"worker.rollout.tensor_parallel_size={min(int(value('worker.rollout.tensor_parallel_size')), ranks)}",
        f"worker.actor.ulysses_size={min(int(value('worker.actor.ulysses_size') or 1), ranks)}",
        "data.rollout_batch_size=4", "worker.actor.global_batch_size=2", "data.val_batch_size=4",
        "worker.actor.micro_batch_size_per_device_for_update=1",  # divides any rank's share
        "trainer.max_steps=2", "trainer.val_before_train=false",
    ]  # fmt: skip
    if lengths:
        sizes += ["data.max_prompt_length=768", f"data.max_response_length={MAX_RESPONSE}",
                  "data.min_pixels=4096", "data.max_pixels=16384"]  # fmt: skip
    if value("data.mini_rollout_batch_size") is not None:
        sizes.append("data.mini_rollout_batch_size=2")
    kwargs = value("worker.reward.reward_function_kwargs")
    if kwargs and "max_response_length" in kwargs:  # DAPO's overlong penalty, scaled with the length
        scaled = {**kwargs, "max_response_length": MAX_RESPONSE, "overlong_buffer_length": MAX_RESPONSE // 3}
        sizes.append(f"worker.reward.reward_function_kwargs={json.dumps(scaled)}")
    return sizes


def run_command(
    workdir: Path, args: list[str], ray_address: str, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": warm_cli.python_path(), "WANDB_MODE": "offline", "SWANLAB_MODE": "offline",
           "RAY_ADDRESS": ray_address}  # fmt: skip
    # the real CLI in a process of its own, forked from one that imported the driver's modules once
    return warm_cli.run(args, workdir, env, timeout)
