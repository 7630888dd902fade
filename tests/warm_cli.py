"""`python -m vlrl.trainer.main ARGS` as a user runs it, minus the driver's imports.

The suite runs the real CLI about forty times; each driver spent ~5-8 s (more on a loaded CPU)
importing torch, transformers, Ray, datasets and vlrl before reading its config. Here one helper
process (the "zygote", started on first use and kept for the session) imports them once, then forks
a child per run. The child is a fresh process with those modules already loaded: it changes to the
run's folder, takes the run's environment, sends its stdout/stderr to the caller's files, sets
`sys.argv` and runs `vlrl.trainer.main` as `__main__` — the same code path, exit codes and output as
the subprocess. Nothing in the zygote starts a thread, a Ray connection or a process group before it
forks (imports only), so the children start clean.

`run(args, cwd, env, timeout)` returns a `subprocess.CompletedProcess` like `subprocess.run(...,
capture_output=True, text=True)`. A run past its timeout is killed with its process group (the
child starts a session of its own) and raises `subprocess.TimeoutExpired`, as `subprocess.run` does.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

# What the driver imports before and while it reads a config (measured with `python -X importtime`
# on a quickstart run); the rank workers are Ray processes of their own and import for themselves.
PRELOAD = (
    "torch",
    "transformers",
    "transformers.image_processing_utils",
    "transformers.processing_utils",
    "datasets",
    "ray",
    "ray.util.placement_group",
    "matplotlib",
    "vlrl.config.loader",
    "vlrl.config.easyr1",
    "vlrl.data",
    "vlrl.data.synthetic",
    "vlrl.trainer.main",
    "vlrl.trainer.ray_trainer",
    "vlrl.trainer.summary",
)


def _zygote_main() -> None:
    """Import PRELOAD, then serve requests (one JSON line each on stdin) by forking a child per run."""
    import importlib

    # answers go out on a copy of stdout; what an import prints goes to stderr, not into them
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    os.environ.setdefault("MPLBACKEND", "Agg")
    for name in PRELOAD:
        importlib.import_module(name)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            answers.close()
            _child(request)  # never returns
        answers.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        answers.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")


def _child(request: dict[str, Any]) -> None:
    """Become the run: own session, folder, environment, output files and argv; then the CLI."""
    code = 1
    try:
        os.setsid()
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        stdin = os.open(os.devnull, os.O_RDONLY)
        os.dup2(stdin, 0)
        os.close(stdin)
        # new streams on the redirected descriptors, line-buffered as a terminal's would be
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 (the process's own streams)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.argv = [str(REPO / "vlrl" / "trainer" / "main.py"), *request["args"]]
        sys.path[0] = os.getcwd()  # as `python -m` puts it (the zygote's was this file's folder)
        import runpy

        try:
            runpy.run_module("vlrl.trainer.main", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 (a crash of the run itself: its trace goes to its stderr)
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # the process ends either way
                stream.flush()
        os._exit(code)


class _Zygote:
    """The helper process and a lock: runs go one at a time, as the tests do."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": python_path(), "MPLBACKEND": "Agg"}
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--zygote"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, env=env, cwd=REPO,
        )  # fmt: skip
        self.lock = threading.Lock()
        atexit.register(self.close)

    def run(self, request: dict[str, Any], timeout: float | None) -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        pid = json.loads(self._line())["pid"]
        killed: list[int] = []
        timer = threading.Timer(timeout or 0, lambda: killed.append(_kill_group(pid)))
        if timeout:
            timer.start()
        try:
            code = json.loads(self._line())["returncode"]
        finally:
            timer.cancel()
        if killed:
            raise subprocess.TimeoutExpired(request["args"], timeout or 0)
        return code

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the CLI zygote ended (exit {self.proc.wait()})")
        return line

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


def _kill_group(pid: int) -> int:
    """SIGKILL the run's process group (its session: the driver and what it started); returns pid."""
    import signal

    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    return pid


_zygote: _Zygote | None = None


def python_path() -> str:
    """PYTHONPATH for a run: the checkout, then this process's (the suite puts tests/ there, for
    the warm rank workers' hook: tests/warm_ranks.py)."""
    return os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))


def run(
    args: list[str], cwd: Path | str, env: dict[str, str] | None = None, timeout: float | None = 600
) -> subprocess.CompletedProcess[str]:
    """The CLI with `args` in `cwd` (environment `env`, default this process's): exit code and output."""
    global _zygote
    if _zygote is None or _zygote.proc.poll() is not None:
        _zygote = _Zygote()
    with _zygote.lock, tempfile.TemporaryDirectory(prefix="vlrl-cli-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        request = {"args": args, "cwd": str(cwd), "env": dict(os.environ if env is None else env),
                   "stdout": str(out), "stderr": str(err)}  # fmt: skip
        code = _zygote.run(request, timeout)
        return subprocess.CompletedProcess(
            [sys.executable, "-m", "vlrl.trainer.main", *args], code, out.read_text(), err.read_text()
        )


if __name__ == "__main__" and sys.argv[1:] == ["--zygote"]:
    _zygote_main()
