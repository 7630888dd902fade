"""Starting Ray and the per-rank workers, and calling them in the open.

`call(RankWorker.method, per_rank_args)` is the only dispatch there is: one remote call per
rank, then `ray.get` on all of them, with the root cause of a failure shown plainly.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from vlrl.config import PPOConfig
from vlrl.trainer.deadlines import CallDeadlines, Stopwatch
from vlrl.trainer.ranks import Method, RankRoles, check_one_per_rank
from vlrl.trainer.ray_sessions import mark_session, remove_ended_sessions
from vlrl.utils.library_logs import worker_log_env
from vlrl.utils.rank_threads import RANK_NUM_CPUS, user_thread_env
from vlrl.workers.rank_worker import RankWorker

# Engines run inside the rank's process (SPMD); tests and CPU runs want quiet, offline workers.
WORKER_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "0"),
    "VLLM_CONFIGURE_LOGGING": os.environ.get("VLLM_CONFIGURE_LOGGING", "1"),
    "RAY_DEDUP_LOGS": "1",
    **worker_log_env(),
}


SHUTDOWN_WAIT_S = 20.0  # for the ranks to close their engines before they are killed (a hung one never does)
logger = logging.getLogger(__name__)


class WorkerError(RuntimeError):
    """A rank failed; the message holds the root cause, not the Ray trace around it."""


class WorkerDied(WorkerError):
    """A rank's process ended (killed, crashed): a fault of the machine, not of the step's code."""


def start_ray(config: PPOConfig) -> None:
    """Join the cluster named by RAY_ADDRESS, or start a local one sized for the ranks."""
    if ray.is_initialized():
        return
    # the user's OMP_NUM_THREADS, if any, reaches every rank before Ray sets its own (utils/rank_threads.py)
    env = {"env_vars": {**WORKER_ENV, **user_thread_env(os.environ)}}
    main_thread = threading.current_thread() is threading.main_thread()
    sigterm = signal.getsignal(signal.SIGTERM) if main_thread else None
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], runtime_env=env)
    else:
        # On CPU the ranks are logical: give Ray at least one "CPU" per rank plus the driver.
        num_cpus = max(os.cpu_count() or 1, config.world_size + 1)
        ray.init(num_cpus=num_cpus, runtime_env=env, include_dashboard=False, log_to_driver=True)
        _tidy_local_sessions()
    if callable(sigterm):
        # ray.init replaces the SIGTERM handler (ray 2.60: `sys.exit` in ray/_private/worker.py
        # `init`, and for a local cluster "kill Ray's processes, exit 1" in ray/_private/node.py
        # `_register_shutdown_hooks`); keep the caller's (the CLI's clean shutdown, whose `finally`
        # stops Ray too).
        signal.signal(signal.SIGTERM, sigterm)


def _tidy_local_sessions() -> None:
    """Mark this cluster's session folder as vlrl's and remove ended runs' (ray_sessions.py).
    Reads Ray's private node record (ray 2.60: `ray._private.worker._global_node`)."""
    node = getattr(ray._private.worker, "_global_node", None)
    if node is None:
        return
    try:
        mark_session(node.get_session_dir_path())
    except OSError as exc:
        logger.warning("could not mark Ray's session folder %s: %s", node.get_session_dir_path(), exc)
        return
    remove_ended_sessions(node.get_temp_dir_path(), node.get_session_dir_path())


def local_ray_stopped() -> bool:
    """Whether the Ray cluster this process started (no RAY_ADDRESS) has lost its GCS or raylet:
    a SIGTERM to the process group stops them with the driver. Ray's calls would then wait
    `gcs_rpc_server_reconnect_timeout_s` (60 s) and end the process with exit 1 (ray 2.60,
    src/ray/rpc/rpc_client.h). Reads Ray's private node record (`ray._private.worker._global_node`,
    `all_processes`); False where it is missing or the cluster is not this process's."""
    node = getattr(ray._private.worker, "_global_node", None)
    if node is None or not getattr(node, "head", False):
        return False
    processes = getattr(node, "all_processes", {})
    ours = [info.process for kind in ("gcs_server", "raylet") for info in processes.get(kind, [])]
    return any(process.poll() is not None for process in ours)


