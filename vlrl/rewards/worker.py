"""Entry point of a reward worker process (started with the `spawn` context by `RewardRunner`).

The worker loads the reward function from its spec (functions are never pickled across processes),
checks the kwargs against its signature, reports `ready` (with the resolved reward type), then serves
jobs until told to stop, until its pipe closes (parent gone), or after a job in which the reward
ran out of memory (MemoryError under `memory_limit_mb`): the parent then starts a fresh worker.

Messages, worker -> parent:
    ("ready", {"pid", "reward_type", "where", "partial_batches"}) | ("load_error", message)
    ("batch", job_id, list[Outcome] | RewardFailure)       batch functions: one reply per job
    ("item", job_id, position, Outcome), ("done", job_id)  sequential functions: one reply per sample
Messages, parent -> worker: ("score", job_id, list[RewardInput]) | ("stop",)
"""

from __future__ import annotations

import os
import signal
from multiprocessing.connection import Connection
from typing import Any

from vlrl.rewards.calling import call_batch, call_one, describe_exception, guarded
from vlrl.rewards.loading import check_kwargs, load_reward_function
from vlrl.rewards.types import RewardFailure, RewardLoadError
from vlrl.user_code.memory import apply_memory_limit


def worker_main(
    conn: Connection, spec: str, reward_type: str, kwargs: dict[str, Any], memory_limit_mb: int | None = None
) -> None:
    """Load the reward function and serve scoring jobs on `conn` (address space capped at
    `memory_limit_mb` MiB, imports included)."""
    # Ctrl-C reaches the whole process group; the parent decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    apply_memory_limit(memory_limit_mb)
    try:
        loaded = load_reward_function(spec, reward_type)
        check_kwargs(loaded, kwargs)
    except RewardLoadError as exc:
        conn.send(("load_error", str(exc)))
        return
    except BaseException as exc:
        conn.send(("load_error", f"loading {spec} {describe_exception(exc)}"))
        return
    info = {
        "reward_type": loaded.reward_type,
        "where": loaded.where,
        "partial_batches": loaded.partial_batches,
    }
    conn.send(("ready", {"pid": os.getpid(), **info}))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the parent went away
            return
        if message[0] == "stop":
            return
        _, job_id, samples = message
        if loaded.reward_type == "sequential":
            outcomes = []
            for position, sample in enumerate(samples):
                outcomes.append(guarded(call_one, loaded, kwargs, sample))
                conn.send(("item", job_id, position, outcomes[-1]))
            conn.send(("done", job_id))
        else:
            result = guarded(call_batch, loaded, kwargs, samples)
            conn.send(("batch", job_id, result))
            outcomes = result if isinstance(result, list) else [result]
        if any(isinstance(o, RewardFailure) and o.out_of_memory for o in outcomes):
            return  # after a MemoryError the heap may stay near the cap: the parent starts a fresh worker
