"""The answer-format warm-up teaches the form of an answer (one listed word, then stop), not which word."""

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from vlrl.data.prompts import ChatFormatter, FormatPrompt
from vlrl.data.synthetic import COLOURS, make_shapes_dataset
from vlrl.models.tiny import build_tiny_model
from vlrl.tools.warmup import MARKER, warm_up_answer_format

FORMAT = "format_prompts/shapes.jinja"
COLOUR_WORDS = sorted(COLOURS)


@pytest.fixture(scope="module")
def warmed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, float]]:
    root = tmp_path_factory.mktemp("warmup")
    model = build_tiny_model(root / "model", arch="qwen2_5_vl", seed=0)
    train, val = make_shapes_dataset(root / "data", n_train=64, n_val=48, seed=3, task="colour")
    stats = warm_up_answer_format(model, train, COLOUR_WORDS, FORMAT, steps=60, seed=0)
    return model, val, stats


REASONING_STEPS = 150


def _next_token_probs(
    model_dir: Path, rows: list[dict], data_dir: Path, suffix: str | list[str], format_prompt: str = FORMAT
) -> torch.Tensor:
    """[rows, vocab] probabilities of the token after prompt + `suffix` (or each row's own suffix)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    processor.tokenizer.padding_side = "left"
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    chat, fmt = ChatFormatter(processor.tokenizer, processor), FormatPrompt(format_prompt)
    suffixes = [suffix] * len(rows) if isinstance(suffix, str) else suffix
    texts = [chat(fmt.render(r["problem"])) + end for r, end in zip(rows, suffixes, strict=True)]
    images = [[Image.open(data_dir / p).convert("RGB") for p in r["images"]] for r in rows]
    with torch.no_grad():
        logits = model(**processor(text=texts, images=images, return_tensors="pt", padding=True)).logits
    return logits[:, -1].softmax(-1)


def test_answers_in_form_at_chance_accuracy(warmed):
    model_dir, val, stats = warmed
    rows = [json.loads(line) for line in val.read_text().splitlines()]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    colour_ids = [tokenizer.convert_tokens_to_ids(c) for c in COLOUR_WORDS]  # each colour is one token
    probs = _next_token_probs(model_dir, rows, val.parent, "")[:, colour_ids]  # [rows, 4]
    assert probs.sum(-1).mean() > 0.9  # answers with a colour word
    share = probs.mean(0) / probs.sum(-1).mean()
    assert share.min() > 0.1 and share.max() < 0.45, share  # no colour favoured
    truth = torch.tensor([COLOUR_WORDS.index(r["answer"]) for r in rows])
    accuracy = (probs.argmax(-1) == truth).float().mean().item()
    assert accuracy < 0.6  # chance is 0.25; the warm-up's labels never depend on the image
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert _next_token_probs(model_dir, rows[:8], val.parent, "blue")[:, end].min() > 0.8  # then stops
    assert stats["loss_last"] < 0.85 < 6 < stats["loss_first"]  # floor ln(4)/2 = 0.69
    assert json.loads((model_dir / MARKER).read_text())["answers"] == COLOUR_WORDS


def test_rejects_empty_answers_and_missing_keys(warmed):
    model_dir, val, _ = warmed
    with pytest.raises(ValueError, match="answers is empty"):
        warm_up_answer_format(model_dir, val, [], FORMAT)
    with pytest.raises(ValueError, match=r"row 0 has no 'question' key"):
        warm_up_answer_format(model_dir, val, COLOUR_WORDS, FORMAT, prompt_key="question")


def test_text_model_learns_the_form(tmp_path):
    """A text-only model (no processor) warms up on rows without images."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = build_tiny_model(tmp_path / "text", arch="qwen2", seed=0)
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"problem": f"Name a colour ({i})."}) + "\n" for i in range(32)))
    stats = warm_up_answer_format(model_dir, train, COLOUR_WORDS, steps=60, seed=1)
    assert stats["loss_last"] < 1.0
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = ChatFormatter(tokenizer, None)("Name a colour (3).")
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        probs = AutoModelForCausalLM.from_pretrained(model_dir).forward(ids).logits[0, -1].softmax(-1)
    assert probs[[tokenizer.convert_tokens_to_ids(c) for c in COLOUR_WORDS]].sum() > 0.9