def _free_port_and_ip() -> tuple[str, int]:
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return ray.util.get_node_ip_address(), port


def rendezvous_address(
    placement: PlacementGroup, bundle: int, strategy: PlacementGroupSchedulingStrategy
) -> tuple[str, int]:
    """The IP of the node holding `bundle` and a free port there. On the driver's own node (every
    single-node run) the driver picks them itself; on another node a task placed there does, which
    first starts a Ray worker process on that node (seconds)."""
    nodes = placement_group_table(placement).get("bundles_to_node_id", {})
    if nodes.get(bundle) == ray.get_runtime_context().get_node_id():
        return _free_port_and_ip()
    return ray.get(ray.remote(_free_port_and_ip).options(scheduling_strategy=strategy).remote())


@dataclass(frozen=True)
class Placement:
    """Where the ranks go: one bundle per node holding that node's ranks (`n_gpus_per_node`).

    Ranks r*n .. r*n+n-1 share bundle r, so every tensor-parallel group (consecutive ranks, and
    its size divides n: see vlrl.config.checks) lies on one node. With several nodes the bundles go to
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
    """Ray actors of one role, called in the open: one remote call per rank, results by rank.
    A call that some ranks do not finish within its limit (`CallDeadlines`) raises `RankHang`."""

    def __init__(
        self, workers: list[Any], placement: Any = None, deadlines: CallDeadlines | None = None
    ) -> None:
        self.workers = workers
        self.placement = placement  # removed by shutdown when this group owns it
        self.deadlines = deadlines or CallDeadlines(0)
        self.names = [f"rank {r}" for r in range(len(workers))]  # with pid and host after `identify`

    def identify(self, first_rank: int = 0) -> None:
        """Learn each rank's pid and host, for the messages about a rank that stopped answering."""
        threads = set()
        for r, (pid, host, *rest) in enumerate(self.call_all(RankWorker.process)):
            self.names[r] = f"rank {first_rank + r} (pid {pid} on {host})"
            threads.update(rest)
        logger.info("started %s", ", ".join(self.names))
        if threads:
            logger.info("rank workers: %s", "; ".join(sorted(threads)))

    def submit(self, method: Method, *per_rank: list[Any], **kwargs: Any) -> Pending:
        """Start `worker[r].method(per_rank[0][r], ..., **kwargs)` on every rank; `.result()` waits.
        `method`: a `RankWorker` method (`RankWorker.update`), called on each rank's actor handle."""
        name = method.__name__
        check_one_per_rank(name, per_rank, len(self.workers))
        refs = [
            getattr(worker, name).remote(*(args[rank] for args in per_rank), **kwargs)
            for rank, worker in enumerate(self.workers)
        ]
        return Pending(name, refs, self)

    def call(self, method: Method, *per_rank: list[Any], **kwargs: Any) -> list[Any]:
        """`submit`, then wait: results by rank."""
        return self.submit(method, *per_rank, **kwargs).result()

    def call_all(self, method: Method, *args: Any, **kwargs: Any) -> list[Any]:
        """The same arguments on every rank."""
        return self.call(method, *([arg] * len(self.workers) for arg in args), **kwargs)

    def shutdown(self) -> None:
        with contextlib.suppress(Exception):  # best effort: the processes are killed next anyway
            # each process is killed next: its engine's memory is not freed first (`RankWorker.shutdown`)
            ray.get([w.shutdown.remote(process_ends=True) for w in self.workers], timeout=SHUTDOWN_WAIT_S)
        for worker in self.workers:
            ray.kill(worker)
        if self.placement is not None:
            remove_placement_group(self.placement)


