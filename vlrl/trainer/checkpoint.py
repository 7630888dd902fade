"""Atomic checkpoints with a tracker of the latest and best, and a retention limit.

Layout under `trainer.save_checkpoint_path`:
    global_step_N/            complete checkpoint (renamed into place as the very last act)
        actor/                model, optimizer, scheduler and RNG states (written by the ranks)
        trainer_state.json    step, dataloader position, KL coefficient, validation score
    global_step_N.tmp/        a save in progress; never resumed from, removed on the next save
    checkpoint_tracker.json   {"latest": N, "best": M, "best_score": x}, replaced atomically

A crash (or kill -9) at any moment leaves either the previous complete checkpoint or the new one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from typing import Any

STEP_DIR = re.compile(r"^global_step_(\d+)$")
TRACKER = "checkpoint_tracker.json"
STATE = "trainer_state.json"


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
        self.tracker = self._read_tracker()

    def _read_tracker(self) -> dict[str, Any]:
        path = os.path.join(self.root, TRACKER)
        if os.path.isfile(path):
            with open(path) as f:
                return json.load(f)
        return {"latest": None, "best": None, "best_score": None}

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
        _write_json_atomic(os.path.join(self.root, TRACKER), self.tracker)

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
