"""The example reward functions (table-driven, adversarial responses) and the format prompts."""

from __future__ import annotations

import time

import jinja2
import pytest
from rewards_helpers import EXAMPLES, PROMPTS, inputs_for, make_config

from vlrl.rewards import RewardRunner, load_reward_function
from vlrl.rewards.math_grading import last_boxed

HUGE = "x" * 100_000
PAD = "<|image_pad|>"


@pytest.fixture(scope="module", autouse=True)
def _import_math_verify():
    # Its first import takes seconds (sympy); keep that out of the per-call time limits below.
    import math_verify  # noqa: F401


def _fn(name):
    return load_reward_function(f"{EXAMPLES / name}.py:compute_score").fn


def _batch(name, response, truth, length=10, **kwargs):
    (score,) = _fn(name)([{"response": response, "ground_truth": truth, "response_length": length}], **kwargs)
    return score


@pytest.mark.parametrize(
    "response, truth, fmt, acc",
    [
        (r"So the answer is \boxed{\frac{1}{2}}.", "0.5", 1, 1),
        (r"\boxed{0.5}", r"\frac{1}{2}", 1, 1),
        (r"\boxed{1/2}", r"$\frac12$", 1, 1),
        (r"\boxed{x^2+1}", "1+x^2", 1, 1),
        (r"\boxed{\dfrac{\sqrt{3}}{2}}", r"\frac{\sqrt3}{2}", 1, 1),
        (r"first \boxed{2} then \boxed{3}", "3", 1, 1),  # the last box counts
        (r"\boxed{４２}", "42", 1, 1),  # full-width digits
        (r"\boxed{4}", "3", 1, 0),
        (r"\boxed{}", "3", 0, 0),  # empty box
        (r"\boxed{   }", "3", 0, 0),
        ("the answer is 3", "3", 0, 0),  # missing box
        (r"\boxed{\frac{1}{2}", "0.5", 0, 0),  # unclosed braces
        (r"\boxed{3} " + PAD, "3", 1, 1),
        (r"\boxed{" + PAD + "}", "3", 1, 0),
        (r"résumé ✓ \boxed{π}", r"\pi", 1, 1),
        (HUGE + r"\boxed{7}", "7", 1, 1),
        (r"\boxed{" * 14_000, "7", 0, 0),  # 100k chars of unclosed boxes
        ("{" * 100_000, "7", 0, 0),
        (r"\boxed{" + "9" * 5000 + "}", "9", 1, 0),  # too long for math_verify: wrong, fast
        ("", "3", 0, 0),
    ],
)
def test_math_reward(response, truth, fmt, acc):
    start = time.perf_counter()
    score = _batch("boxed_math", response, truth)
    # A guard against super-linear regexes (100k-char inputs would take minutes), not a timing:
    # the bound is loose enough for a loaded 2-core machine.
    assert time.perf_counter() - start < 10.0
    assert (score["format"], score["accuracy"]) == (fmt, acc)
    assert score["overall"] == pytest.approx(0.9 * acc + 0.1 * fmt)


def test_math_format_weight_kwarg():
    assert _batch("boxed_math", r"\boxed{1}", "2", format_weight=0.5)["overall"] == 0.5


def test_last_boxed_keeps_nested_braces():
    assert last_boxed(r"\boxed{\frac{1}{2}} and \boxed {a{b}c}") == "a{b}c"
    assert last_boxed(r"\boxed{\frac{1}{2}}}}") == r"\frac{1}{2}"
    assert last_boxed("nothing") is None


