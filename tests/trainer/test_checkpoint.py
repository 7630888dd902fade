"""Checkpoints are atomic, tracked, pruned to save_limit (+ best), and incomplete ones are ignored."""

import json
import os
from pathlib import Path

import pytest

from vlrl.trainer.checkpoint import CheckpointManager, read_state


def _writer(content: str):
    def write(folder: str) -> None:
        os.makedirs(folder)
        Path(folder, "weights.txt").write_text(content)

    return write


def test_save_and_latest(tmp_path: Path) -> None:
    manager = CheckpointManager(str(tmp_path))
    assert manager.latest() is None
    manager.save(1, _writer("a"), {"dataloader": {"index": 16}}, score=None)
    path = manager.save(2, _writer("b"), {"dataloader": {"index": 32}}, score=0.5)
    assert manager.latest() == path == str(tmp_path / "global_step_2")
    assert read_state(path)["dataloader"] == {"index": 32}
    assert Path(path, "actor", "weights.txt").read_text() == "b"
    tracker = json.loads((tmp_path / "checkpoint_tracker.json").read_text())
    assert tracker == {"latest": 2, "best": 2, "best_score": 0.5}


def test_crash_while_saving_leaves_previous_checkpoint(tmp_path: Path) -> None:
    manager = CheckpointManager(str(tmp_path))
    manager.save(1, _writer("a"), {}, score=None)

    def crash(folder: str) -> None:
        os.makedirs(folder)
        raise RuntimeError("killed mid-save")

    with pytest.raises(RuntimeError):
        manager.save(2, crash, {}, score=None)
    assert (tmp_path / "global_step_2.tmp").exists()  # the partial save is visible but not complete
    assert CheckpointManager(str(tmp_path)).latest() == str(tmp_path / "global_step_1")
    # a folder without its trainer state (e.g. copied by hand) is not complete either
    (tmp_path / "global_step_9").mkdir()
    assert manager.complete_steps() == [1]
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        read_state(str(tmp_path / "global_step_9"))


def test_save_limit_keeps_newest_and_best(tmp_path: Path) -> None:
    manager = CheckpointManager(str(tmp_path), save_limit=2)
    for step, score in [(1, 0.1), (2, 0.9), (3, 0.2), (4, 0.3), (5, None)]:
        manager.save(step, _writer(str(step)), {}, score=score)
    assert manager.complete_steps() == [2, 4, 5]  # newest two + the best (step 2)
    assert manager.tracker["best"] == 2 and manager.tracker["latest"] == 5
    assert not any(name.endswith(".tmp") for name in os.listdir(tmp_path))


def test_checkpoints_of_another_trainer_are_never_touched(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An EasyR1 run's folder: global_step_N/{actor,dataloader.pt} and its own checkpoint_tracker.json."""
    theirs = {
        "best_global_step": 2,
        "best_val_reward_score": 0.3,
        "last_global_step": 4,
        "last_actor_path": "x",
    }
    for step in (2, 4):
        _writer("easyr1")(str(tmp_path / f"global_step_{step}" / "actor"))
        (tmp_path / f"global_step_{step}" / "dataloader.pt").write_bytes(b"\0")
    (tmp_path / "checkpoint_tracker.json").write_text(json.dumps(theirs))
    with caplog.at_level("WARNING"):
        manager = CheckpointManager(str(tmp_path), save_limit=1)
    assert (
        "checkpoints vlrl did not write (global_step_2, global_step_4, checkpoint_tracker.json)"
        in caplog.text
    )
    assert manager.latest() is None  # never resumed from
    with pytest.raises(
        RuntimeError, match="holds checkpoints vlrl did not write \\(global_step_4\\) at steps this run"
    ):
        manager.check_no_collisions([3, 4, 5])
    manager.check_no_collisions([1, 3])
    for step in (1, 3):
        manager.save(step, _writer("vlrl"), {}, score=None)  # save_limit=1 prunes only vlrl's own
    assert sorted(os.listdir(tmp_path)) == [
        "checkpoint_tracker.json", "global_step_2", "global_step_3", "global_step_4", "vlrl_checkpoint_tracker.json",
    ]  # fmt: skip
    assert json.loads((tmp_path / "checkpoint_tracker.json").read_text()) == theirs
    assert json.loads((tmp_path / "vlrl_checkpoint_tracker.json").read_text())["latest"] == 3
    with pytest.raises(RuntimeError, match="global_step_4 was not written by vlrl"):
        manager.save(4, _writer("vlrl"), {}, score=None)
    assert (tmp_path / "global_step_4" / "actor" / "weights.txt").read_text() == "easyr1"
