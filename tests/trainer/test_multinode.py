"""Multi-node decisions made on the driver: the ranks' device, rank placement, shared checkpoint
storage, the collectives' timeout."""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import pytest
import torch

from vlrl.config import PPOConfig, resolve_device
from vlrl.trainer.ray_workers import check_cluster_fits, rank_placement
from vlrl.utils.checkpoint_files import check_shared_filesystem, probe_shared_path


# ----------------------------------------------------------------------------- device=auto
def test_auto_on_a_cpu_head_node_of_a_gpu_cluster_is_cuda():
    device = resolve_device("ray://head:10001", cluster_gpus=lambda address: 16.0, local_cuda=lambda: False)
    assert device == "cuda"


def test_auto_on_a_cpu_cluster_is_cpu():
    assert resolve_device("head:6379", cluster_gpus=lambda address: 0.0, local_cuda=lambda: True) == "cpu"


@pytest.mark.parametrize("local", [True, False])
def test_auto_without_a_cluster_follows_this_machine(local):
    assert resolve_device(
        None, cluster_gpus=lambda a: pytest.fail("no cluster to ask"), local_cuda=lambda: local
    ) == ("cuda" if local else "cpu")


def test_derive_asks_the_cluster_named_by_ray_address(monkeypatch):
    import vlrl.config.device

    asked = []
    monkeypatch.setenv("RAY_ADDRESS", "head:6379")
    monkeypatch.setattr(vlrl.config.device, "_cluster_gpus", lambda address: asked.append(address) or 8.0)
    config = PPOConfig()
    config.derive()
    assert config.trainer.device == "cuda" and asked == ["head:6379"]


# ------------------------------------------------------------------------------- placement
def _config(nnodes: int, per_node: int, tp: int, device: str = "cuda") -> PPOConfig:
    config = PPOConfig()
    config.trainer.nnodes, config.trainer.n_gpus_per_node, config.trainer.device = nnodes, per_node, device
    config.worker.rollout.tensor_parallel_size = tp
    return config


def test_each_node_is_one_bundle_and_tp_groups_stay_on_a_node():
    config = _config(nnodes=2, per_node=8, tp=4)
    layout = rank_placement(config)
    assert layout.bundles == [{"CPU": 8.0, "GPU": 8.0}] * 2
    assert layout.strategy == "STRICT_SPREAD"  # the two bundles on two different nodes
    tp = config.worker.rollout.tensor_parallel_size
    for start in range(0, config.world_size, tp):
        assert len({layout.bundle_of_rank[r] for r in range(start, start + tp)}) == 1
    assert layout.bundle_of_rank == [0] * 8 + [1] * 8


def test_single_node_cpu_layout():
    layout = rank_placement(_config(nnodes=1, per_node=2, tp=1, device="cpu"))
    assert layout.bundles == [{"CPU": 2.0}] and layout.strategy == "PACK" and layout.bundle_of_rank == [0, 0]


def test_too_few_gpus_fail_at_once():
    with pytest.raises(RuntimeError, match="has 4 GPUs, the run needs .* = 8"):
        check_cluster_fits(_config(nnodes=1, per_node=8, tp=1), {"CPU": 64.0, "GPU": 4.0})
    check_cluster_fits(_config(nnodes=1, per_node=8, tp=1), {"GPU": 8.0})
    check_cluster_fits(_config(nnodes=1, per_node=8, tp=1, device="cpu"), {"CPU": 64.0})


# --------------------------------------------------------------------- shared checkpoint folder
def test_shared_folder_passes_and_leaves_nothing(tmp_path: Path):
    root = tmp_path / "ckpt"
    check_shared_filesystem(
        str(root), lambda marker, token: [probe_shared_path(marker, token, r) for r in range(2)]
    )
    assert os.listdir(root) == []


def test_a_rank_on_another_filesystem_is_named(tmp_path: Path):
    """Rank 1 'lives on another node': the same path resolves to a different folder there."""
    root, elsewhere = tmp_path / "ckpt", tmp_path / "node2"

    def probe(marker: str, token: str):
        other = str(elsewhere / os.path.relpath(marker, tmp_path))
        return [probe_shared_path(marker, token, 0), probe_shared_path(other, token, 1)]

    with pytest.raises(
        RuntimeError, match=r"rank 1 on .* cannot see a file the driver wrote there.*shared storage"
    ):
        check_shared_filesystem(str(root), probe)
    assert os.listdir(root) == []


def test_driver_must_see_the_ranks_files(tmp_path: Path):
    def probe(marker: str, token: str):
        answer = probe_shared_path(marker, token, 0)
        os.remove(f"{marker}.rank0")  # written where the driver cannot see it
        return [answer]

    with pytest.raises(RuntimeError, match="the driver cannot see the files of rank 0"):
        check_shared_filesystem(str(tmp_path), probe)


# --------------------------------------------------------------------------------- timeout
def test_process_group_gets_the_configured_timeout(monkeypatch):
    from vlrl.workers import rank_worker

    calls = []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda *a, **k: calls.append((a, k)))
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    timeout = datetime.timedelta(minutes=PPOConfig().trainer.dist_timeout_minutes)
    rank_worker._init_process_group("cpu", 0, 2, "127.0.0.1", 29500, timeout=timeout)
    assert calls == [(("gloo",), {"rank": 0, "world_size": 2, "timeout": datetime.timedelta(hours=1)})]
