"""A new run never overwrites an earlier run's checkpoints unasked: at start-up a folder holding them
is resumed from, replaced on purpose (`trainer.overwrite_checkpoints`), or the run stops naming the
choices. Replaced checkpoints are kept until the new run's first checkpoint is complete."""

from __future__ import annotations

import errno
import json
import os
import sys
from pathlib import Path

import pytest
import warm_cli

from vlrl.config import ConfigError, TrainerConfig
from vlrl.trainer.checkpoint import CheckpointManager, folder_use, open_run_folder


def _writer(content: str):
    def write(folder: str) -> None:
        os.makedirs(folder)
        Path(folder, "weights.txt").write_text(content)

    return write


def _earlier_run(root: Path, steps: tuple[int, ...] = (1, 2)) -> None:
    """An earlier run's complete checkpoints in `root`, its last one the best."""
    manager = CheckpointManager(str(root))
    for step in steps:
        manager.save(step, _writer(f"earlier {step}"), {}, score=0.9 if step == steps[-1] else 0.1)
    manager.close()


def _trainer(root: Path, **keys: object) -> TrainerConfig:
    return TrainerConfig(save_checkpoint_path=str(root), **keys)  # type: ignore[arg-type]


def test_an_empty_folder_is_a_new_run_whatever_the_keys(tmp_path: Path) -> None:
    for find_last in (True, False):
        for load in (None, str(tmp_path / "elsewhere" / "global_step_3")):
            assert folder_use(str(tmp_path), [], load, find_last, overwrite=False) == "new"


def test_resuming_from_the_folder_is_never_refused(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    assert folder_use(root, [2, 4], None, find_last_checkpoint=True, overwrite=False) == "resume"
    inside = os.path.join(root, "global_step_2")  # back to an earlier step of the same run
    assert folder_use(root, [2, 4], inside, find_last_checkpoint=False, overwrite=False) == "resume"
    # the same folder under another name (a link) is the same folder
    os.makedirs(inside)
    (tmp_path / "link").symlink_to(root, target_is_directory=True)
    linked = str(tmp_path / "link" / "global_step_2")
    assert folder_use(root, [2, 4], linked, find_last_checkpoint=False, overwrite=False) == "resume"


def test_a_new_run_over_earlier_checkpoints_is_refused_naming_the_choices(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    with pytest.raises(ConfigError) as refused:
        folder_use(root, [2, 4], None, find_last_checkpoint=False, overwrite=False)
    message = str(refused.value)
    assert (
        f"trainer.save_checkpoint_path={root} holds an earlier run's checkpoints (global_step_2, global_step_4)"
        in message
    )
    assert "trainer.find_last_checkpoint=false" in message
    for choice in ("trainer.find_last_checkpoint=true", "trainer.save_checkpoint_path=...",
                   "trainer.experiment_name", "trainer.overwrite_checkpoints=true"):  # fmt: skip
        assert choice in message
    # starting from another run's checkpoint into this folder would overwrite them too
    elsewhere = str(tmp_path / "other" / "global_step_6")
    for find_last in (True, False):  # load_checkpoint_path wins over find_last_checkpoint
        with pytest.raises(
            ConfigError, match=r"trainer.load_checkpoint_path=.*other/global_step_6, outside it"
        ):
            folder_use(root, [2, 4], elsewhere, find_last, overwrite=False)
    many = list(range(1, 11))
    with pytest.raises(ConfigError, match="10 checkpoints, global_step_1 to global_step_10"):
        folder_use(root, many, None, find_last_checkpoint=False, overwrite=False)


def test_overwrite_or_validation_only_is_not_refused(tmp_path: Path) -> None:
    root, elsewhere = str(tmp_path / "run"), str(tmp_path / "other" / "global_step_6")
    assert folder_use(root, [2], None, find_last_checkpoint=False, overwrite=True) == "replace"
    assert folder_use(root, [2], elsewhere, find_last_checkpoint=True, overwrite=True) == "replace"
    assert folder_use(root, [2], None, find_last_checkpoint=True, overwrite=True) == "resume"  # resuming wins
    assert folder_use(root, [2], elsewhere, False, overwrite=False, saves=False) == "new"  # val_only


def test_the_reported_case_second_run_stops_before_touching_anything(tmp_path: Path) -> None:
    """Two quickstarts into one folder (find_last_checkpoint=false): the second stopped only after
    overwriting global_step_2; now it stops at start-up, the folder as it was and unlocked."""
    _earlier_run(tmp_path)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and p.name != ".vlrl.lock"}
    with pytest.raises(ConfigError, match="holds an earlier run's checkpoints"):
        open_run_folder(_trainer(tmp_path, find_last_checkpoint=False))
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and p.name != ".vlrl.lock"}
    assert after == before
    CheckpointManager(str(tmp_path)).close()  # the refused run released its lock