@pytest.mark.parametrize(
    "response, fmt, acc",
    [
        ("<think>2+1</think><answer>3</answer>", 1, 1),
        ("  <think>\nhmm\n</think>\n\n<answer> 3 </answer>\n", 1, 1),
        (r"<think>a</think><answer>\boxed{3}</answer>", 1, 1),
        ("<think>a</think><answer>three</answer>", 1, 0),
        ("<think>a</think><answer></answer>", 0, 0),  # empty answer tags
        ("<think>a</think><answer>   </answer>", 0, 0),
        ("<answer>3</answer>", 0, 1),  # no think block
        ("<think>a</think> text <answer>3</answer>", 0, 1),  # text between the blocks
        ("<think>a</think><answer>3</answer> trailing", 0, 1),
        ("<think>a</think><answer>3</answer><answer>4</answer>", 0, 0),
        ("<think>a<think>b</think><answer>3</answer>", 0, 1),
        ("<think>a</think><answer>3", 0, 0),  # unclosed answer
        (f"<think>{PAD}</think><answer>{PAD}</answer>", 1, 0),
        ("<think>数学</think><answer>３</answer>", 1, 1),
        ("</think>" * 12_500, 0, 0),  # 100k chars of tags
        ("<think>" + HUGE + "</think><answer>3</answer>", 1, 1),
        ("", 0, 0),
    ],
)
def test_r1v_reward(response, fmt, acc):
    start = time.perf_counter()
    score = _batch("r1v", response, "3")
    assert time.perf_counter() - start < 10.0  # the regex guard, as above
    assert (score["format"], score["accuracy"]) == (fmt, acc)
    assert score["overall"] == pytest.approx(0.5 * acc + 0.5 * fmt)


@pytest.mark.parametrize(
    "response, length, acc, penalty",
    [
        (r"\boxed{3}", 100, 1, 0.0),
        (r"\boxed{4}", 100, 0, 0.0),
        ("Answer: 3", 100, 1, 0.0),  # DAPO's own answer format
        ("Answer: $3$\nso that is it", 100, 1, 0.0),
        ("Answer:", 100, 0, 0.0),
        (r"\boxed{}", 100, 0, 0.0),
        (r"\boxed{3}", 768, 1, 0.0),  # buffer starts at 1024 - 256
        (r"\boxed{3}", 896, 1, -0.25),  # halfway through the buffer: factor 0.5 * 0.5
        (r"\boxed{3}", 1024, 1, -0.5),
        (r"\boxed{3}", 5000, 1, -0.5),  # never below -factor
        (PAD + r"\boxed{3}", 10, 1, 0.0),
        (HUGE, 1024, 0, -0.5),
        ("", 0, 0, 0.0),
    ],
)
def test_dapo_reward(response, length, acc, penalty):
    kwargs = {"max_response_length": 1024, "overlong_buffer_length": 256, "overlong_penalty_factor": 0.5}
    score = _batch("dapo", response, "3", length=length, **kwargs)
    assert score == {
        "overall": pytest.approx((1.0 if acc else -1.0) + penalty),
        "accuracy": acc,
        "overlong_penalty": pytest.approx(penalty),
    }


def test_dapo_rejects_bad_kwargs():
    with pytest.raises(ValueError, match="overlong_buffer_length"):
        _batch("dapo", "x", "3", max_response_length=10, overlong_buffer_length=20)
    assert _batch("dapo", "x", "3", length=10**6, overlong_buffer_length=0)["overlong_penalty"] == 0.0


@pytest.mark.parametrize(
    "response, truth, acc, fmt",
    [
        ("red", "red", 1, 1),
        ("Red.", "red", 1, 1),
        ("**RED**", "red", 1, 1),
        ("  red\n", "red", 1, 1),
        ("red, because it is warm", "red", 1, 0),
        ("The answer is red", "red", 1, 0),
        ("redcircle", "red", 1, 1),  # glued words (tiny tokenizers) still name the colour
        ("red or blue", "red", 0, 0),  # naming two colours is not an answer
        ("blue", "red", 0, 1),
        ("3", "3", 1, 1),
        ("3", 3, 1, 1),  # numeric ground truth
        ("13", "3", 0, 1),  # numbers stand alone
        ("3 or 4", "3", 0, 0),
        ("three", "3", 0, 1),
        ("circle!", "circle", 1, 1),
        ("Left.", "left", 1, 1),  # the moving-square video task
        ("left or right", "left", 0, 0),
        ("", "red", 0, 0),
        (PAD, "red", 0, 0),
        (PAD + " red", "red", 1, 0),
        ("«Rouge»", "rouge", 1, 1),
        ("红色", "红色", 1, 1),
        ("red " + HUGE, "red", 1, 0),
        (HUGE, "red", 0, 1),
    ],
)
def test_shapes_reward(response, truth, acc, fmt):
    score = _fn("shapes")({"response": response, "ground_truth": truth})
    assert score == {"overall": acc, "accuracy": acc, "format": fmt}


