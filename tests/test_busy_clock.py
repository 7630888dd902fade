"""Busy and idle time of a rank (vlrl.utils.busy_clock), with a fake clock."""

from __future__ import annotations

import pytest

from vlrl.utils import busy_clock
from vlrl.utils.busy_clock import BusyClock, IdleShares, busy


class _Worker:
    def __init__(self) -> None:
        self.clock = BusyClock()

    @busy
    def work(self, inner: bool = False) -> str:
        if inner:
            return self.work()  # nested: counted once
        _now[0] += 3.0
        return "done"


_now = [100.0]


def test_busy_time_against_wall_time_and_the_idle_share_between_readings(monkeypatch) -> None:
    monkeypatch.setattr(busy_clock.time, "perf_counter", lambda: _now[0])
    worker, idle = _Worker(), IdleShares()
    assert worker.clock.reading() == (0.0, 0.0)  # no call yet
    assert worker.work(inner=True) == "done" and worker.work.__name__ == "work"
    assert worker.clock.reading() == (3.0, 3.0)
    assert idle.metrics("rollout", worker.clock.reading()) == {}  # the first reading
    _now[0] += 1.0  # waiting for the driver
    worker.work()
    assert worker.clock.reading() == (6.0, 7.0)
    assert idle.metrics("rollout", worker.clock.reading()) == {
        "ranks/rollout_idle_share": pytest.approx(0.25)
    }
    assert idle.metrics("train", None) == {}


def test_a_wait_inside_a_call_is_idle_time(monkeypatch) -> None:
    monkeypatch.setattr(busy_clock.time, "perf_counter", lambda: _now[0])
    clock = BusyClock()
    with clock.busy():
        _now[0] += 1.0  # work
        with clock.waiting():
            _now[0] += 4.0  # for weights that are not sent yet
        _now[0] += 2.0
    assert clock.reading() == (3.0, 7.0)
    with clock.waiting():  # outside any call: idle anyway, nothing to take off
        _now[0] += 1.0
    assert clock.reading() == (3.0, 8.0)
