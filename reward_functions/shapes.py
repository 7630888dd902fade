"""Reward of the quickstart's synthetic shapes task (colour, shape or count of shapes in an image).

The ground truth is one lowercase word such as `red`, `circle` or `3`.

Scores (sequential function, `REWARD_TYPE = "sequential"`: called once per sample):
    accuracy  1.0 when the response's first word, lowercased and with surrounding punctuation
              stripped (`Red.`, `**red**` count), equals the ground truth, else 0.0
    format    1.0 when the response is that single word (letters/digits only once stripped) and
              nothing else, else 0.0
    overall   accuracy (format is logged only)

Kwargs: none.

Prompt template: format_prompts/shapes.jinja (answer with one word).
"""

from __future__ import annotations

import string
from typing import Any

REWARD_TYPE = "sequential"
_STRIP = string.punctuation + "\u201c\u201d\u2018\u2019\u00ab\u00bb\u3002\uff0c\uff01\uff1f\uff1a"


def split_first_word(response: str) -> tuple[str, bool]:
    """(first word normalised, whether it was the only word)."""
    words = response.split(maxsplit=1)  # stops after the first split: cheap on huge responses
    if not words:
        return "", False
    return words[0].strip(_STRIP).lower(), len(words) == 1


def compute_score(reward_input: dict[str, Any]) -> dict[str, float]:
    """Score one sample."""
    truth = str(reward_input["ground_truth"]).strip().lower()
    word, single = split_first_word(reward_input["response"])
    accuracy = 1.0 if word and word == truth else 0.0
    return {"overall": accuracy, "accuracy": accuracy, "format": 1.0 if single and word.isalnum() else 0.0}
