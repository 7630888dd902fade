"""Tools whose answers differ from process to process, for the tensor-parallel multi-turn tests.

They carry the names the taught model calls (`show`, `add`, `hang`; tests/rollout/mt_helpers.py's
CUES), but each answer depends on the rank that runs it (the worker inherits `RANK`): the rank's
pid, an image or a text of another size, a hang past the timeout on ranks other than 0. Peers of a
tensor-parallel group that ran them each for themselves would append different tool turns."""

import os
import time

from PIL import Image


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def add(a: int, b: int = 0):
    """Add two integers, and name the process that asked (a tool worker's parent: its rank)."""
    return f"{a + b} from {os.getppid()}" + " ." * 4 * _rank()


def show(colour: str):
    """A square of one colour: 56 pixels wide on rank 0, 84 on the others."""
    return f"here is {colour}", Image.new("RGB", (56 + 28 * min(_rank(), 1),) * 2, colour)


def hang():
    """Answers at once on rank 0; hangs past any timeout on the others."""
    while _rank():
        time.sleep(1)
    return "awake"
