"""Does asynchronous training learn like synchronous training? The quickstart over several seeds.

    .venv/bin/python benchmarks/bench_async_learning.py [--seeds 1-8] [--steps 60]
        [--modes sync,k1,k2,k4,k2+plain,k4+plain] [overrides ...]

Each mode trains `examples/quickstart.yaml` for `--steps` steps on each seed S (`data.seed=S
worker.rollout.seed=S`), one run after the other:
  sync      the quickstart as it is (one rank generates, then trains)
  kN        two ranks, one generating and one training, generation up to N steps ahead
            (`worker.rollout.async_ranks=1 worker.rollout.max_staleness=N`)
            (for N >= 2 with the defaults that come with it since 2026-12-07: the dual-clip bound at
            1 + clip_ratio_high, so a token is pushed only while its ratio to the sampling policy
            is inside the clip range whatever its advantage's sign, and a 5-step learning-rate
            warm-up; `PPOConfig._stale_trust_region`)
  kN+plain  the same with EasyR1's dual clip (3.0) and no warm-up, as k >= 2 ran before then
            (`worker.actor.clip_ratio_dual=3.0 worker.actor.optim.lr_warmup_steps=0`)
Prints per seed the mean reward of the last 10 steps (marked * when more than 0.05 below sync's on
that seed), then per mode: runs more than 0.05 below sync, the lowest last-10 mean, the median step
at which the 10-step mean reward first reached 0.8 (runs that never did in brackets), and the mean
share of clipped tokens over steps 6 to the end. Runs are deterministic on one machine (every digit
repeats); other CPU models round differently and part the runs elsewhere, so compare modes measured
on the same machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ASYNC = ["trainer.n_gpus_per_node=2", "worker.rollout.async_ranks=1"]
PLAIN = ["worker.actor.clip_ratio_dual=3.0", "worker.actor.optim.lr_warmup_steps=0"]
MISS = 0.05  # the bound: an asynchronous run ends within 0.05 of synchronous training


def mode_overrides(mode: str) -> list[str]:
    """`sync`, `kN` or `kN+plain` as config overrides."""
    base, _, extra = mode.partition("+")
    if base == "sync":
        overrides = []
    elif base.startswith("k") and base[1:].isdigit():
        overrides = [*ASYNC, f"worker.rollout.max_staleness={base[1:]}"]
    else:
        raise SystemExit(f"unknown mode {mode!r}: sync, kN or kN+plain")
    if extra not in ("", "plain"):
        raise SystemExit(f"unknown mode suffix {extra!r} in {mode!r}: only +plain")
    return overrides + (PLAIN if extra else [])


def run(overrides: list[str], seed: int, steps: int, workdir: str) -> list[dict[str, float]]:
    argv = [
        "config=examples/quickstart.yaml", f"trainer.max_steps={steps}", f"data.seed={seed}",
        f"worker.rollout.seed={seed}", "trainer.val_before_train=false", "trainer.val_freq=-1",
        "trainer.logger=[file]", "trainer.plot_path=null", f"trainer.save_checkpoint_path={workdir}",
        *overrides,
    ]  # fmt: skip
    subprocess.run([sys.executable, "-m", "vlrl.trainer.main", *argv], check=True, capture_output=True)
    with open(os.path.join(workdir, "logs", "metrics.jsonl"), encoding="utf-8") as f:
        return [m for m in map(json.loads, f) if "reward/overall" in m]


def summary(steps: list[dict[str, float]]) -> tuple[float, int | None, float]:
    """(last-10 mean reward, first step whose 10-step mean reward is >= 0.8, mean clipped share
    of steps 6 on)."""
    rewards = [m["reward/overall"] for m in steps]
    reached = next(
        (i for i in range(10, len(rewards) + 1) if statistics.mean(rewards[i - 10 : i]) >= 0.8), None
    )
    clipped = statistics.mean(m["actor/pg_clipfrac_higher"] for m in steps[5:])
    return statistics.mean(rewards[-10:]), reached, clipped


def seeds_of(text: str) -> list[int]:
    first, _, last = text.partition("-")
    return list(range(int(first), int(last or first) + 1))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", default="1-8", help="a range (1-8) or one seed")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--modes", default="sync,k1,k2,k4,k2+plain,k4+plain")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run")
    args = parser.parse_args()
    modes, seeds = args.modes.split(","), seeds_of(args.seeds)
    if modes[0] != "sync":
        raise SystemExit("--modes must start with sync (the other modes are compared with it)")
    subprocess.run([sys.executable, "examples/prepare_quickstart.py"], check=True, capture_output=True)
    results: dict[str, dict[int, tuple[float, int | None, float]]] = {}
    for mode in modes:
        for seed in seeds:
            with tempfile.TemporaryDirectory(prefix="bench_async_learning_") as workdir:
                steps = run(mode_overrides(mode) + args.overrides, seed, args.steps, workdir)
            results.setdefault(mode, {})[seed] = summary(steps)
            print(f"{mode} seed {seed}: last-10 {results[mode][seed][0]:.3f}", file=sys.stderr, flush=True)
    print_table(results, seeds)


def print_table(results: dict[str, dict[int, tuple[float, int | None, float]]], seeds: list[int]) -> None:
    sync = {seed: results["sync"][seed][0] for seed in seeds}
    print("\n" + f"{'mode':<10}" + "".join(f"{f'seed {s}':>10}" for s in seeds)
          + f"{'misses':>8}{'lowest':>8}{'to 0.8':>12}{'clipped':>9}")  # fmt: skip
    for mode, per_seed in results.items():
        cells = []
        for seed in seeds:
            last10 = per_seed[seed][0]
            cells.append(f"{last10:.3f}{'*' if last10 < sync[seed] - MISS else ' '}")
        misses = sum(per_seed[s][0] < sync[s] - MISS for s in seeds)
        reached = [per_seed[s][1] for s in seeds if per_seed[s][1] is not None]
        median = f"{statistics.median(reached):.1f}" if reached else "never"
        never = len(seeds) - len(reached)
        clipped = statistics.mean(per_seed[s][2] for s in seeds)
        print(f"{mode:<10}" + "".join(f"{c:>10}" for c in cells) + f"{misses:>8}"
              f"{min(per_seed[s][0] for s in seeds):>8.3f}{f'{median} ({never})':>12}{clipped:>9.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
