"""The reasoning quickstart's task: add a few numbers and the value of a shape's colour.

Each row shows one coloured shape (as in the shapes quickstart) and asks for a sum, e.g.
    {"problem": "<image>What is 3 + 1 + 4 + the shape's value? Values: red 1, green 2, blue 3, yellow 4.",
     "answer": "11", "images": ["images/train_00000.png"], "numbers": [3, 1, 4], "colour": "blue"}

Why this task: the answer needs one look at the image (the colour, which a tiny model learns to
read in a few dozen GRPO steps on the shapes quickstart) and a chain of additions as long as the
question. Written out, each step is easy: `worked_solution` keeps a running sum one number at a
time, then names the colour and adds its value. Answered in one token, the model would have to add up to
`MAX_NUMBERS + 1` terms in its head. The number of terms varies per row, so responses vary in length
(15 to 45 tokens with the tiny tokenizer) and end at EOS.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from vlrl.data.synthetic import COLOURS, draw_shapes, write_split

COLOUR_VALUES = {"red": 1, "green": 2, "blue": 3, "yellow": 4}
VALUES_TEXT = ", ".join(f"{c} {v}" for c, v in COLOUR_VALUES.items())
MAX_NUMBERS = 6  # terms besides the shape's value: 1..MAX_NUMBERS distinct numbers of 1..9
MAX_TOTAL = 29  # answers below 30: " 1" .. " 29" are single tokens of the tiny tokenizer, " 30" is not
assert set(COLOUR_VALUES) == set(COLOURS)


def question(numbers: list[int]) -> str:
    terms = " + ".join(map(str, numbers))
    return f"<image>What is {terms} + the shape's value? Values: {VALUES_TEXT}."


def worked_solution(numbers: list[int], colour: str, think: bool = True) -> str:
    """The response a solver would write: `<think>` steps `</think><answer> sum</answer>`.

    Steps (a leading space keeps each number one token; none before the colour keeps each colour
    one token, whereas " red" would be " re" + "d" and " blue" " " + "blue"):
        " 3 + 1 = 4\n 4 + 4 = 8\nblue 3\n 8 + 3 = 11\n"
    A running sum over the numbers, then the colour and its value, then the last addition. The
    colour comes late on purpose: the samples of a GRPO group share the steps before it, so those
    tokens' advantages cancel (they sum to zero over a group) and only the colour and what follows
    it are credited or blamed. Named first, a wrong colour would put the whole sum in a context
    that every negative advantage pushes down, which unlearned the sums in probe runs.
    With `think=False` the think block is empty: the answer alone."""
    value = COLOUR_VALUES[colour]
    total, steps = numbers[0], []
    for term in numbers[1:]:
        steps.append(f" {total} + {term} = {total + term}")
        total += term
    steps += [f"{colour} {value}", f" {total} + {value} = {total + value}"]
    thought = "\n".join(steps) + "\n" if think else ""
    return f"<think>{thought}</think><answer> {total + value}</answer>"


def solution_with_random_colour(row: dict, rng: random.Random, think: bool = True) -> str:
    """The warm-up's target for `row`: its worked solution with a colour drawn at random, whatever
    the image. A model fit to it learns the form and the running sum; its accuracy stays at chance."""
    return worked_solution(row["numbers"], rng.choice(sorted(COLOUR_VALUES)), think)


def _distinct_numbers(rng: random.Random, count: int) -> list[int]:
    """`count` distinct numbers of 1..9 whose sum plus any colour value is at most MAX_TOTAL.

    Distinct, so a step finds the next term by the previous one: in "What is 2 + 7 + 5 + ...",
    the term after 7 is 5. With repeats ("2 + 2 + 3") only counting positions tells which 2 was
    last added, which the quickstart's 2-layer model learned for ~60% of the lines."""
    while True:
        numbers = rng.sample(range(1, 10), count)
        if sum(numbers) + max(COLOUR_VALUES.values()) <= MAX_TOTAL:
            return numbers


def make_reasoning_dataset(
    out_dir: str | Path, n_train: int = 2048, n_val: int = 128, seed: int = 0, image_size: int = 112
) -> tuple[Path, Path]:
    """Write train.jsonl / val.jsonl and their PNGs to `out_dir`; returns (train_path, val_path)."""
    out = Path(out_dir)
    paths = []
    for split, n, split_seed in (("train", n_train, seed), ("val", n_val, seed + 1_000_003)):
        rng = random.Random(split_seed)
        rows = []
        for _ in range(n):
            numbers = _distinct_numbers(rng, rng.randint(1, MAX_NUMBERS))
            image, drawn = draw_shapes(rng, image_size, 1)
            colour = drawn[0][1]
            answer = str(sum(numbers) + COLOUR_VALUES[colour])
            extra = {"numbers": numbers, "colour": colour, "task": "reasoning_sum"}
            rows.append(([image], question(numbers), answer, extra))
        paths.append(write_split(out, split, rows))
    return paths[0], paths[1]


def make_warmup_file(
    data_dir: str | Path, n_per_question: int = 1024, seed: int = 0, image_size: int = 112
) -> Path:
    """`data_dir/warmup.jsonl`: the rows of `data_dir/train.jsonl` plus `n_per_question` rows of
    each of two other visual questions with their true answers, "What shape is in the image?" and
    "What colour is the shape?" (images under `data_dir/shapes/` and `data_dir/colours/`).

    Why (docs/reasoning.md has the measurements): a random model fit only to answers that never
    depend on the image (the sums' colour is drawn at random) stops looking at it. The two
    questions play the part of a real model's pretraining: it sees shapes and can name colours
    when asked; what it has not learned is to use the colour it sees in the sum. Without the colour
    question, ten GRPO runs of up to 336 steps never moved accuracy off chance."""
    from vlrl.data.synthetic import make_shapes_dataset

    data_dir = Path(data_dir)
    lines = (data_dir / "train.jsonl").read_text(encoding="utf-8").splitlines()
    for task, folder, task_seed in (("shape", "shapes", seed + 7), ("colour", "colours", seed + 11)):
        rows, _ = make_shapes_dataset(data_dir / folder, n_per_question, 0, task_seed, task, image_size)
        for line in rows.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            lines.append(json.dumps({**row, "images": [f"{folder}/{p}" for p in row["images"]]}))
    out = data_dir / "warmup.jsonl"
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return out


def is_sum_row(row: dict) -> bool:
    """A row of the sums (not one of `make_warmup_file`'s other questions)."""
    return row.get("task") == "reasoning_sum"


def warmup_target(row: dict, rng: random.Random, think: bool = True) -> str:
    """The warm-up's response to a row of `make_warmup_file`: the shape or colour question's true
    answer, or the sum's worked solution with a random colour (`solution_with_random_colour`). The
    colour is written as in the solutions' colour line, with no space before it (one token)."""
    if row.get("task") == "shape":
        return f"<think> {row['answer']}\n</think><answer> {row['answer']}</answer>"
    if row.get("task") == "colour":
        return f"<think>{row['answer']}\n</think><answer>{row['answer']}</answer>"
    return solution_with_random_colour(row, rng, think)