def test_reasoning_warm_up_teaches_the_steps_not_the_colour(tmp_path):
    """The reasoning quickstart's warm-up (worked solutions with a random colour, and the shape and
    colour questions with true answers): the model writes the r1v form, and names a colour when asked,
    but which colour goes in the sum does not depend on the image (accuracy at chance)."""
    from transformers import AutoProcessor

    from vlrl.data.reasoning_task import (
        is_sum_row,
        make_reasoning_dataset,
        make_warmup_file,
        solution_with_random_colour,
        warmup_target,
        worked_solution,
    )
    from vlrl.tools.warmup import WarmupSchedule, warm_up_responses

    r1v_prompt = "format_prompts/r1v.jinja"
    model_dir = build_tiny_model(
        tmp_path / "model", "qwen2_5_vl", "tiny", 0, 12544, 12544, reasoning_tokens=True
    )
    train, val = make_reasoning_dataset(tmp_path / "data", n_train=64, n_val=48, seed=3)
    mixed = make_warmup_file(tmp_path / "data", n_per_question=32)
    # as examples/prepare_reasoning.py does, shorter: the steps without the sums' colour, then with it
    first = warm_up_responses(
        model_dir, mixed, warmup_target, r1v_prompt, WarmupSchedule(steps=REASONING_STEPS),
        untrained_tokens=COLOUR_WORDS, untrained_in=is_sum_row,
    )  # fmt: skip
    stats = warm_up_responses(model_dir, mixed, warmup_target, r1v_prompt, WarmupSchedule(60))
    assert stats["loss_last"] < first["loss_last"] < 1.0 < 5 < first["loss_first"]
    tokenizer = AutoProcessor.from_pretrained(model_dir).tokenizer
    colour_ids = [tokenizer.convert_tokens_to_ids(c) for c in COLOUR_WORDS]
    asked = [json.loads(line) for line in mixed.read_text().splitlines() if '"task": "colour"' in line][:16]
    named = _next_token_probs(model_dir, asked, mixed.parent, "<think>", r1v_prompt)[:, colour_ids]
    assert named.sum(-1).mean() > 0.9  # asked for the colour, it names one (the rows were trained)
    rows = [json.loads(line) for line in val.read_text().splitlines()]
    solutions = [worked_solution(r["numbers"], "red") for r in rows]
    before_colour = [s[: s.index("red 1")] for s in solutions]  # the running sum
    probs = _next_token_probs(model_dir, rows, val.parent, before_colour, r1v_prompt)[:, colour_ids]
    # after the running sum, a colour (4 of the vocabulary's tokens). The 210-step fit's numerics
    # differ by CPU model: > 0.9 on one AVX-512 Xeon, 0.844 on another (with AMX), 0.861 on an
    # AVX2-only EPYC (same code); the bound leaves room for that spread, far above the
    # 4 / 1,024 = 0.004 of a uniform guess
    assert probs.sum(-1).mean() > 0.75
    share = probs.mean(0) / probs.sum(-1).mean()
    assert share.min() > 0.1 and share.max() < 0.45, share  # none favoured
    truth = torch.tensor([COLOUR_WORDS.index(r["colour"]) for r in rows])
    assert (probs.argmax(-1) == truth).float().mean().item() < 0.6  # chance is 0.25
    with pytest.raises(ValueError, match="untrained token 'blue 3' is 2 tokens"):
        warm_up_responses(model_dir, train, solution_with_random_colour, untrained_tokens=["blue 3"])
