"""Tools of a tensor-parallel group: the TP leader runs them, every peer gets the leader's outputs.

With `tensor_parallel_size` T > 1, T consecutive ranks share one vLLM model, and each of them runs
its own scheduler: their collectives stay matched only while every peer queues the same requests
(same token ids, same order, same step). What a peer queues next depends on the tool outputs (a
result's text and images become the next turn's context) and, with `overlap_tools`, on which calls
have finished by a given step. Tools run in each peer's own processes would not agree: a timeout
near the limit, a crashed worker, a random or time-dependent result on one peer changes its context
length, the peers' batches differ in shape, and the TP all-reduces mismatch or hang.

So only the group's first rank (the leader) has a `ToolPool`; after each call, interaction or poll
it sends the outputs (`ToolOutput`: text, PIL images, error / timed-out flags; interaction replies;
with `overlap_tools` the set of finished tickets) to its peers with `broadcast_object_list` over a
gloo group of the T ranks. Every peer then appends the same turns and queues the same requests.
A failure of the leader's pool is broadcast too, so the peers raise instead of waiting forever.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from vlrl.rollout.multi_turn.tool_pool import ToolPool
from vlrl.rollout.multi_turn.tools import ToolOutput

T = TypeVar("T")
Call = tuple[str, dict[str, Any], dict[str, Any]]  # (tool name, arguments, row context)

# A peer waits in the broadcast while the leader's tools run: a step's calls can take many tool
# timeouts (calls / tool_workers of them), longer than torch's default 30 minutes. A real hang is
# the trainer's to catch (trainer.hang_timeout); a dead leader closes the gloo connection at once.
BROADCAST_TIMEOUT = datetime.timedelta(hours=24)


@dataclass(frozen=True)
class TPGroup:
    """This rank's tensor-parallel group, as far as the tools are concerned."""

    group: Any  # torch.distributed ProcessGroup (gloo) of the T peers
    leader: int  # global rank of the group's first rank, the one that runs the tools
    is_leader: bool


def build_tp_group(tensor_parallel_size: int) -> TPGroup | None:
    """Gloo groups of `tensor_parallel_size` consecutive ranks (vLLM's TP layout); this rank's one.

    Collective: `new_group` must be called by every rank of the world, for every group, in the same
    order, so each rank builds all W / T groups and keeps its own. Gloo also on GPU worlds
    (`cuda:nccl,cpu:gloo`): the objects are pickled into CPU tensors, no device copy. None for
    T = 1 (no peers) or without a torch.distributed world (an engine used on its own)."""
    import torch.distributed as dist

    if tensor_parallel_size <= 1 or not dist.is_initialized():
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % tensor_parallel_size:
        raise ValueError(
            f"worker.rollout.tensor_parallel_size={tensor_parallel_size} must divide the world size {world}"
        )
    mine = None
    for start in range(0, world, tensor_parallel_size):
        ranks = list(range(start, start + tensor_parallel_size))
        group = dist.new_group(ranks, timeout=BROADCAST_TIMEOUT, backend="gloo")
        if rank in ranks:
            mine = group
    leader = rank - rank % tensor_parallel_size
    return TPGroup(mine, leader, rank == leader)


class SharedTools:
    """The `ToolPool` interface the turn loop uses (`call`, `interact`, `submit_calls`, `poll`),
    run on the TP leader and broadcast to the peers; without a group, the local pool itself.

    Calls with nothing to do (no calls, no tickets) return at once on every peer without a
    broadcast: the peers hold the same loop state, so they all skip the same ones."""

    def __init__(self, make_pool: Callable[[], ToolPool], tp: TPGroup | None) -> None:
        self.tp = tp
        self.pool: ToolPool | None = None
        """The leader's (or a TP=1 engine's) tool processes; None on the other peers."""

        def start() -> None:
            self.pool = make_pool()

        self._shared(start, "starting the tool workers")
        self._tickets = 0  # this object's tickets, the same on every peer (same calls, same order)
        self._pool_tickets: dict[int, int] = {}  # leader: this object's ticket -> the pool's

    @property
    def runs_tools(self) -> bool:
        """Whether the tools run in this process (TP=1, or the TP leader)."""
        return self.tp is None or self.tp.is_leader

    def call(self, calls: list[Call]) -> list[ToolOutput]:
        """The outputs of (name, arguments, context) calls in call order (the leader's on every peer)."""
        if not calls:
            return []
        return self._shared(lambda: self._local().call(calls), "running tool calls")

    def interact(self, requests: list[tuple[list[dict[str, Any]], dict[str, Any]]]) -> list[str | None]:
        """The interaction's replies to (messages, context) requests (the leader's on every peer)."""
        if not requests:
            return []
        return self._shared(lambda: self._local().interact(requests), "running the interaction")

    def submit_calls(self, calls: list[Call]) -> list[int]:
        """Queue calls without waiting; one ticket per call. No broadcast: every peer numbers the
        same calls alike, and only the leader hands them to its pool."""
        tickets = list(range(self._tickets + 1, self._tickets + 1 + len(calls)))
        self._tickets += len(calls)
        if self.runs_tools and calls:
            self._pool_tickets.update(zip(tickets, self._local().submit_calls(calls)))
        return tickets

    def poll(self, tickets: set[int], block: bool) -> dict[int, ToolOutput]:
        """The finished calls among `tickets` (block: at least one). Which ones have finished is a
        matter of timing, so the leader's answer is the peers' answer too."""
        if not tickets:
            return {}
        return self._shared(lambda: self._poll_local(tickets, block), "polling tool calls")

    def _poll_local(self, tickets: set[int], block: bool) -> dict[int, ToolOutput]:
        ours = {self._pool_tickets[t]: t for t in tickets}
        done = self._local().poll(set(ours), block)
        for pool_ticket in done:
            del self._pool_tickets[ours[pool_ticket]]
        return {ours[t]: output for t, output in done.items()}

    def _local(self) -> ToolPool:
        assert self.pool is not None, "only the tensor-parallel leader runs tools"
        return self.pool

    def _shared(self, run: Callable[[], T], what: str) -> T:
        """`run()` on the leader, its value (or its failure) broadcast to the peers; `run()` itself
        without a group."""
        if self.tp is None:
            return run()
        import torch.distributed as dist

        box: list[Any] = [None]
        failure: BaseException | None = None
        if self.tp.is_leader:
            try:
                box[0] = ("ok", run())
            except BaseException as exc:  # the peers must not wait for a broadcast that never comes
                failure = exc
                box[0] = ("error", f"{type(exc).__name__}: {exc}")
        dist.broadcast_object_list(box, src=self.tp.leader, group=self.tp.group)
        status, value = box[0]
        if failure is not None:
            raise failure
        if status == "error":
            raise RuntimeError(
                f"{what} failed on the tensor-parallel leader (rank {self.tp.leader}), which runs this "
                f"engine's tools: {value}"
            )
        return value

    def close(self) -> None:
        """Stop the local tool workers (idempotent; nothing to do on the peers)."""
        if self.pool is not None:
            self.pool.close()
