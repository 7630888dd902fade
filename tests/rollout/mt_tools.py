"""Tools for the multi-turn tests: well-behaved, raising, hanging, slow, crashing, image-returning."""

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
