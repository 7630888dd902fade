"""Asynchronous mode's bookkeeping (vlrl.trainer.async_rollout) with recording rank groups.

The broadcast itself runs on real processes in tests/rollout/test_weight_broadcast.py and the
whole mode through Ray in tests/trainer/test_e2e.py; here: which calls go where, and versions.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from vlrl.batch.held import Held, take
from vlrl.batch.rows import PromptBatch, RolloutBatch
from vlrl.batch.samples import StepSamples
from vlrl.trainer.async_rollout import AsyncRollout
from vlrl.trainer.ranks import Done, Method, RankRoles
from vlrl.workers.rank_worker import RankWorker


class _Group:
    """A rank group of `size` ranks that records (method, per-rank args) and answers from `replies`."""

    def __init__(self, size: int, log: list[tuple[str, str, tuple]], name: str) -> None:
        self.workers, self.log, self.name = [object()] * size, log, name

    def submit(self, method: Method, *per_rank: list, **kwargs) -> Done:
        self.log.append((self.name, method.__name__, per_rank))
        return Done(
            [{"sync/bytes": 10.0} if method is RankWorker.send_weights else None for _ in self.workers]
        )

    def call(self, method: Method, *per_rank: list, **kwargs) -> list:
        return self.submit(method, *per_rank, **kwargs).result()

    def call_all(self, method: Method, *args, **kwargs) -> list:
        return self.call(method, *([a] * len(self.workers) for a in args), **kwargs)

    def shutdown(self) -> None:
        pass


def _flow(staleness: int = 1) -> tuple[AsyncRollout, list]:
    log: list[tuple[str, str, tuple]] = []
    return AsyncRollout(RankRoles(_Group(2, log, "train"), _Group(3, log, "engines")), staleness), log


def test_the_broadcast_group_is_training_rank_0_and_every_engine() -> None:
    flow, log = _flow()
    flow.connect(lambda: ("10.0.0.1", 1234))
    (_, _, train_args), (_, _, engine_args) = log
    assert train_args == (["10.0.0.1"] * 2, [1234] * 2, [0, None], [4, 4])  # rank 1 is not a member
    assert engine_args == (["10.0.0.1"] * 3, [1234] * 3, [1, 2, 3], [4, 4, 4])


def test_weights_are_sent_only_when_the_engines_lag() -> None:
    flow, log = _flow()
    assert flow.sync_engines(0) == {"sync/bytes": 10.0} and flow.engine_version == 0
    assert [(who, method) for who, method, _ in log] == [
        ("train", "send_weights"),
        ("engines", "receive_weights"),
    ]
    assert flow.sync_engines(0) == {} and len(log) == 2  # already there
    flow.sync_engines(1)
    assert len(log) == 4 and flow.engine_version == 1


def test_a_prefetched_generation_is_taken_by_its_step_only() -> None:
    flow, _ = _flow()
    flow.sync_engines(3)
    flow.submit(5, _prompts(), Done([_samples()]), lambda per_rank: per_rank[0])
    with pytest.raises(RuntimeError, match="for step 5, not 6"):
        flow.take(6)
    flow.submit(5, _prompts(), Done([_samples()]), lambda per_rank: per_rank[0])
    ahead = flow.take(5)
    assert ahead is not None and ahead.version == 3 and len(ahead.result()) == 2
    assert flow.take(6) is None  # taken: nothing in flight


def test_the_generation_in_flight_is_saved_with_pixels_and_loaded(tmp_path: Path) -> None:
    flow, _ = _flow()
    flow.sync_engines(1)
    flow.submit(3, _prompts(), Done([_samples()]), lambda per_rank: per_rank[0])
    fetched: list[int] = []

    def fetch(images: list[list]) -> list[list]:
        fetched.append(len(images))
        return [[Image.new("RGB", (28, 28), "red")] for _ in images]

    def rows_of(samples: StepSamples) -> RolloutBatch:  # the rows from where they are held
        return take(samples.plan(list(range(len(samples)))), 0)

    flow.save(str(tmp_path), fetch, rows_of)
    assert fetched == [2, 1]  # the rollout's and the prompts' images
    resumed, _ = _flow()
    published: list[RolloutBatch] = []

    def publish(batch: RolloutBatch) -> StepSamples:
        published.append(batch)
        return StepSamples.of(batch, Held(batch))

    resumed.load(str(tmp_path), publish)
    ahead = resumed.take(3)
    assert ahead is not None and ahead.version == 1
    samples = ahead.result()
    assert torch.equal(samples.responses, _rollout().responses)
    assert torch.equal(published[0].input_ids, _rollout().input_ids) and published[0].images[0][0].size == (
        28,
        28,
    )
    _flow()[0].load(str(tmp_path / "nothing"), publish)  # no file: nothing in flight


def _prompts() -> PromptBatch:
    return PromptBatch(
        input_ids=torch.ones(1, 2, dtype=torch.long), attention_mask=torch.ones(1, 2, dtype=torch.long),
        position_ids=torch.zeros(1, 2, dtype=torch.long), raw_prompt_ids=[[1]], images=[["ref"]], prompts=["p"],
        ground_truths=["a"], extras=[{}], uids=[0],
    )  # fmt: skip


def _samples() -> StepSamples:
    rollout = _rollout()
    return StepSamples.of(rollout, Held(rollout))


def _rollout() -> RolloutBatch:
    return RolloutBatch(
        input_ids=torch.ones(2, 3, dtype=torch.long), attention_mask=torch.ones(2, 3, dtype=torch.long),
        position_ids=torch.zeros(2, 3, dtype=torch.long), responses=torch.tensor([[4], [5]]),
        response_mask=torch.ones(2, 1, dtype=torch.long), group_ids=torch.tensor([0, 0]), prompt_length=2,
        images=[["ref"], ["ref"]], prompts=["p", "p"], ground_truths=["a", "a"], extras=[{}, {}],
    )  # fmt: skip


def test_syncs_carry_the_weights_version_to_every_rank() -> None:
    flow, log = _flow()
    flow.sync_engines(6)
    (_, _, sent), (_, _, received) = log
    assert sent == ([6, 6],) and received == ([6, 6, 6],)


def test_token_staleness_weighs_each_response_by_its_tokens() -> None:
    """Two responses: 3 tokens all of version 4, and 1 token of version 5 after 1 of version 4
    (a switch inside its generation); the trainer is at version 6."""
    from vlrl.batch.samples import version_stats
    from vlrl.trainer.async_rollout import token_staleness

    batch = RolloutBatch(
        input_ids=torch.zeros(2, 4, dtype=torch.long), attention_mask=torch.ones(2, 4, dtype=torch.long),
        position_ids=torch.zeros(2, 4, dtype=torch.long), responses=torch.zeros(2, 3, dtype=torch.long),
        response_mask=torch.tensor([[1, 1, 1], [1, 1, 0]]), group_ids=torch.tensor([0, 0]), prompt_length=1,
        images=[[], []], prompts=["", ""], ground_truths=["", ""], extras=[{}, {}],
        rollout_versions=torch.tensor([[4, 4, 4], [4, 5, 0]]),
    )  # fmt: skip
    assert version_stats(batch).tolist() == [[4, 4, 0], [4, 4.5, 1]]
    metrics = token_staleness(StepSamples.of(batch, None), 6)
    assert metrics == {
        "async/token_staleness_mean": pytest.approx(6 - (4 * 3 + 4 + 5) / 5),
        "async/token_staleness_max": 2.0,
        "async/tokens_newer_frac": pytest.approx(1 / 5),
        "async/rows_updated_frac": 0.5,
    }
