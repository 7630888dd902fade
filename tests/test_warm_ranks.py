"""The suite's warm rank workers (tests/warm_ranks.py) behave as the processes Ray starts: the
worker's exit code, signals, environment, folder and streams are its own, and a worker whose
client was killed ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import warm_ranks

WORKER = """
import os, signal, sys, time
print("worker", os.getpid(), os.getcwd(), os.environ.get("ROLE"), "colorsys" in sys.modules, sys.argv[1:], flush=True)
print("to stderr", file=sys.stderr, flush=True)
if sys.argv[1] == "wait":
    open(sys.argv[2], "w").write(str(os.getpid()))
    time.sleep(60)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture
def zygote(tmp_path: Path) -> Iterator[str]:
    """A zygote that preloads `colorsys` only (the real one preloads torch, vLLM and vlrl)."""
    path = str(tmp_path / "z.sock")
    env = {**os.environ, warm_ranks.OWNER_ENV: str(os.getpid())}
    proc = subprocess.Popen([sys.executable, warm_ranks.__file__, "--zygote", path, "colorsys"], env=env)
    deadline = time.monotonic() + 60
    while not os.path.exists(path):
        assert proc.poll() is None and time.monotonic() < deadline, "the zygote did not start"
        time.sleep(0.05)
    yield path
    proc.kill()
    proc.wait()


def _client(zygote: str, folder: Path, *args: str) -> subprocess.Popen:
    script = folder / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, warm_ranks.SOCKET_ENV: zygote, "ROLE": "rank"}
    return subprocess.Popen(
        [sys.executable, warm_ranks.__file__, str(script), *args],
        cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_the_worker_runs_forked_with_the_clients_folder_environment_streams_and_exit_code(
    zygote: str, tmp_path: Path
) -> None:
    proc = _client(zygote, tmp_path, "3")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, err
    word, pid, cwd, role, preloaded, args = out.split(" ", 5)
    assert (word, cwd, role, preloaded, args.strip()) == ("worker", str(tmp_path), "rank", "True", "['3']")
    assert int(pid) != proc.pid  # forked by the zygote, not the client itself
    assert "to stderr" in err


def test_a_signal_to_the_client_reaches_the_worker_and_the_client_ends_by_it(
    zygote: str, tmp_path: Path
) -> None:
    proc = _client(zygote, tmp_path, "wait", str(tmp_path / "pid"))
    worker = _pid_when_written(tmp_path / "pid")
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGTERM
    assert _gone(worker)


def test_a_worker_whose_client_was_killed_ends(zygote: str, tmp_path: Path) -> None:
    proc = _client(zygote, tmp_path, "wait", str(tmp_path / "pid"))
    worker = _pid_when_written(tmp_path / "pid")
    proc.kill()  # SIGKILL: nothing is passed on; the worker sees its connection close
    proc.wait(timeout=30)
    assert _gone(worker)


def _pid_when_written(path: Path) -> int:
    deadline = time.monotonic() + 60
    while not (path.exists() and path.read_text()):
        assert time.monotonic() < deadline, "the worker did not start"
        time.sleep(0.05)
    return int(path.read_text())


def _gone(pid: int, wait_s: float = 30) -> bool:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if not warm_ranks._alive(pid):
            return True
        time.sleep(0.05)
    return False
