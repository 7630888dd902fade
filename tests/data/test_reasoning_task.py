"""The reasoning quickstart's sum task: worked solutions, answers, images and their r1v scores."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from PIL import Image

from vlrl.data.reasoning_task import COLOUR_VALUES, make_reasoning_dataset, question, worked_solution
from vlrl.data.synthetic import COLOURS

REPO = Path(__file__).resolve().parents[2]


def _r1v():
    spec = importlib.util.spec_from_file_location("r1v", REPO / "reward_functions" / "r1v.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_worked_solution_keeps_a_running_sum() -> None:
    assert worked_solution([3, 1, 4], "blue") == (
        "<think> 3 + 1 = 4\n 4 + 4 = 8\nblue 3\n 8 + 3 = 11\n</think><answer> 11</answer>"
    )
    assert worked_solution([2], "red") == "<think>red 1\n 2 + 1 = 3\n</think><answer> 3</answer>"
    assert worked_solution([2], "red", think=False) == "<think></think><answer> 3</answer>"
    assert question([3, 1]) == (
        "<image>What is 3 + 1 + the shape's value? Values: red 1, green 2, blue 3, yellow 4."
    )


def test_r1v_scores_worked_solutions() -> None:
    r1v = _r1v()
    for think in (True, False):
        right = r1v.score_one(worked_solution([3, 1, 4], "blue", think), "11")
        assert right == {"overall": 1.0, "format": 1.0, "accuracy": 1.0}
        wrong_colour = r1v.score_one(worked_solution([3, 1, 4], "red", think), "11")
        assert wrong_colour == {"overall": 0.5, "format": 1.0, "accuracy": 0.0}
    truncated = worked_solution([3, 1, 4], "blue")[:-12]  # cut inside the answer
    assert r1v.score_one(truncated, "11") == {"overall": 0.0, "format": 0.0, "accuracy": 0.0}


def test_dataset_rows(tmp_path: Path) -> None:
    train, val = make_reasoning_dataset(tmp_path / "a", n_train=40, n_val=8, seed=5, image_size=56)
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    assert len(rows) == 40 and len(val.read_text().splitlines()) == 8
    for row in rows:
        assert row["answer"] == str(sum(row["numbers"]) + COLOUR_VALUES[row["colour"]])
        assert row["problem"] == question(row["numbers"])
        image = Image.open(tmp_path / "a" / row["images"][0]).convert("RGB")
        assert COLOURS[row["colour"]] in {colour for _, colour in image.getcolors(4096)}
    assert len({len(row["numbers"]) for row in rows}) >= 5  # lengths vary
    assert {row["colour"] for row in rows} == set(COLOUR_VALUES)
    again, _ = make_reasoning_dataset(tmp_path / "b", n_train=40, n_val=8, seed=5, image_size=56)
    assert again.read_text() == train.read_text()
