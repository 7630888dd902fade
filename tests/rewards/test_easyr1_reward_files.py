"""EasyR1's own reward files run unchanged (their `mathruler`/`pylatexenc` imports are installed).

The files are EasyR1's own, kept unchanged as test fixtures (tests/fixtures/easyr1/, with their
license and the commit they come from).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from rewards_helpers import inputs_for, make_config

from vlrl.rewards import RewardRunner

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "easyr1"


def test_easyr1_reward_imports_are_installed() -> None:
    from mathruler.grader import extract_boxed_content, grade_answer

    assert extract_boxed_content(r"so \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert grade_answer(r"\frac{1}{2}", "0.5")  # pylatexenc parses the LaTeX here
    import pylatexenc  # noqa: F401


def _easyr1_file(name: str, folder: Path) -> str:
    """EasyR1's examples/reward_function/NAME, copied into `folder` (a user's own copy)."""
    path = folder / name
    shutil.copy(FIXTURES / "examples" / "reward_function" / name, path)
    return str(path)


def test_easyr1_math_reward_runs_as_is(tmp_path: Path) -> None:
    spec = _easyr1_file("math.py", tmp_path) + ":compute_score"
    responses = [r"<think>1+1</think> so \boxed{2}", r"\boxed{2}", r"<think>x</think> \boxed{3}"]
    with RewardRunner(make_config(spec, num_workers=1, timeout=30.0)) as runner:
        assert runner.reward_type == "batch"
        result = runner.score(inputs_for(responses, ["2", "2", "2"]))
    assert [s["accuracy"] for s in result.scores] == [1.0, 1.0, 0.0]
    assert [s["format"] for s in result.scores] == [1.0, 0.0, 1.0]  # EasyR1 asks for <think> first
    assert result.overall == pytest.approx([1.0, 0.9, 0.1])


def test_easyr1_r1v_reward_runs_as_is(tmp_path: Path) -> None:
    spec = _easyr1_file("r1v.py", tmp_path) + ":compute_score"
    responses = ["<think>count</think> <answer>3</answer>", "<answer>3</answer>", "4"]
    with RewardRunner(make_config(spec, num_workers=1, timeout=30.0)) as runner:
        assert runner.reward_type == "sequential"
        result = runner.score(inputs_for(responses, ["3", "3", "3"]))
    assert result.overall == pytest.approx([1.0, 0.5, 0.0])


def test_easyr1_dapo_reward_runs_with_its_command_kwargs(tmp_path: Path) -> None:
    """With the kwargs of EasyR1's qwen3_14b_dapo17k_dapo.sh; its `accuracy_normalized` part is the
    part that command filters groups on (algorithm.filter_key)."""
    spec = _easyr1_file("dapo.py", tmp_path) + ":compute_score"
    kwargs = {"max_response_length": 20480, "overlong_buffer_length": 4096, "overlong_penalty_factor": 1.0}
    config = make_config(spec, num_workers=1, timeout=30.0, reward_function_kwargs=kwargs)
    with RewardRunner(config) as runner:
        result = runner.score(inputs_for(["so\nAnswer: 42", "Answer: 41"], ["42", "42"]))
    assert [s["accuracy_normalized"] for s in result.scores] == [1.0, 0.0]
    assert result.overall == pytest.approx([1.0, -1.0])
