"""Does the model look at the image? The shapes quickstart, and a variant whose prompt names the colour.

    .venv/bin/python benchmarks/bench_visual_reliance.py [--steps 60] [--val-freq 10]
        [--out outputs/bench_visual_reliance]

Runs the real CLI on examples/quickstart.yaml twice, one after the other, validating every
`--val-freq` steps (the check generates the first `trainer.val_blind_rows` = 32 validation prompts
again with blank and with swapped images, vlrl/trainer/visual_reliance.py):
    image       the quickstart as it is: the colour is only in the image;
    text_named  the same data with "It is <colour>." added to every prompt (train and validation),
                and every row showing the same picture (the first training image), so the answer
                can be read from the text alone and not from the image. (With the images left as
                they are, the warmed-up tiny model kept reading the image: blind accuracy stayed at
                chance, 0.19-0.25, while accuracy reached 1.0.)
Prints, per validation: val accuracy, blind accuracy (grey images), swapped accuracy (another
row's image) and the blind gap; then whether the warning "may answer from the text alone" fired.
Expected: `image` climbs to 1.0 with blind accuracy near chance (0.25: four colours) and a growing
gap; `text_named` climbs with blind accuracy following it, a small gap and the warning. A run whose
metrics are in OUT is read, not run again.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "outputs" / "quickstart"
WARNING = "may answer from the text alone"


def named_variant(out: Path) -> Path:
    """The quickstart's data with the colour named in each prompt and one picture for every row
    (the images folder shared by a link)."""
    data = out / "text_named_data"
    data.mkdir(parents=True, exist_ok=True)
    if not (data / "images").exists():
        (data / "images").symlink_to(QUICKSTART / "data" / "images", target_is_directory=True)
    for split in ("train", "val"):
        rows = [
            json.loads(line) for line in (QUICKSTART / "data" / f"{split}.jsonl").read_text().splitlines()
        ]
        for row in rows:
            row["problem"] = f"{row['problem']} It is {row['answer']}."
            row["images"] = ["images/train_00000.png"]
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data


def run(name: str, data: Path, out: Path, steps: int, val_freq: int) -> tuple[list[dict[str, float]], bool]:
    """One CLI run (skipped when its metrics are there): its validation rows, and whether the
    warning fired."""
    run_dir = out / name
    log = run_dir.parent / f"{name}.log"
    metrics = run_dir / "logs" / "metrics.jsonl"
    if not metrics.exists():
        train(data, run_dir, log, steps, val_freq)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [r for r in rows if "val/blind_accuracy" in r], WARNING in log.read_text()


def train(data: Path, run_dir: Path, log: Path, steps: int, val_freq: int) -> None:
    args = [
        "config=examples/quickstart.yaml",
        f"data.train_files={data / 'train.jsonl'}", f"data.val_files={data / 'val.jsonl'}",
        f"trainer.max_steps={steps}", f"trainer.val_freq={val_freq}", f"trainer.save_checkpoint_path={run_dir}",
        "trainer.logger=[file]", "trainer.plot_path=null", "trainer.overwrite_checkpoints=true",
    ]  # fmt: skip
    run_dir.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        done = subprocess.run(
            [sys.executable, "-m", "vlrl.trainer.main", *args], cwd=ROOT, stdout=f, stderr=f
        )
    if done.returncode != 0:
        raise SystemExit(f"training failed: see {log}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--val-freq", type=int, default=10)
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench_visual_reliance")
    args = parser.parse_args()
    subprocess.run([sys.executable, "examples/prepare_quickstart.py"], cwd=ROOT, check=True)
    datasets = {"image": QUICKSTART / "data", "text_named": named_variant(args.out)}
    for name, data in datasets.items():
        rows, warned = run(name, data, args.out, args.steps, args.val_freq)
        print(f"\n{name}: warning {'fired' if warned else 'did not fire'}")
        print("step  val acc  blind acc  swapped acc  blind gap")
        for r in rows:
            print(
                f"{int(r['step']):>4}  {r['val/accuracy']:.3f}    {r['val/blind_accuracy']:.3f}      "
                f"{r['val/swapped_accuracy']:.3f}        {r['val/blind_gap']:.3f}"
            )


if __name__ == "__main__":
    main()
