"""Checkpoints are atomic, tracked, pruned to save_limit (+ best), checksummed, locked to one run,
and incomplete or damaged ones are never resumed from."""

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vlrl.trainer.checkpoint import CheckpointManager, check_checkpoint, read_state
from vlrl.utils.checkpoint_files import CorruptCheckpoint, check_shared_filesystem


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
    assert tracker == {"latest": 2, "best": 2, "best_score": 0.5, "steps": [1, 2]}


def test_crash_while_saving_leaves_previous_checkpoint(tmp_path: Path) -> None:
    manager = CheckpointManager(str(tmp_path))
    manager.save(1, _writer("a"), {}, score=None)

    def crash(folder: str) -> None:
        os.makedirs(folder)
        raise RuntimeError("killed mid-save")

    with pytest.raises(RuntimeError):
        manager.save(2, crash, {}, score=None)
    assert not any(".tmp" in name for name in os.listdir(tmp_path))  # a failed save is removed
    assert manager.latest() == str(tmp_path / "global_step_1")
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
        ".vlrl.lock", "checkpoint_tracker.json", "global_step_2", "global_step_3", "global_step_4", "vlrl_checkpoint_tracker.json",
    ]  # fmt: skip
    assert json.loads((tmp_path / "checkpoint_tracker.json").read_text()) == theirs
    assert json.loads((tmp_path / "vlrl_checkpoint_tracker.json").read_text())["latest"] == 3
    with pytest.raises(RuntimeError, match="global_step_4 was not written by vlrl"):
        manager.save(4, _writer("vlrl"), {}, score=None)
    assert (tmp_path / "global_step_4" / "actor" / "weights.txt").read_text() == "easyr1"


def _flip_byte(path: Path, offset: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_every_file_is_checksummed_and_a_damaged_one_is_never_resumed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    manager = CheckpointManager(str(tmp_path))
    for step in (1, 2, 3):
        manager.save(step, _writer(f"weights of step {step}"), {}, score=None)
    manifest = json.loads((tmp_path / "global_step_3" / "checksums.json").read_text())["files"]
    assert sorted(manifest) == ["actor/weights.txt", "trainer_state.json"]
    assert manifest["actor/weights.txt"]["size"] == len("weights of step 3")
    assert manager.resume_point() == str(tmp_path / "global_step_3")

    _flip_byte(tmp_path / "global_step_3" / "actor" / "weights.txt", 5)  # same size, other bytes
    (tmp_path / "global_step_2" / "trainer_state.json").unlink()  # ours (tracked): damaged, not foreign
    with caplog.at_level("WARNING"):
        assert manager.resume_point() == str(tmp_path / "global_step_1")
    assert (
        f"not resuming from {tmp_path}/global_step_3: {tmp_path}/global_step_3/actor/weights.txt does "
        "not match its checksum" in caplog.text
    )
    assert (
        f"not resuming from {tmp_path}/global_step_2: {tmp_path}/global_step_2 is not a complete"
        in caplog.text
    )
    assert manager.foreign_steps() == []

    Path(tmp_path / "global_step_1" / "trainer_state.json").write_text('{"global_step": 1, "val')  # truncated
    with pytest.raises(CorruptCheckpoint, match="no checkpoint in .* passes its checks .*global_step_1, "
                       "global_step_2, global_step_3.*rather than start again from step 1"):  # fmt: skip
        manager.resume_point()
    assert "global_step_1/trainer_state.json cannot be read" in caplog.text


def test_a_truncated_or_missing_file_is_named(tmp_path: Path) -> None:
    manager = CheckpointManager(str(tmp_path))
    folder = Path(manager.save(1, _writer("0123456789"), {}, score=None))
    (folder / "actor" / "weights.txt").write_text("01234")
    assert check_checkpoint(str(folder)) == [f"{folder}/actor/weights.txt has 5 bytes, 10 were written"]
    (folder / "actor" / "weights.txt").unlink()
    assert check_checkpoint(str(folder)) == [f"{folder}/actor/weights.txt is missing"]
    (folder / "checksums.json").write_text("garbage")
    assert check_checkpoint(str(folder))[0].startswith(f"{folder}/checksums.json cannot be read")


def test_one_run_per_folder(tmp_path: Path) -> None:
    manager = CheckpointManager(str(tmp_path))
    with pytest.raises(RuntimeError, match=f"in use by another run \\(pid {os.getpid()} on .* since .*\\)"):
        CheckpointManager(str(tmp_path))
    manager.close()
    CheckpointManager(str(tmp_path)).close()  # released: the next run starts


def test_a_killed_run_holds_no_lock_and_its_leftovers_are_removed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A run killed with -9 mid-save: the kernel drops its lock; the next run removes its partial folder."""
    script = (
        "import os, sys; from vlrl.trainer.checkpoint import CheckpointManager\n"
        f"m = CheckpointManager({str(tmp_path)!r})\n"
        "m.save(1, lambda f: (os.makedirs(f), print('saving', flush=True), os.kill(os.getpid(), 9)), {}, None)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == -9 and "saving" in out.stdout, out.stderr
    [partial] = [name for name in os.listdir(tmp_path) if ".tmp" in name]
    (tmp_path / ".vlrl_shared_check_abc").write_text("")  # a start-up probe a killed run left
    with caplog.at_level("INFO"):
        manager = CheckpointManager(str(tmp_path))
    assert (
        f"removed 2 leftover(s) of an interrupted run from {tmp_path}: .vlrl_shared_check_abc, {partial}"
        in caplog.text
    )
    assert manager.resume_point() is None


def test_a_full_disk_names_the_folder_and_leaves_nothing(tmp_path: Path) -> None:
    manager = CheckpointManager(str(tmp_path))
    manager.save(1, _writer("a" * 4096), {}, score=None)

    def full(folder: str) -> None:
        os.makedirs(folder)
        Path(folder, "part").write_text("x")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match=f"no space left on the device of {tmp_path} while saving global_step_2 "
                       "\\(its partial folder is removed; the previous checkpoint takes 0.00 GiB\\)"):  # fmt: skip
        manager.save(2, full, {}, score=None)
    assert sorted(os.listdir(tmp_path)) == [".vlrl.lock", "checkpoint_tracker.json", "global_step_1"]


def test_shared_folder_probe_leaves_no_file_when_writing_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_space(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(OSError):
        check_shared_filesystem(str(tmp_path), lambda marker, token: [])
    assert os.listdir(tmp_path) == []
