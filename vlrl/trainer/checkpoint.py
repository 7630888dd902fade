"""Atomic, checksummed checkpoints with a tracker of the latest and best, and a retention limit.

Layout under `trainer.save_checkpoint_path`:
    global_step_N/            complete checkpoint (renamed into place as the very last act)
        actor/                model, optimizer, scheduler and RNG states (written by the ranks)
        trainer_state.json    step, dataloader position, KL coefficient, validation score
        checksums.json        size and SHA-256 of every other file (`checkpoint_files`)
    global_step_N.tmp-RUN/    a save in progress; never resumed from, removed at the next start
    checkpoint_tracker.json   {"latest", "best", "best_score", "steps"}, replaced atomically
    .vlrl.lock                held by the run using the folder (`RunLock`)

A crash (or kill -9) at any moment leaves either the previous complete checkpoint or the new one.
Resuming takes the newest of vlrl's checkpoints whose files match their checksums; one that does not
is named and skipped (never loaded), and when none matches the run stops rather than start over.

A new run never overwrites another run's checkpoints unasked: at start-up (`open_run_folder`, before
the data or any model loads) a folder holding vlrl checkpoints must be resumed from
(`trainer.find_last_checkpoint`, or `trainer.load_checkpoint_path` inside it), or replaced on
purpose (`trainer.overwrite_checkpoints`: they are removed together once this run's first
checkpoint is complete), or the run stops naming the choices (`folder_use`).

Checkpoints vlrl did not write (a `global_step_N` with neither trainer state nor checksums and not
in vlrl's tracker, e.g. EasyR1's, and EasyR1's `checkpoint_tracker.json`) are never deleted or
overwritten: they are reported at start-up, vlrl's tracker then goes to
`vlrl_checkpoint_tracker.json`, and a run that would save a step of the same number stops at
start-up (`check_no_collisions`).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from vlrl.config.schema import ConfigError
from vlrl.utils.checkpoint_files import (
    MANIFEST,
    PROBE_PREFIX,
    CorruptCheckpoint,
    RunLock,
    digest_files,
    read_manifest,
    verify_files,
    write_manifest,
)

if TYPE_CHECKING:
    from vlrl.config.schema import TrainerConfig

STEP_DIR = re.compile(r"^global_step_(\d+)$")
TRACKER = "checkpoint_tracker.json"
OWN_TRACKER = "vlrl_checkpoint_tracker.json"  # used when TRACKER belongs to another trainer
STATE = "trainer_state.json"
logger = logging.getLogger(__name__)

FolderUse = Literal["resume", "new", "replace"]  # `folder_use`'s answer
Digest = Callable[[str], dict[str, dict[str, Any]]]  # folder -> the manifest's file table
Verify = Callable[[str, dict[str, dict[str, Any]]], list[str]]  # (folder, table) -> problems


def _write_json_atomic(path: str, data: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class CheckpointManager:
    """The checkpoints of one run folder, which it locks for this process's lifetime."""

    def __init__(self, root: str, save_limit: int = -1) -> None:
        self.root = root
        self.save_limit = save_limit
        os.makedirs(root, exist_ok=True)
        self.lock = RunLock(root)  # first: nothing below may touch a folder another run uses
        self.run_tag = uuid.uuid4().hex[:8]  # names this run's save-in-progress folders
        self.saved: str | None = None  # the newest checkpoint this run wrote
        self.replaces: list[int] = []  # an earlier run's steps, removed at this run's first save (`claim`)
        self._remove_leftovers()
        self.tracker_path = os.path.join(root, TRACKER if self._tracker_is_ours(TRACKER) else OWN_TRACKER)
        self.tracker = self._read_tracker()
        found = self.foreign_entries()
        if found:
            logger.warning(
                "%s holds checkpoints vlrl did not write (%s); they are left untouched and vlrl does not "
                "resume from them",
                root,
                ", ".join(found),
            )

    def _remove_leftovers(self) -> None:
        """Interrupted saves and start-up probe files of earlier runs: no run holds them (we hold the lock)."""
        stale = [
            name
            for name in os.listdir(self.root)
            if (name.startswith("global_step_") and ".tmp" in name) or name.startswith(PROBE_PREFIX)
        ]
        for name in stale:
            path = os.path.join(self.root, name)
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)
        if stale:
            logger.info("removed %d leftover(s) of an interrupted run from %s: %s", len(stale), self.root,
                        ", ".join(sorted(stale)))  # fmt: skip

    def _tracker_is_ours(self, name: str) -> bool:
        """A tracker file vlrl wrote (or none yet)."""
        path = os.path.join(self.root, name)
        if not os.path.isfile(path):
            return True
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            return False
        return isinstance(data, dict) and "latest" in data and "best_score" in data

    def _read_tracker(self) -> dict[str, Any]:
        if os.path.isfile(self.tracker_path):
            with open(self.tracker_path) as f:
                return json.load(f)
        return {"latest": None, "best": None, "best_score": None, "steps": []}

    def _step_folders(self) -> dict[int, str]:
        found = {}
        for name in os.listdir(self.root):
            match = STEP_DIR.match(name)
            if match and os.path.isdir(os.path.join(self.root, name)):
                found[int(match.group(1))] = os.path.join(self.root, name)
        return found

    def _is_ours(self, step: int, folder: str) -> bool:
        """Written by vlrl: it has vlrl's trainer state or checksums, or vlrl's tracker names it (a
        checkpoint of ours that lost its trainer state is damaged, not another trainer's)."""
        named = set(self.tracker.get("steps") or []) | {self.tracker.get("latest"), self.tracker.get("best")}
        return step in named or any(os.path.isfile(os.path.join(folder, f)) for f in (STATE, MANIFEST))

    def foreign_steps(self) -> list[int]:
        """Steps of `global_step_N` folders another trainer wrote."""
        return sorted(
            step for step, folder in self._step_folders().items() if not self._is_ours(step, folder)
        )

    def own_steps(self) -> list[int]:
        """Steps of vlrl's checkpoint folders (complete or damaged), oldest first."""
        return sorted(step for step, folder in self._step_folders().items() if self._is_ours(step, folder))

    def foreign_entries(self) -> list[str]:
        """Names of everything in the folder that another trainer wrote, for the start-up report."""
        names = [f"global_step_{step}" for step in self.foreign_steps()]
        if self.tracker_path.endswith(OWN_TRACKER) and os.path.isfile(os.path.join(self.root, TRACKER)):
            names.append(TRACKER)
        return names

    def claim(
        self,
        load_checkpoint_path: str | None,
        find_last_checkpoint: bool,
        overwrite: bool,
        saves: bool = True,
    ) -> FolderUse:
        """Decide at start-up how this run uses the folder (`folder_use`; it raises when the run would
        overwrite an earlier run's checkpoints unasked) and prepare for it."""
        earlier = self.own_steps()
        use = folder_use(self.root, earlier, load_checkpoint_path, find_last_checkpoint, overwrite, saves)
        if use == "new" and not earlier:  # a tracker whose checkpoints were removed by hand names no best
            self.tracker = {"latest": None, "best": None, "best_score": None, "steps": []}
        elif use == "replace":
            # The tracker stays until then: it tells the earlier run's damaged checkpoints from
            # another trainer's (`_is_ours`), which `check_no_collisions` must not confuse.
            self.replaces = earlier
            logger.warning(
                "trainer.overwrite_checkpoints=true: this run starts anew in %s; the earlier run's checkpoints (%s) "
                "are kept until this run's first checkpoint is complete, then removed",
                self.root,
                _step_names(earlier),
            )
        return use

    def _remove_replaced(self) -> None:
        """The earlier run's checkpoints and tracker, once this run has a complete checkpoint of its own
        (still in its temporary folder): the folder then never mixes two runs' checkpoints."""
        for step in self.replaces:
            shutil.rmtree(os.path.join(self.root, f"global_step_{step}"), ignore_errors=True)
        logger.info(
            "removed the earlier run's checkpoints (%s) from %s", _step_names(self.replaces), self.root
        )
        self.replaces = []
        self.tracker = {"latest": None, "best": None, "best_score": None, "steps": []}
        _write_json_atomic(self.tracker_path, self.tracker)

    def check_no_collisions(self, planned_steps: list[int]) -> None:
        """Fail (at start-up) when this run would save a step whose folder another trainer wrote."""
        clash = sorted(set(self.foreign_steps()) & set(planned_steps))
        if clash:
            raise RuntimeError(
                f"trainer.save_checkpoint_path={self.root} holds checkpoints vlrl did not write "
                f"({', '.join(f'global_step_{s}' for s in clash)}) at steps this run would save; vlrl never "
                "deletes them: point trainer.save_checkpoint_path at another folder"
            )

    def complete_steps(self) -> list[int]:
        """Steps with a complete checkpoint folder (its trainer state written), oldest first."""
        return [
            s for s in self.own_steps() if os.path.isfile(os.path.join(self.root, f"global_step_{s}", STATE))
        ]

    def latest(self) -> str | None:
        steps = self.complete_steps()
        return os.path.join(self.root, f"global_step_{steps[-1]}") if steps else None

    def resume_point(self, verify: Verify = verify_files) -> str | None:
        """The newest of vlrl's checkpoints that passes `check_checkpoint`; None when there is none.
        Each one that fails is named with its problem; when all fail the run stops (CorruptCheckpoint)
        rather than start again from step 1."""
        steps = self.own_steps()
        for step in reversed(steps):
            folder = os.path.join(self.root, f"global_step_{step}")
            problems = check_checkpoint(folder, verify)
            if not problems:
                return folder
            logger.warning("not resuming from %s: %s", folder, "; ".join(problems[:5]))
        if steps:
            raise CorruptCheckpoint(
                f"no checkpoint in {self.root} passes its checks ({', '.join(f'global_step_{s}' for s in steps)}; "
                "the problems are logged above): rather than start again from step 1, the run stops. Restore the "
                "files, or start a new run: in another folder (trainer.save_checkpoint_path), or in this one "
                "with trainer.find_last_checkpoint=false trainer.overwrite_checkpoints=true (which removes "
                "these checkpoints once the new run's first one is saved)"
            )
        return None

    def save(
        self,
        step: int,
        write_actor: Callable[[str], None],
        state: dict[str, Any],
        score: float | None,
        digest: Digest = digest_files,
    ) -> str:
        """Write a checkpoint for `step`: actor files via `write_actor(folder)`, the trainer state,
        then the checksums of them all (`digest(folder)`), and rename it into place."""
        final = os.path.join(self.root, f"global_step_{step}")
        if os.path.isdir(final) and not self._is_ours(step, final):
            raise RuntimeError(
                f"{final} was not written by vlrl; it is not overwritten (choose another folder)"
            )
        tmp = f"{final}.tmp-{self.run_tag}"
        try:
            os.makedirs(tmp)
            write_actor(os.path.join(tmp, "actor"))
            _write_json_atomic(os.path.join(tmp, STATE), {"global_step": step, "val_score": score, **state})
            write_manifest(tmp, digest(tmp))
        except BaseException as exc:
            shutil.rmtree(tmp, ignore_errors=True)  # a partial save must not fill the disk it ran out of
            if _out_of_space(exc):
                raise OSError(errno.ENOSPC, self._no_space_message(step)) from None
            raise
        if self.replaces:
            self._remove_replaced()
        shutil.rmtree(final, ignore_errors=True)  # a re-save of the same step (e.g. after resume)
        os.replace(tmp, final)  # the commit point
        self.saved = final
        self._update_tracker(step, score)
        self._enforce_limit()
        return final

    def _no_space_message(self, step: int) -> str:
        previous = self.latest()
        size = (
            f"; the previous checkpoint takes {_folder_bytes(previous) / 2**30:.2f} GiB" if previous else ""
        )
        earlier = (
            f"; the earlier run's checkpoints ({_step_names(self.replaces)}) are still there (trainer.overwrite_checkpoints "
            "removes them only once this run's first checkpoint is complete)"
            if self.replaces
            else ""
        )
        return (
            f"no space left on the device of {self.root} while saving global_step_{step} (its partial "
            f"folder is removed{size}{earlier}): free space there, lower trainer.save_limit, or point "
            "trainer.save_checkpoint_path at a larger disk"
        )

    def _update_tracker(self, step: int, score: float | None) -> None:
        self.tracker["latest"] = step
        self.tracker["steps"] = sorted(set(self.tracker.get("steps") or []) | {step})
        best = self.tracker.get("best_score")
        if score is not None and (best is None or score > best):
            self.tracker["best"], self.tracker["best_score"] = step, score
        _write_json_atomic(self.tracker_path, self.tracker)

    def _enforce_limit(self) -> None:
        """Keep the newest `save_limit` checkpoints plus the best one."""
        if self.save_limit < 1:
            return
        steps = self.complete_steps()
        keep = set(steps[-self.save_limit :]) | {self.tracker.get("best")}
        removed = [step for step in steps if step not in keep]
        for step in removed:
            shutil.rmtree(os.path.join(self.root, f"global_step_{step}"), ignore_errors=True)
        if removed:
            self.tracker["steps"] = [s for s in self.tracker.get("steps") or [] if s not in removed]
            _write_json_atomic(self.tracker_path, self.tracker)

    def close(self) -> None:
        self.lock.release()


