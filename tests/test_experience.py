"""ExperienceStore semantics (readiness, partial reads, ordering, resume) and the batch <-> rows
round trip the rank uses to keep its shard between the log-prob pass and the update."""

from __future__ import annotations

import pickle

import pytest
import torch

from vlrl.experience import ExperienceStore
from vlrl.protocol import ROW_FIELDS, RolloutBatch


def test_rows_become_ready_column_by_column() -> None:
    store = ExperienceStore(["ids", "old", "adv"])
    store.write([7, 3, 5], ids=["a", "b", "c"])
    assert store.ready(["ids"]) == [7, 3, 5]  # first-written order, not id order
    assert store.ready(["ids", "old"]) == []
    store.write([3], old=[0.5])
    assert store.ready(["ids", "old"]) == [3]
    store.write([5, 7], old=[0.1, 0.2])
    assert store.ready(["ids", "old"]) == [7, 3, 5]
    assert store.ready(["ids", "old"], limit=2) == [7, 3]
    assert store.written_columns([3, 5]) == ["ids", "old"]


def test_partial_reads_return_the_rows_asked_for_in_that_order() -> None:
    store = ExperienceStore(["x", "y"])
    store.write([0, 1, 2], x=[10, 11, 12], y=[20, 21, 22])
    assert store.read([2, 0], ["y"]) == {"y": [22, 20]}
    assert store.read([1], ["x", "y"]) == {"x": [11], "y": [21]}


def test_reading_a_cell_that_is_not_ready_names_it() -> None:
    store = ExperienceStore(["x", "adv"])
    store.write([4], x=[1])
    with pytest.raises(KeyError, match="row 4 has no 'adv' yet"):
        store.read([4], ["adv"])
    with pytest.raises(KeyError, match="row 9 is not in the store"):
        store.read([9], ["x"])
    with pytest.raises(KeyError, match="no column 'z'"):
        store.write([4], z=[0])
    with pytest.raises(ValueError, match="2 values for 1 rows"):
        store.write([4], x=[1, 2])


def test_drop_frees_rows() -> None:
    store = ExperienceStore(["x"])
    store.write([0, 1, 2], x=[0, 1, 2])
    store.drop([1])
    assert store.ready(["x"]) == [0, 2] and 1 not in store
    store.drop()
    assert len(store) == 0


def test_state_dict_round_trip_keeps_cells_and_order() -> None:
    store = ExperienceStore(["x", "t"])
    store.write([5, 2], x=["p", "q"])
    store.write([2], t=[torch.tensor([1.0, 2.0])])
    state = pickle.loads(pickle.dumps(store.state_dict()))
    resumed = ExperienceStore(["x", "t"])
    resumed.load_state_dict(state)
    assert resumed.ready(["x"]) == [5, 2] and resumed.ready(["x", "t"]) == [2]
    assert torch.equal(resumed.read([2], ["t"])["t"][0], torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="saved columns"):
        ExperienceStore(["x"]).load_state_dict(state)


def _batch(n: int = 4, p: int = 3, r: int = 2) -> RolloutBatch:
    g = torch.Generator().manual_seed(0)
    return RolloutBatch(
        input_ids=torch.randint(0, 50, (n, p + r), generator=g), attention_mask=torch.ones(n, p + r, dtype=torch.long),
        position_ids=torch.arange(p + r).expand(n, 3, -1).clone(), responses=torch.randint(0, 50, (n, r), generator=g),
        response_mask=torch.tensor([[1, 1], [1, 0], [1, 1], [1, 0]]), group_ids=torch.tensor([0, 0, 1, 1]),
        prompt_length=p, images=[["img0"], ["img0"], [], []], prompts=["a", "a", "b", "b"],
        ground_truths=["x", "x", "y", "y"], extras=[{}, {}, {}, {}], old_log_probs=torch.randn(n, r, generator=g),
    )  # fmt: skip


def test_a_batch_kept_as_rows_comes_back_identical() -> None:
    batch = _batch()
    store = ExperienceStore(ROW_FIELDS)
    store.write([10, 11, 12, 13], **batch.row_values())
    rows = [12, 10]
    back = RolloutBatch.from_rows(store.read(rows, store.written_columns(rows)), prompt_length=3)
    expected = batch.select([2, 0])
    for name in ROW_FIELDS:
        got, want = getattr(back, name), getattr(expected, name)
        if isinstance(want, torch.Tensor):
            assert torch.equal(got, want) and got.dtype == want.dtype, name
        else:
            assert got == want, name
    assert back.ref_log_probs is None and back.advantages is None  # never written: None again
