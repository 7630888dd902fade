"""Faults through the real CLI, as a user meets them: a second run on a folder in use, a corrupt
checkpoint at resume, a rank that stops answering (found, replaced, and the run goes on)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import warm_cli
from e2e_helpers import REPO, build_assets, cli_args, read_metrics, safe_metrics, start_cli

pytestmark = pytest.mark.slow
COMMON = ["trainer.save_freq=2", "trainer.val_before_train=false", "trainer.val_freq=-1"]


def _wait_for(condition, proc: subprocess.Popen, log: Path, what: str, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None and not condition():
        time.sleep(0.2)
    assert condition(), f"{what} did not happen (exit {proc.poll()}):\n{log.read_text()[-4000:]}"


def _flip_middle_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_folder_lock_corrupt_checkpoint_and_hung_rank_restarted(tmp_path: Path) -> None:
    assets = build_assets(tmp_path / "assets")
    out = tmp_path / "run"

    # 1. A second run on a folder in use stops at start-up, naming the holder; the first is untouched.
    first_log = tmp_path / "first.log"
    first = start_cli(cli_args(assets, out, *COMMON, "trainer.max_steps=4"), first_log)
    lock = out / ".vlrl.lock"
    _wait_for(lambda: lock.is_file() and "pid" in lock.read_text(), first, first_log, "the lock")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    second = warm_cli.run(cli_args(assets, out, "data.seed=7"), REPO, env, timeout=300)
    assert second.returncode == 1, second.stderr[-3000:]
    assert f"is in use by another run (pid {first.pid} on " in second.stderr
    assert first.wait(timeout=600) == 0, first_log.read_text()[-4000:]
    assert sorted(read_metrics(out)) == [1, 2, 3, 4]

    # 2. A flipped byte in the newest checkpoint: named, skipped, and the run resumes from the one before.
    shard = out / "global_step_4" / "actor" / "dcp" / "__0_0.distcp"
    _flip_middle_byte(shard)
    # 3. ... and, once it trains again, its rank stops answering (kill -STOP): the hang is found, the
    #    rank workers are replaced and the run resumes from its latest checkpoint (trainer.max_failures).
    resumed_log = tmp_path / "resumed.log"
    args = cli_args(
        assets, out, *COMMON, "trainer.max_steps=8", "trainer.hang_timeout=40", "trainer.max_failures=1"
    )
    resumed = start_cli(args, resumed_log)
    _wait_for(lambda: 5 in safe_metrics(out), resumed, resumed_log, "step 5")
    text = resumed_log.read_text()
    assert f"not resuming from {out}/global_step_4: {shard} does not match its checksum" in text
    assert f"resumed from {out}/global_step_2 at step 2" in text
    pid = int(re.search(r"started rank 0 \(pid (\d+) on ", text).group(1))
    os.kill(pid, signal.SIGSTOP)
    stopped = time.time()
    try:
        code = resumed.wait(timeout=400)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # if the driver's shutdown left it
    text = resumed_log.read_text()
    assert code == 0, text[-4000:]
    hang = re.search(rf"RankHang: rank 0 \(pid {pid} on .*\) did not finish \w+ within (\d+) s", text)
    assert hang and 40 <= int(hang.group(1)) < 60, text[-4000:]
    assert f"restart 1 of trainer.max_failures=1: new rank workers, resuming from {out}/global_step_4" in text
    assert f"resumed from {out}/global_step_4 at step 4" in text
    metrics = safe_metrics(out)
    assert sorted(metrics) == list(range(1, 9))
    assert [metrics[step]["attempt"] for step in (2, 4, 8)] == [1, 2, 3]  # first run, resumed, restarted
    print(f"hang found and the run resumed {time.time() - stopped:.0f} s after SIGSTOP")
