"""What the trainer needs from its ranks, and a group that runs them in the driver's own process.

`PPOTrainer` calls its ranks only through `call` / `call_all` / `shutdown`, so anything with those
three methods can stand in for the Ray `RankGroup`: `InProcessRanks` runs worker objects one after
another in this process. With one real `RankWorker` (world size 1) that is the whole training step
without Ray, which is how the trainer's logic is unit-tested (tests/trainer/test_ppo_trainer.py).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias

from vlrl.config import PPOConfig

Method: TypeAlias = Callable[..., Any]
"""A `RankWorker` method named at the call site (`ranks.call(RankWorker.update, ...)`): each rank's
worker (a Ray actor handle, or the worker itself in-process) runs its method of that name."""


class Pending(Protocol):
    def result(self) -> list[Any]: ...


class Ranks(Protocol):
    """One remote call per rank, results by rank (see `vlrl.trainer.ray_workers.RankGroup`);
    `submit` starts the calls and returns at once, so the driver can overlap two groups' work."""

    workers: list[Any]  # one handle per rank

    def call(self, method: Method, *per_rank: list[Any], **kwargs: Any) -> list[Any]: ...

    def submit(self, method: Method, *per_rank: list[Any], **kwargs: Any) -> Pending: ...

    def call_all(self, method: Method, *args: Any, **kwargs: Any) -> list[Any]: ...

    def shutdown(self) -> None: ...


@dataclass
class RankRoles:
    """The trainer's ranks by role: `train` holds the actor (and reference), `generate` the engines.
    The same group in the default (hybrid) mode; separate ones in asynchronous mode."""

    train: Ranks
    generate: Ranks

    @property
    def separate(self) -> bool:
        return self.generate is not self.train

    def shutdown(self) -> None:
        if self.separate:
            self.generate.shutdown()
        self.train.shutdown()


class InProcessRanks:
    """Worker objects called in turn in this process.

    Calls are sequential, so the workers must not wait on each other: one real `RankWorker`
    (its collectives have a world of one), or test workers without collectives."""

    def __init__(self, workers: list[Any]) -> None:
        self.workers = workers

    @classmethod
    def single_rank(cls, config: PPOConfig) -> InProcessRanks:
        """One `RankWorker` in this process: a torch.distributed world of size 1 on a free local port."""
        from vlrl.workers.rank_worker import RankWorker

        if config.world_size != 1:
            raise ValueError(
                f"an in-process rank group has one rank; the config asks for {config.world_size}"
            )
        return cls([RankWorker(config, 0, 1, "127.0.0.1", _free_port())])

    def roles(self) -> RankRoles:
        """These ranks in both roles (the hybrid mode)."""
        return RankRoles(self, self)

    def call(self, method: Method, *per_rank: list[Any], **kwargs: Any) -> list[Any]:
        check_one_per_rank(method.__name__, per_rank, len(self.workers))
        return [
            getattr(worker, method.__name__)(*(args[rank] for args in per_rank), **kwargs)
            for rank, worker in enumerate(self.workers)
        ]

    def submit(self, method: Method, *per_rank: list[Any], **kwargs: Any) -> Done:
        """Runs the calls now (nothing overlaps in one process); `.result()` returns them."""
        return Done(self.call(method, *per_rank, **kwargs))

    def call_all(self, method: Method, *args: Any, **kwargs: Any) -> list[Any]:
        return self.call(method, *([arg] * len(self.workers) for arg in args), **kwargs)

    def shutdown(self) -> None:
        for worker in self.workers:
            if hasattr(worker, "shutdown"):
                worker.shutdown()


@dataclass
class Done:
    """Results that are already there (`InProcessRanks.submit`)."""

    results: list[Any]

    def result(self) -> list[Any]:
        return self.results


def check_one_per_rank(method: str, per_rank: tuple[list[Any], ...], ranks: int) -> None:
    """Each per-rank argument list must have one entry per rank (a longer one would be cut silently)."""
    for args in per_rank:
        if len(args) != ranks:
            raise ValueError(f"{method}: {len(args)} per-rank arguments for {ranks} ranks")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
