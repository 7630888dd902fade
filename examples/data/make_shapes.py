"""Write a synthetic coloured-shapes dataset (train.jsonl, val.jsonl and PNGs).

    python examples/data/make_shapes.py data/shapes --task colour --n-train 512 --n-val 64

Tasks: colour (default: "What colour is the shape?" -> red/green/blue/yellow), shape
(circle/square/triangle), count (1-4 shapes -> "1".."4"), mixed (a random task per row).
"""

from __future__ import annotations

import argparse

from vlrl.data.synthetic import TASKS, make_shapes_dataset


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out_dir")
    parser.add_argument("--task", default="colour", choices=TASKS)
    parser.add_argument("--n-train", type=int, default=512)
    parser.add_argument("--n-val", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--image-size", type=int, default=56)
    args = parser.parse_args(argv)
    train, val = make_shapes_dataset(
        args.out_dir, args.n_train, args.n_val, args.seed, args.task, args.image_size
    )
    print(f"wrote {train} ({args.n_train} rows) and {val} ({args.n_val} rows)")


if __name__ == "__main__":
    main()
