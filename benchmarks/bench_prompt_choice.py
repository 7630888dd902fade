"""Choosing prompts on the reasoning quickstart: today's shuffle, online filtering, the pass-rate sampler.

    .venv/bin/python benchmarks/bench_prompt_choice.py [--seeds 0 1 2] [--steps 150] [--n-train 2048]
        [--train-rows N] [--modes shuffle filter pass_rate] [--val-every N] [--out outputs/bench_prompt_choice]
        [--resume RUN/ckpt/global_step_N --rollout-seeds 1 2 3]

For each data seed, `examples/prepare_reasoning.py --seed S` builds the data and the warmed-up model
(once, kept in OUT/seedS), then each mode runs the real CLI on `examples/reasoning_quickstart.yaml`
for `--steps` steps, one run after the other (no validation, no checkpoint but the last), on the
whole training file or, with `--train-rows N`, on its first N rows (the same model: a small dataset
goes round many times in a run, where a prompt's pass rate is known when it comes back):
    shuffle     the config as it is (data.sampler=shuffle)
    filter      algorithm.online_filtering=true (DAPO's: groups whose `overall` rewards are all equal
                are dropped and more rounds are generated until 16 groups are kept)
    pass_rate   data.sampler=pass_rate
    pass_rate_filter  both: the sampler chooses each round's prompts, the filter drops the groups whose
                rewards are all equal (filtering's extra rounds draw more prompts per step, so the
                sampler sees prompts come back within a 2048-prompt run)
`--resume RUN/ckpt/global_step_N` (one data seed) continues a run from its checkpoint for `--steps`
more steps in each mode, once per `--rollout-seeds` value (`worker.rollout.seed`): the same policy
and statistics at the start, so the modes differ only by what they draw from there (folders
`MODE_fromN_rsK_valE`). The checkpoint's prompt statistics come along, so the sampler starts
knowing every prompt the run had drawn.
A run that stops early (with filtering: a batch left unfilled after `trainer.max_try_make_batch`
rounds) is summarised up to its last step, its error line kept in FOLDER/stopped.txt and printed.
The table, per seed and mode: the steps run, the step and the training seconds (sum of
timing/step) at which the 10-step mean of training accuracy first reaches 0.8 (`--target`); the
samples generated per mixed group (a group whose `overall` rewards differ: the only kind GRPO
learns from) over the steps up to there and over the whole run; seconds per step; the last 10
steps' accuracy. Medians over the seeds close it.

Training accuracy is measured on the prompts each mode chose, so it could understate a mode that
draws harder prompts (the pass-rate sampler draws those likely to give mixed groups). `--val-every N` (default 10; 0: none, and no validation set is loaded) also validates on the
held-out set (128 prompts, greedy) before training and every N steps, and reports the first step
whose validation accuracy reaches 0.8, the training seconds to it and the mean validation accuracy
after the one before training: the same yardstick for every mode. Runs with validation go to `MODE_valN` folders (measured on data seed 1: validation does not
move the training trajectory; the training columns repeat the runs without it to the digit).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WINDOW, TARGET = 10, 0.8
MODES = {
    "shuffle": [],
    "filter": ["algorithm.online_filtering=true"],
    "pass_rate": ["data.sampler=pass_rate"],
    "pass_rate_filter": ["data.sampler=pass_rate", "algorithm.online_filtering=true"],
}


def prepare(out: Path, seed: int, n_train: int) -> None:
    command = [sys.executable, "examples/prepare_reasoning.py", "--out", str(out), "--seed", str(seed)]
    subprocess.run([*command, "--n-train", str(n_train)], cwd=ROOT, check=True)


def train_file(data: Path, rows: int | None) -> Path:
    """The training file: the whole one, or its first `rows` rows (written beside it)."""
    whole = data / "data" / "train.jsonl"
    if rows is None:
        return whole
    part = data / "data" / f"train_first{rows}.jsonl"
    part.write_text("".join(whole.read_text().splitlines(keepends=True)[:rows]))
    return part


def run(
    data: Path, train: Path, out: Path, mode: str, steps: int, val_every: int, extra: tuple[str, ...] = ()
) -> list[dict[str, float]]:
    """One CLI run; its metrics by step (rows of a step merged; step 0, or the step resumed from:
    the validation before training). `extra`: more overrides (a checkpoint to resume, a seed)."""
    metrics = out / "ckpt" / "logs" / "metrics.jsonl"
    if not metrics.exists():
        args = [
            "config=examples/reasoning_quickstart.yaml",
            f"data.train_files={train}",
            f"worker.actor.model.model_path={data / 'model'}", f"trainer.max_steps={steps}",
            *validation(data, val_every),
            f"trainer.save_checkpoint_path={out / 'ckpt'}", "trainer.logger=[file]", "trainer.plot_path=null",
            *MODES[mode], *extra,
        ]  # fmt: skip
        log = out / "run.log"
        out.mkdir(parents=True, exist_ok=True)
        with log.open("w") as f:
            done = subprocess.run(
                [sys.executable, "-m", "vlrl.trainer.main", *args], cwd=ROOT, stdout=f, stderr=f
            )
        if done.returncode != 0:  # summarised up to where it stopped (with filtering: a batch not filled)
            (out / "stopped.txt").write_text(_reason(log))
            if not metrics.exists():
                raise SystemExit(f"{mode} failed before its first step: see {log}")
    by_step: dict[int, dict[str, float]] = {}
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        by_step.setdefault(int(row["step"]), {}).update(row)
    first = min(by_step)
    return [row for step, row in sorted(by_step.items()) if "timing/step" in row or step == first]


def _reason(log: Path) -> str:
    """The run's closing error line ("vlrl: training failed: ...")."""
    lines = [line for line in log.read_text().splitlines() if line.startswith("vlrl: ")]
    return lines[-1] if lines else "exited with an error"


