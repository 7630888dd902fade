"""The driver's generation rounds (EasyR1's `mini_rollout_batch_size` meaning), on the driver alone.

The ranks' `generate` is replaced by a function that returns one response per sample whose reward
part `acc` is chosen per prompt, so the rounds, filtering and cut-off can be checked exactly; the
engines themselves are covered by tests/rollout and the whole loop by tests/trainer/test_e2e.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vlrl.protocol import RolloutBatch
from vlrl.trainer.metrics import PhaseTimer
from vlrl.trainer.ppo_trainer import PPOTrainer


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


def _trainer(config: SimpleNamespace, solved: set[int], parts: str = "acc") -> PPOTrainer:
    """A trainer whose generation scores prompt p's samples acc = 1 if p in solved, else alternating."""
    trainer = PPOTrainer.__new__(PPOTrainer)
    trainer.config = config
    trainer.global_step = 1
    trainer.async_rollout = None
    trainer.data = _Prompts(config.data.mini_rollout_batch_size or config.data.rollout_batch_size)
    trainer.data.pad_token_id = 0
    n = config.worker.rollout.n

    def generate(prompts: list[int], overrides: dict | None = None, round_: int = 0) -> RolloutBatch:
        rows = len(prompts) * n
        return RolloutBatch(
            input_ids=torch.ones(rows, 3, dtype=torch.long), attention_mask=torch.ones(rows, 3, dtype=torch.long),
            position_ids=torch.zeros(rows, 3, dtype=torch.long), responses=torch.ones(rows, 1, dtype=torch.long),
            response_mask=torch.ones(rows, 1, dtype=torch.long),
            group_ids=torch.tensor([p for p in prompts for _ in range(n)]), prompt_length=2,
            images=[[] for _ in range(rows)], prompts=[str(p) for p in prompts for _ in range(n)],
            ground_truths=[""] * rows, extras=[{} for _ in range(rows)],
        )  # fmt: skip

    def score(batch: RolloutBatch) -> dict[str, float]:
        ids = [int(p) for p in batch.prompts]
        batch.reward_parts = [
            {"overall": 0.0, parts: 1.0 if p in solved else float(i % 2)} for i, p in enumerate(ids)
        ]
        return {}

    trainer._generate = generate  # type: ignore[method-assign]
    trainer._score = score  # type: ignore[method-assign]
    return trainer


def test_without_mini_one_round_of_the_whole_batch() -> None:
    trainer = _trainer(_config(rollout=8, mini=None, filtering=False), solved=set())
    batch, baselines, _ = trainer._generate_scored_batch(PhaseTimer())
    assert len(batch) == 16 and trainer.data.batches == 1 and baselines is None


def test_mini_batches_fill_the_step_without_filtering() -> None:
    trainer = _trainer(_config(rollout=8, mini=2, filtering=False), solved=set())
    batch, _, _ = trainer._generate_scored_batch(PhaseTimer())
    assert trainer.data.batches == 4 and len(batch) == 16
    assert sorted({int(p) for p in batch.prompts}) == list(range(8))
    assert len(set(batch.group_ids.tolist())) == 8


def test_online_filtering_draws_mini_batches_until_full_and_cuts_the_excess() -> None:
    # prompts 0..5 are solved (all-equal rewards, dropped); from 6 on every group is kept
    trainer = _trainer(_config(rollout=4, mini=4, filtering=True), solved=set(range(6)))
    batch, _, metrics = trainer._generate_scored_batch(PhaseTimer())
    # round 1: prompts 0-3 all dropped; round 2: 4,5 dropped, 6,7 kept; round 3: 8,9 fill the batch, 10,11 cut
    assert trainer.data.batches == 3 and metrics["filter/tries"] == 3.0
    assert [int(p) for p in batch.prompts[::2]] == [6, 7, 8, 9]


def test_a_filter_key_the_reward_does_not_return_fails_at_once() -> None:
    trainer = _trainer(_config(rollout=4, mini=None, filtering=True, key="accuracy_normalized"), solved=set())
    with pytest.raises(ValueError, match=r"filter_key='accuracy_normalized'.*returned \['acc', 'overall'\]"):
        trainer._generate_scored_batch(PhaseTimer())


def test_too_many_rounds_is_an_error() -> None:
    config = _config(rollout=4, mini=2, filtering=True)
    config.trainer.max_try_make_batch = 3
    trainer = _trainer(config, solved=set(range(1000)))
    with pytest.raises(RuntimeError, match="kept 0 of 4 groups after 3 generation rounds"):
        trainer._generate_scored_batch(PhaseTimer())


@pytest.mark.parametrize(
    "mini, max_steps, expected",
    [(None, None, 12), (2, None, 12), (None, 50, 50), (None, 2, 2)],
)
def test_total_steps_as_easyr1_counts_them(mini: int | None, max_steps: int | None, expected: int) -> None:
    """32 prompts, 8 per step, 3 epochs; max_steps wins even past the epochs (the data repeats)."""
    config = _config(rollout=8, mini=mini, filtering=False)
    config.trainer.max_steps, config.trainer.total_epochs = max_steps, 3
    trainer = PPOTrainer.__new__(PPOTrainer)
    trainer.config = config
    trainer.data = SimpleNamespace(train_loader=[None] * (32 // (mini or 8)))
    assert trainer._total_steps() == expected
