"""RewardRunner: batch and sequential functions, kwargs, extra columns, parallel workers, in-process."""

from __future__ import annotations

import os

import pytest
from rewards_helpers import inputs_for, make_config

from vlrl.rewards import RewardError, RewardRunner

SOURCE = """
    import os

    def batch(inputs, scale=1.0):
        return [
            {"overall": scale * float(x.response), "pid": float(os.getpid()), "n": float(len(inputs))}
            for x in inputs
        ]

    def sequential(x, scale=1.0):
        assert isinstance(x, dict), "sequential functions get one input"
        return {"overall": scale * float(x["response"]), "pid": float(os.getpid())}

    def echo_extras(inputs):
        # Extra dataset columns arrive as keys; a colliding column is exposed as extra_<name>.
        return [
            {
                "overall": float(x.difficulty),
                "tag_len": float(len(x["tag"])),
                "extra_prompt_len": float(len(x.extra_prompt)),
                "prompt_is_reserved": float(x.prompt == "p"),
                "gt": float(x.ground_truth),
                "length": float(x.response_length),
            }
            for x in inputs
        ]

    def ragged(inputs):
        # Some samples report parts others do not.
        return [{"overall": 1.0, "bonus": 2.0} if i % 2 else {"overall": 1.0} for i, x in enumerate(inputs)]
"""


@pytest.fixture
def spec(write_reward):
    return write_reward(SOURCE)


@pytest.mark.parametrize("fn, reward_type", [("batch", "batch"), ("sequential", "sequential")])
@pytest.mark.parametrize("num_workers", [0, 1])
def test_batch_and_sequential_with_kwargs(spec, fn, reward_type, num_workers):
    config = make_config(
        f"{spec}:{fn}",
        reward_type=reward_type,
        num_workers=num_workers,
        reward_function_kwargs={"scale": 2.0},
    )
    with RewardRunner(config) as runner:
        assert runner.reward_type == reward_type
        result = runner.score(inputs_for(["1", "2", "3"]))
    assert result.overall == [2.0, 4.0, 6.0]
    assert result.failures == 0
    in_process = num_workers == 0
    assert all((s["pid"] == os.getpid()) == in_process for s in result.scores)
    assert result.metrics()["reward/overall"] == 4.0


def test_extra_columns_reach_the_function(spec):
    inputs = inputs_for(
        ["a", "bb"], ground_truths=[7, 8], difficulty=[0.5, 1.5], tag=["x", "yyy"], prompt=["c", "dd"]
    )
    with RewardRunner(make_config(f"{spec}:echo_extras")) as runner:
        scores = runner.score(inputs).scores
    assert [s["overall"] for s in scores] == [0.5, 1.5]
    assert [s["tag_len"] for s in scores] == [1.0, 3.0]
    assert [s["extra_prompt_len"] for s in scores] == [1.0, 2.0]
    assert [s["prompt_is_reserved"] for s in scores] == [1.0, 1.0]
    assert [s["gt"] for s in scores] == [7.0, 8.0]
    assert [s["length"] for s in scores] == [1.0, 2.0]


@pytest.mark.parametrize("fn, reward_type", [("batch", "batch"), ("sequential", "sequential")])
def test_two_workers_keep_input_order(write_reward, fn, reward_type):
    spec = write_reward("    PARTIAL_BATCHES = True" + SOURCE)  # a batch function may get part of the batch
    responses = [str(i) for i in range(50)]
    with RewardRunner(make_config(f"{spec}:{fn}", reward_type=reward_type, num_workers=2)) as runner:
        for _ in range(2):  # the pool is reused across calls
            result = runner.score(inputs_for(responses))
            assert result.overall == [float(i) for i in range(50)]
            pids = [s["pid"] for s in result.scores]
            assert len(set(pids)) == 2 and os.getpid() not in pids
            assert pids[:25] == [pids[0]] * 25 and pids[25:] == [pids[25]] * 25  # contiguous chunks
        if reward_type == "batch":
            assert {s["n"] for s in result.scores} == {25.0}
        assert runner.score([]).scores == []
        assert runner.score(inputs_for(["5"])).overall == [5.0]  # fewer inputs than workers


