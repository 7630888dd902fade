"""worker.rollout.multi_turn: off by default, every bad value fails at start-up naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from vlrl.config import ConfigError, PPOConfig
from vlrl.config.loader import load_config

TOOLS = str(Path(__file__).with_name("mt_tools.py"))


def test_off_by_default():
    assert PPOConfig().worker.rollout.multi_turn.enable is False


def test_valid_multi_turn_config(base):
    config = load_config(
        [*base, "worker.rollout.multi_turn.enable=true", f"worker.rollout.multi_turn.tools=[{TOOLS}:add]"]
    )
    assert config.worker.rollout.multi_turn.tools == [f"{TOOLS}:add"]


def test_overlapped_tools_with_tensor_parallelism_are_allowed(base):
    """The TP leader runs the tools and broadcasts which calls finished (multi_turn.shared_tools),
    so the peers queue the same turns with overlap_tools too (tests/rollout/test_mt_tensor_parallel.py)."""
    config = load_config([*base, "worker.rollout.multi_turn.enable=true", f"worker.rollout.multi_turn.tools=[{TOOLS}:add]",
                          "worker.rollout.multi_turn.overlap_tools=true", "worker.rollout.tensor_parallel_size=2"])  # fmt: skip
    assert config.worker.rollout.multi_turn.overlap_tools and config.worker.rollout.tensor_parallel_size == 2


@pytest.mark.parametrize(
    "overrides, message",
    [
        ([], r"enable=true needs worker.rollout.multi_turn.tools"),
        (["worker.rollout.multi_turn.tools=[/no/tools.py:f]"], r"file of '/no/tools.py:f' does not exist"),
        ([f"worker.rollout.multi_turn.tools=[{TOOLS}:add]", "worker.rollout.multi_turn.max_assistant_turns=0"],
         r"max_assistant_turns=0 must be >= 1"),
        ([f"worker.rollout.multi_turn.tools=[{TOOLS}:add]", "worker.rollout.multi_turn.tool_timeout=0"],
         r"tool_timeout=0.0 must be > 0"),
        ([f"worker.rollout.multi_turn.tools=[{TOOLS}:add]", "worker.rollout.multi_turn.format=json"],
         r"format='json' is unknown"),
        ([f"worker.rollout.multi_turn.tools=[{TOOLS}:add]", "worker.rollout.name=hf"],
         r"runs on the vLLM engine only"),
    ],
)  # fmt: skip
def test_bad_values_fail_at_start_up(base, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config([*base, "worker.rollout.multi_turn.enable=true", *overrides])
