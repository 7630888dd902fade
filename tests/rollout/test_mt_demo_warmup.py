"""The multi-turn demo's warm-up examples teach the form only: every answer is unrelated to the
shape, the colours come equally often in every batch (no prior for RL to unlearn), and the tool
turn shows the prompt's own grey image with no text (nothing about the colour)."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest
from example_scripts import load_example

from vlrl.data.synthetic import COLOURS

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def demo_files(tmp_path_factory: pytest.TempPathFactory):
    from vlrl.models.tiny import build_tiny_model

    demo, root = load_example("prepare_multi_turn_demo"), tmp_path_factory.mktemp("mt_demo")
    demo.build_data(root, n_train=16, n_val=4)
    model = build_tiny_model(root / "model", "qwen2_5_vl", seed=0, min_pixels=demo.PIXELS,
                             max_pixels=demo.PIXELS, tool_tokens=True)  # fmt: skip
    return demo, model, root / "data" / "train_mt.jsonl"


def test_answers_are_balanced_in_every_batch(demo_files, monkeypatch) -> None:
    demo, model, train = demo_files
    monkeypatch.chdir(REPO)  # the format prompt is read relative to the repository
    example, rng = demo.warm_up_examples(model, train), random.Random(0)
    for _ in range(3):  # three batches of 16
        answers = Counter(example(rng)[-1].text.removesuffix("<|im_end|>") for _ in range(16))
        assert answers == {colour: 4 for colour in COLOURS}


def test_tool_turn_is_neutral(demo_files, monkeypatch) -> None:
    demo, model, train = demo_files
    monkeypatch.chdir(REPO)
    example = demo.warm_up_examples(model, train)(random.Random(1))
    prompt, call, tool, answer = example
    assert call.text == demo.CALL and call.trained and answer.trained and not tool.trained
    assert tool.images == prompt.images  # the grey prompt image again, not the coloured one
    assert not any(colour in tool.text for colour in COLOURS)  # and no name


def test_call_share_zero_answers_at_once(demo_files, monkeypatch) -> None:
    demo, model, train = demo_files
    monkeypatch.chdir(REPO)
    example = demo.warm_up_examples(model, train, call_share=0.0)(random.Random(2))
    assert len(example) == 2 and example[1].text.endswith("<|im_end|>")
