"""The ground-truth rule: a reward function always receives `str` or `list[str]`."""

from __future__ import annotations

import re

import pytest
from data_helpers import write_jsonl

from vlrl.data import DataError, RLDataset
from vlrl.data.answers import AnswerProblem, normalize_answer
from vlrl.rewards.math_grading import math_equal


@pytest.mark.parametrize(
    "cells, expected",
    [
        (["red", ""], ["red", ""]),
        ([5, 12], ["5", "12"]),
        ([2.5, 5.0], ["2.5", "5"]),  # a JSON column mixing 5 and 2.5 loads as floats: 5.0 -> "5"
        ([["a", "b"], ["c"]], [["a", "b"], ["c"]]),
        ([[1, 2]], [["1", "2"]]),
    ],
)
def test_answers_reach_the_sample_as_str_or_list_of_str(
    tokenizer_processor, make_config, tmp_path, cells, expected
):
    path = write_jsonl(tmp_path / "d.jsonl", [{"problem": "q", "answer": cell} for cell in cells])
    dataset = RLDataset(path, make_config(), *tokenizer_processor("qwen2_5_vl"))
    truths = [dataset[i].ground_truth for i in range(len(dataset))]
    assert truths == expected
    assert all(isinstance(t, str) or all(isinstance(x, str) for x in t) for t in truths)


@pytest.mark.parametrize(
    "cell, holds",
    [
        (True, "bool True"),
        ({"value": 3}, "dict {'value': 3}"),
        ([], "an empty list"),
        ([["nested"]], "list ['nested']"),
        (["a", None], "NoneType None"),
    ],
)
def test_other_answers_are_bad_rows(tokenizer_processor, make_config, tmp_path, cell, holds):
    path = write_jsonl(tmp_path / "d.jsonl", [{"problem": "q", "answer": cell}, {"problem": "q"}])
    message = f"d.jsonl row 0: answer key 'answer' holds {holds}; an answer must be a string, a number"
    with pytest.raises(DataError, match=re.escape(message)):
        RLDataset(path, make_config(), *tokenizer_processor("qwen2_5_vl"))


def test_nan_is_refused_and_lists_match_any():
    with pytest.raises(AnswerProblem, match="float nan"):
        normalize_answer(float("nan"))
    assert math_equal("4", ["3", "4"]) and not math_equal("5", ["3", "4"])
