"""Build what the quickstart needs, if missing: the shapes dataset and the tiny Qwen2.5-VL.

python examples/prepare_quickstart.py [--out outputs/quickstart] [--arch qwen2_5_vl]

`--arch internvl` builds a tiny InternVL instead (the same demo on a family that is not Qwen's:
docs/models.md); train it with `worker.actor.model.model_path=OUT/model` and OUT's data.

The model is random, then warmed up to answer with one colour word and stop, the colour drawn at
random whatever the image (`vlrl.tools.warmup`): RL then starts at chance (~0.25) and what it
learns is reading the image.
"""

import argparse
from pathlib import Path

from vlrl.data.synthetic import COLOURS, make_shapes_dataset
from vlrl.models.tiny import build_tiny_model
from vlrl.tools.warmup import MARKER, warm_up_answer_format


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="outputs/quickstart")
    parser.add_argument("--arch", default="qwen2_5_vl", help="a vision arch of vlrl.models.tiny")
    args = parser.parse_args()
    out = Path(args.out)
    if not (out / "data" / "train.jsonl").exists():
        make_shapes_dataset(out / "data", n_train=512, n_val=64, seed=0, task="colour", image_size=112)
        print(f"built the shapes dataset in {out / 'data'}")
    if not (out / "model" / MARKER).exists():
        build_tiny_model(
            out / "model", arch=args.arch, size="tiny", seed=0, min_pixels=12544, max_pixels=12544
        )
        stats = warm_up_answer_format(
            out / "model", out / "data" / "train.jsonl", sorted(COLOURS), "format_prompts/shapes.jinja"
        )
        print(
            f"built the tiny model in {out / 'model'}; answer-format warm-up: "
            f"loss {stats['loss_first']:.2f} -> {stats['loss_last']:.2f} in {stats['seconds']:.1f} s"
        )


if __name__ == "__main__":
    main()
