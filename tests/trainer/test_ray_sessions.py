"""Ray's session folders: ended vlrl runs' are removed beyond the newest few; others never."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from vlrl.trainer.ray_sessions import MARK, mark_session, remove_ended_sessions


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid  # reaped: no process has it (until the kernel reuses it)


def _session(root: Path, index: int, pid: int, marked: bool = True) -> Path:
    path = root / f"session_2026-11-26_10-00-{index:02d}_000000_{pid}"
    (path / "logs").mkdir(parents=True)
    (path / "logs" / "raylet.out").write_bytes(b"x" * 1000)
    if marked:
        (path / MARK).write_text("1\n")
    os.utime(path, (1_000_000 + index, 1_000_000 + index))
    return path


def test_only_ended_marked_sessions_beyond_the_newest_kept_are_removed(tmp_path: Path) -> None:
    dead = _dead_pid()
    ended = [_session(tmp_path, i, dead) for i in range(4)]  # mtimes: 0 oldest ... 3 newest
    running = _session(tmp_path, 10, os.getpid())  # a cluster whose starter is alive
    foreign = _session(tmp_path, 11, dead, marked=False)  # another Ray user's
    current = _session(tmp_path, 12, dead)
    (tmp_path / "session_latest").symlink_to(current)

    removed = remove_ended_sessions(str(tmp_path), str(current), kept=2)

    assert sorted(removed) == sorted(str(path) for path in ended[:2])
    assert [path.exists() for path in ended] == [False, False, True, True]
    assert running.exists() and foreign.exists() and current.exists()
    assert remove_ended_sessions(str(tmp_path), str(current), kept=2) == []


def test_a_missing_temp_folder_removes_nothing(tmp_path: Path) -> None:
    assert remove_ended_sessions(str(tmp_path / "absent"), str(tmp_path)) == []


def test_mark_session_names_the_starting_process(tmp_path: Path) -> None:
    mark_session(str(tmp_path))
    assert (tmp_path / MARK).read_text() == f"{os.getpid()}\n"
