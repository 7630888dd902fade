"""Answer-format warm-up: teach a freshly built (random) model the *form* of an answer, not its content.

    python -m vlrl.tools.warmup MODEL_DIR TRAIN_JSONL --answers red green blue yellow \
        [--format-prompt format_prompts/shapes.jinja] [--steps 60]

RL post-training starts from a model that already answers in the expected form; a random tiny
model instead emits near-uniform tokens from its whole vocabulary, so almost every sample scores
0 and the few that score 1 carry the reward on a handful of lucky tokens among noise. This runs a
short supervised fit on the dataset's own prompts (same format prompt, chat template and images)
with targets `<answer><|im_end|>`, where `<answer>` is drawn uniformly from `answers`
*independently of the row*. The model learns "say one of these words, then stop" and nothing about
which word is right for an image: its accuracy stays at chance (a test checks this), so what RL
then gains is reading the image.

The model folder is overwritten in place and `warmup.json` records what was done.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from vlrl.data.prompts import ChatFormatter, FormatPrompt

MARKER = "warmup.json"


def _load(model_dir: Path) -> tuple[Any, Any, Any | None]:
    """(model, tokenizer, processor or None for a text-only model) in fp32."""
    from vlrl.models.loading import load_config, model_class
    from vlrl.models.processor import load_processor

    tokenizer, processor = load_processor(str(model_dir))
    model = model_class(load_config(str(model_dir))).from_pretrained(model_dir, dtype=torch.float32)
    return model, tokenizer, processor


def _encode(tokenizer: Any, processor: Any | None, texts: list[str], images: list[list[Any]]) -> dict:
    """Right-padded model inputs; images only for a vision model."""
    if processor is None:
        if any(images):
            raise ValueError("the rows have images but the model has no image processor (a text model)")
        return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return processor(text=texts, images=images if any(images) else None, return_tensors="pt", padding=True)


def _render(rows: list[dict], fmt: FormatPrompt | None, chat: ChatFormatter, prompt_key: str) -> list[str]:
    """The prompt of each row as the trainer renders it (format prompt, then chat template)."""
    return [chat(fmt.render(row[prompt_key]) if fmt else row[prompt_key]) for row in rows]


def _single_token_id(tokenizer: Any, text: str) -> int:
    ids = tokenizer(text, add_special_tokens=False).input_ids
    if len(ids) != 1:
        raise ValueError(f"untrained token {text!r} is {len(ids)} tokens of this tokenizer, not one")
    return ids[0]


def _answer_labels(
    input_ids: torch.Tensor, lengths: torch.Tensor, target_ids: list[list[int]]
) -> torch.Tensor:
    """Labels [B, T]: each sequence's last len(target) real tokens, -100 elsewhere (right padding)."""
    labels = torch.full_like(input_ids, -100)
    for i, target in enumerate(target_ids):
        end = int(lengths[i])
        got = input_ids[i, end - len(target) : end].tolist()
        if got != target:
            raise ValueError(
                f"the answer tokens merged with the prompt when tokenized together ({got} != {target}); "
                "end the format prompt or chat template with a newline"
            )
        labels[i, end - len(target) : end] = input_ids[i, end - len(target) : end]
    return labels


def warm_up_answer_format(
    model_dir: str | Path,
    train_file: str | Path,
    answers: list[str],
    format_prompt: str | None = None,
    steps: int = 60,
    batch_size: int = 16,
    lr: float = 1e-3,
    seed: int = 0,
    prompt_key: str = "problem",
    image_key: str = "images",
    end_of_turn: str = "<|im_end|>",
) -> dict[str, float]:
    """Fit `model_dir` to answer the prompts of `train_file` (JSONL) with a random word of `answers`
    followed by `end_of_turn` (the chat template's end-of-turn token; Qwen's by default).

    Returns {"loss_first", "loss_last", "seconds"}; the floor of the loss is about
    ln(len(answers)) / 2 (a uniform guess on the answer token, a certain end of turn).
    """
    if not answers:
        raise ValueError("answers is empty: give the words the model may answer with")

    def respond(row: dict, rng: random.Random) -> str:
        return rng.choice(answers)  # independent of the row: form, not content

    return warm_up_responses(
        model_dir,
        train_file,
        respond,
        format_prompt,
        WarmupSchedule(steps, batch_size, lr, seed),
        prompt_key,
        image_key,
        end_of_turn,
        record={"answers": answers},
    )