@dataclass
class Pending:
    """Calls in flight on a group's ranks."""

    method: str
    refs: list[Any]
    group: RankGroup

    def result(self) -> list[Any]:
        """The results by rank. A rank's failure is raised as soon as it arrives (its peers may be
        waiting for it in a collective); ranks silent past the call's limit raise `RankHang`."""
        deadlines, clock = self.group.deadlines, Stopwatch()
        limit = deadlines.limit(self.method)
        position = {ref: rank for rank, ref in enumerate(self.refs)}
        waiting = list(self.refs)
        while waiting:
            # slices of <= 1 s: the driver's signal handlers (SIGTERM) run between them
            timeout = 1.0 if limit is None else min(1.0, max(limit - clock.elapsed(), 0.0))
            ready, waiting = ray.wait(waiting, num_returns=len(waiting), timeout=timeout)
            for ref in ready:
                _get(self.method, ref)
            if waiting and limit is not None and clock.elapsed() >= limit:
                silent = [self.group.names[position[ref]] for ref in waiting]
                raise deadlines.hang_error(self.method, clock.elapsed(), silent)
        deadlines.record(self.method, clock.elapsed())
        return _get(self.method, self.refs)


def _get(method: str, refs: Any) -> Any:
    """`ray.get`, with a rank's failure shown by its root cause. With `VLRL_DEBUG` set the Ray
    error stays chained (`__cause__`), so a traceback shows the worker's own traceback too."""
    try:
        return ray.get(refs)
    except ray.exceptions.RayTaskError as exc:
        raise WorkerError(f"rank worker failed in {method}: {root_cause(exc)}") from _debug_cause(exc)
    except ray.exceptions.ActorDiedError as exc:
        raise WorkerDied(f"a rank worker died during {method}: {exc}") from _debug_cause(exc)


def _debug_cause(exc: BaseException) -> BaseException | None:
    """`exc` under `VLRL_DEBUG` (its traceback is printed), else None (the trace is hidden)."""
    return exc if os.environ.get("VLRL_DEBUG") else None


def start_rank_groups(config: PPOConfig) -> RankRoles:
    """Place the ranks (see `rank_placement`) and start one `RankWorker` each.

    Hybrid (the default): one group, one torch.distributed world. Asynchronous mode
    (`worker.rollout.async_ranks`): the first ranks train in their own world; each of the last
    `async_ranks` ranks holds an engine in a world of its own."""
    from vlrl.rollout.vllm_hooks import current_run_id

    check_cluster_fits(config, ray.cluster_resources())
    layout = rank_placement(config)
    placement = placement_group(layout.bundles, strategy=layout.strategy)
    ray.get(placement.ready(), timeout=600)
    strategy = [
        PlacementGroupSchedulingStrategy(placement, placement_group_bundle_index=layout.bundle_of_rank[i])
        for i in range(config.world_size)
    ]
    remote_cls = ray.remote(RankWorker)
    run_id = current_run_id()  # names the engines' CPU shared memory, which the driver removes at exit

    def start(rank: int, *args: Any) -> Any:
        gpu = config.trainer.device == "cuda"
        return remote_cls.options(
            scheduling_strategy=strategy[rank], num_cpus=RANK_NUM_CPUS, num_gpus=1 if gpu else 0
        ).remote(config, *args, run_id=run_id)

    def address(rank: int) -> tuple[str, int]:
        return rendezvous_address(placement, layout.bundle_of_rank[rank], strategy[rank])

    train_world = config.train_world_size
    master_ip, master_port = address(0)  # the training world's rendezvous: rank 0's node
    role = "hybrid" if train_world == config.world_size else "train"
    deadlines = CallDeadlines(config.trainer.hang_timeout)
    train = RankGroup(
        [start(r, r, train_world, master_ip, master_port, role) for r in range(train_world)],
        placement,
        deadlines,
    )
    train.identify()
    if role == "hybrid":
        return RankRoles(train, train)
    rollout = [start(r, 0, 1, *address(r), "rollout") for r in range(train_world, config.world_size)]
    engines = RankGroup(rollout, deadlines=deadlines)
    engines.identify(first_rank=train_world)
    return RankRoles(train, engines)


def root_cause(exc: BaseException) -> str:
    """The innermost exception of a Ray error, as `Type: message`."""
    cause = getattr(exc, "cause", None) or exc.__cause__
    while cause is not None and (getattr(cause, "cause", None) or cause.__cause__) is not None:
        cause = getattr(cause, "cause", None) or cause.__cause__
    target = cause or exc
    return f"{type(target).__name__}: {target}"
