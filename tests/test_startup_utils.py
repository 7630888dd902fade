"""The start-up helpers of the rank workers: background work and phase timing."""

from __future__ import annotations

import threading
import time

import pytest

from vlrl.utils.background import in_background
from vlrl.utils.phase_times import PhaseTimes


def test_background_work_runs_beside_the_caller_and_hands_back_result_and_error() -> None:
    started, release = threading.Event(), threading.Event()

    def work() -> int:
        started.set()
        release.wait(5)
        return 7

    future = in_background(work, "test-work")
    assert started.wait(5) and not future.done()  # running while the caller goes on
    release.set()
    assert future.result(timeout=5) == 7

    def fails() -> None:
        raise ValueError("reward file broken")

    with pytest.raises(ValueError, match="reward file broken"):
        in_background(fails, "test-fail").result(timeout=5)


def test_phase_times_add_up_per_phase_and_report_the_total() -> None:
    times = PhaseTimes("setup")
    with times.phase("engine"):
        time.sleep(0.02)
    with times.phase("engine"):  # a phase run twice adds up
        time.sleep(0.02)
    with pytest.raises(RuntimeError), times.phase("actor"):  # timed even when it fails
        raise RuntimeError
    metrics = times.metrics()
    assert list(metrics) == ["setup/engine_s", "setup/actor_s", "setup/total_s"]
    assert metrics["setup/engine_s"] >= 0.04
    assert metrics["setup/total_s"] >= metrics["setup/engine_s"] + metrics["setup/actor_s"]
    assert "engine" in times.describe()
