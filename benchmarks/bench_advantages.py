"""Time the vectorized outcome advantage estimators against plain per-sample Python loops.

    .venv/bin/python benchmarks/bench_advantages.py                 # 16384 sequences x 1024 tokens
    .venv/bin/python benchmarks/bench_advantages.py --seqs 2048 --tokens 256 --threads 1

The loop baselines are written the straightforward way (a dict of per-group score lists filled
sample by sample, per-group torch statistics, per-sample assignment); both sides share the
vectorized [B, T] score sum and broadcast, so the ratio measures the grouping logic plus those two
passes. Each baseline's output is checked against the vectorized estimator before timing.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from vlrl.algorithms import compute_advantages

EPS = 1e-6


# --------------------------------------------------------------------------- loop baselines
def _scores_by_group(scores: torch.Tensor, group_ids: torch.Tensor) -> dict[int, list[int]]:
    members: dict[int, list[int]] = defaultdict(list)
    for i in range(scores.shape[0]):
        members[int(group_ids[i].item())].append(i)
    return members


def loop_grpo(scores, group_ids, baseline, norm_by_std=True):
    adv = torch.zeros_like(scores)
    for idx in _scores_by_group(scores, group_ids).values():
        vals = torch.stack([scores[i] for i in idx])
        mean = vals.mean()
        std = vals.std() if len(idx) > 1 else torch.zeros(())
        for i in idx:
            adv[i] = (scores[i] - mean) / (std + EPS) if norm_by_std else scores[i] - mean
    return adv


def loop_dr_grpo(scores, group_ids, baseline):
    return loop_grpo(scores, group_ids, baseline, norm_by_std=False)


def loop_rloo(scores, group_ids, baseline):
    adv = torch.zeros_like(scores)
    for idx in _scores_by_group(scores, group_ids).values():
        if len(idx) < 2:
            continue
        total = torch.stack([scores[i] for i in idx]).sum()
        for i in idx:
            adv[i] = scores[i] - (total - scores[i]) / (len(idx) - 1)
    return adv


def loop_remax(scores, group_ids, baseline):
    adv = torch.zeros_like(scores)
    for i in range(scores.shape[0]):
        adv[i] = scores[i] - baseline[i]
    return adv


def loop_grpo_passk(scores, group_ids, baseline):
    adv = torch.zeros_like(scores)
    for idx in _scores_by_group(scores, group_ids).values():
        if len(idx) < 2:
            continue
        vals = torch.stack([scores[i] for i in idx])
        order = sorted(idx, key=lambda i: (-float(scores[i]), i))
        adv[order[0]] = (scores[order[0]] - scores[order[1]]) / (vals.std() + EPS)
    return adv


BASELINES: dict[str, Callable] = {
    "grpo": loop_grpo,
    "dr_grpo": loop_dr_grpo,
    "rloo": loop_rloo,
    "remax": loop_remax,
    "grpo_passk": loop_grpo_passk,
}


def run_loop(name, rewards, mask, group_ids, baseline):
    """The whole baseline estimator: vectorized score sum, looped group logic, vectorized broadcast."""
    scores = (rewards * mask).sum(dim=-1)
    adv = BASELINES[name](scores, group_ids, baseline)
    return adv.unsqueeze(-1) * mask


# ------------------------------------------------------------------------------------ driver
def make_batch(seqs: int, tokens: int, group_size: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    group_ids = (torch.arange(seqs) // group_size) * 7919 + 123  # sparse ids ...
    group_ids = group_ids[torch.randperm(seqs, generator=gen)]  # ... in shuffled order
    lengths = torch.randint(1, tokens + 1, (seqs,), generator=gen)
    mask = (torch.arange(tokens)[None, :] < lengths[:, None]).float()
    rewards = torch.zeros(seqs, tokens)
    rewards[torch.arange(seqs), lengths - 1] = (torch.rand(seqs, generator=gen) < 0.5).float()
    baseline = (torch.rand(seqs, generator=gen) < 0.5).float()
    return rewards, mask, group_ids, baseline


def best_time(fn: Callable, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) if repeats < 3 else statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=16384)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads; 0: torch's default")
    args = parser.parse_args()
    if args.threads > 0:  # on a busy shared CPU, 1 thread avoids OpenMP oversubscription stalls
        torch.set_num_threads(args.threads)
    rewards, mask, group_ids, baseline = make_batch(args.seqs, args.tokens, args.group_size)
    print(
        f"{args.seqs} sequences x {args.tokens} tokens, groups of {args.group_size}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads (median of {args.repeats})"
    )
    # "group step" = the same estimator on [B, 1] inputs: the grouping logic without the [B, T] passes.
    scores, ones = (rewards * mask).sum(dim=-1, keepdim=True), torch.ones(args.seqs, 1)
    print(
        f"{'':<12} {'---------- full estimator ----------':>36} {'------------ group step ------------':>36}"
    )
    header = f"{'vectorized ms':>14} {'loop ms':>10} {'speed-up':>10}"
    print(f"{'estimator':<12} {header} {header}")
    for name in BASELINES:
        row = []
        for r, m in ((rewards, mask), (scores, ones)):

            def vectorized(name=name, r=r, m=m):
                return compute_advantages(name, r, m, group_ids, baseline_scores=baseline)[0]

            def looped(name=name, r=r, m=m):
                return run_loop(name, r, m, group_ids, baseline)

            torch.testing.assert_close(vectorized(), looped(), rtol=1e-4, atol=1e-4)
            t_vec, t_loop = best_time(vectorized, args.repeats), best_time(looped, args.repeats)
            row.append(f"{t_vec * 1e3:>14.2f} {t_loop * 1e3:>10.1f} {t_loop / t_vec:>9.1f}x")
        print(f"{name:<12} {' '.join(row)}")
    print("token-level estimators (no loop baseline; one reverse loop over time when gamma < 1):")
    for name, kw in (
        ("reinforce_plus_plus gamma=1", {"gamma": 1.0}),
        ("reinforce_plus_plus gamma=0.99", {"gamma": 0.99}),
    ):
        estimator = name.split()[0]
        t = best_time(
            lambda e=estimator, k=kw: compute_advantages(e, rewards, mask, group_ids, **k), args.repeats
        )
        print(f"  {name:<32} {t * 1e3:>8.1f} ms")


if __name__ == "__main__":
    main()
