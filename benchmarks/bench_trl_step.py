"""Seconds per RL step, vlrl vs TRL's GRPOTrainer, on the same model, prompts and sampling.

    bash benchmarks/trl_env.sh     # once: benchmarks/.trl-venv with TRL
    .venv/bin/python benchmarks/bench_trl_step.py --out /tmp/trl_step [--steps 20]

The setting (what a per-step comparison needs, not learning): the random 21.5M-parameter "small"
tiny Qwen2.5-VL (`vlrl.models.tiny`), the reasoning quickstart's prompts with their 112x112 images
(`vlrl.data.reasoning_task`, data seed 1), 16 prompts x 8 samples per step of at most 64 tokens at
temperature 1, no KL, 2 optimizer steps per step (global batch 8 prompts), the same clip range and
learning rate. A random model rarely emits EOS, so nearly every response is 64 tokens long on both
sides. vlrl keeps optimizer steps whose advantages are all zero
(`skip_steps_without_advantage=false`): the reward of a random model is mostly 0, and TRL steps anyway.

Runs vlrl through its CLI (`python -m vlrl.trainer.main`), then `bench_trl_reasoning.py` in the TRL
venv with the same config file, one after the other, and prints both seconds per step (mean and
median after the first step: the median resists a step slowed by another job on the machine),
TRL / vlrl, and vlrl's phase shares (`timing/*`). `--reuse-trl` keeps an earlier TRL run in OUT/trl
(vlrl runs again; the TRL side takes ~12 minutes here).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
TRL_PYTHON = ROOT / "benchmarks/.trl-venv/bin/python"
PIXELS = 12544  # 112 x 112, as the reasoning quickstart


def write_config(out: Path, model: Path, data: Path, steps: int) -> Path:
    """The reasoning quickstart's config with this benchmark's changes."""
    cfg = yaml.safe_load((ROOT / "examples/reasoning_quickstart.yaml").read_text())
    cfg["data"].update(train_files=str(data / "train.jsonl"), val_files=str(data / "val.jsonl"))
    cfg["data"]["max_response_length"] = 64
    cfg["algorithm"].update(disable_kl=True, use_kl_loss=False)
    cfg["worker"]["actor"]["model"]["model_path"] = str(model)
    cfg["worker"]["actor"]["skip_steps_without_advantage"] = False
    cfg["trainer"].update(
        max_steps=steps,
        val_before_train=False,
        val_freq=-1,
        save_checkpoint_path=str(out / "vlrl_run"),
        plot_path=None,
        logger=["console", "file"],
    )
    path = out / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def vlrl_rows(path: Path) -> list[dict[str, float]]:
    by_step: dict[int, dict[str, float]] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        by_step.setdefault(int(row["step"]), {}).update(row)
    return [row for _, row in sorted(by_step.items()) if "timing/step" in row]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--reuse-trl", action="store_true", help="keep OUT/trl's TRL run, rerun vlrl only")
    args = parser.parse_args()
    if not TRL_PYTHON.exists():
        sys.exit(f"{TRL_PYTHON} is missing: run `bash benchmarks/trl_env.sh` first")
    from vlrl.data.reasoning_task import make_reasoning_dataset
    from vlrl.models.tiny import build_tiny_model

    args.out.mkdir(parents=True, exist_ok=True)
    data, model = args.out / "data", args.out / "model"
    if not (data / "train.jsonl").exists():
        make_reasoning_dataset(data, seed=1)
    if not (model / "config.json").exists():
        build_tiny_model(model, "qwen2_5_vl", "small", 0, PIXELS, PIXELS, reasoning_tokens=True)
    config = write_config(args.out, model, data, args.steps)
    for old in (args.out / "vlrl_run").rglob("metrics.jsonl"):
        old.unlink()  # this run's steps only
    subprocess.run([sys.executable, "-m", "vlrl.trainer.main", f"config={config}"], cwd=ROOT, check=True)
    metrics = next((args.out / "vlrl_run").rglob("metrics.jsonl"))
    trl_out = args.out / "trl"
    if not (args.reuse_trl and (trl_out / "trl_metrics.jsonl").exists()):
        run_trl(args, model, data, config, metrics, trl_out)
    report(metrics, trl_out, args.steps)


def run_trl(
    args: argparse.Namespace, model: Path, data: Path, config: Path, metrics: Path, trl_out: Path
) -> None:
    subprocess.run(
        [str(TRL_PYTHON), str(ROOT / "benchmarks/bench_trl_reasoning.py"), "--model", str(model),
         "--data", str(data), "--steps", str(args.steps), "--out", str(trl_out), "--config", str(config),
         "--vlrl-metrics", str(metrics)],
        cwd=ROOT, check=True,
    )  # fmt: skip


def report(metrics: Path, trl_out: Path, steps: int) -> None:
    rows = vlrl_rows(metrics)[1:]
    trl = [json.loads(line) for line in (trl_out / "trl_metrics.jsonl").read_text().splitlines()][1:]
    print()
    for name, stat in (("mean", statistics.fmean), ("median", statistics.median)):
        vlrl_s, trl_s = stat([r["timing/step"] for r in rows]), stat([r["seconds"] for r in trl])
        print(
            f"steps 2-{steps}, {name}: vlrl {vlrl_s:.2f} s/step, TRL {trl_s:.2f} s/step, TRL / vlrl {trl_s / vlrl_s:.2f}x"
        )
    vlrl_s = statistics.fmean(r["timing/step"] for r in rows)
    phases = sorted(k for k in rows[0] if k.startswith("timing/") and k != "timing/step")
    for key in phases:
        share = statistics.fmean(r[key] for r in rows) / vlrl_s
        print(f"  vlrl {key}: {statistics.fmean(r[key] for r in rows):.3f} s ({share:.0%} of the step)")
    lengths = statistics.fmean(r.get("response_length/mean", float("nan")) for r in rows)
    trl_lengths = statistics.fmean(r["completion_length"] for r in trl)
    print(f"  mean response length: vlrl {lengths:.1f}, TRL {trl_lengths:.1f}")


if __name__ == "__main__":
    main()
