"""Starting Ray and the per-rank workers, and calling them in the open.

`call(workers, "method", per_rank_args)` is the only dispatch there is: one remote call per
rank, then `ray.get` on all of them, with the root cause of a failure shown plainly.
"""

from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from vlrl.config import PPOConfig

# Engines run inside the rank's process (SPMD); tests and CPU runs want quiet, offline workers.
WORKER_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "0"),
    "VLLM_CONFIGURE_LOGGING": os.environ.get("VLLM_CONFIGURE_LOGGING", "1"),
    "RAY_DEDUP_LOGS": "1",
}


class WorkerError(RuntimeError):
    """A rank failed; the message holds the root cause, not the Ray trace around it."""


def start_ray(config: PPOConfig) -> None:
    """Join the cluster named by RAY_ADDRESS, or start a local one sized for the ranks."""
    if ray.is_initialized():
        return
    env = {"env_vars": {k: v for k, v in WORKER_ENV.items()}}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], runtime_env=env)
    else:
        # On CPU the ranks are logical: give Ray at least one "CPU" per rank plus the driver.
        num_cpus = max(os.cpu_count() or 1, config.world_size + 1)
        ray.init(num_cpus=num_cpus, runtime_env=env, include_dashboard=False, log_to_driver=True)


def _free_port_and_ip() -> tuple[str, int]:
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return ray.util.get_node_ip_address(), port


@dataclass(frozen=True)
class Placement:
    """Where the ranks go: one bundle per node holding that node's ranks (`n_gpus_per_node`).

    Ranks r*n .. r*n+n-1 share bundle r, so every tensor-parallel group (consecutive ranks, and
    its size divides n: see config_checks) lies on one node. With several nodes the bundles go to
    distinct nodes (STRICT_SPREAD), matching trainer.nnodes x trainer.n_gpus_per_node; one rank
    per bundle with PACK (the former layout) let Ray split a node's ranks over any nodes."""

    bundles: list[dict[str, float]]
    strategy: str
    bundle_of_rank: list[int]


def rank_placement(config: PPOConfig) -> Placement:
    per_node, nodes = config.trainer.n_gpus_per_node, config.trainer.nnodes
    bundle = {"CPU": float(per_node)}
    if config.trainer.device == "cuda":
        bundle["GPU"] = float(per_node)
    return Placement(
        bundles=[dict(bundle) for _ in range(nodes)],
        strategy="STRICT_SPREAD" if nodes > 1 else "PACK",
        bundle_of_rank=[rank // per_node for rank in range(config.world_size)],
    )


def check_cluster_fits(config: PPOConfig, resources: dict[str, float]) -> None:
    """Fail at once (not after a 10-minute placement wait) when the cluster lacks the GPUs."""
    if config.trainer.device != "cuda":
        return
    gpus = resources.get("GPU", 0)
    if gpus < config.world_size:
        raise RuntimeError(
            f"the Ray cluster has {gpus:g} GPUs, the run needs trainer.nnodes x trainer.n_gpus_per_node = "
            f"{config.world_size}; lower them or add nodes"
        )


class RankGroup:
    """The ranks of one training job, placed by a placement group (see `rank_placement`)."""

    def __init__(self, config: PPOConfig) -> None:
        from vlrl.workers.rank_worker import RankWorker

        world = config.world_size
        gpu = config.trainer.device == "cuda"
        check_cluster_fits(config, ray.cluster_resources())
        layout = rank_placement(config)
        self.placement = placement_group(layout.bundles, strategy=layout.strategy)
        ray.get(self.placement.ready(), timeout=600)
        strategy = [
            PlacementGroupSchedulingStrategy(
                self.placement, placement_group_bundle_index=layout.bundle_of_rank[i]
            )
            for i in range(world)
        ]
        # The rendezvous address is rank 0's node, learnt by a task placed where rank 0 will run.
        master_ip, master_port = ray.get(
            ray.remote(_free_port_and_ip).options(scheduling_strategy=strategy[0]).remote()
        )
        remote_cls = ray.remote(RankWorker)
        self.workers = [
            remote_cls.options(
                scheduling_strategy=strategy[rank], num_cpus=1, num_gpus=1 if gpu else 0
            ).remote(config, rank, world, master_ip, master_port)
            for rank in range(world)
        ]

    def call(self, method: str, *per_rank: list[Any], **kwargs: Any) -> list[Any]:
        """`worker[r].method(per_rank[0][r], per_rank[1][r], ..., **kwargs)` on every rank; results by rank."""
        refs = [
            getattr(worker, method).remote(*(args[rank] for args in per_rank), **kwargs)
            for rank, worker in enumerate(self.workers)
        ]
        try:
            return ray.get(refs)
        except ray.exceptions.RayTaskError as exc:
            raise WorkerError(f"rank worker failed in {method}: {root_cause(exc)}") from None
        except ray.exceptions.ActorDiedError as exc:
            raise WorkerError(f"a rank worker died during {method}: {exc}") from None

    def call_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """The same arguments on every rank."""
        return self.call(method, *([arg] * len(self.workers) for arg in args), **kwargs)

    def shutdown(self) -> None:
        with contextlib.suppress(Exception):  # best effort: the processes are killed next anyway
            ray.get([w.shutdown.remote() for w in self.workers], timeout=60)
        for worker in self.workers:
            ray.kill(worker)
        remove_placement_group(self.placement)


def root_cause(exc: BaseException) -> str:
    """The innermost exception of a Ray error, as `Type: message`."""
    cause = getattr(exc, "cause", None) or exc.__cause__
    while cause is not None and (getattr(cause, "cause", None) or cause.__cause__) is not None:
        cause = getattr(cause, "cause", None) or cause.__cause__
    target = cause or exc
    return f"{type(target).__name__}: {target}"
