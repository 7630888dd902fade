"""A long quickstart run watched for leaks: memory of the whole process tree and checkpoint disk.

    .venv/bin/python benchmarks/soak.py [--minutes 15] [--every 15] [--out outputs/soak]

Runs `python -m vlrl.trainer.main config=examples/quickstart.yaml` (prepared by
`examples/prepare_quickstart.py`) with no step limit, a checkpoint every 5 steps and
`save_limit=2`, samples the resident memory of the driver and every process under it (Ray's,
the rank workers', the reward workers') and the size of the checkpoint folder, then stops the run
with SIGTERM to its process group, as a scheduler would, and checks it exits 143. Prints a table
and the verdict: memory flat (the last sample within 10% of the one after the first 2 minutes,
when the engines and caches are warm) and disk bounded (never more than 3 checkpoints' worth).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
WARM_S = 120.0  # samples before this are start-up (model load, engine warm-up)


def tree_rss_mib(pid: int) -> float:
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            total += proc.memory_info().rss
    return total / 2**20


def folder_mib(path: Path) -> float:
    total = sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0
    return total / 2**20


def steps_logged(log: Path) -> int:
    return log.read_text(errors="replace").count("[step ")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=15.0)
    parser.add_argument("--every", type=float, default=15.0, help="seconds between samples")
    parser.add_argument("--out", default="outputs/soak")
    args = parser.parse_args()
    out = (REPO / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    ckpt, log = out / "checkpoints", out / "run.log"
    command = [sys.executable, "-m", "vlrl.trainer.main", "config=examples/quickstart.yaml",
               "trainer.max_steps=100000", "trainer.save_freq=5", "trainer.save_limit=2",
               f"trainer.save_checkpoint_path={ckpt}", "trainer.find_last_checkpoint=false",
               f"trainer.plot_path={out / 'reward.png'}"]  # fmt: skip
    with open(log, "w") as sink:
        proc = subprocess.Popen(command, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    start, rows = time.monotonic(), []
    try:
        while proc.poll() is None and time.monotonic() - start < args.minutes * 60:
            time.sleep(args.every)
            rows.append(
                (time.monotonic() - start, steps_logged(log), tree_rss_mib(proc.pid), folder_mib(ckpt))
            )
            print(f"{rows[-1][0]:7.0f} s  step {rows[-1][1]:5d}  {rows[-1][2]:8.0f} MiB  {rows[-1][3]:7.1f} MiB disk",
                  flush=True)  # fmt: skip
        if proc.poll() is not None:
            print(f"the run ended early (exit {proc.returncode}); see {log}")
            return 1
        sent = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        code = proc.wait(timeout=120)
        exit_s = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return report(rows, code, exit_s, one_checkpoint_mib(ckpt))


def one_checkpoint_mib(ckpt: Path) -> float:
    """The size of the newest complete checkpoint (`global_step_N`, no `.tmp`)."""
    done = [p for p in ckpt.glob("global_step_*") if p.name.split("_")[-1].isdigit()]
    newest = max(done, key=lambda p: int(p.name.split("_")[-1]), default=None)
    return folder_mib(newest) if newest else 0.0


def report(
    rows: list[tuple[float, int, float, float]], code: int, exit_s: float, one_checkpoint: float
) -> int:
    warm = next((row for row in rows if row[0] >= WARM_S), rows[0])
    last = rows[-1]
    growth = (last[2] - warm[2]) / warm[2]
    disk_max = max(row[3] for row in rows)
    print("\n| | time s | steps | memory MiB | checkpoints MiB |\n|---|---|---|---|---|")
    for name, row in (("warm", warm), ("peak", max(rows, key=lambda r: r[2])), ("last", last)):
        print(f"| {name} | {row[0]:.0f} | {row[1]} | {row[2]:.0f} | {row[3]:.1f} |")
    flat, bounded, clean = abs(growth) <= 0.10, disk_max <= 3 * one_checkpoint + 5, code == 143
    print(f"\nmemory {warm[2]:.0f} -> {last[2]:.0f} MiB ({growth:+.1%}): {'flat' if flat else 'GROWING'}")
    print(
        f"disk at most {disk_max:.1f} MiB (one checkpoint ~{one_checkpoint:.1f}): {'bounded' if bounded else 'UNBOUNDED'}"
    )
    print(f"SIGTERM to the process group: exit {code} in {exit_s:.1f} s")
    return 0 if flat and bounded and clean else 1


if __name__ == "__main__":
    sys.exit(main())
