"""Rows for the zoom-tool recipe (examples/qwen2_5_vl_7b_geo3k_zoom.yaml): each row's first image is
saved at full resolution, and a `tools_kwargs` column tells the `zoom_in` tool where it is and at
which size the model sees it.

    python examples/prepare_zoom_data.py --source hiyouga/geometry3k@train --out data/geo3k_zoom/train.jsonl
    python examples/prepare_zoom_data.py --source hiyouga/geometry3k@test --out data/geo3k_zoom/test.jsonl

`--source` is anything `data.train_files` accepts (a .parquet/.jsonl/.csv file, or `hub_name@split`)
with the columns `problem` (text with one `<image>` marker), `answer` and `images` (a list; paths or
{bytes, path} cells). Charts work the same way (e.g. a ChartQA export with those three columns).
The shown size follows the recipe's `data.min_pixels`/`max_pixels` and the model's processor (read
from `--config`), so boxes the model writes in pixels of the image it sees map onto the original.

Output rows: problem, answer, images ([absolute PNG path]) and
tools_kwargs = {"zoom_in": {"image_path": <same PNG>, "shown_size": [width, height]}}.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml

RECIPE = "examples/qwen2_5_vl_7b_geo3k_zoom.yaml"


def shown_size_rule(model: str, min_pixels: int | None, max_pixels: int | None) -> Any:
    """`(width, height) -> [width, height]` as the data pipeline resizes images for `model`."""
    from transformers import AutoConfig

    from vlrl.config import DataConfig
    from vlrl.data.prepare import RowPreparer
    from vlrl.models.processor import load_processor

    tokenizer, processor = load_processor(model)
    if processor is None:
        raise SystemExit(f"{model} has no image processor: the zoom recipe needs a vision-language model")
    data = DataConfig(min_pixels=min_pixels, max_pixels=max_pixels)
    preparer = RowPreparer(data, tokenizer, processor, AutoConfig.from_pretrained(model))

    def rule(width: int, height: int) -> list[int]:
        shown_h, shown_w = preparer.target_size(height, width)
        return [shown_w, shown_h]

    return rule


def prepare(source: str, out: Path, shown_size: Any, limit: int | None = None) -> int:
    """Write `out` (JSON lines) and its images (next to it, in `<stem>_images/`); returns the row count."""
    from vlrl.data.images import image_list, load_image
    from vlrl.data.sources import load_source

    loaded = load_source(source, None, "images")
    image_dir = out.parent / f"{out.stem}_images"
    image_dir.mkdir(parents=True, exist_ok=True)
    count = 0
    with open(out, "w", encoding="utf-8") as file:
        for i, row in enumerate(loaded.dataset):
            if limit is not None and count >= limit:
                break
            images = image_list(row["images"])
            if len(images) != 1 or str(row["problem"]).count("<image>") != 1:
                raise SystemExit(f"{source} row {i}: needs one image and one <image> marker in `problem`")
            image = load_image(images[0], loaded.image_dir)
            path = (image_dir / f"{i:06d}.png").resolve()
            image.save(path)
            context = {"zoom_in": {"image_path": str(path), "shown_size": shown_size(*image.size)}}
            record = {"problem": row["problem"], "answer": str(row["answer"]), "images": [str(path)],
                      "tools_kwargs": context}  # fmt: skip
            file.write(json.dumps(record) + "\n")
            count += 1
    return count


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--source", required=True, help="file or hub_name@split with problem/answer/images")
    parser.add_argument("--out", required=True, type=Path, help="output .jsonl")
    parser.add_argument(
        "--config", default=RECIPE, help="recipe whose model and pixel bounds decide the shown size"
    )
    parser.add_argument("--model", default=None, help="model folder or hub id (default: the recipe's)")
    parser.add_argument("--limit", type=int, default=None, help="first N rows only")
    args = parser.parse_args()
    recipe = yaml.safe_load(Path(args.config).read_text())
    data = recipe["data"]
    model = args.model or recipe["worker"]["actor"]["model"]["model_path"]
    rule = shown_size_rule(model, data.get("min_pixels"), data.get("max_pixels"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    print(f"wrote {prepare(args.source, args.out, rule, args.limit)} rows to {args.out}")


if __name__ == "__main__":
    main()
