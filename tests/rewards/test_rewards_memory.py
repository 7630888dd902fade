"""A reward that eats memory is reported as that (not as a timeout), and `memory_limit_mb` caps it."""

from __future__ import annotations

import pytest
from rewards_helpers import inputs_for, make_config

from vlrl.rewards import RewardError, RewardRunner
from vlrl.rewards.types import RewardLoadError

SOURCE = """
    import os, signal, time

    def main(inputs):
        r = inputs[0]["response"]
        if r == "allocate":
            block = bytearray(1 << 30)  # 1 GiB
            return [{"overall": float(len(block))} for _ in inputs]
        if r == "grow_and_die":
            block = b"x" * (150 << 20)  # 150 MiB, written (resident)
            time.sleep(2.5)  # the runner samples memory about once a second
            os.kill(os.getpid(), signal.SIGKILL)  # what the out-of-memory killer does
        if r == "hang":
            block = b"x" * (80 << 20)
            time.sleep(60)
        return [{"overall": 1.0} for _ in inputs]
"""


def test_allocation_past_the_cap_is_reported_as_out_of_memory(write_reward):
    spec = write_reward(SOURCE) + ":main"
    with RewardRunner(make_config(spec, memory_limit_mb=200)) as runner:
        with pytest.raises(
            RewardError,
            match=r"failed on samples 0-0 \(one batch call\): ran out of memory \(raised MemoryError",
        ):
            runner.score(inputs_for(["allocate"]))
        assert runner.score(inputs_for(["ok"])).overall == [1.0]
        assert runner.restarts == 1  # its heap may stay near the cap: a fresh worker took its place


def test_without_a_cap_the_allocation_succeeds(write_reward):
    spec = write_reward(SOURCE) + ":main"
    with RewardRunner(make_config(spec)) as runner:
        assert runner.score(inputs_for(["allocate"])).overall == [float(1 << 30)]  # not touched: not resident


def test_killed_worker_reports_the_signal_and_its_memory(write_reward):
    spec = write_reward(SOURCE) + ":main"
    killed = (
        r"worker process was killed by SIGKILL \(exit code -9\) while scoring; its resident memory peaked "
        r"at 1[5-9]\d MiB \(the out-of-memory killer sends SIGKILL, as can `kill -9`\); "
        r"set worker.reward.memory_limit_mb"
    )
    with RewardRunner(make_config(spec, timeout=30.0)) as runner, pytest.raises(RewardError, match=killed):
        runner.score(inputs_for(["grow_and_die"]))


def test_timeout_reports_the_memory(write_reward):
    spec = write_reward(SOURCE) + ":main"
    timed_out = (
        r"timed out after 2s \(worker killed and restarted; resident memory \d+ MiB, peak (9|1[0-9])\d MiB\)"
    )
    with RewardRunner(make_config(spec, timeout=2.0)) as runner, pytest.raises(RewardError, match=timed_out):
        runner.score(inputs_for(["hang"]))


def test_a_cap_too_small_to_start_the_worker_is_named(write_reward):
    spec = write_reward("import numpy\n\ndef main(inputs):\n    return [{'overall': 1.0} for _ in inputs]\n")
    with pytest.raises(RewardLoadError, match=r"worker.reward.memory_limit_mb=40, which counts the reward "
                       r"file's imports too"):  # fmt: skip
        RewardRunner(make_config(spec + ":main", memory_limit_mb=40))
