"""StatefulPromptLoader: seeded per-epoch order, drop_last, exact resume mid-epoch and across epochs."""

from __future__ import annotations

import itertools

import pytest
import torch
from data_helpers import write_jsonl

from vlrl.data import PromptSample, RLDataset, StatefulPromptLoader, create_dataloaders
from vlrl.data.errors import DataError


class FakeDataset:
    """n text-only samples whose uid is their index (fast: no tokenizer involved)."""

    pad_token_id = 0

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> PromptSample:
        ids = torch.arange(1, 2 + i % 3)
        return PromptSample(ids, torch.arange(len(ids)), ids.tolist(), [], f"p{i}", i, uid=i)


def _uids(batches) -> list[list[int]]:
    return [b.uids for b in batches]


def test_epochs_are_seeded_permutations():
    loader = StatefulPromptLoader(FakeDataset(10), 3, seed=7)
    assert len(loader) == 3  # drop_last: 10 // 3
    epoch0 = _uids(loader)
    epoch1 = _uids(loader)
    assert loader.epoch == 2 and epoch0 != epoch1
    for epoch, batches in enumerate((epoch0, epoch1)):
        flat = list(itertools.chain(*batches))
        assert len(set(flat)) == 9 and flat == loader.order(epoch)[:9]
    again = StatefulPromptLoader(FakeDataset(10), 3, seed=7)
    assert _uids(again) == epoch0
    assert _uids(StatefulPromptLoader(FakeDataset(10), 3, seed=8)) != epoch0


def test_no_shuffle_no_drop_last():
    loader = StatefulPromptLoader(FakeDataset(5), 2, shuffle=False, drop_last=False)
    assert _uids(loader) == [[0, 1], [2, 3], [4]]
    whole = StatefulPromptLoader(FakeDataset(5), -1, shuffle=False, drop_last=False)
    assert _uids(whole) == [[0, 1, 2, 3, 4]]


@pytest.mark.parametrize("consumed", [0, 1, 2, 3, 4, 6])
def test_resume_yields_exactly_the_remaining_batches(consumed):
    """Save after `consumed` batches (3 per epoch; 3 and 6 are epoch boundaries), restore in a new
    loader: the rest of the run is identical to an uninterrupted one."""
    reference = StatefulPromptLoader(FakeDataset(7), 2, seed=3)
    straight = [b for _ in range(3) for b in _uids(reference)]  # 3 epochs
    loader = StatefulPromptLoader(FakeDataset(7), 2, seed=3)
    seen = []
    while len(seen) < consumed:
        for batch in loader:
            seen.append(batch.uids)
            if len(seen) == consumed:
                break
    state = loader.state_dict()
    resumed = StatefulPromptLoader(FakeDataset(7), 2, seed=3)
    resumed.load_state_dict(state)
    rest = []
    while len(seen) + len(rest) < len(straight):
        rest += _uids(resumed)
    assert seen + rest == straight
    assert state["epoch"] == consumed // 3 and state["batch_index"] == consumed % 3


def test_state_mismatch_is_refused():
    loader = StatefulPromptLoader(FakeDataset(7), 2, seed=3)
    state = loader.state_dict()
    with pytest.raises(ValueError, match="saved seed=3 but this loader has seed=4"):
        StatefulPromptLoader(FakeDataset(7), 2, seed=4).load_state_dict(state)
    with pytest.raises(ValueError, match="saved dataset_size=7"):
        StatefulPromptLoader(FakeDataset(9), 2, seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match="gives no batch of 8"):
        StatefulPromptLoader(FakeDataset(7), 8)


def test_create_dataloaders(tokenizer_processor, make_config, tmp_path):
    tokenizer, processor = tokenizer_processor("qwen2_5_vl")
    rows = [{"problem": f"question {i}", "answer": str(i)} for i in range(6)]
    train_path = write_jsonl(tmp_path / "train.jsonl", rows)
    val_path = write_jsonl(tmp_path / "val.jsonl", rows[:3])
    config = make_config(train_files=train_path, val_files=val_path, rollout_batch_size=4, val_batch_size=-1)
    train, val = create_dataloaders(config, tokenizer, processor)
    (batch,) = list(train)
    assert len(batch) == 4 and batch.input_ids.shape[0] == 4 and batch.position_ids.shape[:2] == (4, 3)
    assert isinstance(train.dataset, RLDataset) and train.seed == config.seed
    assert _uids(val) == [[0, 1, 2]]
    assert create_dataloaders(make_config(train_files=train_path), tokenizer, processor)[1] is None


def test_create_dataloaders_builds_the_curriculum_and_the_mix(tokenizer_processor, make_config, tmp_path):
    tokenizer, processor = tokenizer_processor("qwen2_5_vl")
    rows = [{"problem": f"question {i}", "answer": str(i), "level": 7 - i} for i in range(8)]
    train_path = write_jsonl(tmp_path / "train.jsonl", rows)
    easy_first = make_config(
        train_files=train_path, rollout_batch_size=2, curriculum="column:level", curriculum_start=0.25,
        curriculum_steps=3,
    )  # fmt: skip
    train, _ = create_dataloaders(easy_first, tokenizer, processor)
    first = next(iter(train))
    assert sorted(first.uids) == [6, 7]  # levels 1 and 0: the easiest quarter
    no_level = write_jsonl(tmp_path / "plain.jsonl", [{"problem": "q", "answer": "a"}] * 4)
    with pytest.raises(DataError, match="column 'level', which this file lacks"):
        create_dataloaders(make_config(train_files=no_level, curriculum="column:level", curriculum_steps=2),
                           tokenizer, processor)  # fmt: skip
    words = write_jsonl(tmp_path / "words.jsonl", [{"problem": "q", "answer": "a", "level": "hard"}] * 4)
    with pytest.raises(DataError, match="must hold numbers"):
        create_dataloaders(make_config(train_files=words, curriculum="column:level", curriculum_steps=2),
                           tokenizer, processor)  # fmt: skip
    folder = tmp_path / "more"
    folder.mkdir()
    (folder / "train.csv").write_text("problem,answer\n" + "".join(f"csv {i},{i}\n" for i in range(3)))
    mixed = make_config(
        train_files=[train_path, f"{folder}@train"], train_weights=[3, 1], rollout_batch_size=4
    )
    train, _ = create_dataloaders(mixed, tokenizer, processor)
    batches = list(itertools.islice(itertools.chain.from_iterable(itertools.repeat(train)), 5))
    # 3 of each 4 from the JSON lines (uids 0-7), 1 from the folder's CSV (uids 8-10), cycled through
    assert [sum(uid >= 8 for uid in b.uids) for b in batches] == [1] * 5
    assert sorted(uid for b in batches[:3] for uid in b.uids if uid >= 8) == [8, 9, 10]
