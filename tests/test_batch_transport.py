"""Batches cross between processes in about half the bytes and arrive equal, dtypes included."""

from __future__ import annotations

import pickle

import torch

from vlrl.batch.rows import Narrowed, RolloutBatch, narrow, widen
from vlrl.batch.samples import Ragged, StepSamples


def _batch(rows: int = 16, p: int = 40, r: int = 24) -> RolloutBatch:
    g = torch.Generator().manual_seed(0)
    mask = (torch.arange(r)[None] < torch.randint(1, r + 1, (rows, 1), generator=g)).long()
    return RolloutBatch(
        input_ids=torch.randint(0, 151_000, (rows, p + r), generator=g),
        attention_mask=torch.cat([torch.ones(rows, p, dtype=torch.long), mask], 1),
        position_ids=torch.randint(0, 4000, (rows, 3, p + r), generator=g), responses=torch.randint(0, 151_000, (rows, r), generator=g),
        response_mask=mask, group_ids=torch.arange(rows) + (3 << 40), prompt_length=p, images=[[] for _ in range(rows)],
        prompts=["x"] * rows, ground_truths=[1] * rows, extras=[{}] * rows, rollout_log_probs=torch.randn(rows, r, generator=g),
    )  # fmt: skip


def test_a_pickled_batch_comes_back_equal_with_its_dtypes() -> None:
    batch = _batch()
    back = pickle.loads(pickle.dumps(batch))
    for name, value in batch.__dict__.items():
        if isinstance(value, torch.Tensor):
            assert back.__dict__[name].dtype == value.dtype and torch.equal(back.__dict__[name], value), name
        else:
            assert back.__dict__[name] == value, name


def test_int64_fields_travel_narrow() -> None:
    assert narrow(torch.tensor([0, 1, 1])).values.dtype == torch.bool
    assert narrow(torch.tensor([5, -7])).values.dtype == torch.int32
    group_ids = torch.tensor([1 << 40])  # generation rounds offset group ids past int32
    assert narrow(group_ids) is group_ids
    floats, empty = torch.randn(3), torch.zeros(0, dtype=torch.long)
    assert narrow(floats) is floats and narrow(empty) is empty
    assert widen(Narrowed(torch.tensor([True]))).dtype == torch.int64

    batch = _batch(rows=64, p=400, r=200)
    plain = len(pickle.dumps({k: v for k, v in batch.__dict__.items()}))  # the fields as they are
    assert len(pickle.dumps(batch)) < 0.5 * plain


def _samples(responses: torch.Tensor, mask: torch.Tensor, turns: list[int]) -> StepSamples:
    n = len(turns)
    return StepSamples(
        responses=responses, response_mask=mask, group_ids=torch.arange(n), prompt_lengths=torch.full((n,), 5),
        turn_lengths=torch.tensor(turns), prompts=["p"] * n, ground_truths=[None] * n, extras=[{}] * n, held=[None] * n,
    )  # fmt: skip


def _assert_round_trip(samples: StepSamples) -> int:
    back = pickle.loads(pickle.dumps(samples))
    for name in ("responses", "response_mask", "turn_lengths"):
        value = getattr(samples, name)
        assert getattr(back, name).dtype == value.dtype and torch.equal(getattr(back, name), value), name
    return len(pickle.dumps(samples))


def test_the_drivers_samples_travel_ragged_and_arrive_equal() -> None:
    """A rank reports responses of very different lengths: the padding is left out on the way,
    so the bytes follow the tokens (here 1 long response among short ones), not N x the longest."""
    turns = [400] + [8] * 31
    responses = torch.full((32, 400), 7)  # pad id 7
    responses[torch.arange(400)[None] < torch.tensor(turns)[:, None]] = 151_000  # real tokens
    mask = (torch.arange(400)[None] < torch.tensor(turns)[:, None]).long()
    ragged = _assert_round_trip(_samples(responses, mask, turns))
    assert ragged < 32 * 400  # less than one byte per padded entry: ~5 bytes x 648 tokens
    # multi-turn: holes (tool results) inside a row's mask travel as they are
    mask[0, 10:20] = 0
    _assert_round_trip(_samples(responses, mask, turns))


def test_samples_that_are_not_ragged_by_their_lengths_travel_whole() -> None:
    """Entries past a row's length that are not padding (a token after EOS, say) keep the dense form."""
    responses, mask = torch.full((2, 4), 7), torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]])
    responses[0, 3] = 9  # past row 0's length 2, not the pad id
    samples = _samples(responses, mask, [2, 1])
    assert Ragged.pack(samples.responses, samples.turn_lengths, None) is None
    assert Ragged.pack(samples.response_mask, samples.turn_lengths, 0) is not None
    _assert_round_trip(samples)
    full = _samples(torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long), [3, 3])
    assert Ragged.pack(full.responses, full.turn_lengths, None) is None  # nothing to leave out
    _assert_round_trip(full)
