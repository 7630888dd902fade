"""Sequence-length balancing: split samples into parts of similar token counts.

Used twice:
- across ranks (`balance_across_ranks`): the driver reorders a step's samples so every rank gets
  the same number of samples and a similar number of tokens. Only indices are returned: every
  field, group ids included, moves with its row, and `inverse_permutation` undoes the order.
- inside a rank (`micro_batches_by_tokens`): dynamic batching forms micro-batches under a
  token budget, with the same number of micro-batches on every rank (FSDP needs every rank to run
  the same number of forward/backward passes).

The partitioner is greedy LPT (longest first, each item to the lightest part that still has room)
followed by a swap refinement: while some swap of one item of the heaviest part with one of the
lightest part narrows their gap, do the best such swap (or, without the equal-count constraint,
move one item). LPT alone measured worse than optimal by a few % on skewed length mixes; the
refinement removes most of that (tests/actor/test_balance_optim_flops.py). An equal-count
Karmarkar-Karp was tried and measured worse than LPT on bimodal and long-tailed lengths.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

MAX_REFINE_ROUNDS = 1000


def _lpt(weights: Sequence[int], k: int, capacity: int | None) -> list[list[int]]:
    """Longest first onto the lightest part with fewer than `capacity` items (None: no limit)."""
    parts: list[list[int]] = [[] for _ in range(k)]
    sums = [0] * k
    for i in sorted(range(len(weights)), key=lambda i: -weights[i]):
        open_parts = [p for p in range(k) if capacity is None or len(parts[p]) < capacity]
        target = min(open_parts, key=lambda p: (sums[p], len(parts[p])))
        parts[target].append(i)
        sums[target] += weights[i]
    return parts


def _best_swap(weights: Sequence[int], heavy: list[int], light: list[int], gap: int, allow_move: bool):
    """(i, j, new_gap) of the exchange (j = None: move i) that narrows `gap` the most, or None."""
    light_sorted = sorted(light, key=lambda j: weights[j])
    light_w = [weights[j] for j in light_sorted]
    best = None
    for i in heavy:
        wi = weights[i]
        candidates: list[tuple[int | None, int]] = [(None, 0)] if allow_move else []
        pos = bisect.bisect_left(light_w, wi - gap / 2)  # ideal partner weighs wi - gap / 2
        for q in (pos - 1, pos):
            if 0 <= q < len(light_sorted):
                candidates.append((light_sorted[q], light_w[q]))
        for j, wj in candidates:
            delta = wi - wj
            if 0 < delta < gap and (best is None or abs(gap - 2 * delta) < best[2]):
                best = (i, j, abs(gap - 2 * delta))
    return best


def _refine(weights: Sequence[int], parts: list[list[int]], equal_size: bool) -> list[list[int]]:
    for _ in range(MAX_REFINE_ROUNDS):
        sums = [sum(weights[i] for i in p) for p in parts]
        h = max(range(len(parts)), key=sums.__getitem__)
        lo = min(range(len(parts)), key=sums.__getitem__)
        gap = sums[h] - sums[lo]
        swap = _best_swap(weights, parts[h], parts[lo], gap, allow_move=not equal_size) if gap > 0 else None
        if swap is None:
            break
        i, j, _ = swap
        parts[h].remove(i)
        parts[lo].append(i)
        if j is not None:
            parts[lo].remove(j)
            parts[h].append(j)
    return parts


def partition(weights: Sequence[int], k: int, equal_size: bool = True) -> list[list[int]]:
    """Partition item indices into k parts of similar total weight (each part's indices sorted).

    With `equal_size` every part gets exactly len(weights) / k items (which must divide evenly).
    """
    n = len(weights)
    if k <= 0:
        raise ValueError(f"k must be positive, got {k}")
    if equal_size and n % k:
        raise ValueError(f"cannot split {n} samples into {k} parts of equal size")
    parts = _lpt(weights, k, n // k if equal_size else None)
    return [sorted(p) for p in _refine(weights, parts, equal_size)]


def balance_across_ranks(seq_lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """Per-rank sample indices: equal counts, similar token totals (rank r gets parts[r])."""
    parts = partition(list(seq_lengths), world_size, equal_size=True)
    # Deterministic rank order: by smallest index, so a balanced-already batch keeps its layout.
    return sorted(parts, key=lambda p: p[0] if p else len(seq_lengths))


def inverse_permutation(parts: Sequence[Sequence[int]]) -> list[int]:
    """Where each original sample landed in the concatenation of `parts` (to restore the order)."""
    flat = [i for part in parts for i in part]
    inverse = [0] * len(flat)
    for pos, i in enumerate(flat):
        inverse[i] = pos
    return inverse


def imbalance(seq_lengths: Sequence[int], parts: Sequence[Sequence[int]]) -> float:
    """max / mean of the parts' token totals (1.0 = perfectly balanced)."""
    totals = [sum(seq_lengths[i] for i in part) for part in parts]
    mean = sum(totals) / max(len(totals), 1)
    return max(totals) / mean if mean > 0 else 1.0


def count_micro_batches(seq_lengths: Sequence[int], max_tokens: int) -> int:
    """Fewest micro-batches whose balanced split keeps each within `max_tokens` tokens.

    A sample longer than the budget gets a micro-batch of its own (it cannot be split).
    """
    if max_tokens <= 0:
        raise ValueError(f"max_token_len_per_device must be positive, got {max_tokens}")
    if not seq_lengths:
        return 0
    count = min(max(-(-sum(seq_lengths) // max_tokens), 1), len(seq_lengths))
    while count < len(seq_lengths):
        parts = partition(list(seq_lengths), count, equal_size=False)
        if all(len(p) <= 1 or sum(seq_lengths[i] for i in p) <= max_tokens for p in parts):
            break
        count += 1
    return count


def micro_batches_by_tokens(seq_lengths: Sequence[int], num_micro_batches: int) -> list[list[int]]:
    """Split sample indices into exactly `num_micro_batches` token-balanced micro-batches.

    Parts may be empty when there are fewer samples than micro-batches. Micro-batches are ordered
    by their first index and keep the samples in their original order.
    """
    parts = partition(list(seq_lengths), num_micro_batches, equal_size=False) if num_micro_batches else []
    return sorted(parts, key=lambda p: p[0] if p else len(seq_lengths))
