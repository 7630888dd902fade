"""Drop-in reward functions (`path/to/file.py:fn`), run safely and in parallel.

See docs/rewards.md for how to write one. Public API:

- `RewardInput`, `build_reward_inputs`: what a reward function receives.
- `load_reward_function`, `LoadedReward`: load `file.py:fn` and decide batch vs sequential.
- `RewardRunner`, `RewardResult`: score inputs in worker processes with timeouts and failure handling.
- `RewardError`, `RewardLoadError`: raised on failures (`on_failure=raise`) and load problems.
- `scores_to_token_level`: put each sequence's score on its last response token.

Importing this package does not import torch (reward worker processes import it too).
"""

from vlrl.rewards.loading import LoadedReward, check_kwargs, load_reward_function
from vlrl.rewards.runner import RewardRunner
from vlrl.rewards.token_level import scores_to_token_level
from vlrl.rewards.types import (
    RESERVED_KEYS,
    RewardError,
    RewardFailure,
    RewardInput,
    RewardLoadError,
    RewardResult,
    build_reward_inputs,
)
from vlrl.user_code.loading import parse_spec

__all__ = [
    "RESERVED_KEYS",
    "LoadedReward",
    "RewardError",
    "RewardFailure",
    "RewardInput",
    "RewardLoadError",
    "RewardResult",
    "RewardRunner",
    "build_reward_inputs",
    "check_kwargs",
    "load_reward_function",
    "parse_spec",
    "scores_to_token_level",
]
