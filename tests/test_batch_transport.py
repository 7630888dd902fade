"""Batches cross between processes in about half the bytes and arrive equal, dtypes included."""

from __future__ import annotations

import pickle

import torch

from vlrl.batch.rows import Narrowed, RolloutBatch, narrow, widen


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