@dataclass(frozen=True)
class WarmupSchedule:
    """The supervised fit's steps, batch size (rows per step), AdamW learning rate and seed."""

    steps: int = 60
    batch_size: int = 16
    lr: float = 1e-3
    seed: int = 0


def warm_up_responses(
    model_dir: str | Path,
    train_file: str | Path,
    respond: Callable[[dict, random.Random], str],
    format_prompt: str | None = None,
    schedule: WarmupSchedule = WarmupSchedule(),
    prompt_key: str = "problem",
    image_key: str = "images",
    end_of_turn: str = "<|im_end|>",
    record: dict[str, Any] | None = None,
    untrained_tokens: Collection[str] = (),
    untrained_in: Callable[[dict], bool] | None = None,
) -> dict[str, float]:
    """Fit `model_dir` to answer each sampled row of `train_file` with `respond(row, rng)` followed
    by `end_of_turn`. `respond` decides what is taught: a form with content drawn at random keeps
    accuracy at chance. Response tokens in `untrained_tokens` (each one token of the vocabulary) are
    not trained, in the rows where `untrained_in(row)` (default: all): their prediction is left as it
    was. Overwrites the model folder and writes
    `warmup.json` (with `record` in it).

    Returns {"loss_first", "loss_last", "seconds"} (mean loss per response token)."""
    model_dir, train_file = Path(model_dir), Path(train_file)
    rows = [json.loads(line) for line in train_file.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{train_file} has no rows")
    missing = next((i for i, row in enumerate(rows) if prompt_key not in row), None)
    if missing is not None:
        raise ValueError(f"{train_file} row {missing} has no {prompt_key!r} key: set prompt_key")
    torch.manual_seed(schedule.seed)
    rng = random.Random(schedule.seed)
    model, tokenizer, processor = _load(model_dir)
    tokenizer.padding_side = "right"
    chat = ChatFormatter(tokenizer, processor)
    fmt = FormatPrompt(format_prompt) if format_prompt else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=schedule.lr, weight_decay=0.0)
    skip = torch.tensor([_single_token_id(tokenizer, t) for t in untrained_tokens], dtype=torch.long)
    losses, start = [], time.perf_counter()
    for _ in range(schedule.steps):
        batch = rng.sample(rows, min(schedule.batch_size, len(rows)))
        responses = [respond(row, rng) + end_of_turn for row in batch]
        images = [
            [Image.open(train_file.parent / p).convert("RGB") for p in row.get(image_key) or []]
            for row in batch
        ]
        prompts = _render(batch, fmt, chat, prompt_key)
        enc = _encode(tokenizer, processor, [p + r for p, r in zip(prompts, responses, strict=True)], images)
        targets = [tokenizer(r, add_special_tokens=False).input_ids for r in responses]
        labels = _answer_labels(enc["input_ids"], enc["attention_mask"].sum(1), targets)
        masked_rows = torch.tensor([untrained_in is None or untrained_in(row) for row in batch])[:, None]
        labels[torch.isin(labels, skip) & masked_rows] = -100
        losses.append(supervised_step(model, optimizer, enc, labels))
    model.save_pretrained(model_dir)
    stats = {"loss_first": losses[0], "loss_last": losses[-1], "seconds": time.perf_counter() - start}
    info = {**(record or {}), "train_file": str(train_file), **asdict(schedule), **stats}
    (model_dir / MARKER).write_text(json.dumps(info, indent=1))
    return stats


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model_dir")
    parser.add_argument("train_file")
    parser.add_argument("--answers", nargs="+", required=True)
    parser.add_argument("--format-prompt", default=None)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    stats = warm_up_answer_format(
        args.model_dir,
        args.train_file,
        args.answers,
        args.format_prompt,
        args.steps,
        lr=args.lr,
        seed=args.seed,
    )
    print(
        f"answer-format warm-up: loss {stats['loss_first']:.3f} -> {stats['loss_last']:.3f} in {stats['seconds']:.1f} s"
    )


if __name__ == "__main__":
    main()


def supervised_step(
    model: Any, optimizer: torch.optim.Optimizer, inputs: dict[str, Any], labels: torch.Tensor
) -> float:
    """One next-token cross-entropy step on `labels` [B, T] (-100: not trained); returns the loss."""
    logits = model(**inputs).logits[:, :-1]  # [B, T-1, V] predicts tokens 1..T-1
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()
