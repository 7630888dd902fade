"""Tools for the multi-turn tests: well-behaved, raising, hanging, slow, crashing, image-returning."""

import json
import os
import time

from PIL import Image


def add(a: int, b: int = 0):
    """Add two integers.

    Args:
        a: the first number
        b (int): the second number

    Returns:
        the sum as text
    """
    return str(a + b)


def show(colour: str, *, size: int = 56):
    """Return a square image of one colour, and its name."""
    return f"here is {colour}", Image.new("RGB", (size, size), colour)


def secret(*, answer: str):
    """Reveal the answer (from the row's tools_kwargs)."""
    return answer


def boom():
    """Always raises."""
    raise ValueError("kaboom")


def hang():
    """Never returns."""
    while True:
        time.sleep(1)


def slow(seconds: float):
    """Sleeps, then answers."""
    time.sleep(seconds)
    return "slept"


def crash():
    """Kills its own process."""
    os._exit(3)


def bad_return():
    """Returns something that is not text or an image."""
    return {"a": 1}


def follow_up(messages, *, reply=None, log=None):
    """Interaction: answers `reply` as the user after the first final answer, ends after the second.

    Rows without `reply` in their tools_kwargs["interaction"] end at once. `log`: a file that gets the
    roles of the messages of every call (one JSON line each)."""
    if log:
        with open(log, "a", encoding="utf-8") as file:
            file.write(json.dumps([m["role"] for m in messages]) + "\n")
    if reply is None or any(m["role"] == "user" for m in messages):
        return None
    return reply
