"""Choosing prompts: per-prompt statistics, the pass-rate sampler, weighted mixing, and the loader
resuming all of them exactly."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from test_loader import FakeDataset

from vlrl.config.checks import _check_prompt_choice
from vlrl.config.schema import DataConfig
from vlrl.data import StatefulPromptLoader
from vlrl.data.prompt_stats import PromptStats
from vlrl.data.samplers import (
    SHARPNESS,
    Curriculum,
    PassRateSampler,
    SourceMix,
    first_pass_note,
    mixed_group_chance,
)


def _record(stats: PromptStats, uid: int, accuracies: list[float], step: int = 1) -> None:
    parts = [{"overall": 0.5 * a + 0.5, "accuracy": a} for a in accuracies]
    stats.record([uid] * len(parts), parts, step)


def test_statistics_by_hand() -> None:
    stats = PromptStats([10, 30, 20])  # uids by dataset index (not sorted)
    stats.mark_pending([30, 20])
    _record(stats, 30, [1, 0, 0, 0], step=3)
    stats.record([20, 20], [{"overall": 0.25}, {"overall": 0.75}], 3)  # no accuracy: overall is the pass
    _record(stats, 30, [1, 1, 1, 1], step=5)
    assert stats.attempts.tolist() == [0, 8, 2]
    assert stats.reward_sum.tolist() == [0.0, 0.5 * 5 + 0.5 * 8, 1.0]
    assert stats.pass_sum.tolist() == [0.0, 5.0, 1.0]
    assert stats.last_step.tolist() == [-1, 5, 3] and stats.pending.tolist() == [False, False, False]
    # each group weighs as much as all earlier ones: uid 30's evidence 4 -> 4/2 + 4
    assert stats.evidence.tolist() == [0.0, 6.0, 2.0]
    # the level, by hand: round 1 (uid 30, 1 of 4 at level 0): score 1 - 2, information 4/4: -1;
    # round 2 (uid 20, 1 of 2, expected s(-1) = 0.269 each): +0.462 / 0.393 = +1.18, capped at +1;
    # round 3 (uid 30, 4 of 4, expected 0.484 each): +2.06 / 0.999, capped: level 1
    s, logit = lambda x: 1 / (1 + math.exp(-x)), lambda p: math.log(p / (1 - p))  # noqa: E731
    assert stats.level.item() == 1.0
    # uid 30: prior s(-1) weight 2, then 1 of 4 -> posterior 1; at level 0 its belief is s(-1 + o1),
    # weight 4/2 + 2, then 4 of 4 -> posterior 2
    o1 = logit((2 * s(-1) + 1) / 6) + 1
    o30 = logit((4 * s(1 + o1) + 4) / 8) - 1
    assert stats.offset.tolist() == pytest.approx([0.0, o30, 0.0], abs=1e-6)  # uid 20: (2 * 0.5 + 1) / 4
    mean, concentration = stats.belief(torch.tensor([0, 1]))  # uid 10, never seen: the level's
    assert mean.tolist() == pytest.approx([s(1), s(1 + o30)]) and concentration.tolist() == [2.0, 8.0]
    metrics = stats.metrics()  # pass rates 5/8 and 1/2: one in the bin from 0.6, one from 0.5
    hist = {key: metrics.pop(key) for key in list(metrics) if key.startswith("prompts/pass_rate_hist/")}
    assert metrics == {
        "prompts/seen_share": 2 / 3,
        "prompts/pass_rate_mean": (5 / 8 + 1 / 2) / 2,
        "prompts/level_pass_rate": pytest.approx(s(1)),
    }
    assert hist == {f"prompts/pass_rate_hist/{b / 10:.1f}": 0.5 if b in (5, 6) else 0.0 for b in range(10)}
    stats.record([10, 10], [{"overall": -1.0}, {"overall": -1.0}], 6)  # not pass rates: beliefs stay finite
    assert stats.offset.isfinite().all() and stats.level.isfinite() and stats.evidence[0] == 2.0
    with pytest.raises(KeyError, match="uid 40"):
        stats.record([40], [{"overall": 1.0}], 1)
    assert "'accuracy' reward is 2" in stats.pass_values_in_unit_range([{"overall": 1.0, "accuracy": 2.0}])


def test_mixed_group_chance_is_the_beta_moments() -> None:
    # a flat prior (mean 0.5, weight 2 = Beta(1, 1)): E[p^n] = 1 / (n + 1)
    flat = mixed_group_chance(torch.tensor([0.5]), torch.tensor([2.0]), 8)
    assert flat.item() == pytest.approx(1 - 2 / 9)
    # Beta(3, 1), n = 2: E[p^2] = 3*4/(4*5) = 3/5, E[(1-p)^2] = 1*2/(4*5) = 1/10
    seen = mixed_group_chance(torch.tensor([0.75]), torch.tensor([4.0]), 2)
    assert seen.item() == pytest.approx(1 - 3 / 5 - 1 / 10)
    solved = mixed_group_chance(torch.tensor([17 / 18]), torch.tensor([18.0]), 8)  # Beta(17, 1)
    assert solved.item() == pytest.approx(1 - 17 / 25 - 0.0, abs=1e-6)  # E[p^8] = 17/25; E[(1-p)^8] ~ 1e-7
    assert solved.item() < 0.4 < flat.item()


def _stats_with_kinds() -> PromptStats:
    """30 prompts: 0-9 solved, 10-19 hopeless, 20-29 half right, each seen twice."""
    stats = PromptStats(range(30))
    for uid, _ in itertools.product(range(30), range(2)):
        _record(stats, uid, [1.0] * 8 if uid < 10 else [0.0] * 8 if uid < 20 else [1.0, 0.0] * 4)
    return stats


def test_the_sampler_draws_prompts_by_their_chance_of_a_mixed_group_and_revisits_the_rest() -> None:
    stats = _stats_with_kinds()
    rows = torch.arange(30)
    # one prompt per batch: drawn with probability proportional to its chance of a mixed group,
    # squared (SHARPNESS)
    chance = mixed_group_chance(*stats.belief(rows), 8) ** SHARPNESS
    expected_mixed = float(chance[20:].sum() / chance.sum())
    firsts = [
        PassRateSampler(stats, 8, seed=1, revisit_share=0.0).rank(rows, 1, draw)[0] for draw in range(3000)
    ]
    assert sum(r >= 20 for r in firsts) / 3000 == pytest.approx(expected_mixed, abs=0.03)
    assert expected_mixed > 0.5 and chance[20] > 2.5 * chance[0]  # 10 of 30 prompts, over half the draws
    ranked = [PassRateSampler(stats, 8, seed=1, revisit_share=0.0).rank(rows, 10, draw) for draw in range(20)]
    assert all(sorted(r) == list(range(30)) for r in ranked)  # every row once: drawn, then spares
    assert PassRateSampler(stats, 8, seed=1, revisit_share=0.0).rank(rows, 10, 3) == ranked[3]  # (seed, draw)
    assert PassRateSampler(stats, 8, seed=2, revisit_share=0.0).rank(rows, 10, 3) != ranked[3]
    # revisit_share=1: the whole batch uniform, so the mixed third gets a third of the draws
    uniform = [PassRateSampler(stats, 8, seed=1, revisit_share=1.0).rank(rows, 1, d)[0] for d in range(3000)]
    assert sum(r >= 20 for r in uniform) / 3000 == pytest.approx(1 / 3, abs=0.03)
    stats.mark_pending(list(range(20, 30)))  # drawn, not scored yet: every other row comes first
    assert all(r < 20 for r in PassRateSampler(stats, 8, seed=1, revisit_share=0.0).rank(rows, 10, 0)[:20])


def test_a_prompt_mixed_while_the_policy_was_weak_is_expected_solved_once_it_is_strong() -> None:
    """Prompts 0-9 scored 4 of 8 at the start; the policy then solves 10-19 three times over, and
    scores 20-29 4 of 8. The same recent evidence (4 of 8) means a harder prompt now: 20-29 are the
    likely mixed groups, 0-9 likely solved, and the sampler draws accordingly."""
    stats = PromptStats(range(30))

    def round_(uids: range, passes: int, step: int) -> None:
        parts = [{"overall": float(i < passes)} for _ in uids for i in range(8)]
        stats.record([u for u in uids for _ in range(8)], parts, step)

    levels = []
    for uids, passes, step in [
        (range(10), 4, 1),
        *[(range(10, 20), 8, s) for s in (2, 3, 4)],
        (range(20, 30), 4, 5),
    ]:
        round_(uids, passes, step)
        levels.append(stats.level.item())
    # 40 of 80 at level 0 as expected: no move; three rounds of all passes: +1 each (capped); then
    # prompts never seen (offset 0, expected 0.95 at level 3) pass half the time: -1 (capped)
    assert levels == [0.0, 1.0, 2.0, 3.0, 2.0]
    mean, _ = stats.belief(torch.arange(30))
    assert (mean[:10] > 0.85).all() and (mean[20:] < 0.6).all()
    chance = mixed_group_chance(*stats.belief(torch.arange(30)), 8)
    assert chance[20:].min() > 0.9 and chance[:10].max() < 0.6
    sampler = PassRateSampler(stats, 8, seed=1, revisit_share=0.0)
    drawn = [r for d in range(300) for r in sampler.rank(torch.arange(30), 5, d)[:5]]
    assert sum(r >= 20 for r in drawn) > 1.4 * sum(r < 10 for r in drawn)


def test_prompts_never_drawn_come_before_every_prompt_seen() -> None:
    """0-9 gave mixed groups (the highest chance there is), 10-14 are drawn and not scored yet,
    15-39 were never drawn: they fill whole batches, revisits included, in the first-pass order."""
    stats = PromptStats(range(40))
    for uid in range(10):
        _record(stats, uid, [1.0, 0.0] * 4)
    stats.mark_pending(list(range(10, 15)))
    rows, fresh = torch.arange(40), list(range(15, 40))
    first_pass = torch.tensor([*range(39, 14, -1), *range(15)])  # 39, 38, ..., 15, then the rest
    sampler = PassRateSampler(stats, 8, seed=1, revisit_share=0.5, first_pass=first_pass)
    for draw in range(20):  # the draw's random keys play no part while never-drawn rows are left
        ranked = sampler.rank(rows, 16, draw)
        assert ranked[:25] == fresh[::-1]
        assert set(ranked[25:35]) == set(range(10)) and set(ranked[35:]) == set(range(10, 15))
    for uid in range(15, 37):  # 3 never drawn are left: they come first, then the seen
        _record(stats, uid, [1.0] * 8)
    ranked = sampler.rank(rows, 16, 0)
    assert ranked[:3] == [39, 38, 37] and set(ranked[3:16]) <= set(range(10)) | set(range(15, 37))
    # with revisit_share=1 the 13 slots left are drawn uniformly from the 32 seen rows not pending
    uniform = PassRateSampler(stats, 8, seed=1, revisit_share=1.0, first_pass=first_pass)
    solved = [sum(r >= 15 for r in uniform.rank(rows, 16, d)[3:16]) for d in range(300)]
    assert sum(solved) / 300 == pytest.approx(13 * 22 / 32, abs=0.5)
    assert all(not set(uniform.rank(rows, 16, d)[3:16]) & set(range(10, 15)) for d in range(20))


def test_the_sampler_draws_what_the_shuffle_draws_until_it_has_seen_every_prompt() -> None:
    """A first pass with `data.sampler=pass_rate` is the plain shuffle's first epoch, batch for
    batch (so the two runs part only where the statistics decide); the second pass is not."""
    shuffled = StatefulPromptLoader(FakeDataset(48), 6, seed=3)
    stats = PromptStats(range(48))
    sampler = PassRateSampler(stats, 4, seed=3, revisit_share=0.25)
    by_pass_rate = StatefulPromptLoader(FakeDataset(48), 6, seed=3, picker=sampler, stats=stats)
    for epoch in range(2):
        plain, chosen = _uids_scored(shuffled, None), _uids_scored(by_pass_rate, stats)
        assert (plain == chosen) == (epoch == 0)
    assert sorted(itertools.chain(*chosen)) != list(range(48))  # the second pass chose by pass rate


@pytest.mark.parametrize("prompts", [48, 50])
def test_the_start_up_note_names_the_first_step_the_sampler_chooses(prompts: int) -> None:
    """The start-up line's step is the first batch holding a prompt drawn before (with 50 prompts
    in batches of 6, the 9th batch is 2 never drawn and 4 chosen); a shorter run is told the sampler
    may choose nothing."""
    stats = PromptStats(range(prompts))
    sampler = PassRateSampler(stats, 4, seed=3, revisit_share=0.25)
    loader = StatefulPromptLoader(FakeDataset(prompts), 6, seed=3, picker=sampler, stats=stats)
    batches = [*_uids_scored(loader, stats), *_uids_scored(loader, stats)]
    seen_before = [set(itertools.chain(*batches[:k])) for k in range(len(batches))]
    step = next(k + 1 for k, uids in enumerate(batches) if seen_before[k] & set(uids))
    assert f"own choices start at step {step} of 20" in first_pass_note(prompts, 6, 20, filtering=False)
    assert "may choose nothing" in first_pass_note(prompts, 6, step - 1, filtering=False)


def _uids_scored(loader: StatefulPromptLoader, stats: PromptStats | None) -> list[list[int]]:
    """One epoch's batches; with `stats`, each batch scored before the next is drawn (prompt u
    solved u % 4 of 4 times), as the trainer does."""
    out = []
    for batch in loader:
        if stats is not None:
            for uid in batch.uids:
                _record(stats, uid, [float(k < uid % 4) for k in range(4)])
        out.append(batch.uids)
    return out


def test_mixing_shares_stay_within_one_prompt_of_the_weights() -> None:
    entries = [torch.arange(0, 100), torch.arange(100, 107)]  # the small entry is cycled through
    mix = SourceMix(entries, [0.75, 0.25], seed=1, within=None)
    drawn = [mix.rank(16, draw)[:16] for draw in range(100)]
    for batches in range(1, 101):
        small = sum(r >= 100 for batch in drawn[:batches] for r in batch)
        assert abs(small - 0.25 * 16 * batches) <= 1
    small_rows = [r for batch in drawn for r in batch if r >= 100]
    for start in range(0, 399, 7):  # each pass through the small entry takes every row once
        assert sorted(small_rows[start : start + 7]) == list(range(100, 107))


def test_statistics_saved_before_the_level_load_with_fresh_beliefs(caplog: pytest.LogCaptureFixture) -> None:
    """A checkpoint of an earlier vlrl (per-prompt recent passes and fails, no level) resumes: the
    counts carry over, the beliefs start at the level's prior, and the log says so."""
    stats = PromptStats([5, 6])
    _record(stats, 6, [1.0, 0.0])
    old = {k: v for k, v in stats.state_dict().items() if k not in ("offset", "evidence", "level")}
    old.update(recent_pass=torch.tensor([0.0, 1.0]), recent_fail=torch.tensor([0.0, 1.0]))
    resumed = PromptStats([5, 6])
    resumed.load_state_dict(old)
    assert resumed.attempts.tolist() == [0, 2] and resumed.pass_sum.tolist() == [0.0, 1.0]
    assert resumed.level.item() == 0.0 and resumed.evidence.tolist() == [0.0, 0.0]
    assert "predate the pass-rate sampler's level model" in caplog.text


