"""`RewardRunner`: score responses with a drop-in reward function in worker processes.

Rewards run off the training process so that a hanging or crashing reward can be killed without
taking training down. The inputs are split into contiguous chunks, one per worker; results are put
back in input order. A worker that exceeds `timeout` (or dies) is killed and restarted.

The reward file is imported only inside the workers (each loads it from the spec; nothing is
pickled), so its module-level code (heavy imports, a model) never runs in the training process.

`num_workers=0` scores in the calling process: handy under a debugger, but a hang cannot be
interrupted there (no timeout enforcement) and a crash takes the caller down.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import pickle
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

from vlrl.rewards.calling import Outcome, call_batch, call_one, guarded
from vlrl.rewards.loading import LoadedReward, check_kwargs, load_reward_function, reward_file
from vlrl.rewards.types import RewardError, RewardFailure, RewardInput, RewardLoadError, RewardResult
from vlrl.rewards.worker import worker_main
from vlrl.user_code.memory import describe_exit, describe_timeout
from vlrl.user_code.worker_process import STARTUP_TIMEOUT, WorkerProcess, idle_workers

logger = logging.getLogger(__name__)

MEMORY_POLL_S = 1.0
"""While waiting for results, a busy worker's memory is sampled at least this often (for reports)."""
MAX_FAILURE_MESSAGES = 20
"""`RewardResult.failure_messages` keeps at most this many (the count is always exact)."""

_NOT_SCORED = RewardFailure("not scored: stopped after an earlier failure")
"""Marks samples skipped in `on_failure=raise` mode once a failure is known (never reported first)."""


@dataclass
class _Job:
    job_id: int
    indices: list[int]
    """Global sample indices sent to the worker, in order."""
    done: int = 0
    """How many of them the worker has answered (sequential rewards answer one by one)."""
    out_of_memory: bool = False
    """A sample of it raised MemoryError (the worker exits after the job)."""


@dataclass
class _Batch:
    """State of one scoring pass (`RewardStream`)."""

    inputs: dict[int, RewardInput] = field(default_factory=dict)
    """The samples added so far, by position."""
    outcomes: dict[int, Outcome] = field(default_factory=dict)
    pending: deque[list[int]] = field(default_factory=deque)
    failed: bool = False
    retried: set[int] = field(default_factory=set)
    """Samples already sent again after their worker died (each is retried once)."""

    def record(self, index: int, outcome: Outcome) -> None:
        self.outcomes[index] = outcome
        self.failed = self.failed or isinstance(outcome, RewardFailure)

    def fail_chunk(self, indices: Sequence[int], reason: str) -> None:
        failure = RewardFailure(reason, chunk=(indices[0], indices[-1]))
        for i in indices:
            self.record(i, failure)


def _out_of_memory(outcome: Any) -> bool:
    return isinstance(outcome, RewardFailure) and outcome.out_of_memory


def _split(n: int, parts: int) -> list[list[int]]:
    """`range(n)` in `parts` contiguous chunks of near-equal size (no empty chunk)."""
    parts = max(1, min(parts, n))
    size, extra = divmod(n, parts)
    chunks, start = [], 0
    for p in range(parts):
        end = start + size + (1 if p < extra else 0)
        chunks.append(list(range(start, end)))
        start = end
    return chunks


