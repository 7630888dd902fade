"""The driver's generation rounds (EasyR1's `mini_rollout_batch_size` meaning), on the driver alone.

`BatchFiller` gets rounds from a function that returns one response per sample whose reward
part `acc` is chosen per prompt, so the rounds, filtering and cut-off can be checked exactly; the
engines themselves are covered by tests/rollout and the whole loop by tests/trainer/test_e2e.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vlrl.batch.samples import StepSamples
from vlrl.trainer.ppo_trainer import planned_steps
from vlrl.trainer.rounds import BatchFiller


def _config(rollout: int, mini: int | None, filtering: bool, n: int = 2, key: str = "acc") -> SimpleNamespace:
    return SimpleNamespace(
        data=SimpleNamespace(rollout_batch_size=rollout, mini_rollout_batch_size=mini),
        algorithm=SimpleNamespace(
            online_filtering=filtering,
            filter_key=key,
            filter_low=0.01,
            filter_high=0.99,
            adv_estimator="grpo",
        ),
        trainer=SimpleNamespace(max_try_make_batch=20),
        worker=SimpleNamespace(
            rollout=SimpleNamespace(n=n, seed=1, tensor_parallel_size=1),
            reward=SimpleNamespace(streaming=False),  # the stubs below generate, then score
        ),
        world_size=1,
    )


class _Prompts:
    """A loader of prompt ids 0, 1, 2, ... in batches of `size` (epochs repeat the ids)."""

    def __init__(self, size: int, dataset: int = 1000) -> None:
        self.size, self.dataset, self.next_id, self.batches = size, dataset, 0, 0

    def next_train_batch(self) -> list[int]:
        self.batches += 1
        ids = [(self.next_id + i) % self.dataset for i in range(self.size)]
        self.next_id += self.size
        return ids


def _fill(config: SimpleNamespace, solved: set[int], prompts: _Prompts | None = None) -> tuple:
    """`BatchFiller.fill` with rounds whose samples score acc = 1 if their prompt is in `solved`, else
    alternating 0, 1 (a group with both is kept by the filter), and the same as `overall` and
    `accuracy`; the loader `prompts` counts batches."""
    n = config.worker.rollout.n
    prompts = prompts or _Prompts(config.data.mini_rollout_batch_size or config.data.rollout_batch_size)

    def draw_round(round_: int) -> tuple[list[int], StepSamples, dict[str, float]]:
        ids = prompts.next_train_batch()
        rows = len(ids) * n
        batch = StepSamples(
            responses=torch.ones(rows, 1, dtype=torch.long), response_mask=torch.ones(rows, 1, dtype=torch.long),
            group_ids=torch.tensor([p for p in ids for _ in range(n)]), prompt_lengths=torch.full((rows,), 2),
            turn_lengths=torch.ones(rows, dtype=torch.long), prompts=[str(p) for p in ids for _ in range(n)],
            ground_truths=[""] * rows, extras=[{} for _ in range(rows)], held=[None] * rows,
            reward_parts=[dict.fromkeys(("overall", "accuracy", "acc"), 1.0 if p in solved else float(i % 2))
                          for i, p in enumerate(p for p in ids for _ in range(n))],
        )  # fmt: skip
        return ids, batch, {"reward/overall": float(round_)}

    filler = BatchFiller(
        config.data.rollout_batch_size, n, config.algorithm, config.trainer.max_try_make_batch, 0
    )
    return filler.fill(draw_round)


def test_without_mini_one_round_of_the_whole_batch() -> None:
    prompts = _Prompts(8)
    batch, baselines, metrics = _fill(_config(rollout=8, mini=None, filtering=False), set(), prompts)
    assert len(batch) == 16 and prompts.batches == 1 and baselines is None
    assert metrics.pop("reward/overall") == 0.0  # the first round's metrics
    # every group has a 0 and a 1: all mixed, 2 samples generated per mixed group
    assert metrics == {"groups/generated_samples": 16.0, "groups/mixed_share": 1.0, "groups/all_correct_share": 0.0, "groups/all_wrong_share": 0.0,
                       "groups/samples_per_mixed_group": 2.0, "groups/samples_per_kept_group": 2.0}  # fmt: skip


def test_mini_batches_fill_the_step_without_filtering() -> None:
    prompts = _Prompts(2)
    batch, _, metrics = _fill(_config(rollout=8, mini=2, filtering=False), set(), prompts)
    assert prompts.batches == 4 and len(batch) == 16 and metrics["reward/overall"] == 0.0
    assert sorted({int(p) for p in batch.prompts}) == list(range(8))
    assert len(set(batch.group_ids.tolist())) == 8


def test_online_filtering_draws_mini_batches_until_full_and_cuts_the_excess() -> None:
    # prompts 0..5 are solved (all-equal rewards, dropped); from 6 on every group is kept
    prompts = _Prompts(4)
    batch, _, metrics = _fill(_config(rollout=4, mini=4, filtering=True), set(range(6)), prompts)
    # round 1: prompts 0-3 all dropped; round 2: 4,5 dropped, 6,7 kept; round 3: 8,9 fill the batch, 10,11 cut
    assert prompts.batches == 3 and metrics["filter/tries"] == 3.0 and metrics["reward/overall"] == 0.0
    assert [int(p) for p in batch.prompts[::2]] == [6, 7, 8, 9]
    # 12 groups generated (the cut ones count: they were paid for): 0-5 all correct, 6-11 mixed
    assert metrics["groups/mixed_share"] == 0.5 and metrics["groups/all_correct_share"] == 0.5
    assert metrics["groups/all_wrong_share"] == 0.0 and metrics["groups/samples_per_mixed_group"] == 4.0
    assert metrics["groups/generated_samples"] == 24.0
    assert metrics["groups/samples_per_kept_group"] == 6.0  # 24 samples for the 4 groups kept


def test_a_filter_key_the_reward_does_not_return_fails_at_once() -> None:
    with pytest.raises(
        ValueError, match=r"filter_key='accuracy_normalized'.*returned \['acc', 'accuracy', 'overall'\]"
    ):
        _fill(_config(rollout=4, mini=None, filtering=True, key="accuracy_normalized"), set())


def test_too_many_rounds_is_an_error() -> None:
    config = _config(rollout=4, mini=2, filtering=True)
    config.trainer.max_try_make_batch = 3
    prompts = _Prompts(2)
    with pytest.raises(RuntimeError, match="kept 0 of 4 groups after 3 generation rounds"):
        _fill(config, set(range(1000)), prompts)
    assert prompts.batches == 3


@pytest.mark.parametrize(
    "mini, max_steps, expected",
    [(None, None, 12), (2, None, 12), (None, 50, 50), (None, 2, 2)],
)
def test_total_steps_as_easyr1_counts_them(mini: int | None, max_steps: int | None, expected: int) -> None:
    """32 prompts, 8 per step, 3 epochs; max_steps wins even past the epochs (the data repeats)."""
    config = _config(rollout=8, mini=mini, filtering=False)
    config.trainer.max_steps, config.trainer.total_epochs = max_steps, 3
    assert planned_steps(config, [None] * (32 // (mini or 8))) == expected
