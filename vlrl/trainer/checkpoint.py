"""Atomic checkpoints with a tracker of the latest and best, and a retention limit.

Layout under `trainer.save_checkpoint_path`:
    global_step_N/            complete checkpoint (renamed into place as the very last act)
        actor/                model, optimizer, scheduler and RNG states (written by the ranks)
        trainer_state.json    step, dataloader position, KL coefficient, validation score
    global_step_N.tmp/        a save in progress; never resumed from, removed on the next save
    checkpoint_tracker.json   {"latest": N, "best": M, "best_score": x}, replaced atomically

A crash (or kill -9) at any moment leaves either the previous complete checkpoint or the new one.

Checkpoints vlrl did not write (a `global_step_N` without `trainer_state.json`, e.g. EasyR1's, and
EasyR1's `checkpoint_tracker.json`) are never deleted or overwritten: they are reported at start-up,
vlrl's tracker then goes to `vlrl_checkpoint_tracker.json`, and a run that would save a step of the
same number stops at start-up (`check_no_collisions`).
The ranks write their shards into the folder and the driver completes it, so the folder must be
shared by all nodes: `check_shared_filesystem` verifies that at start-up.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import socket
import uuid
from collections.abc import Callable
from typing import Any

STEP_DIR = re.compile(r"^global_step_(\d+)$")
TRACKER = "checkpoint_tracker.json"
OWN_TRACKER = "vlrl_checkpoint_tracker.json"  # used when TRACKER belongs to another trainer
STATE = "trainer_state.json"
logger = logging.getLogger(__name__)


def _write_json_atomic(path: str, data: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class CheckpointManager:
    def __init__(self, root: str, save_limit: int = -1) -> None:
        self.root = root
        self.save_limit = save_limit
        os.makedirs(root, exist_ok=True)
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
        return {"latest": None, "best": None, "best_score": None}

    def foreign_steps(self) -> list[int]:
        """Steps of `global_step_N` folders without vlrl's trainer state (another trainer's)."""
        steps = []
        for name in os.listdir(self.root):
            match = STEP_DIR.match(name)
            if match and not os.path.isfile(os.path.join(self.root, name, STATE)):
                steps.append(int(match.group(1)))
        return sorted(steps)

    def foreign_entries(self) -> list[str]:
        """Names of everything in the folder that another trainer wrote, for the start-up report."""
        names = [f"global_step_{step}" for step in self.foreign_steps()]
        if self.tracker_path.endswith(OWN_TRACKER) and os.path.isfile(os.path.join(self.root, TRACKER)):
            names.append(TRACKER)
        return names

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
        """Steps with a complete checkpoint folder, oldest first."""
        steps = []
        for name in os.listdir(self.root):
            match = STEP_DIR.match(name)
            if match and os.path.isfile(os.path.join(self.root, name, STATE)):
                steps.append(int(match.group(1)))
        return sorted(steps)

    def latest(self) -> str | None:
        steps = self.complete_steps()
        return os.path.join(self.root, f"global_step_{steps[-1]}") if steps else None

    def save(
        self, step: int, write_actor: Callable[[str], None], state: dict[str, Any], score: float | None
    ) -> str:
        """Write a checkpoint for `step`: actor files via `write_actor(folder)`, then the trainer state."""
        final = os.path.join(self.root, f"global_step_{step}")
        if os.path.isdir(final) and not os.path.isfile(os.path.join(final, STATE)):
            raise RuntimeError(
                f"{final} was not written by vlrl; it is not overwritten (choose another folder)"
            )
        tmp = final + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        write_actor(os.path.join(tmp, "actor"))
        _write_json_atomic(os.path.join(tmp, STATE), {"global_step": step, "val_score": score, **state})
        shutil.rmtree(final, ignore_errors=True)  # a re-save of the same step (e.g. after resume)
        os.replace(tmp, final)  # the commit point
        self._update_tracker(step, score)
        self._enforce_limit()
        return final

    def _update_tracker(self, step: int, score: float | None) -> None:
        self.tracker["latest"] = step
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
        for step in steps:
            if step not in keep:
                shutil.rmtree(os.path.join(self.root, f"global_step_{step}"), ignore_errors=True)
        for name in os.listdir(self.root):  # leftovers of interrupted saves
            if name.endswith(".tmp") and name.startswith("global_step_"):
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)


def probe_shared_path(marker: str, token: str, rank: int) -> tuple[bool, str]:
    """Rank side of `check_shared_filesystem`: (saw the driver's marker, this host's name).

    A rank that sees it answers with a file of its own next to it, for the driver to find."""
    try:
        with open(marker) as f:
            seen = f.read() == token
    except OSError:
        seen = False
    if seen:
        with open(f"{marker}.rank{rank}", "w") as f:
            f.write(token)
    return seen, socket.gethostname()


def check_shared_filesystem(root: str, probe_ranks: Callable[[str, str], list[tuple[bool, str]]]) -> None:
    """Every rank writes its checkpoint shards under `root` and the driver completes the checkpoint
    there (trainer state, rename), so `root` must be one folder for all of them: shared storage on a
    multi-node cluster. Checked once at start-up, before any training time is spent.

    `probe_ranks(marker, token)` runs `probe_shared_path` on every rank and returns their answers."""
    os.makedirs(root, exist_ok=True)
    token = uuid.uuid4().hex
    marker = os.path.join(root, f".vlrl_shared_check_{token}")
    with open(marker, "w") as f:
        f.write(token)
        f.flush()
        os.fsync(f.fileno())
    answers: list[tuple[bool, str]] = []
    try:
        answers = probe_ranks(marker, token)
        blind = [f"rank {r} on {host}" for r, (seen, host) in enumerate(answers) if not seen]
        unseen = [
            f"rank {r} on {host}"
            for r, (seen, host) in enumerate(answers)
            if seen and not os.path.isfile(f"{marker}.rank{r}")
        ]
    finally:
        for path in [marker] + [f"{marker}.rank{r}" for r in range(len(answers))]:
            with contextlib.suppress(OSError):
                os.remove(path)
    if blind or unseen:
        raise RuntimeError(
            f"trainer.save_checkpoint_path={root} is not one folder shared by the driver "
            f"({socket.gethostname()}) and every rank: "
            + (f"{', '.join(blind)} cannot see a file the driver wrote there" if blind else "")
            + ("; " if blind and unseen else "")
            + (f"the driver cannot see the files of {', '.join(unseen)}" if unseen else "")
            + ". Every rank writes its checkpoint shards there and the driver completes the checkpoint:"
            " point it at shared storage (NFS or a cluster filesystem mounted at the same path on all nodes)"
        )


def read_state(checkpoint: str) -> dict[str, Any]:
    """The trainer state of a complete checkpoint folder; a clear error otherwise."""
    path = os.path.join(checkpoint, STATE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{checkpoint} is not a complete checkpoint (no {STATE}); point trainer.load_checkpoint_path "
            "at a global_step_N folder"
        )
    with open(path) as f:
        return json.load(f)