def test_replaced_checkpoints_are_kept_until_the_first_save_is_complete(tmp_path: Path) -> None:
    _earlier_run(tmp_path, steps=(1, 2, 3))
    manager = open_run_folder(_trainer(tmp_path, find_last_checkpoint=False, overwrite_checkpoints=True))
    assert manager.replaces == [1, 2, 3]

    def failing(folder: str) -> None:
        raise RuntimeError("the rank died while saving")

    with pytest.raises(RuntimeError, match="the rank died"):
        manager.save(2, failing, {}, score=None)
    assert manager.own_steps() == [1, 2, 3]  # a failed first save loses nothing
    manager.save(2, _writer("new 2"), {}, score=0.5)
    assert sorted(p.name for p in tmp_path.glob("global_step_*")) == ["global_step_2"]
    assert (tmp_path / "global_step_2" / "actor" / "weights.txt").read_text() == "new 2"
    tracker = json.loads((tmp_path / "checkpoint_tracker.json").read_text())
    assert tracker == {"latest": 2, "best": 2, "best_score": 0.5, "steps": [2]}  # not the earlier best
    manager.save(4, _writer("new 4"), {}, score=0.4)
    assert manager.own_steps() == [2, 4]  # later saves remove nothing more
    manager.close()
    # the run's own checkpoints are then resumed from, not replaced again
    again = open_run_folder(_trainer(tmp_path, load_checkpoint_path=str(tmp_path / "global_step_2"),
                                     find_last_checkpoint=False, overwrite_checkpoints=True))  # fmt: skip
    assert again.replaces == [] and again.own_steps() == [2, 4]
    again.close()


def test_a_damaged_earlier_checkpoint_is_replaced_not_taken_for_another_trainers(tmp_path: Path) -> None:
    """A checkpoint of the earlier run that lost its trainer state and checksums is known as vlrl's by
    the tracker only: replacing must not make it look foreign (which would stop a run saving that step)."""
    _earlier_run(tmp_path, steps=(1, 2))
    for name in ("trainer_state.json", "checksums.json"):
        (tmp_path / "global_step_2" / name).unlink()
    manager = open_run_folder(_trainer(tmp_path, find_last_checkpoint=False, overwrite_checkpoints=True))
    assert manager.replaces == [1, 2]
    manager.check_no_collisions([2])
    manager.save(2, _writer("new 2"), {}, score=None)
    assert manager.complete_steps() == [2]
    manager.close()


def test_a_tracker_without_checkpoints_names_nothing_of_the_new_run(tmp_path: Path) -> None:
    """Checkpoints removed by hand leave a tracker whose best would outrank the new run's and be kept by
    save_limit though it no longer exists."""
    (tmp_path / "checkpoint_tracker.json").write_text(
        json.dumps({"latest": 9, "best": 9, "best_score": 0.99, "steps": [9]})
    )
    manager = open_run_folder(_trainer(tmp_path, find_last_checkpoint=False, save_limit=1))
    manager.save(1, _writer("a"), {}, score=0.5)
    manager.save(2, _writer("b"), {}, score=0.1)
    tracker = json.loads((tmp_path / "checkpoint_tracker.json").read_text())
    assert tracker == {"latest": 2, "best": 1, "best_score": 0.5, "steps": [1, 2]}
    manager.close()


@pytest.mark.slow
def test_the_cli_refuses_at_start_up(tmp_path: Path) -> None:
    """Through `python -m vlrl.trainer.main` on the quickstart's config: exit 2 with the message,
    within seconds (the check comes before the data, Ray or any model load)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from e2e_helpers import REPO, build_assets, cli_args

    assets = build_assets(tmp_path / "assets")
    out = tmp_path / "run"
    _earlier_run(out, steps=(2,))
    args = cli_args(assets, out, "trainer.find_last_checkpoint=false", "trainer.overwrite_checkpoints=false")
    done = warm_cli.run(args, REPO, timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    assert (
        f"vlrl: trainer.save_checkpoint_path={out} holds an earlier run's checkpoints (global_step_2)"
        in done.stderr
    )
    assert "trainer.overwrite_checkpoints=true" in done.stderr
    assert (out / "global_step_2" / "actor" / "weights.txt").read_text() == "earlier 2"


def test_a_full_disk_before_the_first_save_says_the_earlier_checkpoints_are_still_there(
    tmp_path: Path,
) -> None:
    _earlier_run(tmp_path, steps=(1,))
    manager = open_run_folder(_trainer(tmp_path, find_last_checkpoint=False, overwrite_checkpoints=True))

    def full(folder: str) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match=r"the earlier run's checkpoints \(global_step_1\) are still there"):
        manager.save(1, full, {}, score=None)
    assert (tmp_path / "global_step_1" / "actor" / "weights.txt").read_text() == "earlier 1"
    manager.close()
