"""Which prompts a training batch draws, beyond the loader's plain per-epoch shuffle.

`PassRateSampler` (`data.sampler=pass_rate`): draws prompts whose groups are likely to disagree,
the only groups GRPO learns from. A prompt's pass rate p now has a Beta belief
(`PromptStats.belief`: its mean follows the policy's level as it learns, its concentration is the
prompt's recent evidence plus a prior of 2 samples). The chance that a group of n samples is mixed
is 1 - E[p^n] - E[(1-p)^n] (Beta moments: E[p^n] = B(a+n, b) / B(a, b)). A batch draws
(1 - revisit_share) of its prompts with weights chance ** SHARPNESS, without replacement
(Efraimidis-Spirakis keys), and the rest uniformly, so that solved and hopeless prompts are looked
at again. Prompts never drawn come before every prompt seen, whole batches of them, in the order the
plain shuffle's first epoch draws them (`epoch_order`): the sampler knows nothing of a prompt it has
not seen, so over a first pass through the data it draws exactly what `data.sampler=shuffle` draws,
a prompt's first group is never traded for another group of a prompt seen, and a run with the
sampler parts from the same run without it only where the statistics decide. Prompts whose scores
have not come back yet (`PromptStats.pending`) are not drawn while others are left.

`SourceMix` (`data.train_weights`): each batch takes its prompts from the entries of
`data.train_files` in proportion to the weights (a slot goes to the entry furthest behind its share,
so the shares after any number of batches are within one prompt of the weights). Within an entry,
rows come in a seeded shuffled order, reshuffled each time the entry is used up, or by pass rate.

Both are deterministic for a seed: a batch's draw depends on the seed, the batch's number and the
state the loader saves (and the statistics the checkpoint saves).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import Any

import torch

from vlrl.data.prompt_stats import PromptStats

SAMPLERS = ("shuffle", "pass_rate")
# A prompt's weight in a batch's draw is its chance of a mixed group to this power. Late in a run
# most prompts are solved and each keeps a small chance (its belief is never certain): drawn in
# proportion to the chance itself (power 1), 2,000 prompts at 0.01 outweigh 100 at 0.5, and 4 in 5
# draws are all-correct groups (measured: docs/data.md, "Choosing prompts"). Squared, the likely
# mixed prompts get most draws; `data.revisit_share` still looks at the rest.
SHARPNESS = 2.0


def _generator(*parts: int) -> torch.Generator:
    """A generator seeded by a tuple of ints (seed, purpose, batch number, ...)."""
    seed = 0
    for part in parts:
        seed = (seed * 1_000_003 + int(part)) % (2**63 - 1)
    return torch.Generator().manual_seed(seed)


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    """Dataset indices [n] in the plain loader's order for `epoch`: a permutation seeded by
    `seed + epoch`, or the file order without `shuffle`."""
    if not shuffle:
        return torch.arange(n)
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))


def mixed_group_chance(mean: torch.Tensor, concentration: torch.Tensor, n: int) -> torch.Tensor:
    """P(a group of `n` samples has both passes and fails) when each prompt's pass rate is
    Beta(mean * concentration, (1 - mean) * concentration). [P] float64"""
    mean = mean.double().clamp(0.001, 0.999)
    a, b = mean * concentration.double(), (1 - mean) * concentration.double()

    def log_beta(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.lgamma(x) + torch.lgamma(y) - torch.lgamma(x + y)

    all_pass = torch.exp(log_beta(a + n, b) - log_beta(a, b))
    all_fail = torch.exp(log_beta(a, b + n) - log_beta(a, b))
    return (1 - all_pass - all_fail).clamp(min=0.0)


def first_pass_note(prompts: int, batch: int, steps: int, filtering: bool) -> str:
    """What `data.sampler=pass_rate` can do in a run of `steps` steps of `batch` prompts over
    `prompts` prompts: it draws the shuffle's batches until it has drawn every prompt once (module
    docstring), so its own choices start at step `prompts // batch + 1`, or sooner with online
    filtering, whose extra rounds draw more prompts a step."""
    first_pass, start = math.ceil(prompts / batch), prompts // batch + 1
    fewer = ", fewer with online filtering's extra rounds" if filtering else ""
    head = (
        f"data.sampler=pass_rate: until every prompt was drawn once ({first_pass} steps of {batch} of "
        f"the {prompts} prompts{fewer}) the batches are the shuffle's, as a prompt's pass rate is unknown "
        "until it is drawn"
    )
    if start <= steps:
        return f"{head}; the sampler's own choices start at step {start} of {steps}"
    return (
        f"{head}, and this run has {steps} steps: the sampler may choose nothing. It pays where prompts "
        "come back within a run (docs/data.md, 'Choosing prompts')"
    )


class PassRateSampler:
    """Ranks candidate rows for a batch by their chance of a mixed group (see the module docstring).
    `n`: samples per prompt (`worker.rollout.n`); `revisit_share`: `data.revisit_share`."""

    def __init__(
        self,
        stats: PromptStats,
        n: int,
        seed: int,
        revisit_share: float,
        first_pass: torch.Tensor | None = None,
    ) -> None:
        self.stats, self.n, self.seed, self.revisit_share = stats, n, seed, revisit_share
        # `first_pass`: dataset indices [P] in the order never-drawn rows are drawn (default: the
        # plain shuffle's first epoch for `seed`); kept as each row's place in it. [P] int64
        order = first_pass if first_pass is not None else epoch_order(len(stats.attempts), seed, 0)
        self.first_pass_rank = torch.empty(len(order), dtype=torch.long)
        self.first_pass_rank[order] = torch.arange(len(order))

    def rank(self, rows: torch.Tensor, size: int, draw: int, salt: int = 0) -> list[int]:
        """`rows` (dataset indices [R]) ordered for a batch of `size`: the first `size` are drawn, the
        rest are spares (a row that fails to load is replaced by the next) in their key order."""
        stats, generator = self.stats, _generator(self.seed, 7, draw, salt)
        chance = mixed_group_chance(*stats.belief(rows), self.n)
        random = torch.rand(len(rows), generator=generator, dtype=torch.float64)
        weighted_keys = random.log() / (chance**SHARPNESS).clamp(min=1e-12)  # <= 0
        uniform_keys = torch.rand(len(rows), generator=generator, dtype=torch.float64)
        # Rows never drawn come first, in the plain shuffle's first-epoch order (the sampler knows
        # nothing of them; see the module docstring). Pending rows (drawn, scores not back) rank last.
        pending = stats.pending[rows]
        never_drawn = (stats.attempts[rows] == 0) & ~pending
        fresh = never_drawn.nonzero().squeeze(1)  # [F] positions in `rows`
        fresh = fresh[torch.argsort(self.first_pass_rank[rows[fresh]])]
        seen = (~never_drawn).nonzero().squeeze(1)
        weighted_keys[pending] = -float("inf")
        seen_by_weight = seen[torch.argsort(weighted_keys[seen], descending=True, stable=True)]
        # The batch's slots left after the never-drawn rows: (1 - revisit_share) by weight, the
        # rest uniformly among the seen rows not chosen by weight.
        n_fresh = min(len(fresh), size)
        n_seen = size - n_fresh
        n_revisit = min(round(self.revisit_share * n_seen), len(seen))
        chosen = seen_by_weight[: min(n_seen - n_revisit, len(seen))]
        rest = torch.zeros(len(rows), dtype=torch.bool)
        rest[seen] = True
        rest[chosen] = False
        uniform_keys[~rest] = -1.0
        uniform_keys[pending & rest] = -0.5
        by_uniform = torch.argsort(uniform_keys, descending=True, stable=True)
        revisits = by_uniform[: min(n_revisit, int(rest.sum()))]
        picked = torch.cat([fresh[:n_fresh], chosen, revisits])
        spare = torch.ones(len(rows), dtype=torch.bool)
        spare[picked] = False
        order = torch.cat([picked, fresh[n_fresh:], seen_by_weight[spare[seen_by_weight]]])
        return rows[order].tolist()


class SourceMix:
    """Batches drawn from `entries` (dataset indices of each `data.train_files` entry) by `weights`;
    within an entry by `within` (a `PassRateSampler`) or a shuffled cycle (None)."""

    def __init__(
        self, entries: list[torch.Tensor], weights: list[float], seed: int, within: PassRateSampler | None
    ) -> None:
        total = sum(weights)
        self.entries, self.shares, self.seed, self.within = (
            entries,
            [w / total for w in weights],
            seed,
            within,
        )
        self.given = [0] * len(entries)  # prompts drawn from each entry so far
        self.cycle = [0] * len(entries)  # shuffled passes through each entry begun
        self.position = [0] * len(entries)  # rows taken in the current pass

    def counts(self, size: int) -> list[int]:
        """Prompts from each entry in the next batch of `size`: each slot to the entry furthest
        below its share of all slots so far."""
        given, counts = list(self.given), [0] * len(self.entries)
        for _ in range(size):
            total = sum(given) + 1
            entry = max(range(len(given)), key=lambda e: (self.shares[e] * total - given[e], -e))
            given[entry] += 1
            counts[entry] += 1
        return counts

    def rank(self, size: int, draw: int) -> list[int]:
        """The next batch's rows, then spares; advances the state (the loader saves it)."""
        picked: list[int] = []
        spares: list[int] = []
        for entry, count in enumerate(self.counts(size)):
            if count == 0:
                continue
            rows = (
                self._next_rows(entry, count)
                if self.within is None
                else self.within.rank(self.entries[entry], count, draw, salt=entry)
            )
            picked += rows[:count]
            spares += rows[count:]
            self.given[entry] += count
        return picked + spares

    def _next_rows(self, entry: int, count: int) -> list[int]:
        """`count` rows of `entry` in its shuffled order (a new order for each pass through it),
        then up to as many spares; the state advances by `count`."""
        length = len(self.entries[entry])
        stream = self._stream(entry, self.cycle[entry], self.position[entry])
        out = list(itertools.islice(stream, count + min(count, length)))
        position = self.position[entry] + count
        self.cycle[entry] += position // length
        self.position[entry] = position % length
        return out

    def _stream(self, entry: int, cycle: int, position: int) -> Iterator[int]:
        rows = self.entries[entry]
        while True:
            order = torch.randperm(len(rows), generator=_generator(self.seed, 11, entry, cycle))
            yield from rows[order][position:].tolist()
            cycle, position = cycle + 1, 0

    def state_dict(self) -> dict[str, Any]:
        return {"given": list(self.given), "cycle": list(self.cycle), "position": list(self.position)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("given", "cycle", "position"):
            if len(state[key]) != len(self.entries):
                raise ValueError(
                    f"cannot resume: the checkpoint's data mixing has {len(state[key])} entries but "
                    f"data.train_files has {len(self.entries)}"
                )
        self.given, self.cycle, self.position = (
            list(state["given"]),
            list(state["cycle"]),
            list(state["position"]),
        )


class Curriculum:
    """Easy to hard (`data.curriculum`): rows ranked by `difficulty` (low: easy; [N] float, or None
    to rank by pass rate, high first, from `stats`); batch number `draw` draws from the easiest
    `pool_share(draw)` of them: `start` of the data at the first batch, growing linearly to all of
    it at batch `ramp_batches`. Within the pool, by `within` (pass rate) or uniformly."""

    def __init__(
        self,
        difficulty: torch.Tensor | None,
        stats: PromptStats,
        start: float,
        ramp_batches: int,
        seed: int,
        within: PassRateSampler | None,
    ) -> None:
        self.difficulty, self.stats, self.start, self.ramp_batches = difficulty, stats, start, ramp_batches
        self.seed, self.within = seed, within

    def pool_share(self, draw: int) -> float:
        progress = min(1.0, draw / max(self.ramp_batches, 1))
        return self.start + (1.0 - self.start) * progress

    def rank(self, size: int, draw: int) -> list[int]:
        """The easiest rows for batch `draw` (ties broken at random), drawn, then spares (the rest
        of the pool, then the rows beyond it, easiest first)."""
        generator = _generator(self.seed, 13, draw)
        hardness = self._hardness()
        n = len(hardness)
        tie_break = torch.rand(n, generator=generator, dtype=torch.float64)
        shuffled = torch.argsort(tie_break)
        easiest = shuffled[torch.argsort(hardness[shuffled], stable=True)]  # [N] by hardness, ties at random
        pool = easiest[: max(size, math.ceil(self.pool_share(draw) * n))]
        if self.within is not None:
            ranked = self.within.rank(pool, size, draw)
        else:
            ranked = pool[torch.randperm(len(pool), generator=generator)].tolist()
        return ranked + easiest[len(pool) :].tolist()

    def _hardness(self) -> torch.Tensor:
        """[N] low: easy. By pass rate: minus each prompt's offset from the level (logits; a prompt
        never seen sits at 0, the average), so a prompt is ranked against the policy of the step it
        was scored at: one that passed 3 of 8 while most groups failed is easier than one that
        passed 5 of 8 while most were solved, which its lifetime pass rate would rank the other way."""
        if self.difficulty is not None:
            return self.difficulty
        return -self.stats.offset.double()