class RewardRunner:
    """Load `config.reward_function` and score `RewardInput`s with it in `config.num_workers` processes.

    Use as a context manager (or call `close()`) so the worker processes are stopped.
    """

    def __init__(self, config: Any) -> None:
        self.config = config
        self.kwargs: dict[str, Any] = dict(config.reward_function_kwargs or {})
        self.timeout = float(config.timeout)
        self.on_failure = config.on_failure
        if self.on_failure not in ("raise", "zero"):
            raise ValueError(f"worker.reward.on_failure={self.on_failure!r} must be raise or zero")
        if config.num_workers < 0 or self.timeout <= 0:
            raise ValueError("worker.reward.num_workers must be >= 0 and worker.reward.timeout > 0")
        self._ctx = mp.get_context("spawn")
        self._workers: list[WorkerProcess | None] = [None] * int(config.num_workers)
        self._job_ids = 0
        self._closed = False
        self.restarts = 0  # worker processes started to replace one that died, hung or ran out of memory
        self.loaded: LoadedReward | None = None
        """The function itself, only when scoring in-process (`num_workers=0`)."""
        self.reward_type = ""
        """`batch` or `sequential`, as resolved when the file was loaded."""
        self.where = ""
        """`file.py:function`, as named in error messages."""
        self.partial_batches = False
        """The file declares `PARTIAL_BATCHES = True` (see `vlrl.rewards.loading`)."""
        if self.num_workers == 0:
            self.loaded = load_reward_function(config.reward_function, config.reward_type)
            check_kwargs(self.loaded, self.kwargs)
            self.reward_type, self.where = self.loaded.reward_type, self.loaded.where
            self.partial_batches = self.loaded.partial_batches
        else:
            # The workers load the file; the training process never runs the user's module code
            # (which may import heavy libraries or load a model). A missing file fails before spawning.
            reward_file(config.reward_function)
            self._start_all()

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    # ------------------------------------------------------------------------------- lifecycle
    def _start_all(self) -> None:
        # Start every process first, then wait: they import in parallel.
        self._workers = [self._new_worker(i) for i in range(self.num_workers)]
        try:
            for worker in self._workers:
                assert worker is not None
                info = worker.wait_ready(STARTUP_TIMEOUT + self.timeout)
        except BaseException:
            self.close()
            raise
        self.reward_type, self.where = info["reward_type"], info["where"]
        self.partial_batches = info["partial_batches"]
        calls = "the whole batch per call" if self.whole_batches else "any part of the batch per call"
        logger.info("started %d reward workers for %s (%s: %s)", self.num_workers, self.where, self.reward_type,
                    calls if self.reward_type == "batch" else "one sample per call")  # fmt: skip

    def _new_worker(self, slot: int) -> WorkerProcess:
        config = self.config
        args = (config.reward_function, config.reward_type, self.kwargs, config.memory_limit_mb)
        return WorkerProcess(
            self._ctx, slot, worker_main, args, "reward", config.memory_limit_mb, RewardLoadError
        )

    def _restart(self, slot: int) -> WorkerProcess:
        worker = self._new_worker(slot)
        self._workers[slot] = worker
        worker.wait_ready(STARTUP_TIMEOUT + self.timeout)
        self.restarts += 1
        logger.warning("reward worker %d restarted (pid %d; %d restarts in this run)", slot,
                       worker.process.pid, self.restarts)  # fmt: skip
        return worker

    def _kill(self, slot: int) -> int | None:
        worker = self._workers[slot]
        self._workers[slot] = None
        return worker.kill() if worker is not None else None

    def close(self) -> None:
        """Stop the worker processes (idempotent)."""
        self._closed = True
        for slot, worker in enumerate(self._workers):
            if worker is not None:
                worker.stop()
                self._workers[slot] = None

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Not contextlib.suppress: at interpreter shutdown module globals may already be None.
        try:  # noqa: SIM105
            self.close()
        except Exception:
            pass

    # --------------------------------------------------------------------------------- scoring
    def score(self, inputs: Sequence[RewardInput]) -> RewardResult:
        """Score `inputs`; the result's scores are in input order and all have the same parts."""
        inputs = list(inputs)
        if not inputs:
            self._check_open()
            return RewardResult(scores=[])
        with self.stream() as stream:
            stream.add(inputs, range(len(inputs)))
            return stream.finish(len(inputs))

    def stream(self) -> RewardStream:
        """Score samples handed over a few at a time (`RewardStream.add`) while the caller goes on
        with other work; use it as a context manager."""
        self._check_open()
        return RewardStream(self)

    def _check_open(self) -> None:
        if self._closed:
            raise RewardError("RewardRunner is closed")

    def _score_in_process(self, inputs: list[RewardInput]) -> list[Outcome]:
        assert self.loaded is not None
        if self.reward_type == "sequential":
            return [guarded(call_one, self.loaded, self.kwargs, s) for s in inputs]
        result = guarded(call_batch, self.loaded, self.kwargs, inputs)
        if isinstance(result, RewardFailure):
            return [RewardFailure(result.reason, chunk=(0, len(inputs) - 1))] * len(inputs)
        return result

    @property
    def whole_batches(self) -> bool:
        """A batch function that must see the whole batch in one call (EasyR1's meaning of a batch
        reward): it is neither split over workers nor streamed group by group."""
        return self.reward_type == "batch" and not self.partial_batches

    def _queue(self, batch: _Batch, positions: list[int]) -> None:
        """Queue `positions` in up to `num_workers` contiguous chunks, or one for `whole_batches`
        (unless a failure already decided the outcome: `on_failure=raise` scores nothing more)."""
        if batch.failed and self.on_failure == "raise":
            return
        for chunk in _split(len(positions), 1 if self.whole_batches else self.num_workers):
            batch.pending.append([positions[i] for i in chunk])

    def _pump(self, batch: _Batch, max_wait: float) -> None:
        """Hand queued chunks to idle workers and take in what arrives within `max_wait` seconds."""
        if batch.failed and self.on_failure == "raise":
            # We are going to raise: start nothing new, but let running jobs finish (bounded by
            # the timeout) rather than killing healthy workers that we would have to restart.
            batch.pending.clear()
        self._dispatch(batch)
        self._collect(batch, max_wait)

    def _busy(self) -> list[tuple[int, WorkerProcess]]:
        return [(slot, w) for slot, w in enumerate(self._workers) if w is not None and w.job is not None]

    def _abort_busy(self) -> None:
        for slot, _ in self._busy():
            self._kill(slot)

    def _dispatch(self, batch: _Batch) -> None:
        for worker in idle_workers(self._workers, self._restart, lambda: bool(batch.pending)):
            indices = batch.pending.popleft()
            self._job_ids += 1
            _send_job(worker, _Job(self._job_ids, indices), [batch.inputs[i] for i in indices], self.timeout)

    def _collect(self, batch: _Batch, max_wait: float = MEMORY_POLL_S) -> None:
        """Wait for the next message (or deadline, at most `max_wait` s), handle it, then enforce
        the deadlines."""
        busy = self._busy()
        if not busy:
            return
        wait_s = max(0.0, min(max_wait, min(w.deadline for _, w in busy) - time.monotonic()))
        ready = wait([w.conn for _, w in busy], timeout=wait_s)
        for slot, worker in busy:
            worker.sample_memory()
            if worker.conn in ready:
                self._receive(slot, worker, batch)
        now = time.monotonic()
        limit = self.config.memory_limit_mb
        for slot, worker in self._busy():
            if worker.deadline <= now and not worker.conn.poll():
                self._lose_job(slot, batch, describe_timeout(self.timeout, worker.memory, limit))

    def _receive(self, slot: int, worker: WorkerProcess, batch: _Batch) -> None:
        job = worker.job
        assert job is not None
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):
            worker.process.join(1)  # reap it so the exit code is known
            peak = worker.memory[1] if worker.memory else None
            reason = describe_exit(worker.process.exitcode, peak, self.config.memory_limit_mb)
            self._lose_job(slot, batch, reason, retry=True)
            return
        kind, job_id = message[0], message[1]
        if job_id != job.job_id:
            return  # a reply to a job we already gave up on
        if kind == "item":
            batch.record(job.indices[message[2]], message[3])
            job.done += 1
            job.out_of_memory = job.out_of_memory or _out_of_memory(message[3])
            worker.deadline = time.monotonic() + self.timeout  # the timeout is per call
        elif kind == "done":
            worker.job = None
        elif kind == "batch":
            result = message[2]
            if isinstance(result, RewardFailure):
                batch.fail_chunk(job.indices, result.reason)
            else:
                for index, outcome in zip(job.indices, result):
                    batch.record(index, outcome)
            job.out_of_memory = any(map(_out_of_memory, result if isinstance(result, list) else [result]))
            worker.job = None
        if worker.job is None and job.out_of_memory:  # the worker exits after it: replace it
            logger.warning("reward worker %d ran out of memory; a fresh one takes its place", slot)
            self._kill(slot)

    def _lose_job(self, slot: int, batch: _Batch, reason: str, retry: bool = False) -> None:
        """The worker hung or died: kill it; blame the sample in flight (sequential) or the chunk.
        With `retry` (a death, which may be transient), unanswered samples not retried before go
        once more to a fresh worker instead."""
        worker = self._workers[slot]
        assert worker is not None and worker.job is not None
        remaining = worker.job.indices[worker.job.done :]
        logger.warning("reward worker %d (pid %d): %s", slot, worker.process.pid, reason)
        self._kill(slot)
        if not remaining:
            return
        if retry and not batch.retried.intersection(remaining):
            batch.retried.update(remaining)
            batch.pending.appendleft(remaining)
            logger.warning("retrying its %d unanswered sample(s) once on a fresh worker", len(remaining))
            return
        if self.reward_type == "sequential":
            batch.record(remaining[0], RewardFailure(reason))
            if remaining[1:]:
                batch.pending.appendleft(remaining[1:])
        else:
            batch.fail_chunk(remaining, reason)

    # ------------------------------------------------------------------------------- results
    def _describe(self, index: int, failure: RewardFailure) -> str:
        where = f"reward function {self.where} ({self.reward_type})"
        if failure.chunk is not None:
            first, last = failure.chunk
            return f"{where} failed on samples {first}-{last} (one batch call): {failure.reason}"
        return f"{where} failed on sample {index}: {failure.reason}"

    def _finish(self, outcomes: list[Outcome]) -> RewardResult:
        failed = [(i, o) for i, o in enumerate(outcomes) if isinstance(o, RewardFailure)]
        messages: list[str] = []
        seen = {id(_NOT_SCORED)}
        for i, failure in failed:
            if len(messages) == MAX_FAILURE_MESSAGES:  # a broken reward can fail every sample
                break
            if id(failure) not in seen:  # a chunk failure is one object shared by its samples
                seen.add(id(failure))
                messages.append(self._describe(i, failure))
        if failed and self.on_failure == "raise":
            skipped = sum(o is _NOT_SCORED for o in outcomes)
            raise RewardError(
                f"{messages[0]}\n({len(failed) - skipped} of {len(outcomes)} samples failed, {skipped} not "
                "scored; set worker.reward.on_failure=zero to score failed samples 0 and continue)"
            )
        names = set().union(*(o for o in outcomes if not isinstance(o, RewardFailure)))
        parts = ["overall", *sorted(names - {"overall"})]
        # Missing parts (and every part of a failed sample) are 0.0 so each part has one value per sample.
        scores = [
            {p: (0.0 if isinstance(o, RewardFailure) else o.get(p, 0.0)) for p in parts} for o in outcomes
        ]
        if failed:
            logger.warning(
                "%d of %d reward samples failed and scored 0; first: %s",
                len(failed),
                len(outcomes),
                messages[0],
            )
        limit = self.config.max_failure_rate
        if len(failed) > limit * len(outcomes):
            raise RewardError(
                f"{len(failed)} of {len(outcomes)} reward samples failed in one step, more than "
                f"worker.reward.max_failure_rate={limit:g} allows: scores of 0 in their place would train "
                f"the model on a broken reward. First: {messages[0]}"
            )
        return RewardResult(scores=scores, failures=len(failed), failure_messages=messages)


