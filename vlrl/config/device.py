"""What `trainer.device=auto` resolves to, and the error every config check raises."""

from __future__ import annotations

from collections.abc import Callable


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type or inconsistent with another."""


def resolve_device(
    ray_address: str | None,
    cluster_gpus: Callable[[str], float] | None = None,
    local_cuda: Callable[[], bool] | None = None,
    unusable_gpus: Callable[[], str | None] | None = None,
) -> str:
    """What `trainer.device=auto` means: the ranks' device, not the driver's.

    Joining a cluster (`ray_address`): cuda when the cluster has GPUs. The driver may run on a
    head node without one, so its own torch.cuda says nothing about where the ranks run (a rank
    whose torch cannot use its GPU stops with the reason: `vlrl.utils.gpu_driver`).
    Otherwise Ray starts on this machine: cuda when torch can use a GPU here; cpu when the machine
    has none. NVIDIA GPUs that torch cannot use (a driver too old for torch's CUDA build) are a
    `ConfigError` saying so, not a silent CPU run. `cluster_gpus(address) -> float`,
    `local_cuda() -> bool` and `unusable_gpus() -> message | None` are injectable for tests."""
    if ray_address:
        gpus = (cluster_gpus or _cluster_gpus)(ray_address)
        return "cuda" if gpus > 0 else "cpu"
    if local_cuda is None:
        import torch

        local_cuda = torch.cuda.is_available
    if local_cuda():
        return "cuda"
    problem = (unusable_gpus or _unusable_local_gpus)()
    if problem:
        raise ConfigError(f"trainer.device=auto: {problem}")
    return "cpu"


def _unusable_local_gpus() -> str | None:
    """Why this machine's NVIDIA GPUs cannot be used by torch, or None (`vlrl.utils.gpu_driver`)."""
    from vlrl.utils.gpu_driver import unusable_gpus_problem

    return unusable_gpus_problem()


def _cluster_gpus(address: str) -> float:
    """GPUs of the Ray cluster at `address` (connects, reads, disconnects)."""
    import ray

    if ray.is_initialized():
        return float(ray.cluster_resources().get("GPU", 0))
    ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    try:
        return float(ray.cluster_resources().get("GPU", 0))
    finally:
        ray.shutdown()
