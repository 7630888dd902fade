"""Build what the multi-turn demo needs, if missing: greyscale shapes, the tiny model, a format warm-up.

python examples/prepare_multi_turn_demo.py [--out outputs/multi_turn_demo]

The prompt image shows the shape in one grey whatever its colour, so the answer is not in the
prompt: without the `reveal` tool the reward ceiling is chance (0.25). The tool (examples/tools/
reveal.py) returns the colour image and its name. The warm-up (`vlrl.tools.turn_warmup`) teaches
the *form* only: every example calls `reveal` and then answers a colour unrelated to the shape. So the model
starts with well-formed calls and answers at chance; RL must learn to read the tool's result (and to
keep calling). `--warmup-steps` counts in all: a rerun fits only the missing steps.

The warm-up's tool turns hold a neutral result (the prompt's grey image again, no text), never a
real one. With real results (the colour image and name) next to a random answer, the warm-up fits
"the answer does not depend on what the tool said": 100 such steps left RL learning to read more
slowly, and 300 of them left it not learning at all in 100 steps (docs/multi_turn.md).
"""

import argparse
import itertools
import json
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image

from vlrl.data.prompts import ChatFormatter, FormatPrompt
from vlrl.data.synthetic import BACKGROUND, COLOURS, make_shapes_dataset
from vlrl.models.tiny import build_tiny_model
from vlrl.tools.turn_warmup import Segment, fit_segments

GREY = (128, 128, 128)
CALL = '<tool_call>{"name": "reveal"}</tool_call>'
FORMAT = "format_prompts/shapes.jinja"
PIXELS = 12544  # 112 x 112: 16 image tokens
WARMUP_CHUNK = 40  # warm-up steps saved at a time


def grey_copy(path: Path) -> Path:
    """The image with every non-background pixel painted one grey."""
    pixels = np.array(Image.open(path).convert("RGB"))  # [H, W, 3]
    pixels[(pixels != np.array(BACKGROUND)).any(-1)] = GREY
    out = path.with_name("grey_" + path.name)
    Image.fromarray(pixels).save(out)
    return out


def build_data(out: Path, n_train: int = 512, n_val: int = 64) -> None:
    colour_dir = out / "data"
    make_shapes_dataset(colour_dir, n_train=n_train, n_val=n_val, seed=0, task="colour", image_size=112)
    for split in ("train", "val"):
        rows = [json.loads(line) for line in (colour_dir / f"{split}.jsonl").read_text().splitlines()]
        with open(colour_dir / f"{split}_mt.jsonl", "w", encoding="utf-8") as f:
            for row in rows:
                colour_path = (colour_dir / row["images"][0]).resolve()
                grey = grey_copy(colour_path)
                context = {"reveal": {"image_path": str(colour_path), "colour": row["answer"]}}
                f.write(json.dumps({**row, "images": [str(grey.relative_to(colour_dir.resolve()))],
                                    "tools_kwargs": context}) + "\n")  # fmt: skip


def warm_up_examples(
    model_dir: Path,
    train_file: Path,
    call_share: float = 1.0,
    filler: Callable[[random.Random], str] | None = None,
) -> Callable[[random.Random], list[Segment]]:
    """`rng -> example` for the warm-up: `call_share` of the examples call `reveal` first and read a
    neutral result; the answers are unrelated colours. `filler(rng)`: text written before the call
    and before the answer (the benchmark's long turns)."""
    from vlrl.models.processor import load_processor
    from vlrl.rollout.multi_turn.rendering import TurnRenderer

    tokenizer, processor = load_processor(str(model_dir))
    chat, fmt = ChatFormatter(tokenizer, processor), FormatPrompt(FORMAT)
    renderer = TurnRenderer(tokenizer, processor.chat_template, True, 64)
    rows = [json.loads(line) for line in train_file.read_text().splitlines()]
    lead = filler or (lambda _: "")
    # answers cycle through the colours: every batch of a multiple of 4 holds each equally often, so the
    # warm-up leaves no colour preference (random draws left one: p(red) 0.16, and RL plateaued lower)
    answers = itertools.cycle(sorted(COLOURS))

    def example(rng: random.Random) -> list[Segment]:
        row = rng.choice(rows)
        prompt = Segment(
            chat(fmt.render(row["problem"])), images=[Image.open(train_file.parent / row["images"][0])]
        )
        answer = Segment(lead(rng) + next(answers) + "<|im_end|>", trained=True)  # unrelated: form only
        if rng.random() >= call_share:
            return [prompt, answer]
        # a neutral result: the prompt's own grey image and no text (see the module docstring)
        tool = Segment(renderer.tool_turn("", 1), images=prompt.images)
        return [prompt, Segment(lead(rng) + CALL, trained=True), tool, answer]

    return example


def warm_up(
    model_dir: Path,
    train_file: Path,
    steps: int,
    batch_size: int = 16,
    call_share: float = 1.0,
    filler: Callable[[random.Random], str] | None = None,
    lr: float = 1e-3,
    seed: int = 0,
) -> dict[str, float]:
    """Fit the form on `warm_up_examples` (see there) in place."""
    examples = warm_up_examples(model_dir, train_file, call_share, filler)
    return fit_segments(model_dir, examples, steps=steps, batch_size=batch_size, lr=lr, seed=seed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="outputs/multi_turn_demo")
    parser.add_argument("--warmup-steps", type=int, default=100, help="in all; a rerun fits only the rest")
    args = parser.parse_args()
    out = Path(args.out)
    if not (out / "data" / "train_mt.jsonl").exists():
        build_data(out)
        print(f"built the greyscale shapes dataset in {out / 'data'}")
    marker = out / "model" / "turn_warmup.json"
    if not marker.exists():
        build_tiny_model(out / "model", "qwen2_5_vl", "tiny", seed=0, min_pixels=PIXELS, max_pixels=PIXELS,
                         tool_tokens=True)  # fmt: skip
        marker.write_text(json.dumps({"steps": 0, "chunks": []}))
    done = json.loads(marker.read_text())
    # chunks of WARMUP_CHUNK steps (each a fresh optimizer and sampling seed), saved after each one,
    # so an interrupted or shorter warm-up is continued, not redone
    while done["steps"] < args.warmup_steps:
        steps = min(WARMUP_CHUNK, args.warmup_steps - done["steps"])
        stats = warm_up(out / "model", out / "data" / "train_mt.jsonl", steps, seed=len(done["chunks"]))
        done["steps"] += steps
        done["chunks"].append(stats)
        marker.write_text(json.dumps(done))
        print(f"format warm-up: {done['steps']}/{args.warmup_steps} steps, loss {stats['loss_first']:.2f} -> "
              f"{stats['loss_last']:.2f} in {stats['seconds']:.0f} s")  # fmt: skip
    print(f"tiny model in {out / 'model'}: {done['steps']} warm-up steps")


if __name__ == "__main__":
    main()