def test_a_mixed_pass_rate_loader_resumes_exactly() -> None:
    def loader(stats: PromptStats) -> StatefulPromptLoader:
        entries = [torch.arange(0, 14), torch.arange(14, 20)]
        mix = SourceMix(entries, [2.0, 1.0], seed=5, within=PassRateSampler(stats, 4, 5, 0.25))
        return StatefulPromptLoader(FakeDataset(20), 3, seed=5, picker=mix, stats=stats)

    def score(stats: PromptStats, uids: list[int], step: int) -> None:
        for uid in uids:
            _record(stats, uid, [float((uid * step + k) % 3 == 0) for k in range(4)], step)

    def run(stats: PromptStats, ld: StatefulPromptLoader, steps: range) -> list[list[int]]:
        batches = itertools.islice(itertools.chain.from_iterable(itertools.repeat(ld)), len(steps))
        out = []
        for step, batch in zip(steps, batches):
            assert stats.pending[stats.indices(batch.uids)].all()
            score(stats, batch.uids, step)
            out.append(batch.uids)
        return out

    stats = PromptStats(range(20))
    straight = run(stats, loader(stats), range(1, 16))  # 15 batches: more than two epochs of 6
    assert all(sum(u >= 14 for u in batch) == 1 for batch in straight)  # 2 : 1 in every batch of 3
    first = PromptStats(range(20))
    ld = loader(first)
    head = run(first, ld, range(1, 9))
    saved_loader, saved_stats = ld.state_dict(), first.state_dict()
    again = PromptStats(range(20))
    again.load_state_dict(saved_stats)
    resumed = loader(again)
    resumed.load_state_dict(saved_loader)
    assert head + run(again, resumed, range(9, 16)) == straight
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), stats.state_dict().values()))


