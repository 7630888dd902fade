"""Wall-clock seconds of the phases of a start-up, as metrics (`setup/<phase>_s`).

`RankWorker.setup` returns them, so where a rank's start-up goes is measurable without a profiler
(processor, engine, actor, reference, first weight sync).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator


class PhaseTimes:
    """Seconds per named phase, in the order they ran; a phase run twice adds up."""

    def __init__(self, prefix: str = "setup") -> None:
        self.prefix = prefix
        self.seconds: dict[str, float] = {}
        self._start = time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        """`{prefix}/{phase}_s` per phase and `{prefix}/total_s` since this object was made."""
        out = {f"{self.prefix}/{name}_s": s for name, s in self.seconds.items()}
        out[f"{self.prefix}/total_s"] = time.perf_counter() - self._start
        return out

    def describe(self) -> str:
        return ", ".join(f"{name} {s:.2f} s" for name, s in self.metrics().items())

    def brief(self) -> str:
        """`total 12.3 s: phase 1.2 s, ...` (one decimal)."""
        phases = ", ".join(f"{name} {s:.1f} s" for name, s in self.seconds.items())
        return f"{time.perf_counter() - self._start:.1f} s: {phases}"

    def print_to_stderr(self, who: str) -> None:
        print(f"[vlrl] {who} {self.describe()}", file=sys.stderr, flush=True)
