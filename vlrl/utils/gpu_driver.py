"""NVIDIA GPUs that torch cannot use: found at start-up instead of training on CPU by surprise.

torch reports no CUDA (`torch.cuda.is_available()` is False, with only a warning) when the
machine's NVIDIA driver is older than the CUDA version torch was built for: the CUDA 13.0 build
(`+cu130`, what the registry's torch 2.13 carries) needs driver >= 580, CUDA 12.x builds >= 525.
`trainer.device=auto` would then quietly pick the CPU. `nvidia-smi` (or `/dev/nvidia0`) tells that
the machine has GPUs all the same, so the two together are an error with the fix in it.
"""

from __future__ import annotations

import os
import subprocess
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass

MIN_DRIVER = {13: 580, 12: 525}
"""Oldest NVIDIA driver (major version) for a CUDA major version (CUDA's minor-version
compatibility: any 13.x runtime runs on 580+, any 12.x on 525+)."""
NVIDIA_SMI_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class NvidiaGpus:
    """What the machine shows of its NVIDIA GPUs without CUDA."""

    count: int
    driver: str | None  # the driver version nvidia-smi reports, None when unknown
    names: tuple[str, ...] = ()


def nvidia_gpus(run: Callable[[list[str]], str] | None = None) -> NvidiaGpus | None:
    """The GPUs `nvidia-smi` lists, else a device node `/dev/nvidia0`, else None (no GPU)."""
    query = ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"]
    try:
        out = (run or _run)(query)
    except (OSError, subprocess.SubprocessError):
        out = ""
    rows = [[part.strip() for part in line.split(",")] for line in out.splitlines() if line.strip()]
    if rows:
        driver = rows[0][1] if len(rows[0]) > 1 else None
        return NvidiaGpus(len(rows), driver, tuple(row[0] for row in rows))
    if os.path.exists("/dev/nvidia0"):  # a driver without nvidia-smi on the PATH
        return NvidiaGpus(1, None)
    return None


def _run(cmd: list[str]) -> str:
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=True
    ).stdout


def gpus_hidden_on_purpose(env: Mapping[str, str] = os.environ) -> bool:
    """CUDA_VISIBLE_DEVICES set to nothing (or -1): the user hid the GPUs from CUDA."""
    value = env.get("CUDA_VISIBLE_DEVICES")
    return value is not None and value.strip() in ("", "-1")


def unusable_gpus_message(
    gpus: NvidiaGpus, torch_version: str, torch_cuda: str | None, torch_reason: str | None = None
) -> str:
    """Why torch sees no CUDA although the machine has NVIDIA GPUs, and what to do."""
    names = f" ({', '.join(sorted(set(gpus.names)))})" if gpus.names else ""
    driver = (
        f"driver {gpus.driver}" if gpus.driver else "a driver of unknown version (no answer from nvidia-smi)"
    )
    if torch_cuda is None:
        cause = f"torch {torch_version} is a CPU-only build: install a CUDA build of torch (README, Install)"
    else:
        need = MIN_DRIVER.get(int(torch_cuda.split(".")[0]))
        cause = f"torch {torch_version} is built for CUDA {torch_cuda}" + (
            f", which needs NVIDIA driver >= {need}" if need else ""
        )
        cause += "; upgrade the driver, or install a torch built for a CUDA version the driver supports"
    said = f" torch says: {torch_reason.strip()}." if torch_reason else ""
    return (
        f"this machine has {gpus.count} NVIDIA GPU(s){names} with {driver}, but torch cannot use CUDA: "
        f"{cause}.{said} To train on the CPU anyway, set trainer.device=cpu."
    )


def unusable_gpus_problem(
    cuda_available: Callable[[], bool] | None = None,
    find_gpus: Callable[[], NvidiaGpus | None] | None = None,
) -> str | None:
    """The message of `unusable_gpus_message` when the machine has NVIDIA GPUs that torch cannot
    use (and the user did not hide them with CUDA_VISIBLE_DEVICES), else None."""
    import torch

    if cuda_available is not None:
        available, reason = cuda_available(), None
    else:
        available, reason = _torch_cuda_status()
    if available or gpus_hidden_on_purpose():
        return None
    gpus = (find_gpus or nvidia_gpus)()
    if gpus is None:
        return None
    return unusable_gpus_message(gpus, torch.__version__, torch.version.cuda, reason)


def _torch_cuda_status() -> tuple[bool, str | None]:
    """torch.cuda.is_available() and the warning torch gives when CUDA fails to initialise ("The
    NVIDIA driver on your system is too old (found version ...)"), if it gives one now."""
    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
    reasons = [str(w.message) for w in caught if "CUDA" in str(w.message)]
    return available, reasons[0] if reasons else None


def check_torch_sees_cuda() -> None:
    """In a rank given a GPU (`trainer.device=cuda`): stop with the driver's story when torch
    cannot use it."""
    import torch

    if torch.cuda.is_available():
        return
    problem = unusable_gpus_problem(cuda_available=lambda: False)
    raise RuntimeError(
        problem
        or "trainer.device=cuda but torch sees no CUDA GPU on this rank's node; set trainer.device=cpu"
    )
