"""The tool recipes' data scripts and configs: GSM8K rows for the calculator, zoom rows (full-resolution
image, shown size) for the crop tool, and both recipe YAMLs passing every start-up check with a tiny
model in place of the hub one."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from example_scripts import load_example
from PIL import Image

from vlrl.config.loader import load_config
from vlrl.user_code.loading import load_function

REPO = Path(__file__).resolve().parents[2]
calculate = load_function(f"{REPO}/examples/tools/calculator.py:calculate", "tool")[0]


gsm8k = load_example("prepare_gsm8k")
zoom_data = load_example("prepare_zoom_data")


def test_gsm8k_rows():
    row = gsm8k.gsm8k_row(" Natalia sold 48 clips... ", "48 / 2 = <<48/2=24>>24\n48 + 24 = 72\n#### 72")
    assert row == {"problem": "Natalia sold 48 clips...", "answer": "72"}
    assert gsm8k.gsm8k_row("q", "so 1,080 in all #### 1,080")["answer"] == "1080"
    for bad in ("no marker 72", "#### "):
        with pytest.raises(ValueError, match="GSM8K answer"):
            gsm8k.gsm8k_row("q", bad)


def test_synthetic_gsm8k_answers_are_what_the_calculator_gives():
    rows = gsm8k.synthetic_rows(20, seed=3)
    assert len({r["problem"] for r in rows}) == 20
    for row in rows:
        boxes, per_box, sold = map(int, re.findall(r"\d+", row["problem"]))
        assert calculate(f"{boxes} * {per_box} - {sold}") == row["answer"]


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory):
    from vlrl.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("zoom_model"), "qwen2_5_vl", tool_tokens=True))


def test_zoom_rows_keep_the_original_and_its_shown_size(vl_model, tmp_path):
    from transformers import AutoConfig

    from vlrl.config import DataConfig
    from vlrl.data.prepare import RowPreparer
    from vlrl.models.processor import load_processor

    Image.new("RGB", (300, 150), "green").save(tmp_path / "a.png")
    source = tmp_path / "src.jsonl"
    rows = [{"problem": "<image> Find x.", "answer": "3", "images": ["a.png"]}] * 2
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rule = zoom_data.shown_size_rule(vl_model, 12544, 50176)
    out = tmp_path / "out" / "train.jsonl"
    out.parent.mkdir()
    assert zoom_data.prepare(str(source), out, rule, limit=1) == 1
    (written,) = [json.loads(line) for line in out.read_text().splitlines()]
    path = written["images"][0]
    assert Image.open(path).size == (300, 150)  # saved at full resolution
    tokenizer, processor = load_processor(vl_model)
    preparer = RowPreparer(DataConfig(min_pixels=12544, max_pixels=50176), tokenizer, processor,
                           AutoConfig.from_pretrained(vl_model))  # fmt: skip
    height, width = preparer.target_size(150, 300)
    assert written["tools_kwargs"] == {"zoom_in": {"image_path": path, "shown_size": [width, height]}}
    assert (width, height) != (300, 150)  # the box frame really differs from the original


@pytest.mark.parametrize(
    "recipe, arch",
    [("qwen2_5_3b_gsm8k_calculator", "qwen2"), ("qwen2_5_vl_7b_geo3k_zoom", "qwen2_5_vl")],
)
def test_recipes_pass_start_up_checks(recipe, arch, tmp_path, monkeypatch):
    """Every key of the recipe is valid and its tool YAML loads (paths relative to the repo root)."""
    monkeypatch.chdir(REPO)
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"problem": "1 + 1?", "answer": "2"}) + "\n")
    config = load_config(
        [
            f"config=examples/{recipe}.yaml",
            f"worker.actor.model.model_path={tmp_path}",  # model folders need only exist here
            f"data.train_files={data}",
            f"data.val_files={data}",
            "trainer.device=cpu",
        ]
    )
    mt = config.worker.rollout.multi_turn
    assert mt.enable and mt.tool_config_path and not mt.tools