def test_the_curriculum_widens_its_pool_from_the_easiest_rows() -> None:
    stats = PromptStats(range(40))
    by_column = Curriculum(torch.arange(40.0).flip(0), stats, start=0.25, ramp_batches=4, seed=3, within=None)
    assert [by_column.pool_share(d) for d in (0, 2, 4, 9)] == [0.25, 0.625, 1.0, 1.0]
    first = by_column.rank(4, 0)
    assert len(first) == 40 and set(first[:10]) == set(range(30, 40))  # the pool: the 10 lowest values
    assert first[10:] == list(range(29, -1, -1))  # then the rest, easiest first
    assert all(r >= 15 for d in range(20) for r in Curriculum(
        torch.arange(40.0).flip(0), stats, 0.25, 4, seed=d, within=None).rank(4, 2)[:4])  # fmt: skip
    assert by_column.rank(4, 1) == by_column.rank(4, 1) and by_column.rank(4, 1) != by_column.rank(4, 3)
    # by pass rate: the prompts solved so far are the easy ones, unseen at the mean, failed last
    for uid in range(40):
        if uid % 4 == 0:
            _record(stats, uid, [1.0] * 4)
        elif uid % 4 == 1:
            _record(stats, uid, [0.0] * 4)
    by_pass = Curriculum(None, stats, start=0.25, ramp_batches=4, seed=3, within=None)
    ranked = by_pass.rank(4, 0)
    assert set(ranked[:10]) == {u for u in range(40) if u % 4 == 0}
    assert {u % 4 for u in ranked[-10:]} == {1}


