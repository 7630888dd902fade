"""Reward of the quickstart's synthetic tasks: colour, shape or count of shapes in an image, and the
moving square's direction in a video (`make_moving_square_dataset`).

The ground truth is one lowercase word such as `red`, `circle`, `3` or `left`.

Scores (sequential function, `REWARD_TYPE = "sequential"`: called once per sample):
    accuracy  1.0 when the response names the ground truth and no other answer of the task,
              case-insensitively: `red`, `Red.`, `the answer is red` count; `red or blue` does not.
              Words match as substrings (a tiny model's tokenizer glues words: `redcircle` names
              red); numbers must stand alone as digits (`13` does not name 3).
    format    1.0 when the response is a single word (letters/digits once punctuation is stripped)
    overall   accuracy (format is logged only)

Other answers: those of the ground truth's kind in `vlrl.data.synthetic` (colours, shapes,
directions) or digits.
Kwargs: none. Prompt template: format_prompts/shapes.jinja (answer with one word).
"""

from __future__ import annotations

import re
import string
from typing import Any

from vlrl.data.synthetic import COLOURS, DIRECTIONS, SHAPES

REWARD_TYPE = "sequential"
_STRIP = string.punctuation + "\u201c\u201d\u2018\u2019\u00ab\u00bb\u3002\uff0c\uff01\uff1f\uff1a"
_ANSWER_SETS = (
    frozenset(COLOURS),
    frozenset(SHAPES),
    frozenset(str(k) for k in range(10)),
    frozenset(DIRECTIONS),
)


def names(response: str, answer: str) -> bool:
    """Whether `response` (lowercased) names `answer`."""
    if answer.isdigit():
        return re.search(rf"(?<!\d){answer}(?!\d)", response) is not None
    return answer in response


def is_single_word(response: str) -> bool:
    words = response.split(maxsplit=1)  # stops after the first split: cheap on huge responses
    return len(words) == 1 and words[0].strip(_STRIP).isalnum()


def compute_score(reward_input: dict[str, Any]) -> dict[str, float]:
    """Score one sample."""
    truth = str(reward_input["ground_truth"]).strip().lower()
    text = reward_input["response"].lower()
    # the other answers of the ground truth's kind (colours for a colour question, ...)
    candidates = next((set(s) for s in _ANSWER_SETS if truth in s), set()) | {truth}
    named = {a for a in candidates if names(text, a)}
    accuracy = 1.0 if truth and named == {truth} else 0.0
    return {"overall": accuracy, "accuracy": accuracy, "format": 1.0 if is_single_word(text) else 0.0}