def validation(data: Path, every: int) -> list[str]:
    """The overrides for greedy validation on the held-out set every `every` steps (0: none)."""
    if not every:
        return ["trainer.val_before_train=false", "trainer.val_freq=-1", "data.val_files="]
    val = data / "data" / "val.jsonl"
    return [f"data.val_files={val}", "trainer.val_before_train=true", f"trainer.val_freq={every}"]


def samples_per_mixed(rows: list[dict[str, float]]) -> float:
    samples = sum(r["groups/generated_samples"] for r in rows)
    mixed = sum(
        r["groups/generated_samples"] / r["groups/samples_per_mixed_group"]
        for r in rows
        if "groups/samples_per_mixed_group" in r
    )
    return samples / mixed if mixed else float("inf")


def summary(all_rows: list[dict[str, float]], target: float = TARGET) -> dict[str, float]:
    rows = [r for r in all_rows if "timing/step" in r]
    accuracy = [r["reward/accuracy"] for r in rows]
    reached = next(
        (
            end
            for end in range(WINDOW, len(rows) + 1)
            if statistics.fmean(accuracy[end - WINDOW : end]) >= target
        ),
        None,
    )
    return {
        "steps_run": float(len(rows)),
        "steps_to": float(reached) if reached else float("nan"),
        "seconds_to": sum(r["timing/step"] for r in rows[:reached]) if reached else float("nan"),
        "spmg_to": samples_per_mixed(rows[:reached]) if reached else float("nan"),
        "spmg": samples_per_mixed(rows),
        "s_per_step": statistics.fmean(r["timing/step"] for r in rows[1:]),
        "last10": statistics.fmean(accuracy[-WINDOW:]),
        **held_out(all_rows, target),
    }


def held_out(rows: list[dict[str, float]], target: float) -> dict[str, float]:
    """The first step after the start whose validation accuracy reaches `target`, the training seconds to it, and the
    first validation accuracy (before training), their mean after it and the last one (NaN without
    validation)."""
    val = [(int(r["step"]), r["val/accuracy"]) for r in rows if "val/accuracy" in r]
    nan = float("nan")
    step = next((s for s, acc in val[1:] if acc >= target), None)
    seconds = (
        nan
        if step is None
        else sum(r["timing/step"] for r in rows if "timing/step" in r and r["step"] <= step)
    )
    return {
        "val_steps_to": nan if step is None else float(step),
        "val_seconds_to": seconds,
        "val_first": val[0][1] if val else nan,
        "val_mean": statistics.fmean(acc for _, acc in val[1:]) if len(val) > 1 else nan,
        "val_last": val[-1][1] if val else nan,
    }


