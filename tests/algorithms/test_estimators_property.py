"""Randomized property test: every vectorized estimator equals a plain Python-loop reference.

Random groups (random sizes, ids that are arbitrary int64 values in shuffled order), random lengths
with holes, binary or dense rewards. The references below use Python floats and lists only.
"""

import math
from collections import defaultdict

import pytest
import torch

from vlrl.algorithms import compute_advantages

EPS = 1e-6
TRIALS = 40


# ----------------------------------------------------------------------------- references
def _groups(ids: list[int]) -> dict[int, list[int]]:
    members = defaultdict(list)
    for i, g in enumerate(ids):
        members[g].append(i)
    return members


def _mean_std(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return mean, std


def ref_outcome(
    name: str, scores: list[float], ids: list[int], norm: bool, baseline: list[float]
) -> list[float]:
    adv = [0.0] * len(scores)
    if name == "remax":
        return [s - b for s, b in zip(scores, baseline)]
    for idx in _groups(ids).values():
        vals = [scores[i] for i in idx]
        mean, std = _mean_std(vals)
        n = len(idx)
        if name == "grpo_passk":
            if n > 1:
                order = sorted(idx, key=lambda i: (-scores[i], i))
                gap = scores[order[0]] - scores[order[1]]
                adv[order[0]] = gap / (std + EPS) if norm else gap
            continue
        for i in idx:
            if name == "grpo":
                adv[i] = (scores[i] - mean) / (std + EPS) if norm else scores[i] - mean
            elif name == "dr_grpo":
                adv[i] = scores[i] - mean
            elif name == "rloo":
                adv[i] = scores[i] - (sum(vals) - scores[i]) / (n - 1) if n > 1 else 0.0
    return adv


def _whiten(rows: list[list[float]], mask: list[list[int]]) -> list[list[float]]:
    valid = [x for row, m in zip(rows, mask) for x, v in zip(row, m) if v]
    n = max(len(valid), 1)
    mean = sum(valid) / n
    std = math.sqrt(sum((x - mean) ** 2 for x in valid) / n)
    return [[(x - mean) / (std + EPS) if v else 0.0 for x, v in zip(row, m)] for row, m in zip(rows, mask)]


def ref_reinforce_pp(rewards, mask, gamma):
    returns = []
    for r_row, m_row in zip(rewards, mask):
        running, row = 0.0, [0.0] * len(r_row)
        for t in reversed(range(len(r_row))):
            if m_row[t]:
                running = r_row[t] + gamma * running
                row[t] = running
        returns.append(row)
    return _whiten(returns, mask), returns


# ---------------------------------------------------------------------------- random batches
def random_batch(gen: torch.Generator, dense: bool):
    """Shuffled groups of random sizes with arbitrary int64 ids; masks with random lengths and holes."""
    num_groups = int(torch.randint(1, 7, (1,), generator=gen))
    sizes = torch.randint(1, 6, (num_groups,), generator=gen)
    distinct = (
        torch.randperm(1000, generator=gen)[:num_groups] * 7_919_993 - 3 * 10**9
    )  # sparse, negative too
    ids = torch.repeat_interleave(distinct, sizes)
    perm = torch.randperm(ids.numel(), generator=gen)
    ids = ids[perm]
    b, t = ids.numel(), int(torch.randint(1, 8, (1,), generator=gen))
    lengths = torch.randint(0, t + 1, (b,), generator=gen)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).long()
    holes = torch.rand(b, t, generator=gen) < 0.15
    mask = mask * (~holes).long()
    if dense:  # continuous per-token rewards in float64
        rewards = torch.randn(b, t, generator=gen, dtype=torch.float64)
    else:  # 0/1 outcome rewards on the first token (many ties), float32
        rewards = torch.zeros(b, t)
        rewards[:, 0] = (torch.rand(b, generator=gen) < 0.5).float()
        mask[:, 0] = 1
    return rewards, mask, ids


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "remax", "grpo_passk"])
@pytest.mark.parametrize("norm", [True, False])
def test_outcome_estimators_match_loop_reference(name, norm):
    gen = torch.Generator().manual_seed(1234)
    for trial in range(TRIALS):
        rewards, mask, ids = random_batch(gen, dense=trial % 2 == 0)
        baseline = torch.randn(ids.numel(), generator=gen, dtype=torch.float64)
        adv, _ = compute_advantages(
            name, rewards, mask, ids, norm_by_std=norm, eps=EPS, baseline_scores=baseline
        )
        r, m = rewards.tolist(), mask.tolist()
        scores = [sum(x for x, v in zip(row, mrow) if v) for row, mrow in zip(r, m)]
        seq = ref_outcome(name, scores, ids.tolist(), norm, baseline.tolist())
        expected = torch.tensor([[a * v for v in mrow] for a, mrow in zip(seq, m)], dtype=rewards.dtype)
        torch.testing.assert_close(adv, expected, rtol=1e-5, atol=1e-5, msg=f"{name} trial {trial}")


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_matches_loop_reference(gamma):
    gen = torch.Generator().manual_seed(99)
    for trial in range(TRIALS):
        rewards, mask, ids = random_batch(gen, dense=True)
        adv, ret = compute_advantages("reinforce_plus_plus", rewards, mask, ids, gamma=gamma, eps=EPS)
        exp_adv, exp_ret = ref_reinforce_pp(rewards.tolist(), mask.tolist(), gamma)
        torch.testing.assert_close(ret, torch.tensor(exp_ret, dtype=torch.float64), msg=f"trial {trial}")
        torch.testing.assert_close(adv, torch.tensor(exp_adv, dtype=torch.float64), msg=f"trial {trial}")
