"""Answer extraction and math equivalence helpers shared by the example reward functions.

`math_verify` (and sympy behind it) is imported lazily, by `preload()` or the first comparison: it
takes seconds, and `vlrl.rewards` is imported by processes that never grade math.

Every helper is linear in the response length, so adversarial 100k-character responses stay cheap,
and long candidate answers are rejected before they reach sympy.
"""

from __future__ import annotations

import functools
import re
import threading
import unicodedata
from typing import Any

MAX_ANSWER_CHARS = 1000
"""Answers longer than this are judged wrong without calling math_verify (sympy can take seconds)."""
MATH_VERIFY_TIMEOUT = 3
"""Seconds math_verify may spend per parse/verify call (enforced only on the main thread)."""

_BOX_TOKENS = re.compile(r"\\boxed\s*\{|\{|\}")
_LATEX_SPACING = re.compile(r"\\(?:left|right|displaystyle)\b|\\[!,;: ]|\s+")


def boxed_answers(text: str) -> list[tuple[int, str]]:
    """Every closed `\\boxed{...}` in `text` as (content start, content), braces balanced."""
    stack: list[int] = []  # per open brace: where its box content starts, or -1 for a plain brace
    found: list[tuple[int, str]] = []
    for match in _BOX_TOKENS.finditer(text):
        token = match.group()
        if token == "}":
            if stack:  # a stray closing brace is ignored
                start = stack.pop()
                if start >= 0:
                    found.append((start, text[start : match.start()]))
        else:
            stack.append(-1 if token == "{" else match.end())
    return found


def last_boxed(text: str) -> str | None:
    """Content of the last closed `\\boxed{...}` (nested braces kept), or None."""
    found = boxed_answers(text)
    return max(found)[1] if found else None


def normalize_answer(text: Any) -> str:
    """Cheap canonical form for exact comparison: NFKC (full-width digits), no `$`, spacing macros,
    whitespace or final period, lowercase."""
    text = unicodedata.normalize("NFKC", str(text)).strip().strip("$")
    text = _LATEX_SPACING.sub("", text).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return text.rstrip(".").lower()


def preload() -> None:
    """Import math_verify and warm its parser now (call at reward-file import).

    Reward files are imported when a worker starts, which has a generous start-up limit; otherwise
    the first scoring call would spend its `worker.reward.timeout` on a multi-second import.
    """
    from math_verify import parse

    parse("$1$", parsing_timeout=_timeout())


def _timeout() -> int | None:
    # math_verify's timeouts use SIGALRM, which Python only allows on the main thread.
    return MATH_VERIFY_TIMEOUT if threading.current_thread() is threading.main_thread() else None


@functools.lru_cache(maxsize=4096)
def _parse_gold(text: str) -> list[Any]:
    """Parse a ground truth (cached: the n samples of a group share it)."""
    from math_verify import parse

    timeout = _timeout()
    if "$" not in text and "\\boxed" not in text:
        # Bare LaTeX such as `\frac12` is only recognised inside math delimiters.
        parsed = parse(f"${text}$", parsing_timeout=timeout)
        if parsed:
            return parsed
    return parse(text, parsing_timeout=timeout)


def math_equal(answer: str, ground_truth: Any) -> bool:
    """Whether `answer` (already extracted from the response) matches `ground_truth`.

    Exact match after `normalize_answer` first (fast, and covers non-math answers), then math_verify.
    Any math_verify error or timeout counts as not equal. A list ground truth (a multi-answer row)
    matches when any of its answers does.
    """
    if isinstance(ground_truth, (list, tuple)):
        return any(math_equal(answer, gold) for gold in ground_truth)
    answer = unicodedata.normalize("NFKC", answer)
    gold_text = unicodedata.normalize("NFKC", str(ground_truth)).strip()
    if not answer.strip() or not gold_text:
        return False
    if normalize_answer(answer) == normalize_answer(gold_text):
        return True
    if len(answer) > MAX_ANSWER_CHARS or len(gold_text) > MAX_ANSWER_CHARS:
        return False
    from math_verify import parse, verify

    try:
        gold = _parse_gold(gold_text)
        pred = parse(f"\\boxed{{{answer}}}", parsing_timeout=_timeout())
        return bool(gold and pred and verify(gold, pred, timeout_seconds=_timeout()))
    except Exception:  # math_verify/sympy can raise on odd input; a reward must not
        return False
