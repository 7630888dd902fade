"""Write a tiny two-images-per-prompt dataset: "Which image is red, first or second?".

    python examples/data/make_multi_image.py data/multi --n-train 256 --n-val 32

Each row: {"problem": "<image><image>Which image is red, first or second?",
"answer": "first" | "second", "images": [path1, path2]}.
"""

from __future__ import annotations

import argparse

from vlrl.data.synthetic import make_multi_image_dataset


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out_dir")
    parser.add_argument("--n-train", type=int, default=256)
    parser.add_argument("--n-val", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--image-size", type=int, default=56)
    args = parser.parse_args(argv)
    train, val = make_multi_image_dataset(args.out_dir, args.n_train, args.n_val, args.seed, args.image_size)
    print(f"wrote {train} ({args.n_train} rows) and {val} ({args.n_val} rows)")


if __name__ == "__main__":
    main()
