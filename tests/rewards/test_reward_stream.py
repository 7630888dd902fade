"""`RewardStream`: samples added a few at a time, scored while the caller does other work.

Real worker processes throughout. The reward sleeps per sample, so whether scoring overlapped the
caller's work shows in wall time, and it records the size of each call, so the chunking shows too.
"""

from __future__ import annotations

import time

import pytest
from rewards_helpers import inputs_for, make_config

from vlrl.rewards import RewardError, RewardRunner

SLEEP_S = 0.2
SOURCE = f"""
import time
PARTIAL_BATCHES = True  # the batch function may be called on part of the batch (streamed groups)

def sequential(x):
    time.sleep({SLEEP_S})
    if x.response == "raise":
        raise ValueError("boom")
    return {{"overall": float(len(x.response))}}

def batch(inputs):
    return [{{"overall": float(len(x.response)), "call_size": float(len(inputs))}} for x in inputs]
"""


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("stream") / "slow.py"
    path.write_text(SOURCE)
    return str(path)


def test_positions_out_of_order_come_back_in_position_order(reward_file: str) -> None:
    with (
        RewardRunner(make_config(f"{reward_file}:batch", num_workers=2)) as runner,
        runner.stream() as stream,
    ):
        stream.add(inputs_for(["ccc", "dddd"]), [2, 3])  # a later group finished first
        stream.add(inputs_for(["a", "bb"]), [0, 1])
        result = stream.finish(4)
    assert result.overall == [1.0, 2.0, 3.0, 4.0]
    # each add is split over the two workers: one call per sample here, never a mixed call
    assert [s["call_size"] for s in result.scores] == [1.0] * 4


def test_in_process_scoring_streams_the_same(reward_file: str) -> None:
    with RewardRunner(make_config(f"{reward_file}:batch", num_workers=0)) as runner:
        with runner.stream() as stream:
            stream.add(inputs_for(["dddd", "e"]), [3, 4])
            stream.add(inputs_for(["a", "bb", "ccc"]), [0, 1, 2])
            streamed = stream.finish(5)
        whole = runner.score(inputs_for(["a", "bb", "ccc", "dddd", "e"]))
    assert streamed.overall == whole.overall == [1.0, 2.0, 3.0, 4.0, 1.0]


def test_scoring_overlaps_the_callers_work(reward_file: str) -> None:
    """Samples are scored while the caller works and only pumps now and then: all four are in
    before `finish` is called."""
    config = make_config(f"{reward_file}:sequential", reward_type="sequential", num_workers=2)
    with RewardRunner(config) as runner, runner.stream() as stream:
        stream.add(inputs_for(["a", "bb", "ccc", "dddd"]), range(4))
        assert stream.scored == 0
        deadline = time.monotonic() + 30
        while stream.scored < 4 and time.monotonic() < deadline:
            time.sleep(SLEEP_S / 4)  # the caller's own work
            stream.pump(0.0)
        assert stream.scored == 4
        assert stream.finish(4).overall == [1.0, 2.0, 3.0, 4.0]


def test_finish_names_samples_never_added(reward_file: str) -> None:
    with RewardRunner(make_config(f"{reward_file}:batch")) as runner, runner.stream() as stream:
        stream.add(inputs_for(["a"]), [0])
        with pytest.raises(ValueError, match="1 of 2 samples were never added"):
            stream.finish(2)
        with pytest.raises(ValueError, match="sample 0 is negative or added twice"):
            stream.add(inputs_for(["a"]), [0])


def test_failure_names_the_final_position(reward_file: str) -> None:
    with (
        RewardRunner(make_config(f"{reward_file}:sequential", reward_type="sequential")) as runner,
        runner.stream() as stream,
    ):
        stream.add(inputs_for(["raise"]), [7])
        stream.add(inputs_for(["a"] * 7), range(7))
        with pytest.raises(RewardError, match="failed on sample 7: raised ValueError: boom"):
            stream.finish(8)


def test_leaving_early_leaves_no_stale_answer(reward_file: str) -> None:
    """A pass abandoned while a worker is busy (an exception in the caller) kills that worker, so
    its late answer cannot land in the next pass."""
    with RewardRunner(make_config(f"{reward_file}:sequential", reward_type="sequential")) as runner:
        with pytest.raises(KeyboardInterrupt), runner.stream() as stream:
            stream.add(inputs_for(["long response"]), [0])
            raise KeyboardInterrupt
        assert runner.score(inputs_for(["a", "bb"])).overall == [1.0, 2.0]
