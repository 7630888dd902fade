"""Running checks independently and writing their report (JSON + a printed table).

Each check is a function `check(ctx, outcome)` that fills the `Outcome` it is given as it goes.
`run_check` gives it a time limit, catches whatever it raises (recorded with its traceback and
with what the check had measured until then; the other checks still run) and frees the GPU memory
it left behind, so one broken check cannot take the rest of the suite down with it.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import platform
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

PASS, FAIL, SKIP = "pass", "fail", "skip"


class CheckTimeout(TimeoutError):
    """A check ran past its time limit."""


@dataclass
class Outcome:
    """What a check returns: key numbers, everything else it measured, and what it found wrong."""

    summary: dict[str, Any] = field(default_factory=dict)  # a few numbers for the table
    details: dict[str, Any] = field(default_factory=dict)  # everything measured (per phase, per case)
    failures: list[str] = field(default_factory=list)  # empty: the check passed
    skipped: str | None = None  # a reason when the check could not run here (e.g. no CUDA kernel)

    def expect(self, ok: bool, message: str) -> None:
        """Record `message` as a failure unless `ok`."""
        if not ok:
            self.failures.append(message)


@dataclass
class CheckResult:
    name: str
    status: str  # pass | fail | skip
    seconds: float
    summary: dict[str, Any]
    details: dict[str, Any]
    failures: list[str]
    error: str | None = None  # "ExceptionType: message" when the check raised
    traceback: str | None = None


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Raise `CheckTimeout` in the running check after `seconds` (SIGALRM; main thread only).

    The signal is delivered between Python bytecodes, so a long CUDA kernel finishes first; the
    check then stops at its next Python line. Elsewhere (other threads, no SIGALRM) no limit applies.
    """
    usable = (
        bool(seconds) and hasattr(signal, "SIGALRM") and threading.current_thread() is threading.main_thread()
    )
    if not usable or seconds is None:
        yield
        return

    def on_alarm(signum: int, frame: Any) -> None:
        raise CheckTimeout(f"time limit of {seconds:.0f} s exceeded")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    start = time.monotonic()
    outer, _ = signal.setitimer(signal.ITIMER_REAL, seconds)  # an outer timer (pytest-timeout) ...
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer > 0:  # ... is put back with what is left of it
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - start), 1e-3))


def _free_memory() -> None:
    """Drop what a check left behind (its objects, cached CUDA blocks) before the next one."""
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    except Exception:  # noqa: BLE001 (a broken CUDA context is reported by the next check)
        pass


def run_check(
    name: str, check: Callable[[Any, Outcome], None], ctx: Any, limit_s: float | None
) -> CheckResult:
    """Run one check: never raises (except KeyboardInterrupt); a raise becomes a `fail` with its traceback."""
    start, outcome = time.perf_counter(), Outcome()
    try:
        with time_limit(limit_s):
            check(ctx, outcome)
        status = SKIP if outcome.skipped else (FAIL if outcome.failures else PASS)
        if outcome.skipped:
            outcome.summary.setdefault("skipped", outcome.skipped)
        result = CheckResult(name, status, 0.0, outcome.summary, outcome.details, outcome.failures)
    except Exception as err:  # noqa: BLE001 (recorded, and the suite goes on)
        failures = [*outcome.failures, f"raised {type(err).__name__}"]
        result = CheckResult(
            name, FAIL, 0.0, outcome.summary, outcome.details, failures,
            error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc(),
        )  # fmt: skip
    finally:
        _free_memory()
    result.seconds = round(time.perf_counter() - start, 2)
    return result


def environment() -> dict[str, Any]:
    """Versions and the device: what a reader needs to compare two reports."""
    import torch
    import transformers

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(
            gpu=props.name,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            gpu_count=torch.cuda.device_count(),
        )
    return env


def _clean(value: Any) -> Any:
    """JSON-safe: NaN/inf become strings, tuples lists, unknown objects their repr."""
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return repr(value)


def build_report(results: list[CheckResult], options: dict[str, Any], env: dict[str, Any]) -> dict[str, Any]:
    """The report: environment, options, a pass/fail summary and every check's result."""
    statuses = {r.name: r.status for r in results}
    return _clean(
        {
            "ok": all(s != FAIL for s in statuses.values()),
            "summary": {r.name: {"status": r.status, "seconds": r.seconds, **r.summary} for r in results},
            "environment": env,
            "options": options,
            "checks": [asdict(r) for r in results],
        }
    )


def write_report(report: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=2, sort_keys=False)
        f.write("\n")


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def format_table(report: dict[str, Any], width: int = 110) -> str:
    """One line per check: status, seconds and its key numbers (wrapped); errors below."""
    lines = [f"{'check':<16} {'status':<6} {'secs':>7}  key numbers", "-" * width]
    for check in report["checks"]:
        numbers = [f"{k}={_fmt(v)}" for k, v in check["summary"].items()]
        text, rows = "", []
        for item in numbers:
            if text and len(text) + len(item) + 2 > width - 33:
                rows.append(text)
                text = ""
            text = f"{text}, {item}" if text else item
        rows.append(text)
        lines.append(f"{check['name']:<16} {check['status']:<6} {check['seconds']:>7.1f}  {rows[0]}")
        lines += [f"{'':<32}{row}" for row in rows[1:]]
        for failure in check["failures"]:
            lines.append(f"{'':<16} ! {failure}")
        if check["error"]:
            lines.append(f"{'':<16} ! {check['error'].splitlines()[0][: width - 20]}")
    lines.append("-" * width)
    lines.append("ALL PASSED" if report["ok"] else "SOME CHECKS FAILED (details in the JSON report)")
    return "\n".join(lines)


def markdown_path(json_path: str) -> str:
    """The Markdown report's path: the JSON path with `.md` for its suffix."""
    from pathlib import Path

    return str(Path(json_path).with_suffix(".md"))


def _cell(value: Any) -> str:
    return _fmt(value).replace("|", "/").replace("\n", " ")


def format_markdown(report: dict[str, Any]) -> str:
    """The report for a person: environment, one table row per check, the goal lines each check
    wrote (`details["goal_lines"]`), then failures and errors. The JSON keeps everything else."""
    env, options = report["environment"], report["options"]
    lines = ["# vlrl gpu_check report", "",
             f"- result: **{'all passed' if report['ok'] else 'some checks failed'}**"
             f" ({'complete' if options.get('complete') else 'incomplete'}, {options.get('total_seconds')} s)",
             "- environment: " + ", ".join(f"{k} {_cell(v)}" for k, v in env.items()),
             "- options: " + ", ".join(f"{k} {_cell(v)}" for k, v in options.items()), "",
             "| check | status | seconds | key numbers |", "|---|---|---|---|"]  # fmt: skip
    for check in report["checks"]:
        numbers = ", ".join(f"{k}={_cell(v)}" for k, v in check["summary"].items())
        lines.append(f"| {check['name']} | {check['status']} | {check['seconds']:.1f} | {numbers} |")
    goals = [(c["name"], line) for c in report["checks"] for line in c["details"].get("goal_lines", [])]
    if goals:
        lines += ["", "## Goals", ""] + [f"- {name}: {line}" for name, line in goals]
    problems = [
        (c["name"], p)
        for c in report["checks"]
        for p in [*c["failures"], *([c["error"]] if c["error"] else [])]
    ]
    if problems:
        lines += ["", "## Failures", ""] + [f"- {name}: {_cell(p)}" for name, p in problems]
    return "\n".join(lines) + "\n"


def write_markdown(report: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        f.write(format_markdown(report))
