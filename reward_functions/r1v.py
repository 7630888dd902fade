"""R1-V style reward: `<think>...</think> <answer>...</answer>` format plus answer accuracy.

Scores (batch function):
    format    1.0 when the whole response (surrounding whitespace aside) is exactly one
              `<think>...</think>` block followed by one non-empty `<answer>...</answer>` block
              (only whitespace between them), else 0.0
    accuracy  1.0 when the answer matches the ground truth, else 0.0. The answer is the text inside the
              last `<answer>...</answer>` (or the last `\\boxed{...}` within it); it is compared by
              case-insensitive normalised string equality, then with math_verify.
    overall   (1 - format_weight) * accuracy + format_weight * format

Kwargs:
    format_weight  weight of the format score in `overall` (default 0.5)

Prompt template: format_prompts/r1v.jinja.

The format check counts and finds tags instead of running a backtracking regex, so a 100k-character
response full of tags costs linear time.
"""

from __future__ import annotations

from typing import Any

from vlrl.rewards.math_grading import last_boxed, math_equal, preload

REWARD_TYPE = "batch"
PARTIAL_BATCHES = True  # each sample is scored on its own: groups may be scored as they finish
preload()  # pay math_verify's import when the worker starts, not inside the first timed call
_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def extract_answer(response: str) -> str | None:
    """Text inside the last `<answer>...</answer>`, or None when there is no such closed pair."""
    start = response.rfind("<answer>")
    if start == -1:
        return None
    start += len("<answer>")
    end = response.find("</answer>", start)
    return None if end == -1 else response[start:end].strip()


def format_ok(response: str) -> bool:
    """Exactly `<think>X</think> <answer>Y</answer>`, each tag once, Y not empty."""
    text = response.strip()
    if any(text.count(tag) != 1 for tag in _TAGS):
        return False
    think_open, think_close, answer_open, answer_close = (text.find(tag) for tag in _TAGS)
    return (
        think_open == 0
        and think_open < think_close < answer_open < answer_close
        and text[think_close + len("</think>") : answer_open].strip() == ""
        and text.endswith("</answer>")
        and text[answer_open + len("<answer>") : answer_close].strip() != ""
    )


def score_one(response: str, ground_truth: Any, format_weight: float = 0.5) -> dict[str, float]:
    """Score one response against its ground truth."""
    answer = extract_answer(response)
    accuracy = 0.0
    if answer:
        answer = last_boxed(answer) or answer  # tolerate `<answer>\boxed{3}</answer>`
        accuracy = 1.0 if math_equal(answer, ground_truth) else 0.0
    fmt = 1.0 if format_ok(response) else 0.0
    return {
        "overall": (1.0 - format_weight) * accuracy + format_weight * fmt,
        "format": fmt,
        "accuracy": accuracy,
    }


def compute_score(reward_inputs: list[dict[str, Any]], format_weight: float = 0.5) -> list[dict[str, float]]:
    """Batch entry point: one score dict per input."""
    return [score_one(x["response"], x["ground_truth"], format_weight) for x in reward_inputs]