def open_run_folder(trainer: TrainerConfig) -> CheckpointManager:
    """The run's checkpoint folder, locked, and its use decided (`CheckpointManager.claim`): the first
    act of a run, so that a refusal comes in seconds, before the data or any model loads."""
    assert trainer.save_checkpoint_path is not None  # PPOConfig.finalize() fills it in
    manager = CheckpointManager(trainer.save_checkpoint_path, trainer.save_limit)
    try:
        manager.claim(
            trainer.load_checkpoint_path,
            trainer.find_last_checkpoint,
            trainer.overwrite_checkpoints,
            saves=not trainer.val_only,  # validating only writes no checkpoint
        )
    except BaseException:
        manager.close()
        raise
    return manager


def folder_use(
    root: str,
    earlier_steps: list[int],
    load_checkpoint_path: str | None,
    find_last_checkpoint: bool,
    overwrite: bool,
    saves: bool = True,
) -> FolderUse:
    """How a run uses its checkpoint folder `root`, which holds vlrl checkpoints of `earlier_steps`:

    "new": the folder holds none, or this run neither resumes nor `saves` (trainer.val_only);
    "resume": it resumes from one of them (`find_last_checkpoint` without `load_checkpoint_path`, or
        `load_checkpoint_path` inside `root`), continuing that run;
    "replace": it starts anew and `overwrite` (trainer.overwrite_checkpoints) says to replace them.
    Otherwise a ConfigError naming the folder and the choices: the run's saves would silently
    overwrite the earlier run's folders of the same steps, and leave the others mixed with its own."""
    if not earlier_steps:
        return "new"
    if load_checkpoint_path is not None:
        if _inside(load_checkpoint_path, root):
            return "resume"
        reason = f"it starts from trainer.load_checkpoint_path={load_checkpoint_path}, outside it"
    elif find_last_checkpoint:
        return "resume"
    else:
        reason = "trainer.find_last_checkpoint=false: it starts anew"
    if not saves:
        return "new"
    if overwrite:
        return "replace"
    raise ConfigError(
        f"trainer.save_checkpoint_path={root} holds an earlier run's checkpoints ({_step_names(earlier_steps)}) "
        f"and this run does not resume from them ({reason}): its saves would overwrite them. Choose one: "
        "resume that run (trainer.find_last_checkpoint=true, without trainer.load_checkpoint_path); save "
        "into another folder (trainer.save_checkpoint_path=..., or another trainer.experiment_name when "
        "the path is not set); or replace them (trainer.overwrite_checkpoints=true: they are removed once "
        "this run's first checkpoint is complete)"
    )


