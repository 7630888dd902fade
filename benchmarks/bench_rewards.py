"""Throughput of the math reward (reward_functions/boxed_math.py) through RewardRunner, by worker count.

    .venv/bin/python benchmarks/bench_rewards.py [--n 2000] [--workers 1,2] [--group 8]

Inputs look like GRPO rollouts: `n / group` problems, `group` responses each (~300 characters of
reasoning, then a boxed answer written in a different form from the ground truth half of the time,
a wrong answer a quarter of the time, and no box otherwise). Each worker count gets a fresh runner,
a small warm-up call (sympy's lazy imports), then one timed `score` call on all inputs.
Workers 0 means in-process (no worker processes), shown as a reference.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path

from vlrl.config import RewardConfig
from vlrl.rewards import RewardInput, RewardRunner, build_reward_inputs

SPEC = str(Path(__file__).resolve().parents[1] / "reward_functions" / "boxed_math.py") + ":compute_score"
FILLER = "Let us compute this carefully. We expand the expression and simplify each term in turn. "


def _problem(rng: random.Random) -> tuple[str, str, str]:
    """(ground truth, the same value written differently, a wrong value)."""
    a, b = rng.randint(1, 40), rng.randint(2, 40)
    kind = rng.randrange(4)
    if kind == 0:
        return str(a * b), f"{a * b}", str(a * b + 1)
    if kind == 1:
        return f"\\frac{{{a}}}{{{b}}}", f"{a}/{b}", f"\\frac{{{a + 1}}}{{{b}}}"
    if kind == 2:
        return f"{a}\\sqrt{{{b}}}", f"\\sqrt{{{b}}} \\cdot {a}", f"{a + 1}\\sqrt{{{b}}}"
    return f"x^2 + {a}x + {b}", f"{b} + {a}x + x^2", f"x^2 + {a}x + {b + 1}"


def make_inputs(n: int, group: int, seed: int) -> list[RewardInput]:
    rng = random.Random(seed)
    responses, truths = [], []
    while len(responses) < n:
        truth, same, wrong = _problem(rng)
        for _ in range(group):
            roll = rng.random()
            answer = same if roll < 0.5 else truth if roll < 0.6 else wrong if roll < 0.85 else None
            text = FILLER * rng.randint(2, 5)
            responses.append(text + (f"The answer is \\boxed{{{answer}}}." if answer else "I am not sure."))
            truths.append(truth)
    responses, truths = responses[:n], truths[:n]
    return build_reward_inputs(responses, [len(r) // 4 for r in responses], ["p"] * n, truths, None)


def bench(workers: int, inputs: list[RewardInput], warmup: list[RewardInput]) -> dict[str, float]:
    config = RewardConfig(reward_function=SPEC, num_workers=workers, timeout=600.0)
    start = time.perf_counter()
    with RewardRunner(config) as runner:
        startup = time.perf_counter() - start
        runner.score(warmup)
        start = time.perf_counter()
        result = runner.score(inputs)
        elapsed = time.perf_counter() - start
    return {
        "startup": startup,
        "elapsed": elapsed,
        "rate": len(inputs) / elapsed,
        "accuracy": result.metrics()["reward/accuracy"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=2000, help="inputs per timed call")
    parser.add_argument("--workers", default="1,2", help="comma-separated worker counts (0: in-process)")
    parser.add_argument("--group", type=int, default=8, help="responses per problem (GRPO group size)")
    args = parser.parse_args()
    inputs = make_inputs(args.n, args.group, seed=0)
    warmup = make_inputs(64, args.group, seed=1)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"math reward, {args.n} inputs ({args.n // args.group} problems x {args.group}); ", end="")
    print(f"{os.cpu_count()} CPUs, load average {load} (other processes compete for the cores)")
    print(
        f"{'workers':>7} | {'start-up s':>10} | {'score s':>8} | {'rewards/s':>9} | {'speed-up':>8} | accuracy"
    )
    base = None
    for workers in (int(w) for w in args.workers.split(",")):
        row = bench(workers, inputs, warmup)
        base = base or row["rate"]
        print(
            f"{workers:>7} | {row['startup']:>10.2f} | {row['elapsed']:>8.2f} | {row['rate']:>9.0f} | "
            f"{row['rate'] / base:>7.2f}x | {row['accuracy']:.3f}"
        )


if __name__ == "__main__":
    main()
