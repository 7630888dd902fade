"""The ground-truth rule: what type `RewardInput.ground_truth` has, whatever the data file held.

- a string stays the same string;
- a number becomes its decimal text: integers (and integral floats, since a JSON column mixing
  `5` and `2.5` loads as floats) as `"5"`, other floats as Python writes them (`"2.5"`);
- a non-empty list of strings / numbers becomes a `list[str]` (multi-answer tasks: the reward
  decides whether any or all must match; `math_equal` accepts any);
- anything else (bool, dict, null inside a list, nested lists, NaN, an empty list) is a bad row.

So a reward function sees `str` or `list[str]`, nothing else (docs/rewards.md).
"""

from __future__ import annotations

import math
from typing import Any


class AnswerProblem(ValueError):
    """An answer cell that is not a string, a number or a list of them."""


def _scalar_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise AnswerProblem(f"{type(value).__name__} {value!r}")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise AnswerProblem(f"float {value!r}")
        if value.is_integer():
            return str(int(value))
    return str(value)


def normalize_answer(value: Any, key: str = "answer") -> str | list[str]:
    """`value` as `str` or `list[str]` by the rule above (raises AnswerProblem naming `key`)."""
    try:
        if isinstance(value, (list, tuple)):
            if not value:
                raise AnswerProblem("an empty list")
            return [_scalar_text(item) for item in value]
        return _scalar_text(value)
    except AnswerProblem as err:
        raise AnswerProblem(
            f"answer key {key!r} holds {err}; an answer must be a string, a number, or a non-empty list "
            "of them (docs/rewards.md, 'ground_truth')"
        ) from None
