"""Where a rank's wall time goes: busy in the driver's calls, or idle waiting for the next one.

A rank worker runs each step's work in calls from the driver (generate, take rows, update, send or
receive weights). `BusyClock` adds up the wall seconds spent inside them; its `reading` is (busy
seconds, wall seconds since the first call), and `IdleShares` turns two readings into the share of
the wall time between them that the rank waited: for weights, for rows, or for the driver.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from typing import Concatenate, ParamSpec, Protocol, TypeVar

BUSY_S, WALL_S = "clock/busy_s", "clock/wall_s"  # a reading in a rank's update metrics (not logged)
P = ParamSpec("P")
R = TypeVar("R")


class BusyClock:
    """Busy seconds inside `busy()` blocks (nested blocks count once; `waiting()` blocks inside them
    do not count) and wall seconds since the first."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.busy_s = 0.0
        self._depth, self._entered, self._waited = 0, 0.0, 0.0

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        now = time.perf_counter()
        if self.start is None:
            self.start = now
        if self._depth == 0:
            self._entered = now
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self.busy_s += time.perf_counter() - self._entered - self._waited
                self._waited = 0.0

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """A wait inside a call (for weights another rank has not sent yet, for a previous send to
        be received): idle time, though the rank is in one of the driver's calls."""
        start = time.perf_counter()
        try:
            yield
        finally:
            if self._depth:
                self._waited += time.perf_counter() - start

    def reading(self) -> tuple[float, float]:
        """(busy seconds, wall seconds) since the first call; a call in progress counts as busy so far."""
        now = time.perf_counter()
        if self.start is None:
            return 0.0, 0.0
        running = now - self._entered - self._waited if self._depth else 0.0
        return self.busy_s + running, now - self.start


class _Clocked(Protocol):
    clock: BusyClock


S = TypeVar("S", bound=_Clocked)


def busy(method: Callable[Concatenate[S, P], R]) -> Callable[Concatenate[S, P], R]:
    """A method whose calls count as busy time on `self.clock`."""

    @functools.wraps(method)
    def timed(self: S, *args: P.args, **kwargs: P.kwargs) -> R:
        with self.clock.busy():
            return method(self, *args, **kwargs)

    return timed


class IdleShares:
    """Each role's idle share between its consecutive readings: 1 - busy / wall of the interval."""

    def __init__(self) -> None:
        self.last: dict[str, tuple[float, float]] = {}

    def metrics(self, role: str, reading: tuple[float, float] | None) -> dict[str, float]:
        """`ranks/<role>_idle_share` since the role's previous reading ({} at the first, or when no
        time passed)."""
        if reading is None:
            return {}
        busy_s, wall_s = float(reading[0]), float(reading[1])
        last, self.last[role] = self.last.get(role), (busy_s, wall_s)
        if last is None or wall_s <= last[1]:
            return {}
        share = 1.0 - (busy_s - last[0]) / (wall_s - last[1])
        return {f"ranks/{role}_idle_share": min(max(share, 0.0), 1.0)}
