"""How long a call to the rank workers may take before the run calls it hung (`trainer.hang_timeout`).

A rank stopped by the OS, stuck in a collective its peers never entered, or looping, never answers;
without a limit the driver waits forever. The limit of a call is
    max(hang_timeout, FACTOR x the longest the same method took earlier in this run),
so a step that is slow by nature (long responses, a big model) is never cut short, and the limit
follows the step times measured as the run goes.
"""

from __future__ import annotations

import time

FACTOR = 10.0


class RankHang(RuntimeError):
    """Some ranks did not answer a call within its limit."""


class CallDeadlines:
    """The limit of each method's calls, from `hang_timeout` and the durations recorded so far."""

    def __init__(self, hang_timeout: float) -> None:
        self.hang_timeout = hang_timeout  # 0: no limit
        self.longest: dict[str, float] = {}

    def limit(self, method: str) -> float | None:
        """Seconds the next call of `method` may take; None: no limit."""
        if self.hang_timeout <= 0:
            return None
        return max(self.hang_timeout, FACTOR * self.longest.get(method, 0.0))

    def record(self, method: str, seconds: float) -> None:
        self.longest[method] = max(seconds, self.longest.get(method, 0.0))

    def hang_error(self, method: str, waited: float, silent: list[str]) -> RankHang:
        """The error for a call of `method` that `silent` (one description per rank) never answered."""
        return RankHang(
            f"{', '.join(silent)} did not finish {method} within {waited:.0f} s (the limit: "
            f"max(trainer.hang_timeout={self.hang_timeout:g}, {FACTOR:g} x the longest {method} so far, "
            f"{self.longest.get(method, 0.0):.1f} s)), so the call is given up as hung: a rank stopped, or is "
            "stuck in a collective its peers left. If the call is slow by nature, raise trainer.hang_timeout"
        )


class Stopwatch:
    """Seconds since it was made."""

    def __init__(self) -> None:
        self.start = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start
