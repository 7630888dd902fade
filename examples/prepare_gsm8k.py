"""Rows for the calculator recipe (examples/qwen2_5_3b_gsm8k_calculator.yaml) from GSM8K.

    python examples/prepare_gsm8k.py --source openai/gsm8k --out data/gsm8k      # needs the hub
    python examples/prepare_gsm8k.py --source gsm8k_train.parquet --out data/gsm8k  # a local copy
    python examples/prepare_gsm8k.py --synthetic 256 --out data/gsm8k_synthetic     # no download

GSM8K's columns are `question` and `answer`, where the answer is worked text ending in
`#### 72`. Output (`train.jsonl`, `test.jsonl`): `problem` (the question) and `answer` (the number
after `####`, thousands separators removed), the columns the recipe reads.

`--synthetic N` writes made-up two-step word problems in GSM8K's form (same conversion), for
smoke-testing the pipeline on a machine without the hub; a model learns nothing real from them.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

SPLITS = ("train", "test")


def gsm8k_row(question: str, answer: str) -> dict[str, str]:
    """One output row; the final answer is the text after GSM8K's `####` marker."""
    if "####" not in answer:
        raise ValueError(f"GSM8K answer without '####': {answer[-80:]!r}")
    final = answer.rsplit("####", 1)[1].strip().replace(",", "")
    if not final:
        raise ValueError(f"GSM8K answer with nothing after '####': {answer[-80:]!r}")
    return {"problem": question.strip(), "answer": final}


def synthetic_rows(n: int, seed: int) -> list[dict[str, str]]:
    """GSM8K-shaped two-step problems: (boxes * per_box) - given_away."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        boxes, per_box = rng.randint(2, 40), rng.randint(3, 60)
        given = rng.randint(1, boxes * per_box - 1)
        question = (
            f"A shop has {boxes} boxes with {per_box} pencils in each box. It sells {given} pencils. "
            "How many pencils are left?"
        )
        worked = f"{boxes} * {per_box} = {boxes * per_box}. {boxes * per_box} - {given} = "
        rows.append(gsm8k_row(question, f"{worked}{boxes * per_box - given}\n#### {boxes * per_box - given}"))
    return rows


def load_split(source: str, split: str, subset: str) -> list[dict[str, Any]]:
    """GSM8K rows of a local file (one split) or of the hub (`source` = dataset name)."""
    from datasets import load_dataset

    if Path(source).is_file():
        kind = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}[Path(source).suffix]
        return list(load_dataset(kind, data_files=source, split="train"))
    return list(load_dataset(source, subset, split=split))


def write(rows: list[dict[str, str]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as file:
        for row in rows:
            file.write(json.dumps(row) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--source", help="hub dataset name (both splits) or one local file (written as train)"
    )
    parser.add_argument("--subset", default="main", help="hub subset (GSM8K: main)")
    parser.add_argument("--synthetic", type=int, default=0, help="write N made-up problems instead")
    parser.add_argument("--out", required=True, type=Path, help="output folder")
    args = parser.parse_args()
    if args.synthetic:
        n_test = max(1, args.synthetic // 8)
        write(synthetic_rows(args.synthetic, seed=0), args.out / "train.jsonl")
        write(synthetic_rows(n_test, seed=1), args.out / "test.jsonl")
    elif args.source:
        splits = ["train"] if Path(args.source).is_file() else list(SPLITS)
        for split in splits:
            rows = [
                gsm8k_row(r["question"], r["answer"]) for r in load_split(args.source, split, args.subset)
            ]
            write(rows, args.out / f"{split}.jsonl")
    else:
        parser.error("give --source or --synthetic N")
    print(f"wrote {', '.join(str(p) for p in sorted(args.out.glob('*.jsonl')))}")


if __name__ == "__main__":
    main()