def _inside(path: str, root: str) -> bool:
    """`path` is `root` or under it (links resolved: the same folder under two names is one folder)."""
    path, root = os.path.realpath(path), os.path.realpath(root)
    return os.path.commonpath([path, root]) == root


def _step_names(steps: list[int]) -> str:
    """`global_step_N` folder names for a message; a long list by its ends and count."""
    if len(steps) > 4:
        return f"{len(steps)} checkpoints, global_step_{steps[0]} to global_step_{steps[-1]}"
    return ", ".join(f"global_step_{s}" for s in steps)


def check_checkpoint(folder: str, verify: Verify = verify_files) -> list[str]:
    """What is wrong with a checkpoint folder, one line each (none: it can be resumed from): its
    trainer state must be readable and its files must match their checksums (`verify`)."""
    try:
        read_state(folder)
        files = read_manifest(folder)
    except (OSError, CorruptCheckpoint) as exc:
        return [str(exc)]
    if files is None:  # written by a vlrl that kept no checksums
        logger.warning("%s has no %s: its files cannot be checked", folder, MANIFEST)
        return []
    return verify(folder, files)


def _out_of_space(exc: BaseException) -> bool:
    """ENOSPC here or on a rank (a rank's error reaches the driver as text)."""
    return (isinstance(exc, OSError) and exc.errno == errno.ENOSPC) or "[Errno 28]" in str(exc)


def _folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(p, n)) for p, _, names in os.walk(folder) for n in names)


def read_state(checkpoint: str) -> dict[str, Any]:
    """The trainer state of a complete checkpoint folder; an error naming the file otherwise."""
    path = os.path.join(checkpoint, STATE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{checkpoint} is not a complete checkpoint (no {STATE}); point trainer.load_checkpoint_path "
            "at a global_step_N folder"
        )
    try:
        with open(path) as f:
            state = json.load(f)
    except (OSError, ValueError) as exc:
        raise CorruptCheckpoint(f"{path} cannot be read ({exc})") from None
    if not isinstance(state, dict) or not isinstance(state.get("global_step"), int):
        raise CorruptCheckpoint(f"{path} holds no global_step: it is not a trainer state vlrl wrote")
    return state
