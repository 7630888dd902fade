"""Build what the quickstart needs, if missing: the tiny Qwen2.5-VL and the shapes dataset.

python examples/prepare_quickstart.py [--out outputs/quickstart]
"""

import argparse
from pathlib import Path

from vlrl.data.synthetic import make_shapes_dataset
from vlrl.models.tiny import build_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="outputs/quickstart")
    args = parser.parse_args()
    out = Path(args.out)
    if not (out / "model" / "config.json").exists():
        build_tiny_model(
            out / "model", arch="qwen2_5_vl", size="tiny", seed=0, min_pixels=12544, max_pixels=12544
        )
        print(f"built the tiny model in {out / 'model'}")
    if not (out / "data" / "train.jsonl").exists():
        make_shapes_dataset(out / "data", n_train=512, n_val=64, seed=0, task="colour", image_size=112)
        print(f"built the shapes dataset in {out / 'data'}")


if __name__ == "__main__":
    main()
