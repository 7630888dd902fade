"""The pass-rate sampler against a simulated policy that learns: samples generated per mixed group.

    .venv/bin/python benchmarks/bench_sampler_sim.py [--prompts 2048] [--steps 150] [--seeds 0 1 2]

No model: each prompt i has a difficulty d_i ~ N(0, SPREAD) and the policy a level that rises
linearly from START to END over the first RAMP share of the steps (logits); a sample of prompt i at
step t passes with probability sigmoid(level_t - d_i). (These settings give online filtering
about the price it pays on the reasoning quickstart: 31 samples per mixed group here, 40 there.) A step draws 16 prompts x 8 samples through
`vlrl.data.samplers` and records them in `PromptStats` as the trainer does; with filtering (DAPO's)
it draws further rounds until 16 mixed groups are kept (at most MAX_ROUNDS, vlrl's default
`trainer.max_try_make_batch`; a real run stops at a batch left unfilled, the simulation counts them
and goes on). The table: samples generated per mixed group over the run and over its last third,
the share of mixed groups, per mode, averaged over the seeds, the batches left unfilled (summed),
and the level's pass rate at the end (`prompts/level_pass_rate`; the truth for a median prompt is
sigmoid(END) = 0.993). A mixed group is the only kind GRPO learns from, so this is the price
of what an update learns from; the simulated policy does not learn from the choice (the real runs
are `bench_prompt_choice.py`), so this measures what the sampler is built to do, in seconds.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from vlrl.data.prompt_stats import PromptStats
from vlrl.data.samplers import PassRateSampler

BATCH, N_SAMPLES, MAX_ROUNDS = 16, 8, 20  # trainer.max_try_make_batch
SPREAD, START, END, RAMP = 1.5, -1.5, 5.0, 0.7


class Run:
    """One simulated run of a mode: draws, outcomes, statistics."""

    def __init__(self, prompts: int, steps: int, seed: int, sampler: bool, filtering: bool) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.difficulty = torch.randn(prompts, generator=self.generator) * SPREAD
        self.stats = PromptStats(range(prompts))
        self.picker = PassRateSampler(self.stats, N_SAMPLES, seed, revisit_share=0.1) if sampler else None
        self.steps, self.filtering, self.draw = steps, filtering, 0
        self.order: list[int] = []
        self.samples: list[int] = []  # per step
        self.mixed: list[int] = []  # per step
        self.unfilled = 0  # steps whose batch MAX_ROUNDS rounds did not fill (the trainer stops there)

    def level(self, step: int) -> float:
        return START + (END - START) * min(1.0, step / (RAMP * self.steps))

    def next_prompts(self) -> list[int]:
        if self.picker is not None:
            chosen = self.picker.rank(torch.arange(len(self.difficulty)), BATCH, self.draw)[:BATCH]
        else:  # the loader's per-epoch shuffle
            if len(self.order) < BATCH:
                self.order += torch.randperm(len(self.difficulty), generator=self.generator).tolist()
            chosen, self.order = self.order[:BATCH], self.order[BATCH:]
        self.draw += 1
        self.stats.mark_pending(chosen)
        return chosen

    def round(self, step: int) -> int:
        """One generation round: returns its mixed groups."""
        prompts = self.next_prompts()
        chance = torch.sigmoid(self.level(step) - self.difficulty[prompts])  # [16]
        passes = torch.rand(len(prompts), N_SAMPLES, generator=self.generator) < chance[:, None]
        uids = [p for p in prompts for _ in range(N_SAMPLES)]
        self.stats.record(uids, [{"overall": float(v)} for v in passes.flatten()], step)
        counts = passes.sum(1)
        return int(((counts > 0) & (counts < N_SAMPLES)).sum())

    def run(self) -> Run:
        for step in range(1, self.steps + 1):
            rounds, mixed = 0, 0
            while True:
                mixed += self.round(step)
                rounds += 1
                if not self.filtering or mixed >= BATCH:
                    break
                if rounds == MAX_ROUNDS:
                    self.unfilled += 1
                    break
            self.samples.append(rounds * BATCH * N_SAMPLES)
            self.mixed.append(mixed)
        return self


def price(run: Run, first: int = 0) -> float:
    return sum(run.samples[first:]) / max(sum(run.mixed[first:]), 1)


MODES = {
    "shuffle": (False, False),
    "filter": (False, True),
    "pass_rate": (True, False),
    "pass_rate_filter": (True, True),
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    print(f"{args.prompts} prompts, {args.steps} steps, level {START} -> {END} over the first {RAMP:.0%}")
    print(
        f"{'mode':18} {'samples/mixed group':>20} {'last third':>11} {'mixed share':>12} {'unfilled':>9} {'level':>6}"
    )
    for mode, (sampler, filtering) in MODES.items():
        runs = [Run(args.prompts, args.steps, s, sampler, filtering).run() for s in args.seeds]
        whole = statistics.fmean(price(r) for r in runs)
        late = statistics.fmean(price(r, 2 * args.steps // 3) for r in runs)
        level = statistics.fmean(
            float(torch.sigmoid(getattr(r.stats, "level", torch.tensor(float("nan"))))) for r in runs
        )
        share = statistics.fmean(sum(r.mixed) * BATCH * N_SAMPLES / (BATCH * sum(r.samples)) for r in runs)
        unfilled = sum(r.unfilled for r in runs)
        print(f"{mode:18} {whole:20.1f} {late:11.1f} {share:12.2f} {unfilled:9d} {level:6.3f}")


if __name__ == "__main__":
    main()
