"""Math reward: accuracy of the last `\\boxed{...}` answer plus a small format bonus.

Scores (batch function, `REWARD_TYPE = "batch"`):
    accuracy  1.0 when the last boxed answer equals the ground truth (exact after normalisation, else
              math_verify equivalence: `\\frac{1}{2}` == `0.5` == `1/2`), else 0.0
    format    1.0 when the response contains a non-empty, brace-balanced `\\boxed{...}`, else 0.0
    overall   (1 - format_weight) * accuracy + format_weight * format

Kwargs (`worker.reward.reward_function_kwargs`):
    format_weight  weight of the format score in `overall` (default 0.1)

Prompt template: format_prompts/math.jinja (reason, then the final answer in \\boxed{}).

math_verify runs in the reward worker processes; answers over 1000 characters are judged wrong
without calling it, each parse/verify call is capped at a few seconds, and the runner's
`worker.reward.timeout` kills a worker that still hangs.
"""

from __future__ import annotations

from typing import Any

from vlrl.rewards.math_grading import last_boxed, math_equal, preload

REWARD_TYPE = "batch"
PARTIAL_BATCHES = True  # each sample is scored on its own: groups may be scored as they finish
preload()  # pay math_verify's import when the worker starts, not inside the first timed call


def score_one(response: str, ground_truth: Any, format_weight: float = 0.1) -> dict[str, float]:
    """Score one response against its ground truth."""
    answer = last_boxed(response)
    has_box = answer is not None and answer.strip() != ""
    accuracy = 1.0 if has_box and math_equal(answer, ground_truth) else 0.0
    fmt = 1.0 if has_box else 0.0
    return {
        "overall": (1.0 - format_weight) * accuracy + format_weight * fmt,
        "format": fmt,
        "accuracy": accuracy,
    }


def compute_score(reward_inputs: list[dict[str, Any]], format_weight: float = 0.1) -> list[dict[str, float]]:
    """Batch entry point: one score dict per input."""
    return [score_one(x["response"], x["ground_truth"], format_weight) for x in reward_inputs]
