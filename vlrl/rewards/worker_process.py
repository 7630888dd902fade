"""`WorkerProcess`: one reward worker process as seen from `RewardRunner` (its pipe, job, memory)."""

from __future__ import annotations

import contextlib
import pickle
import time
from collections.abc import Callable, Iterator
from typing import Any

from vlrl.rewards.memory import memory_kib
from vlrl.rewards.types import RewardError, RewardInput, RewardLoadError
from vlrl.rewards.worker import worker_main

STARTUP_TIMEOUT = 120.0
"""Seconds a worker may take to start and import the reward file (spawn re-imports the main module)."""


class WorkerProcess:
    """One worker process, its pipe, and the job it is running."""

    def __init__(
        self,
        ctx: Any,
        config: Any,
        kwargs: dict[str, Any],
        slot: int,
        target: Callable[..., None] | None = None,
        args: tuple[Any, ...] | None = None,
        kind: str = "reward",
    ) -> None:
        """A reward worker for `config`; or, with `target` and `args`, any worker served the same
        way (`target(conn, *args)`, answering `ready`/`load_error` first; tools use this)."""
        self.conn, child = ctx.Pipe()
        if target is None:
            target = worker_main
            args = (config.reward_function, config.reward_type, kwargs, config.memory_limit_mb)
        self.kind = kind
        self.memory_limit_mb = getattr(config, "memory_limit_mb", None) if target is worker_main else None
        self.process = ctx.Process(
            target=target, args=(child, *(args or ())), daemon=True, name=f"vlrl-{kind}-{slot}"
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
        """Block until the worker has loaded the reward function; returns its `ready` info."""
        if not self.conn.poll(timeout):
            self.kill()
            raise RewardLoadError(f"{self.kind} worker did not start within {timeout:g}s")
        try:
            kind, payload = self.conn.recv()
        except (EOFError, OSError):
            code = self.kill()
            raise RewardLoadError(
                f"{self.kind} worker exited while starting (exit code {code}){self._cap_note()}"
            ) from None
        if kind == "load_error":
            self.kill()
            raise RewardLoadError(payload + self._cap_note())
        return payload

    def _cap_note(self) -> str:
        """Under a memory cap, a failed start is most often the cap itself (imports count against it)."""
        if self.memory_limit_mb is None:
            return ""
        return (
            f"\n(the worker runs under worker.reward.memory_limit_mb={self.memory_limit_mb}, which counts the "
            "reward file's imports too: if it failed for lack of memory, raise the cap)"
        )

    def send_job(self, job: Any, samples: list[RewardInput], timeout: float) -> None:
        try:
            self.conn.send(("score", job.job_id, samples))
        except (pickle.PicklingError, TypeError, AttributeError) as exc:  # pickled before any byte is sent
            raise RewardError(
                f"could not send the inputs to a reward worker: {exc!r}; every RewardInput value "
                "(extra columns included) must be picklable"
            ) from exc
        self.job = job
        self.deadline = time.monotonic() + timeout

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