class RewardStream:
    """One scoring pass over samples handed over as they become ready.

    `add` queues samples at their final positions and starts them on idle workers at once; `pump`
    takes in finished results (call it while waiting on something else); `finish` waits for the
    rest and returns the `RewardResult` in position order. Chunks are contiguous within one `add`,
    so a batch reward function is called once per chunk of what was added together (a group, as
    the trainer streams them). Leaving the `with` block early kills the workers still busy, so no
    stale answer can reach a later pass. `num_workers=0` scores in `add` itself.
    """

    def __init__(self, runner: RewardRunner) -> None:
        self.runner = runner
        self.batch = _Batch()

    def __enter__(self) -> RewardStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.runner._abort_busy()  # only busy when leaving early (an exception): no stale jobs

    def add(self, inputs: Sequence[RewardInput], positions: Sequence[int]) -> None:
        """Queue `inputs[i]` as sample `positions[i]` (each position once)."""
        positions = list(positions)
        if len(positions) != len(inputs):
            raise ValueError(f"RewardStream.add: {len(inputs)} inputs for {len(positions)} positions")
        for position, sample in zip(positions, inputs):
            if position in self.batch.inputs or position < 0:
                raise ValueError(f"RewardStream.add: sample {position} is negative or added twice")
            self.batch.inputs[position] = sample
        if not positions:
            return
        if self.runner.num_workers == 0:
            self._score_now(list(inputs), positions)
            return
        self.runner._queue(self.batch, positions)
        self.pump(0.0)

    def _score_now(self, inputs: list[RewardInput], positions: list[int]) -> None:
        for position, outcome in zip(positions, self.runner._score_in_process(inputs)):
            if isinstance(outcome, RewardFailure) and outcome.chunk is not None:  # name the positions
                outcome = RewardFailure(outcome.reason, chunk=(positions[0], positions[-1]))
            self.batch.record(position, outcome)

    @property
    def scored(self) -> int:
        """Samples with an outcome so far."""
        return len(self.batch.outcomes)

    def pump(self, max_wait: float = 0.0) -> None:
        """Start queued chunks on idle workers; take in results arriving within `max_wait` seconds."""
        if self.runner.num_workers > 0:
            self.runner._pump(self.batch, max_wait)

    def finish(self, total: int) -> RewardResult:
        """Wait for the added samples, which must be positions 0 .. total-1; the result in position
        order (raises on failures in `on_failure=raise` mode, naming the file, function and sample)."""
        if sorted(self.batch.inputs) != list(range(total)):
            missing = total - len(self.batch.inputs.keys() & set(range(total)))
            raise ValueError(
                f"RewardStream.finish: {missing} of {total} samples were never added (or extra ones were)"
            )
        while self.runner.num_workers > 0 and (self.batch.pending or self.runner._busy()):
            self.runner._pump(self.batch, MEMORY_POLL_S)
        return self.runner._finish([self.batch.outcomes.get(i, _NOT_SCORED) for i in range(total)])


def _send_job(worker: WorkerProcess, job: _Job, samples: list[RewardInput], timeout: float) -> None:
    """Hand `samples` to an idle worker as `job` (pickled here: unpicklable inputs fail before a byte is sent)."""
    try:
        worker.send(("score", job.job_id, samples), job, timeout)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise RewardError(
            f"could not send the inputs to a reward worker: {exc!r}; every RewardInput value "
            "(extra columns included) must be picklable"
        ) from exc
