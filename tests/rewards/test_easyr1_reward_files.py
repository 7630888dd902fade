"""EasyR1's own reward files run unchanged (their `mathruler`/`pylatexenc` imports are installed).

The files are read from a local EasyR1 checkout when one exists (EASYR1_REPO: a git directory, by
default the mirror this project was developed next to); without one only the imports are checked.
Nothing of EasyR1 is kept in this repository.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from rewards_helpers import inputs_for, make_config

from vlrl.rewards import RewardRunner

EASYR1_REPO = os.environ.get("EASYR1_REPO", "/work/.mirror/hiyouga+EasyR1/repo")


def test_easyr1_reward_imports_are_installed() -> None:
    from mathruler.grader import extract_boxed_content, grade_answer

    assert extract_boxed_content(r"so \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert grade_answer(r"\frac{1}{2}", "0.5")  # pylatexenc parses the LaTeX here
    import pylatexenc  # noqa: F401


def _easyr1_file(name: str, folder: Path) -> str:
    """Copy EasyR1's examples/reward_function/NAME into `folder`; skip without a checkout."""
    if shutil.which("git") is None or not os.path.isdir(EASYR1_REPO):
        pytest.skip(f"no EasyR1 checkout at {EASYR1_REPO} (set EASYR1_REPO)")
    text = subprocess.run(
        ["git", "-C", EASYR1_REPO, "show", f"HEAD:examples/reward_function/{name}"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    path = folder / name
    path.write_text(text)
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