def test_examples_run_in_a_worker():
    spec = f"{EXAMPLES / 'shapes'}.py:compute_score"
    with RewardRunner(make_config(spec, num_workers=1)) as runner:
        assert runner.reward_type == "sequential"  # declared in the file
        result = runner.score(inputs_for(["red", "blue", "Circle."], ["red", "red", "circle"]))
    assert result.overall == [1.0, 0.0, 1.0] and result.metrics()["reward/accuracy"] == pytest.approx(2 / 3)


@pytest.mark.parametrize(
    "name, must_contain", [("math", r"\boxed{}"), ("r1v", "<answer>"), ("shapes", "single")]
)
def test_format_prompts(name, must_contain):
    template = jinja2.Environment().from_string((PROMPTS / f"{name}.jinja").read_text())
    content = "  <image>\nWhat is shown in <image>? {{ not a variable }}\n\n"
    rendered = template.render(content=content)
    assert rendered.startswith("<image>\nWhat is shown in <image>? {{ not a variable }}\n\n")
    assert rendered.count("<image>") == 2 and must_contain in rendered


def _trajectory(*errors):
    return {"tool_calls": [{"error": e} for e in errors]}


@pytest.mark.parametrize(
    "response, trajectory, overall, acc, called",
    [
        ("red", _trajectory(False), 1.1, 1, 1),  # called the tool, answered right
        ("red", _trajectory(), 1.0, 1, 0),  # answered right without a call (a lucky guess)
        ("blue", _trajectory(False), 0.1, 0, 1),  # called, answered wrong: the bonus only
        ("blue", _trajectory(True), 0.0, 0, 0),  # a malformed call earns nothing
        ("red", _trajectory(True, False), 1.1, 1, 1),  # a failed call, then one that ran
        ("red or blue", _trajectory(False), 0.1, 0, 1),
        ("", _trajectory(False), 0.1, 0, 1),
    ],
)
def test_reveal_demo_reward(response, trajectory, overall, acc, called):
    fn = _fn("reveal_demo")
    score = fn({"response": response, "ground_truth": "red", "trajectory": trajectory})
    assert score == pytest.approx({"overall": overall, "accuracy": acc, "called": called})
    no_bonus = fn({"response": response, "ground_truth": "red", "trajectory": trajectory}, call_bonus=0.0)
    assert no_bonus["overall"] == acc
    with pytest.raises(ValueError, match="multi_turn"):
        fn({"response": response, "ground_truth": "red"})


def test_the_shipped_reward_files_load_without_torch_or_transformers() -> None:
    """Each reward worker is a process of its own that imports the file: torch and transformers
    there cost ~3 s of start-up and ~650 MB per worker (shapes.py reads its vocabulary from
    vlrl.data.synthetic, whose package imports them only on first use)."""
    import subprocess
    import sys

    files = sorted(EXAMPLES.glob("*.py"))
    assert {f.stem for f in files} >= {"shapes", "reveal_demo", "r1v", "dapo", "boxed_math"}
    check = (
        "import sys\nfrom vlrl.rewards import load_reward_function\n"
        f"for path in {[str(f) for f in files]!r}:\n"
        "    load_reward_function(path + ':compute_score')\n"
        "heavy = sorted({'torch', 'transformers'} & set(sys.modules))\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
