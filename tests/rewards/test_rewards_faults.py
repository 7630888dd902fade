"""Every fault a reward function can commit, for batch and sequential functions, in raise and zero modes.

One reward file misbehaves according to the response text; four module-scoped runners
(batch/sequential x raise/zero) keep the suite fast. Inputs are ["ok", "ok", FAULT, "ok"].
"""

from __future__ import annotations

import textwrap

import pytest
from rewards_helpers import inputs_for, make_config

from vlrl.rewards import RewardError, RewardRunner

TIMEOUT = 1.0
SOURCE = """
    import math, os, time
    PARTIAL_BATCHES = True  # scores each sample on its own: two workers may split a batch

    def one(x):
        r = x["response"]
        if r == "raise":
            raise ValueError("boom")
        if r == "hang":
            time.sleep(60)
        if r == "die":
            os._exit(3)
        if r == "exit":
            raise SystemExit(4)
        return {
            "nan": {"overall": math.nan},
            "inf": {"overall": 1.0, "part": -math.inf},
            "str": {"overall": "high"},
            "none": {"overall": None},
            "no_overall": {"score": 1.0},
            "not_dict": 1.0,
            "list": [1.0],
        }.get(r, {"overall": 1.0, "part": 0.5})

    def batch(inputs):
        responses = [x.response for x in inputs]
        if "wrong_count" in responses:
            return [{"overall": 1.0}] * (len(inputs) - 1)
        if "not_list" in responses:
            return {"overall": 1.0}
        if "generator" in responses:
            return ({"overall": 1.0} for _ in inputs)
        return [one(x) for x in inputs]

    def sequential(x):
        return one(x)
"""

# fault -> (raise-mode message pattern, attributable to the one sample in a batch call?)
SAMPLE_FAULTS = {
    "nan": (r"returned overall=nan \(not finite\)", True),
    "inf": (r"returned part=-inf \(not finite\)", True),
    "str": (r"returned overall='high' \(str\), not a number", True),
    "none": (r"returned overall=None \(NoneType\), not a number", True),
    "no_overall": (r"returned a dict without 'overall' \(keys: \['score'\]\)", True),
    "not_dict": (r"returned a float \(1\.0\), expected a dict", True),
    "list": (r"returned a list \(\[1\.0\]\), expected a dict", True),
    "raise": (r"raised ValueError: boom[\s\S]*Traceback", False),
    "exit": (r"called sys\.exit\(4\)", False),
    "hang": (rf"timed out after {TIMEOUT:g}s \(worker killed and restarted; resident memory \d+ MiB", False),
    "die": (r"worker process died \(exit code -?\d+\)", False),
}
BATCH_ONLY_FAULTS = {
    "wrong_count": r"returned 3 results for 4 inputs",
    "not_list": r"returned a dict, expected a list of 4 dicts",
    "generator": r"returned a generator, expected a list of 4 dicts",
}


@pytest.fixture(scope="module")
def runners(tmp_path_factory):
    path = tmp_path_factory.mktemp("faults") / "faulty.py"
    path.write_text(textwrap.dedent(SOURCE))
    made = {}
    for fn in ("batch", "sequential"):
        for mode in ("raise", "zero"):
            config = make_config(
                f"{path}:{fn}", reward_type=fn, on_failure=mode, timeout=TIMEOUT, max_failure_rate=1.0
            )  # fmt: skip (a whole failed chunk is 4 of 4)
            made[fn, mode] = RewardRunner(config)
    yield str(path), made
    for runner in made.values():
        runner.close()


def _inputs(fault):
    return inputs_for(["ok", "ok", fault, "ok"])


def _check_runner_still_works(runner):
    assert runner.score(_inputs("ok")).overall == [1.0] * 4


@pytest.mark.parametrize("fn", ["batch", "sequential"])
@pytest.mark.parametrize("fault", list(SAMPLE_FAULTS))
def test_fault_raise_mode(runners, fn, fault):
    path, made = runners
    pattern, per_sample = SAMPLE_FAULTS[fault]
    runner = made[fn, "raise"]
    where = rf"{path}:{fn} \({fn}\) failed on "
    # Sequential calls are one per sample, so every fault is attributable to sample 2.
    sample = "sample 2: " if per_sample or fn == "sequential" else r"samples 0-3 \(one batch call\): "
    with pytest.raises(RewardError, match=where + sample + pattern) as info:
        runner.score(_inputs(fault))
    if fn == "sequential":  # after a hang or crash the rest of the chunk is skipped, not retried
        skipped = int(fault in ("hang", "die"))
        assert f"(1 of 4 samples failed, {skipped} not scored;" in str(info.value)
    else:
        assert f"({1 if per_sample else 4} of 4 samples failed, 0 not scored;" in str(info.value)
    _check_runner_still_works(runner)


