"""CPU threads of a rank worker: the node's CPUs shared between its ranks.

Ray sets `OMP_NUM_THREADS` in an actor's process when it is unset, to the actor's whole "CPU"
resource, at least 1 (ray 2.60, python/ray/_private/utils.py `set_omp_num_threads_if_unset`, run
when the actor is created; a rank asks for `RANK_NUM_CPUS` = 1). torch takes its intra-op thread
count from it, so on a GPU node image preprocessing, the CPU-offloaded AdamW step and the weight
sync's host copies would run on one core of the node's many. A rank therefore sets its threads to
CPUs per node // ranks per node (at least 1), and `OMP_NUM_THREADS` to the same for its children.

A user's own `OMP_NUM_THREADS` wins: the driver forwards the one it was started with
(`user_thread_env`), and a value other than Ray's in a rank's environment (exported before
`ray start`) is the user's too.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

RANK_NUM_CPUS = 1
"""The Ray "CPU" resource each rank actor asks for (`vlrl.trainer.ray_workers.start_rank_groups`)."""
USER_THREADS_ENV = "VLRL_USER_OMP_NUM_THREADS"
"""The driver's own OMP_NUM_THREADS, forwarded to the ranks: a user's setting, not Ray's."""


def rank_cpu_threads(node_cpus: int, ranks_per_node: int, user_value: str | None = None) -> int:
    """Threads of one rank: the user's OMP_NUM_THREADS when it is a positive integer, else the
    node's CPUs split evenly between its ranks, at least 1."""
    return _positive_int(user_value) or max(1, node_cpus // max(ranks_per_node, 1))


def _positive_int(value: str | None) -> int | None:
    text = (value or "").strip()
    return int(text) if text.isdigit() and int(text) >= 1 else None


def user_thread_setting(env: Mapping[str, str], under_ray: bool) -> str | None:
    """The user's OMP_NUM_THREADS as this rank sees it, or None when only Ray (or nobody) set it.

    Under Ray a value equal to the one Ray sets (`RANK_NUM_CPUS`) cannot be told from Ray's and
    counts as Ray's; the driver's forwarded value (`USER_THREADS_ENV`) is always the user's."""
    if env.get(USER_THREADS_ENV):
        return env[USER_THREADS_ENV]
    value = env.get("OMP_NUM_THREADS")
    if not value or (under_ray and value.strip() == str(RANK_NUM_CPUS)):
        return None
    return value


def user_thread_env(env: Mapping[str, str]) -> dict[str, str]:
    """Runtime-env variables that carry the driver's OMP_NUM_THREADS (if any) to every rank: set
    before the worker starts, Ray leaves it alone and torch reads it at import."""
    value = env.get("OMP_NUM_THREADS")
    return {"OMP_NUM_THREADS": value, USER_THREADS_ENV: value} if value else {}


def node_cpus() -> int:
    """CPUs this process may run on (its affinity mask: a cpuset or taskset counts), else all."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def set_rank_threads(ranks_per_node: int, under_ray: bool) -> str:
    """Set torch's intra-op threads by `rank_cpu_threads` and, under Ray, `OMP_NUM_THREADS` for
    the rank's child processes (tool workers, engine helpers). Returns a line for the start-up log.

    In-process (tests, one rank in the caller's process) the environment is left alone: it is the
    caller's, and its children (other test runs) would read the value as a user's setting."""
    import torch

    user = user_thread_setting(os.environ, under_ray)
    cpus = node_cpus()
    threads = rank_cpu_threads(cpus, ranks_per_node, user)
    torch.set_num_threads(threads)
    if under_ray:
        os.environ["OMP_NUM_THREADS"] = str(threads)
    if _positive_int(user) is not None:
        return f"{threads} CPU threads per rank (OMP_NUM_THREADS={user}, the user's)"
    return f"{threads} CPU threads per rank ({cpus} CPUs / {ranks_per_node} rank(s) on the node)"
