"""`ToolPool`: tool calls run in isolated worker processes, in parallel, each under a timeout.

Composition over the reward machinery: each worker is a `vlrl.rewards.worker_process.WorkerProcess`
running `tool_worker_main`. A call that exceeds `timeout` (or kills its process) gets an error
output for the model; its worker is killed and replaced before the next call it would take.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import time
from collections import deque
from collections.abc import Sequence
from multiprocessing.connection import wait
from typing import Any

from vlrl.rewards.memory import describe_exit
from vlrl.rewards.worker_process import STARTUP_TIMEOUT, WorkerProcess
from vlrl.rollout.multi_turn.tool_config import ToolEntry
from vlrl.rollout.multi_turn.tool_worker import tool_worker_main
from vlrl.rollout.multi_turn.tools import ToolOutput

logger = logging.getLogger(__name__)


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
        self._job_ids = 0

    def _new(self, slot: int) -> WorkerProcess:
        return WorkerProcess(self._ctx, None, {}, slot, target=tool_worker_main, args=self.args, kind="tool")

    def call(self, calls: list[tuple[str, dict[str, Any], dict[str, Any]]]) -> list[ToolOutput]:
        """Run (name, arguments, context) calls in parallel; outputs in call order."""
        messages = [("call", name, args, ctx) for name, args, ctx in calls]
        names = [name for name, _, _ in calls]
        return self._run(messages, lambda i, why, timed_out: ToolOutput(f"error: {names[i]} {why}", error=True,
                                                                          timed_out=timed_out))  # fmt: skip

    def interact(self, requests: list[tuple[list[dict[str, Any]], dict[str, Any]]]) -> list[str | None]:
        """The interaction's reply (or None: end) for each (messages, context)."""
        return self._run([("interact", m, c) for m, c in requests], lambda i, why, timed_out: None)

    def _run(self, messages: list[tuple[Any, ...]], on_failure: Any) -> list[Any]:
        results: list[Any] = [None] * len(messages)
        pending = deque(range(len(messages)))
        while pending or self._busy():
            for slot in range(len(self._workers)):
                if not pending:
                    break
                worker = self._workers[slot]
                if worker is not None and worker.job is not None:
                    continue
                if worker is None or not worker.process.is_alive():
                    if worker is not None:
                        worker.kill()
                    worker = self._workers[slot] = self._new(slot)
                    worker.wait_ready(STARTUP_TIMEOUT)
                index = pending.popleft()
                self._job_ids += 1
                kind, *payload = messages[index]
                worker.send((kind, self._job_ids, *payload), (self._job_ids, index), self.timeout)
            self._collect(results, on_failure)
        return results

    def _busy(self) -> list[tuple[int, WorkerProcess]]:
        return [(s, w) for s, w in enumerate(self._workers) if w is not None and w.job is not None]

    def _collect(self, results: list[Any], on_failure: Any) -> None:
        busy = self._busy()
        if not busy:
            return
        wait_s = max(0.0, min(w.deadline for _, w in busy) - time.monotonic())
        ready = wait([w.conn for _, w in busy], timeout=wait_s)
        for slot, worker in busy:
            job_id, index = worker.job
            if worker.conn in ready:
                try:
                    kind, reply_id, value = worker.conn.recv()
                except (EOFError, OSError):
                    worker.process.join(1)
                    why = describe_exit(worker.process.exitcode, None, None).replace("while scoring", "")
                    results[index] = on_failure(index, f"failed: {why.strip()}", False)
                    self._drop(slot)
                    continue
                if reply_id == job_id:
                    results[index] = value
                    worker.job = None
            elif worker.deadline <= time.monotonic():
                results[index] = on_failure(index, f"timed out after {self.timeout:g}s", True)
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