def test_the_curriculum_by_pass_rate_ranks_a_prompt_against_the_policy_it_was_scored_by() -> None:
    """0-9 pass 3 of 8 at the start (the level falls); 10-19 are solved three times over (it rises
    by 3); then 20-29 pass 5 of 8, far below what the policy now does on an average prompt. By
    lifetime pass rate 20-29 (0.62) would rank easier than 0-9 (0.38); against the level they are
    the hardest."""
    stats = PromptStats(range(30))
    for uids, passes, step in [
        (range(10), 3, 1),
        *[(range(10, 20), 8, s) for s in (2, 3, 4)],
        (range(20, 30), 5, 5),
    ]:
        parts = [{"overall": float(i < passes)} for _ in uids for i in range(8)]
        stats.record([u for u in uids for _ in range(8)], parts, step)
    by_pass = Curriculum(None, stats, start=0.0, ramp_batches=4, seed=3, within=None)
    ranked = by_pass.rank(1, 0)  # a pool of one, then every other row easiest first
    assert [set(ranked[:10]), set(ranked[10:20]), set(ranked[20:])] == [
        set(range(10, 20)),
        set(range(10)),
        set(range(20, 30)),
    ]


def test_start_up_checks_name_the_keys() -> None:
    def problems(**data: object) -> list[str]:
        return _check_prompt_choice(DataConfig(train_files="a.jsonl,b.jsonl", **data))  # type: ignore[arg-type]

    assert problems(sampler="pass_rate", train_weights=[3, 1]) == []
    assert "data.sampler='by_rate' must be one of shuffle, pass_rate" in problems(sampler="by_rate")
    assert "data.revisit_share=1.5 must be in [0, 1]" in problems(revisit_share=1.5)
    [one] = problems(train_weights=[1.0])
    assert "1 weights but data.train_files has 2 entries" in one
    assert "must be >= 0 with a positive sum" in problems(train_weights=[0.0, 0.0])[0]
    assert "must be column:NAME" in problems(curriculum="level", curriculum_steps=5)[0]
    assert "needs data.curriculum_steps >= 1" in problems(curriculum="pass_rate")[0]
    assert "not combined" in problems(curriculum="column:level", curriculum_steps=5, train_weights=[1, 1])[0]
    assert problems(curriculum="column:level", curriculum_steps=5) == []
    assert (
        "data.shuffle=false asks for file order, but data.sampler=pass_rate"
        in problems(sampler="pass_rate", shuffle=False)[0]
    )