def test_a_batch_function_gets_the_whole_batch_unless_partial_batches(spec, write_reward):
    """EasyR1 calls a batch reward once with the whole batch; more workers must not split it."""
    with RewardRunner(make_config(f"{spec}:batch", num_workers=2)) as runner:
        assert runner.whole_batches
        result = runner.score(inputs_for([str(i) for i in range(10)]))
    assert {s["n"] for s in result.scores} == {10.0} and len({s["pid"] for s in result.scores}) == 1
    bad = write_reward("    PARTIAL_BATCHES = 'yes'" + SOURCE)
    with pytest.raises(RewardError, match="PARTIAL_BATCHES in .* must be True or False"):
        RewardRunner(make_config(f"{bad}:batch", num_workers=0))


def test_missing_parts_are_filled_with_zero(spec):
    with RewardRunner(make_config(f"{spec}:ragged", num_workers=0)) as runner:
        result = runner.score(inputs_for(["a", "b", "c"]))
    assert result.scores == [
        {"overall": 1.0, "bonus": 0.0},
        {"overall": 1.0, "bonus": 2.0},
        {"overall": 1.0, "bonus": 0.0},
    ]
    assert list(result.scores[0]) == ["overall", "bonus"]  # overall first, then sorted


def test_closed_runner_refuses_work(spec):
    runner = RewardRunner(make_config(f"{spec}:batch"))
    worker = runner._workers[0]
    runner.close()
    runner.close()  # idempotent
    assert worker is not None and not worker.process.is_alive()
    with pytest.raises(RewardError, match="closed"):
        runner.score(inputs_for(["1"]))


def test_invalid_settings(spec):
    with pytest.raises(ValueError, match="on_failure"):
        RewardRunner(make_config(f"{spec}:batch", on_failure="ignore"))
    with pytest.raises(ValueError, match="num_workers"):
        RewardRunner(make_config(f"{spec}:batch", num_workers=-1))


def test_reward_file_is_not_imported_by_the_training_process(write_reward, tmp_path):
    marker = tmp_path / "imported_by.txt"
    path = write_reward(
        f"""
        import os
        with open({str(marker)!r}, "a") as f:
            f.write(f"{{os.getpid()}}\\n")
        def main(inputs):
            return [{{"overall": 1.0}} for _ in inputs]
        """
    )
    with RewardRunner(make_config(path, num_workers=2)) as runner:
        assert runner.score(inputs_for(["a", "b"])).overall == [1.0, 1.0]
        assert runner.where == f"{path}:main" and runner.loaded is None
    pids = marker.read_text().split()
    assert len(pids) == 2 and str(os.getpid()) not in pids


def test_failure_messages_are_capped_but_counted(write_reward):
    path = write_reward("def main(x):\n    return {'overall': float('nan')}\n")
    config = make_config(
        path, reward_type="sequential", num_workers=0, on_failure="zero", max_failure_rate=1.0
    )
    with RewardRunner(config) as runner:
        result = runner.score(inputs_for(["a"] * 50))
    assert result.failures == 50 and len(result.failure_messages) == 20
    assert result.scores == [{"overall": 0.0}] * 50


@pytest.mark.parametrize("num_workers", [0, 1])
def test_unprintable_return_value_is_a_failure_not_a_crash(write_reward, num_workers):
    path = write_reward(
        """
        class Odd:
            def __repr__(self):
                raise RuntimeError("no repr")
        def main(x):
            return {"overall": Odd()}
        """
    )
    config = make_config(
        path, reward_type="sequential", num_workers=num_workers, on_failure="zero", max_failure_rate=1.0
    )
    with RewardRunner(config) as runner:
        result = runner.score(inputs_for(["a", "b"]))
    assert result.failures == 2 and "could not be checked" in result.failure_messages[0]
