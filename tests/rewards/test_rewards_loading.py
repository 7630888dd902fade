"""load_reward_function: specs, error messages, reward-type precedence, kwargs checks."""

from __future__ import annotations

import pytest
from rewards_helpers import EXAMPLES, make_config

from vlrl.rewards import RewardLoadError, RewardRunner, check_kwargs, load_reward_function, parse_spec

GOOD = """
    REWARD_TYPE_NOTE = "no declaration"
    LIMIT = 3

    def main(inputs):
        return [{"overall": 1.0} for _ in inputs]

    def other(inputs, scale=1.0):
        return [{"overall": scale} for _ in inputs]

    def _private():
        pass
"""


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("a/b.py:fn", ("a/b.py", "fn")),
        ("a/b.py", ("a/b.py", "main")),
        ("./x:y/b.py", ("./x:y/b.py", "main")),  # a colon in a folder name is not a function
    ],
)
def test_parse_spec(spec, expected):
    assert parse_spec(spec) == expected


def test_load_good_paths(write_reward, monkeypatch, tmp_path):
    path = write_reward(GOOD)
    default = load_reward_function(path, None)
    assert default.name == "main" and default.reward_type == "batch" and default.fn([1]) == [{"overall": 1.0}]
    named = load_reward_function(f"{path}:other", "sequential")
    assert named.name == "other" and named.reward_type == "sequential" and named.where == f"{path}:other"
    monkeypatch.chdir(tmp_path)  # relative paths resolve against the working directory
    assert load_reward_function("reward.py:other").path == path


def test_same_file_name_loads_as_separate_modules(write_reward, tmp_path):
    (tmp_path / "sub").mkdir()
    first = load_reward_function(write_reward("def main(x):\n    return 'a'\n", "math.py"))
    second = load_reward_function(write_reward("def main(x):\n    return 'b'\n", "sub/math.py"))
    assert (first.fn(0), second.fn(0)) == ("a", "b")
    assert first.fn.__module__ != second.fn.__module__
    import math  # the stdlib module is untouched

    assert math.sqrt(4) == 2


@pytest.mark.parametrize(
    "source, spec_suffix, match",
    [
        (None, "", r"reward file not found: .*nope\.py"),
        (
            "def main(:\n",
            "",
            r"(?s)reward\.py failed to import:.*reward\.py\", line 1.*SyntaxError: invalid syntax",
        ),
        (
            "x = 1 / 0\n",
            "",
            r"(?s)reward\.py failed to import:.*line 1, in <module>.*ZeroDivisionError: division by zero",
        ),
        ("import sys\nsys.exit(2)\n", "", r"(?s)failed to import:.*SystemExit: 2"),
        (
            GOOD,
            ":missing",
            r"function 'missing' not found in .*reward\.py; callables defined there: main, other$",
        ),
        (GOOD, ":LIMIT", r"reward\.py:LIMIT is a int, not a function"),
        ("X = 1\n", "", r"function 'main' not found .*callables defined there: none"),
    ],
)
def test_load_errors_name_the_file_and_function(write_reward, tmp_path, source, spec_suffix, match):
    path = write_reward(source) if source is not None else str(tmp_path / "nope.py")
    with pytest.raises(RewardLoadError, match=match):
        load_reward_function(path + spec_suffix, None)


def test_empty_spec_is_a_clear_error():
    with pytest.raises(RewardLoadError, match="no reward function given"):
        load_reward_function("", None)


@pytest.mark.parametrize(
    "declared, requested, expected",
    [
        (None, None, "batch"),
        (None, "batch", "batch"),
        (None, "sequential", "sequential"),
        ("sequential", None, "sequential"),
        ("sequential", "batch", "sequential"),  # the config default never overrides the file
        ("sequential", "sequential", "sequential"),
        ("batch", "batch", "batch"),
        ("batch", "sequential", "error: declares REWARD_TYPE = 'batch'"),
        ("parallel", None, "error: must be one of"),
        (None, "parallel", "error: must be one of"),
    ],
)
def test_reward_type_precedence(write_reward, declared, requested, expected):
    header = f"REWARD_TYPE = {declared!r}\n" if declared else ""
    path = write_reward(header + "def main(x):\n    return x\n")
    if expected.startswith("error: "):
        with pytest.raises(RewardLoadError, match=expected[len("error: ") :]):
            load_reward_function(path, requested)
    else:
        assert load_reward_function(path, requested).reward_type == expected


def test_check_kwargs(write_reward):
    loaded = load_reward_function(write_reward(GOOD) + ":other")
    check_kwargs(loaded, {"scale": 2.0})
    with pytest.raises(RewardLoadError, match=r"has \['scael'\] but .*:other accepts only \['scale'\]"):
        check_kwargs(loaded, {"scael": 2.0})
    var_kw = load_reward_function(write_reward("def main(x, **kw):\n    return x\n", "kw.py"))
    check_kwargs(var_kw, {"anything": 1})


def test_runner_fails_at_startup_on_bad_spec_or_kwargs(write_reward, tmp_path):
    with pytest.raises(RewardLoadError, match="not found"):
        RewardRunner(make_config(str(tmp_path / "missing.py")))
    with pytest.raises(RewardLoadError, match="accepts only"):
        RewardRunner(make_config(write_reward(GOOD) + ":other", reward_function_kwargs={"bad": 1}))


def test_worker_side_load_error_is_reported(write_reward):
    # Importable in the parent, fails inside the spawned worker: the runner must still fail at start-up.
    path = write_reward(
        """
        import multiprocessing
        if multiprocessing.parent_process() is not None:
            raise RuntimeError("no GPU in the worker")
        def main(inputs):
            return [{"overall": 1.0} for _ in inputs]
        """
    )
    with pytest.raises(RewardLoadError, match="(?s)failed to import:.*RuntimeError: no GPU in the worker"):
        RewardRunner(make_config(path))


@pytest.mark.parametrize("name", ["boxed_math", "r1v", "dapo", "shapes"])
def test_examples_load(name):
    loaded = load_reward_function(f"{EXAMPLES / name}.py:compute_score", "batch")
    assert loaded.reward_type == ("sequential" if name == "shapes" else "batch")
