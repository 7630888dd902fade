"""A worker's memory: the optional cap (the reward workers' `worker.reward.memory_limit_mb`) and how
a worker that ran out of memory is reported (instead of as a timeout or a bare exit code).

The cap is RLIMIT_AS (address space) set in the worker before the reward file is imported, so an
allocation past it raises MemoryError inside the reward function, which is reported as running out
of memory while the worker lives on. Without a cap a runaway allocation ends with the kernel's
out-of-memory killer (SIGKILL) or with swapping until the timeout; the parent then reports the
signal and the worker's resident memory (sampled from /proc while it runs).
"""

from __future__ import annotations

import resource
import signal

NO_CAP_HINT = "set worker.reward.memory_limit_mb to cap a worker's memory (a MemoryError instead)"


def apply_memory_limit(limit_mb: int | None) -> None:
    """Cap this process's address space at `limit_mb` MiB (None: leave it)."""
    if limit_mb is None:
        return
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = limit_mb * 1024 * 1024
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def memory_kib(pid: int) -> tuple[int, int] | None:
    """(resident KiB now, peak resident KiB) of process `pid` from /proc; None when unavailable."""
    values = {}
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    values[key] = int(rest.split()[0])
    except (OSError, ValueError, IndexError):
        return None
    if len(values) < 2:
        return None
    return values["VmRSS"], values["VmHWM"]


def format_kib(kib: int) -> str:
    return f"{kib / 1024**2:.1f} GiB" if kib >= 1024**2 else f"{kib / 1024:.0f} MiB"


def describe_exit(
    code: int | None, peak_kib: int | None, limit_mb: int | None, doing: str = "while scoring"
) -> str:
    """Why a worker process ended `doing` something, from its exit code and the peak memory seen."""
    seen = f"; its resident memory peaked at {format_kib(peak_kib)}" if peak_kib else ""
    if code is not None and code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
        text = f"worker process was killed by {name} (exit code {code}) {doing}{seen}".replace("  ", " ")
        if -code == signal.SIGKILL:  # the kernel's OOM killer sends it, as may a person or a scheduler
            text += " (the out-of-memory killer sends SIGKILL, as can `kill -9`)"
            text += "" if limit_mb is not None else f"; {NO_CAP_HINT}"
        return text
    return f"worker process died (exit code {code}) {doing}{seen}".replace("  ", " ")


def describe_timeout(timeout: float, memory: tuple[int, int] | None, limit_mb: int | None) -> str:
    """Timeout message with the worker's memory (a swapping worker looks like a hang)."""
    text = f"timed out after {timeout:g}s (worker killed and restarted"
    if memory is not None:
        text += f"; resident memory {format_kib(memory[0])}, peak {format_kib(memory[1])}"
    return text + ")"
