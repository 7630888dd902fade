"""Helpers shared by the reward tests (a uniquely named module, so it cannot clash with other test dirs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vlrl.config import RewardConfig
from vlrl.rewards import RewardInput, build_reward_inputs

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "reward_functions"
PROMPTS = REPO / "format_prompts"


def make_config(spec: str, **overrides: Any) -> RewardConfig:
    """A RewardConfig for `spec`; tests default to one worker and a short timeout."""
    values: dict[str, Any] = {"reward_function": spec, "num_workers": 1, "timeout": 5.0}
    values.update(overrides)
    return RewardConfig(**values)


def inputs_for(
    responses: list[str], ground_truths: list[Any] | None = None, **extras: list[Any]
) -> list[RewardInput]:
    """RewardInputs for `responses` (lengths = character counts, prompt 'p', extra columns as lists)."""
    n = len(responses)
    rows = [{k: v[i] for k, v in extras.items()} for i in range(n)]
    truths = ground_truths if ground_truths is not None else [""] * n
    return build_reward_inputs(responses, [len(r) for r in responses], ["p"] * n, truths, rows)
