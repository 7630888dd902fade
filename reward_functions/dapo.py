"""DAPO reward: +1 for a correct answer, -1 for a wrong one, plus a soft overlong penalty.

Scores (batch function):
    accuracy          1.0 correct / 0.0 wrong (logged as the fraction correct; `overall` uses +1/-1)
    overlong_penalty  0 up to `max_response_length - overlong_buffer_length` tokens, then falling
                      linearly to `-overlong_penalty_factor` at `max_response_length` tokens (uses
                      `response_length`, the token count, not characters); never below that
    overall           (+1 if correct else -1) + overlong_penalty

The answer is the last `\\boxed{...}` in the response, or else what follows the last `Answer:`
(DAPO's own prompt format) up to the end of that line; it is compared with math_verify.

Kwargs:
    max_response_length      generation limit in tokens; keep equal to data.max_response_length (4096)
    overlong_buffer_length   length of the penalty ramp in tokens; 0 disables the penalty (512)
    overlong_penalty_factor  penalty at the limit (1.0)

Prompt template: format_prompts/math.jinja.
"""

from __future__ import annotations

from typing import Any

from vlrl.rewards.math_grading import last_boxed, math_equal, preload

REWARD_TYPE = "batch"
PARTIAL_BATCHES = True  # each sample is scored on its own: groups may be scored as they finish
preload()  # pay math_verify's import when the worker starts, not inside the first timed call


def extract_answer(response: str) -> str | None:
    """The last boxed answer, else the text after the last `Answer:` on its line."""
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed
    start = response.rfind("Answer:")
    if start == -1:
        return None
    line = response[start + len("Answer:") :].split("\n", 1)[0]
    return line.strip().strip("$").strip() or None


def overlong_penalty(length: int, max_length: int, buffer: int, factor: float) -> float:
    """0 before the buffer starts, then linear down to `-factor` at `max_length` tokens."""
    if buffer <= 0:
        return 0.0
    excess = length - (max_length - buffer)
    if excess <= 0:
        return 0.0
    return -min(excess / buffer, 1.0) * factor


def compute_score(
    reward_inputs: list[dict[str, Any]],
    max_response_length: int = 4096,
    overlong_buffer_length: int = 512,
    overlong_penalty_factor: float = 1.0,
) -> list[dict[str, float]]:
    """Batch entry point: one score dict per input."""
    if not 0 <= overlong_buffer_length <= max_response_length:
        raise ValueError(
            f"need 0 <= overlong_buffer_length ({overlong_buffer_length}) <= "
            f"max_response_length ({max_response_length})"
        )
    scores = []
    for x in reward_inputs:
        answer = extract_answer(x["response"])
        correct = answer is not None and math_equal(answer, x["ground_truth"])
        penalty = overlong_penalty(
            int(x["response_length"]), max_response_length, overlong_buffer_length, overlong_penalty_factor
        )
        scores.append(
            {
                "overall": (1.0 if correct else -1.0) + penalty,
                "accuracy": 1.0 if correct else 0.0,
                "overlong_penalty": penalty,
            }
        )
    return scores
