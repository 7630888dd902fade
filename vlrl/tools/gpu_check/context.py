"""What every check shares: the device, the size mode, a scratch folder, the tiny model, a
one-rank process group and a CUDA memory probe."""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass
class Context:
    device: torch.device  # cuda:0, or cpu for the CPU self-test (`--device cpu`)
    small: bool  # tiny shapes everywhere (CPU self-test); False: the full GPU sizes
    workdir: Path  # scratch space: model folders, checkpoints
    seed: int = 0
    _models: dict[str, Path] = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def tiny_model(self, arch: str = "qwen2_5_vl") -> str:
        """A tiny model folder of `arch` (vlrl.models.tiny), built once per run."""
        if arch not in self._models:
            from vlrl.models.tiny import build_tiny_model

            self._models[arch] = build_tiny_model(self.workdir / f"tiny_{arch}", arch=arch, seed=self.seed)
        return str(self._models[arch])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def world_env(port: int | None = None) -> tuple[str, int]:
    """(master address, port) for a one-rank world on this machine."""
    return "127.0.0.1", port or free_port()


@contextlib.contextmanager
def single_rank_world(device: torch.device, cpu_too: bool = False) -> Iterator[None]:
    """A world-size-1 default process group for FSDP2: NCCL on CUDA, gloo on CPU.

    `cpu_too` (CUDA only): the group also serves CPU tensors (backend "cuda:nccl,cpu:gloo"), so
    a CPU model can be sharded in the same process. Destroyed on exit (if still alive: a
    `RankWorker.shutdown` may have destroyed it already).
    """
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialized; checks must not leak theirs")
    addr, port = world_env()
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR=addr, MASTER_PORT=str(port))  # fmt: skip
    if device.type == "cuda":
        torch.cuda.set_device(device)
        backend = "cuda:nccl,cpu:gloo" if cpu_too else "nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend, rank=0, world_size=1, timeout=datetime.timedelta(seconds=300))
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def memory(device: torch.device, reset_peak: bool = True) -> dict[str, Any]:
    """CUDA memory now (MiB): allocated, reserved, and the peak allocated since the last reset.

    On CPU: the process's peak resident memory (MiB), the only comparable number there."""
    if device.type != "cuda":
        import resource

        return {"max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    torch.cuda.synchronize(device)
    out = {
        "allocated_mib": round(torch.cuda.memory_allocated(device) / 2**20, 1),
        "reserved_mib": round(torch.cuda.memory_reserved(device) / 2**20, 1),
        "peak_allocated_mib": round(torch.cuda.max_memory_allocated(device) / 2**20, 1),
    }
    if reset_peak:
        torch.cuda.reset_peak_memory_stats(device)
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
