"""`ToolPool`: tool calls run in isolated worker processes, in parallel, each under a timeout.

Composition over the reward machinery: each worker is a `vlrl.user_code.worker_process.WorkerProcess`
running `tool_worker_main`. A call that exceeds `timeout` (or kills its process) gets an error
output for the model; its worker is killed and replaced before the next call it would take.
`call` and `interact` wait for their results; `submit_calls` + `poll` let the caller go on (the
multi-turn loop's `overlap_tools`) and take results as they come.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import time
from collections import deque
from collections.abc import Sequence
from multiprocessing.connection import wait
from typing import Any

from vlrl.rollout.multi_turn.tool_config import ToolEntry
from vlrl.rollout.multi_turn.tool_worker import tool_worker_main
from vlrl.rollout.multi_turn.tools import ToolOutput
from vlrl.user_code.memory import describe_exit
from vlrl.user_code.worker_process import STARTUP_TIMEOUT, WorkerProcess, idle_workers

logger = logging.getLogger(__name__)


def _failed_call(name: str) -> Any:
    """The output of a call of `name` that failed (why) or timed out."""
    return lambda why, timed_out: ToolOutput(f"error: {name} {why}", error=True, timed_out=timed_out)


class ToolPool:
    """`workers` processes serving the tools of `specs` (and an optional interaction).

    A spec is `path/to/file.py:function` (schema from the signature) or a `ToolEntry` (as read from a
    tool YAML by `tool_config.tool_entries`)."""

    def __init__(
        self,
        specs: Sequence[str | ToolEntry],
        interaction: str | None = None,
        workers: int = 2,
        timeout: float = 30.0,
        max_images: int = 1,
        memory_limit_mb: int | None = None,
    ) -> None:
        entries = [s if isinstance(s, ToolEntry) else ToolEntry(s) for s in specs]
        self.args = (entries, interaction, max_images, memory_limit_mb)
        self.timeout = float(timeout)
        self._ctx = mp.get_context("spawn")
        self._workers: list[WorkerProcess | None] = [self._new(i) for i in range(max(1, workers))]
        info: dict[str, Any] = {}
        try:
            for worker in self._workers:
                assert worker is not None
                info = worker.wait_ready(STARTUP_TIMEOUT)
        except BaseException:
            self.close()
            raise
        self.schemas: list[dict[str, Any]] = info["schemas"]
        """OpenAI-style function schemas, one per tool (for the chat template's tools section)."""
        self.names = [s["function"]["name"] for s in self.schemas]
        self._job_ids = 0  # ids of the messages sent (a reply names its job)
        self._tickets = 0  # ids handed to callers, one per submitted call or interaction
        self._queued: deque[tuple[int, tuple[Any, ...], Any]] = deque()  # (ticket, message, on_failure)
        self._finished: dict[int, Any] = {}  # ticket -> output, until polled

    def _restart(self, slot: int) -> WorkerProcess:
        worker = self._workers[slot] = self._new(slot)
        worker.wait_ready(STARTUP_TIMEOUT)
        return worker

    def _new(self, slot: int) -> WorkerProcess:
        return WorkerProcess(self._ctx, slot, tool_worker_main, self.args, "tool")

    def call(self, calls: list[tuple[str, dict[str, Any], dict[str, Any]]]) -> list[ToolOutput]:
        """Run (name, arguments, context) calls in parallel; outputs in call order."""
        return self._run(self.submit_calls(calls))

    def interact(self, requests: list[tuple[list[dict[str, Any]], dict[str, Any]]]) -> list[str | None]:
        """The interaction's reply (or None: end) for each (messages, context)."""
        return self._run([self._submit(("interact", m, c), lambda why, timed_out: None) for m, c in requests])

    def submit_calls(self, calls: list[tuple[str, dict[str, Any], dict[str, Any]]]) -> list[int]:
        """Queue (name, arguments, context) calls without waiting; a ticket per call for `poll`."""
        return [self._submit(("call", name, args, ctx), _failed_call(name)) for name, args, ctx in calls]

    def poll(self, tickets: set[int], block: bool) -> dict[int, Any]:
        """Start queued jobs on free workers and take the finished ones among `tickets` (their
        outputs, removed from the pool). block: wait until at least one of them has finished."""
        while True:
            self._dispatch()
            self._collect(block and not (tickets & self._finished.keys()))
            done = {t: self._finished.pop(t) for t in tickets & self._finished.keys()}
            if done or not block or not (self._queued or self._busy()):
                return done

    def _submit(self, message: tuple[Any, ...], on_failure: Any) -> int:
        self._tickets += 1
        self._queued.append((self._tickets, message, on_failure))
        return self._tickets

    def _run(self, tickets: list[int]) -> list[Any]:
        results: dict[int, Any] = {}
        while len(results) < len(tickets):
            results.update(self.poll(set(tickets) - results.keys(), block=True))
        return [results[t] for t in tickets]

    def _dispatch(self) -> None:
        """Send queued jobs to idle workers (replacing dead ones)."""
        for worker in idle_workers(self._workers, self._restart, lambda: bool(self._queued)):
            ticket, (kind, *payload), on_failure = self._queued.popleft()
            self._job_ids += 1
            worker.send((kind, self._job_ids, *payload), (self._job_ids, ticket, on_failure), self.timeout)

    def _busy(self) -> list[tuple[int, WorkerProcess]]:
        return [(s, w) for s, w in enumerate(self._workers) if w is not None and w.job is not None]

    def _collect(self, block: bool) -> None:
        """Take replies (and time-outs) of busy workers into `_finished`; block: wait for the first
        reply or the earliest deadline."""
        busy = self._busy()
        if not busy:
            return
        wait_s = max(0.0, min(w.deadline for _, w in busy) - time.monotonic()) if block else 0.0
        ready = wait([w.conn for _, w in busy], timeout=wait_s)
        for slot, worker in busy:
            job_id, ticket, on_failure = worker.job
            if worker.conn in ready:
                try:
                    kind, reply_id, value = worker.conn.recv()
                except (EOFError, OSError):
                    worker.process.join(1)
                    why = describe_exit(worker.process.exitcode, None, None, doing="")
                    self._finished[ticket] = on_failure(f"failed: {why.strip()}", False)
                    self._drop(slot)
                    continue
                if reply_id == job_id:
                    self._finished[ticket] = value
                    worker.job = None
            elif worker.deadline <= time.monotonic():
                self._finished[ticket] = on_failure(f"timed out after {self.timeout:g}s", True)
                self._drop(slot)

    def _drop(self, slot: int) -> None:
        worker = self._workers[slot]
        if worker is not None:
            worker.kill()
        self._workers[slot] = None

    def close(self) -> None:
        """Stop every worker (idempotent)."""
        for slot, worker in enumerate(self._workers):
            if worker is not None:
                worker.stop()
                self._workers[slot] = None

    def __enter__(self) -> ToolPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:  # noqa: SIM105 (module globals may be gone at interpreter exit)
            self.close()
        except Exception:
            pass