@pytest.mark.parametrize("fn", ["batch", "sequential"])
@pytest.mark.parametrize("fault", list(SAMPLE_FAULTS))
def test_fault_zero_mode(runners, fn, fault):
    _, made = runners
    _, per_sample = SAMPLE_FAULTS[fault]
    runner = made[fn, "zero"]
    result = runner.score(_inputs(fault))
    ok, zero = {"overall": 1.0, "part": 0.5}, {"overall": 0.0, "part": 0.0}
    if per_sample or fn == "sequential":
        assert result.scores == [ok, ok, zero, ok]
        assert result.failures == 1
    else:  # a failed batch call (exception, hang, crash) zeroes its whole chunk
        assert result.scores == [{"overall": 0.0}] * 4
        assert result.failures == 4
    assert result.metrics()["reward/failures"] == result.failures
    assert len(result.failure_messages) == 1 and "failed on sample" in result.failure_messages[0]
    _check_runner_still_works(runner)


@pytest.mark.parametrize("fault", list(BATCH_ONLY_FAULTS))
def test_batch_call_faults(runners, fault):
    path, made = runners
    with pytest.raises(
        RewardError, match=rf"{path}:batch \(batch\) failed on samples 0-3 .*{BATCH_ONLY_FAULTS[fault]}"
    ):
        made["batch", "raise"].score(_inputs(fault))
    result = made["batch", "zero"].score(_inputs(fault))
    assert result.failures == 4 and result.overall == [0.0] * 4


def test_hang_in_one_of_two_workers_keeps_the_other_chunk(runners):
    path, _ = runners
    config = make_config(f"{path}:batch", num_workers=2, on_failure="zero", timeout=TIMEOUT)
    with RewardRunner(config) as runner:
        result = runner.score(inputs_for(["ok", "ok", "ok", "hang"]))
        assert result.overall == [1.0, 1.0, 0.0, 0.0] and result.failures == 2
        assert runner.score(inputs_for(["ok"] * 4)).overall == [1.0] * 4  # the killed worker came back


def test_unpicklable_inputs_are_a_clear_error(runners):
    path, made = runners
    inputs = inputs_for(["ok"], handle=[lambda: None])
    with pytest.raises(RewardError, match="must be picklable"):
        made["batch", "zero"].score(inputs)
    _check_runner_still_works(made["batch", "zero"])


def test_in_process_mode_reports_faults_too(runners):
    path, _ = runners
    with RewardRunner(
        make_config(f"{path}:batch", num_workers=0, on_failure="zero", max_failure_rate=1.0)
    ) as runner:
        assert runner.score(_inputs("nan")).failures == 1
        assert runner.score(_inputs("raise")).failures == 4
    with (
        RewardRunner(make_config(f"{path}:sequential", reward_type="sequential", num_workers=0)) as runner,
        pytest.raises(RewardError, match="failed on sample 2: raised ValueError: boom"),
    ):
        runner.score(_inputs("raise"))


FLAKY = """
    import os, sys

    def main(inputs):
        marker = os.path.join(os.path.dirname(__file__), "died_once")
        if any(x.response == "die_once" for x in inputs) and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(9)  # a transient death: the fresh worker scores the chunk
        if any(x.response == "fail" for x in inputs):
            raise ValueError("broken")
        return [{"overall": 1.0} for _ in inputs]
"""


def test_a_worker_that_dies_once_is_replaced_and_its_chunk_retried(write_reward, caplog):
    with RewardRunner(make_config(write_reward(FLAKY) + ":main")) as runner, caplog.at_level("WARNING"):
        assert runner.score(inputs_for(["ok", "die_once"])).overall == [1.0, 1.0]
        assert runner.restarts == 1
    assert "worker process died (exit code 9) while scoring" in caplog.text
    assert "retrying its 2 unanswered sample(s) once on a fresh worker" in caplog.text
    assert "reward worker 0 restarted (pid" in caplog.text


def test_zero_mode_stops_when_too_many_samples_fail(write_reward):
    spec = write_reward(FLAKY) + ":main"
    too_many = (
        r"^2 of 2 reward samples failed in one step, more than worker.reward.max_failure_rate=0.5 allows"
    )
    with RewardRunner(make_config(spec, on_failure="zero", max_failure_rate=0.5)) as runner, \
            pytest.raises(RewardError, match=too_many + ".*raised ValueError: broken"):  # fmt: skip
        runner.score(inputs_for(["fail", "ok"]))
    with RewardRunner(make_config(spec, on_failure="zero", max_failure_rate=1.0)) as runner:
        assert runner.score(inputs_for(["fail", "ok"])).overall == [0.0, 0.0]
