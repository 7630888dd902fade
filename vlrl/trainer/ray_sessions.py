"""The folders Ray leaves under its temp folder: one `session_<date>_<time>_<usec>_<pid>` per local
cluster, with its logs and sockets (0.3-4 MB each here), never removed by Ray itself. A run that
starts its own cluster marks its folder, and removes the marked folders of earlier runs whose
starting process is gone, keeping the newest `KEPT` for their logs. Folders of other Ray users
(no mark) and of clusters still running are never touched."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from pathlib import Path

MARK = "vlrl_run"  # a file in the session folder: the run that started this cluster was vlrl's
KEPT = 5  # ended runs' folders kept, newest first, for their logs
logger = logging.getLogger(__name__)


def mark_session(session_dir: str) -> None:
    Path(session_dir, MARK).write_text(f"{os.getpid()}\n")


def remove_ended_sessions(temp_dir: str, current: str, kept: int = KEPT) -> list[str]:
    """Remove the marked session folders of ended runs in `temp_dir`, all but the newest `kept`
    and never `current`; their paths. Logged with the space freed."""
    ended = [
        path
        for path in _marked_sessions(temp_dir)
        if path != os.path.abspath(current) and not _starter_alive(path)
    ]
    ended.sort(key=os.path.getmtime, reverse=True)
    removed, freed = [], 0
    for path in ended[kept:]:
        size = _size(path)
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            removed.append(path)
            freed += size
    if removed:
        logger.info("removed %d Ray session folder(s) of ended vlrl runs under %s (%.1f MB); the newest %d are kept",
                    len(removed), temp_dir, freed / 2**20, kept)  # fmt: skip
    return removed


def _marked_sessions(temp_dir: str) -> list[str]:
    try:
        names = os.listdir(temp_dir)
    except OSError:
        return []
    paths = [os.path.join(os.path.abspath(temp_dir), name) for name in names if name.startswith("session_")]
    return [path for path in paths if not os.path.islink(path) and os.path.isfile(os.path.join(path, MARK))]


def _starter_alive(session_dir: str) -> bool:
    """Whether the process that started the cluster (the pid ending the folder's name) is running;
    an unreadable name counts as alive, so it is kept."""
    pid = os.path.basename(session_dir).rsplit("_", 1)[-1]
    if not pid.isdigit():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _size(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total