def run_plan(
    args: argparse.Namespace, seed: int, rollout_seed: int, mode: str
) -> tuple[str, str, int, tuple[str, ...]]:
    """(the table's seed label, the run's folder name, its `trainer.max_steps`, its extra overrides)."""
    name = mode if args.train_rows is None else f"{mode}_first{args.train_rows}"
    label, steps, extra = str(seed), args.steps, ()
    if args.resume:
        start = json.loads((Path(args.resume) / "trainer_state.json").read_text())["global_step"]
        name, steps = f"{name}_from{start}", start + args.steps
        extra = (f"trainer.load_checkpoint_path={Path(args.resume).resolve()}",)
    if args.resume or args.rollout_seeds != [1]:
        name, label = f"{name}_rs{rollout_seed}", f"{seed} rs{rollout_seed}"
        extra = (*extra, f"worker.rollout.seed={rollout_seed}")
    return label, name, steps, extra


def median_over_seeds(values: list[float], column: str) -> float:
    """The median of a column over seeds. A run that never reached 0.8 (NaN in a "to 0.8" column)
    counts as later than every run that did (inf), so it is neither dropped nor made the median by
    NaN's ordering; in other columns a NaN (no validation; samples up to a 0.8 never reached) makes
    the median NaN."""
    if column in REACHED_COLUMNS:
        values = [math.inf if math.isnan(v) else v for v in values]
    elif any(math.isnan(v) for v in values):
        return math.nan
    return statistics.median(values)


REACHED_COLUMNS = ("steps_to", "seconds_to", "val_steps_to", "val_seconds_to")
COLUMNS = {
    "steps_run": ("steps run", "{:.0f}"),
    "steps_to": ("steps to {target}", "{:.0f}"),
    "seconds_to": ("s to {target}", "{:.0f}"),
    "spmg_to": ("samples/mixed group to {target}", "{:.2f}"),
    "spmg": ("samples/mixed group (run)", "{:.2f}"),
    "s_per_step": ("s/step", "{:.2f}"),
    "last10": ("last-10 acc", "{:.3f}"),
    "val_steps_to": ("val >= {target} at", "{:.0f}"),
    "val_seconds_to": ("s to val {target}", "{:.0f}"),
    "val_first": ("val first", "{:.3f}"),
    "val_mean": ("val mean after", "{:.3f}"),
    "val_last": ("val last", "{:.3f}"),
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--n-train", type=int, default=2048)
    parser.add_argument("--train-rows", type=int, help="train on the first N rows of the training file")
    parser.add_argument("--val-every", type=int, default=10, help="validate every N steps (0: never)")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench_prompt_choice")
    parser.add_argument(
        "--resume", metavar="RUN/ckpt/global_step_N",
        help="continue a run of this data seed (one --seeds) from its checkpoint for --steps more steps, "
        "validating before the first",
    )  # fmt: skip
    parser.add_argument("--target", type=float, default=TARGET, help="the accuracy the 'to' columns wait for")
    parser.add_argument(
        "--rollout-seeds", type=int, nargs="+", default=[1], help="worker.rollout.seed values"
    )
    args = parser.parse_args()
    if args.resume and len(args.seeds) != 1:
        parser.error("--resume continues one run: give one --seeds")
    results: dict[tuple[str, str], dict[str, float]] = {}
    for seed in args.seeds:
        data = args.out / f"n{args.n_train}_seed{seed}"
        prepare(data, seed, args.n_train)
        train = train_file(data, args.train_rows)
        for rollout_seed, mode in itertools.product(args.rollout_seeds, args.modes):
            label, name, steps, extra = run_plan(args, seed, rollout_seed, mode)
            folder = data / (f"{name}_val{args.val_every}" if args.val_every else name)
            results[label, mode] = summary(
                run(data, train, folder, mode, steps, args.val_every, extra), args.target
            )
            stopped = folder / "stopped.txt"
            note = f" (stopped: {stopped.read_text()})" if stopped.exists() else ""
            print(f"seed {label} {mode}: {results[label, mode]}{note}", flush=True)
    header = ["seed", "mode", *(title.format(target=args.target) for title, _ in COLUMNS.values())]
    lines = [header]
    for (label, mode), values in results.items():
        lines.append([label, mode, *(fmt.format(values[k]) for k, (_, fmt) in COLUMNS.items())])
    for mode in args.modes:
        per_seed = [values for (_, m), values in results.items() if m == mode]
        medians = {k: median_over_seeds([v[k] for v in per_seed], k) for k in COLUMNS}
        lines.append(["median", mode, *(fmt.format(medians[k]) for k, (_, fmt) in COLUMNS.items())])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    rows = args.n_train if args.train_rows is None else args.train_rows
    start = f", from {args.resume}" if args.resume else ""
    print(f"\nreasoning quickstart, {rows} training prompts, {args.steps} steps{start}")
    for line in lines:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)))


if __name__ == "__main__":
    main()
