"""RankWorker phases: the actor leaves the GPU around generation (worker.actor.offload)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vlrl.protocol import FinishedGroups, RolloutBatch
from vlrl.workers.rank_worker import RankWorker

BATCH = RolloutBatch.__new__(RolloutBatch)  # stands for the shard's batch (only passed along)
GROUPS = FinishedGroups(prompt_rows=[0], responses=[[7]])


class _Recorder:
    """Fake actor / engine: records the calls the worker makes, in order."""

    def __init__(self, calls: list[str], name: str, fail_on: str | None = None) -> None:
        self.calls, self.name, self.fail_on = calls, name, fail_on

    def __getattr__(self, method: str):
        def record(*args, **kwargs):
            self.calls.append(f"{self.name}.{method}")
            if method == self.fail_on:
                raise RuntimeError("engine failed")
            return iter([GROUPS, BATCH]) if method == "generate_stream" else None

        return record


def _worker(calls: list[str], device: str, fail_on: str | None = None) -> RankWorker:
    worker = RankWorker.__new__(RankWorker)  # no process group needed for this phase
    worker.device = torch.device(device)
    worker.role, worker.image_refs = "hybrid", None
    worker.actor = _Recorder(calls, "actor")
    worker.rollout = _Recorder(calls, "rollout", fail_on)
    return worker


def test_actor_offloads_before_the_engine_wakes_and_returns_after(monkeypatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    assert _worker(calls, "cuda").generate(prompts=SimpleNamespace(images=[])) is BATCH
    assert calls == [
        "actor.offload_to_cpu",
        "empty_cache",
        "rollout.wake_up",
        "rollout.generate_stream",
        "rollout.sleep",
        "actor.load_to_device",
    ]


def test_streamed_groups_pass_while_the_actor_is_away_and_the_batch_comes_last() -> None:
    calls: list[str] = []
    stream = _worker(calls, "cpu").generate_stream(prompts=SimpleNamespace(images=[]))
    assert next(stream) is GROUPS
    assert calls[-1] == "rollout.generate_stream"  # the actor is still offloaded
    assert list(stream) == [BATCH] and calls[-1] == "actor.load_to_device"


def test_no_cuda_cache_release_on_cpu(monkeypatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    _worker(calls, "cpu").generate(prompts=SimpleNamespace(images=[]))
    assert "empty_cache" not in calls and calls[0] == "actor.offload_to_cpu"


def test_actor_comes_back_when_generation_fails() -> None:
    calls: list[str] = []
    with pytest.raises(RuntimeError, match="engine failed"):
        _worker(calls, "cpu", fail_on="generate_stream").generate(prompts=SimpleNamespace(images=[]))
    assert calls[-1] == "actor.load_to_device"


def test_gpu_process_group_has_a_cpu_backend_for_fsdp_cpu_offload() -> None:
    """Collectives on CPU tensors (FSDP CPU offload) need a CPU backend in the default group."""
    from torch.distributed.distributed_c10d import BackendConfig

    from vlrl.workers.rank_worker import process_group_backend

    plain = BackendConfig("nccl").get_device_backend_map()
    assert "cpu" not in plain  # what the old backend string gave: CPU tensor collectives fail
    ours = BackendConfig(process_group_backend("cuda")).get_device_backend_map()
    assert ours == {"cuda": "nccl", "cpu": "gloo"}
    assert process_group_backend("cpu") == "gloo"
