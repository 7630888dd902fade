"""`WorkerProcess`: one worker process as its parent sees it (its pipe, job, memory): the reward
runner's (`vlrl.rewards.runner`) and the tool pool's (`vlrl.rollout.multi_turn.tool_pool`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from vlrl.user_code.loading import UserCodeError
from vlrl.user_code.memory import memory_kib

STARTUP_TIMEOUT = 120.0
"""Seconds a worker may take to start and import the reward file (spawn re-imports the main module)."""


class WorkerProcess:
    """One worker process, its pipe, and the job it is running."""

    def __init__(
        self,
        ctx: Any,
        slot: int,
        target: Callable[..., None],
        args: tuple[Any, ...],
        kind: str,
        memory_limit_mb: int | None = None,
        load_error: type[UserCodeError] = UserCodeError,
    ) -> None:
        """Start `target(conn, *args)` in a `ctx` process named after `kind` and `slot`; it answers
        `ready` or `load_error` first. `memory_limit_mb`: the cap `target` sets on itself (named in
        messages about a failed start); `load_error`: what a failed start raises."""
        self.conn, child = ctx.Pipe()
        self.kind, self.memory_limit_mb, self.load_error = kind, memory_limit_mb, load_error
        self.process = ctx.Process(
            target=target, args=(child, *args), daemon=True, name=f"vlrl-{kind}-{slot}"
        )
        self.process.start()
        child.close()  # so a dead worker shows up as EOF on our end
        self.job: Any = None  # the runner's job in flight
        self.deadline = float("inf")
        self.memory: tuple[int, int] | None = None
        """(resident KiB, peak resident KiB) when last sampled (reported if the worker dies or hangs)."""

    def sample_memory(self) -> None:
        """Record the process's current and peak resident memory (kept when it cannot be read)."""
        if self.process.pid is not None:
            self.memory = memory_kib(self.process.pid) or self.memory

    def wait_ready(self, timeout: float) -> dict[str, Any]:
        """Block until the worker has loaded the user's file; returns its `ready` info."""
        if not self.conn.poll(timeout):
            self.kill()
            raise self.load_error(f"{self.kind} worker did not start within {timeout:g}s")
        try:
            kind, payload = self.conn.recv()
        except (EOFError, OSError):
            code = self.kill()
            raise self.load_error(
                f"{self.kind} worker exited while starting (exit code {code}){self._cap_note()}"
            ) from None
        if kind == "load_error":
            self.kill()
            raise self.load_error(payload + self._cap_note())
        return payload

    def _cap_note(self) -> str:
        """Under a memory cap, a failed start is most often the cap itself (imports count against it)."""
        if self.memory_limit_mb is None:
            return ""
        return (
            f"\n(the worker runs under worker.reward.memory_limit_mb={self.memory_limit_mb}, which counts the "
            "reward file's imports too: if it failed for lack of memory, raise the cap)"
        )

    def send(self, message: tuple[Any, ...], job: Any, timeout: float) -> None:
        """Send any message (pickled here: an unpicklable one raises before a byte is sent) as `job`."""
        self.conn.send(message)
        self.job = job
        self.deadline = time.monotonic() + timeout

    def kill(self) -> int | None:
        """Kill the process (if alive) and close the pipe; returns its exit code."""
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)
        self.conn.close()
        return self.process.exitcode

    def stop(self) -> None:
        """Ask the worker to exit, killing it if it does not within a few seconds."""
        with contextlib.suppress(OSError, ValueError):  # pipe already broken: kill below
            self.conn.send(("stop",))
        self.process.join(2)
        self.kill()


def idle_workers(
    workers: list[WorkerProcess | None],
    restart: Callable[[int], WorkerProcess],
    more: Callable[[], bool],
) -> Iterator[WorkerProcess]:
    """Each worker without a job in flight, in slot order, while `more()` says there is work for
    it; a dead or missing worker is killed and replaced by `restart(slot)` (which also stores it in
    `workers`) only then, so no process starts for nothing."""
    for slot, worker in enumerate(workers):
        if not more():
            return
        if worker is not None and worker.job is not None:
            continue
        if worker is None or not worker.process.is_alive():
            if worker is not None:
                worker.kill()
            worker = restart(slot)
        yield worker
