"""Build what the reasoning quickstart needs, if missing: the sum dataset and the tiny Qwen2.5-VL.

python examples/prepare_reasoning.py [--out outputs/reasoning] [--seed 0] [--no-think]

The task (`vlrl.data.reasoning_task`): "What is 3 + 1 + 4 + the shape's value?", the value given by
the colour of the one shape in the image. The random model is warmed up on worked solutions in
EasyR1's r1v form, `<think> 3 + 1 = 4\\n 4 + 4 = 8\\n blue 3\\n 8 + 3 = 11\\n</think><answer> 11</answer>`, whose colour is
drawn at random whatever the image. Rows of two other questions with their true answers are mixed
in ("What shape is in the image?", "What colour is the shape?"): the model can see, as a pretrained
one can. It learns the form and the running sum, not which colour goes in the sum, so its accuracy
starts at chance (~0.25). GRPO then has to learn to use the colour it sees. `--no-think` warms up
on the answer alone (`<think></think><answer> 11</answer>`) to measure what the steps are worth.
"""

import argparse
from dataclasses import replace
from functools import partial
from pathlib import Path

from vlrl.data.reasoning_task import (
    COLOUR_VALUES,
    is_sum_row,
    make_reasoning_dataset,
    make_warmup_file,
    warmup_target,
)
from vlrl.models.tiny import build_tiny_model
from vlrl.tools.warmup import MARKER, WarmupSchedule, warm_up_responses

FORMAT_PROMPT = "format_prompts/r1v.jinja"
PIXELS = 12544  # 112 x 112: 16 image tokens, as in the shapes quickstart
# The warm-up (docs/reasoning.md says why each part is there): on the sums' rows plus rows of two other
# visual questions (shape and colour, true answers), first the steps with the sums' colour word
# untrained, then whole solutions with the colour drawn at random.
STEPS_PHASE = WarmupSchedule(steps=2400, batch_size=24, lr=1e-3, seed=0)
COLOUR_PHASE = WarmupSchedule(steps=100, batch_size=24, lr=1e-3, seed=1)


def warm_up(
    model_dir: Path,
    data_dir: Path,
    think: bool = True,
    steps: int = STEPS_PHASE.steps,
    colour_steps: int = COLOUR_PHASE.steps,
) -> dict:
    """Teach the worked-solution form with a colour drawn at random (accuracy stays at chance)."""
    rows = make_warmup_file(data_dir)
    respond = partial(warmup_target, think=think)
    record = {"task": "reasoning_sum", "think": think}
    first = warm_up_responses(
        model_dir,
        rows,
        respond,
        FORMAT_PROMPT,
        replace(STEPS_PHASE, steps=steps),
        record=record,
        untrained_tokens=sorted(COLOUR_VALUES),
        untrained_in=is_sum_row,  # the colour question's answers are trained
    )
    record["steps_phase"] = first
    colour_phase = replace(COLOUR_PHASE, steps=colour_steps)
    second = warm_up_responses(model_dir, rows, respond, FORMAT_PROMPT, colour_phase, record=record)
    return {**second, "loss_first": first["loss_first"], "seconds": first["seconds"] + second["seconds"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="outputs/reasoning")
    parser.add_argument("--seed", type=int, default=0, help="data seed (the model's seed stays 0)")
    parser.add_argument("--no-think", action="store_true", help="warm up on the answer alone")
    parser.add_argument(
        "--warmup-steps", type=int, default=STEPS_PHASE.steps, help="steps of the first warm-up phase"
    )
    parser.add_argument(
        "--colour-steps", type=int, default=COLOUR_PHASE.steps, help="steps of the second warm-up phase"
    )
    parser.add_argument("--n-train", type=int, default=2048, help="training prompts")
    args = parser.parse_args()
    out = Path(args.out)
    if not (out / "data" / "train.jsonl").exists():
        make_reasoning_dataset(out / "data", n_train=args.n_train, seed=args.seed)
        print(f"built the sum dataset in {out / 'data'}")
    if not (out / "model" / MARKER).exists():
        build_tiny_model(out / "model", "qwen2_5_vl", "tiny", 0, PIXELS, PIXELS, reasoning_tokens=True)
        stats = warm_up(out / "model", out / "data", not args.no_think, args.warmup_steps, args.colour_steps)
        print(
            f"built the tiny model in {out / 'model'}; worked-solution warm-up: "
            f"loss {stats['loss_first']:.2f} -> {stats['loss_last']:.2f} in {stats['seconds']:.1f} s"
        )


if __name__ == "__main__":
    main()
