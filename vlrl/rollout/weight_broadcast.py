"""Weights from the training ranks to separate rollout ranks (asynchronous mode), by broadcast.

When the engines do not live on the training ranks (asynchronous mode, `worker.rollout.async_ranks`), the weights
cross between two torch.distributed worlds. `WeightBroadcast` is a process group of its own,
made from a TCP store and not the default group (each side keeps its own default world: FSDP on
the training ranks, vLLM's on the rollout ranks): member 0 is training rank 0, members 1..k are the
rollout ranks.

One sync (`send` on every training rank, `receive` on every rollout rank, at the same time):
1. every training rank casts its shards to the engines' dtype and walks the actor's full tensors
   (FSDP all-gathers are collectives of the training world); rank 0 packs them into flat byte
   buckets of at most `bucket_mb` MiB;
2. rank 0 broadcasts each bucket; every rollout rank unpacks it into views of the received buffer
   and hands them to its engine's `load_weights`.
The layout (names, shapes, dtypes, bucket bounds) is fixed for a run; it is written to the store
once, at the first sync, and read once by each receiver.

Each sync is announced in the store first (`announce`: sync number s -> the weights' version), so a
rollout rank can tell, without blocking, that weights are on their way (`announced`) and take them
between two engine steps (partial rollouts), or wait for a given version (`next_version`). Every
receiver takes every sync, in order: the broadcasts are collectives of the whole group.

Backends: gloo on CPU, NCCL on CUDA. A standalone group is built directly from the store
(torch 2.13, torch/csrc/distributed/c10d/init.cpp binds `ProcessGroupGloo(store, rank, size,
timeout)` and `ProcessGroupNCCL(store, rank, size, options)`); NCCL needs each member's CUDA device
set first (it binds the communicator to the current device) and broadcasts CUDA tensors, so on
GPU the buckets are packed on the device.
"""

from __future__ import annotations

import datetime
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

LAYOUT_KEY = "vlrl/weight_layout"
SYNCS_KEY = "vlrl/weight_syncs"  # how many syncs were announced; f"{SYNCS_KEY}/{s}": sync s's version


@dataclass(frozen=True)
class TensorSlot:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # bytes into its bucket
    nbytes: int


def make_group(host: str, port: int, member: int, members: int, device: str, timeout_minutes: float) -> Any:
    """The broadcast group; member 0 hosts the store (training rank 0)."""
    from torch.distributed import TCPStore

    timeout = datetime.timedelta(minutes=timeout_minutes)
    store = TCPStore(host, port, members, is_master=member == 0, timeout=timeout)
    if device == "cuda":
        from torch.distributed import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        return store, ProcessGroupNCCL(store, member, members, options)
    from torch.distributed import ProcessGroupGloo

    return store, ProcessGroupGloo(store, member, members, timeout)


class WeightBroadcast:
    """One side of the trainer -> engines weight broadcast (see the module docstring)."""

    def __init__(
        self,
        host: str,
        port: int,
        member: int,
        members: int,
        device: str = "cpu",
        timeout_minutes: float = 30.0,
    ) -> None:
        self.member, self.device = member, torch.device("cuda" if device == "cuda" else "cpu")
        self.store, self.group = make_group(host, port, member, members, device, timeout_minutes)
        self.layout: list[list[TensorSlot]] | None = None
        self.syncs = 0  # syncs this member announced (member 0) or received (the others)

    # ------------------------------------------------------------------ announcements
    def announce(self, version: int) -> None:
        """Member 0, before broadcasting a sync: its version (updates done), then the count, so a
        receiver that sees the count can always read the version."""
        self.syncs += 1
        self.store.set(f"{SYNCS_KEY}/{self.syncs}", str(version))
        self.store.add(SYNCS_KEY, 1)

    def announced(self) -> bool:
        """Whether a sync this receiver has not taken was announced (a store round trip, no wait)."""
        return int(self.store.add(SYNCS_KEY, 0)) > self.syncs

    def next_version(self) -> int:
        """The version of the next sync to take, waiting for its announcement; `receive` takes it."""
        return int(self.store.get(f"{SYNCS_KEY}/{self.syncs + 1}").decode())

    # ------------------------------------------------------------------ training side
    def pack(
        self, named: Iterator[tuple[str, torch.Tensor]], bucket_mb: float, dtype: torch.dtype | None
    ) -> list[tuple[torch.Tensor, list[TensorSlot]]]:
        """`named` packed into host byte buckets (flat uint8, their slots): a snapshot of the weights
        that `send_packed` can broadcast later, from another thread, while the actor trains on."""
        buckets = []
        for bucket in self._buckets(named, bucket_mb, dtype):
            flat, slots = _flatten(bucket)
            buckets.append((flat.cpu(), slots))
        return buckets

    def send_packed(self, buckets: list[tuple[torch.Tensor, list[TensorSlot]]]) -> dict[str, float]:
        """Broadcast what `pack` made (the rollout ranks are in `receive`). May run in a thread: on
        CUDA `self.device` is `cuda` without an index, i.e. the calling thread's current device,
        which a new thread starts at 0 (torch keeps it per thread); a Ray rank sees its one GPU as
        cuda:0, the device the group was made on. Not yet run on a GPU (no tests/gpu case)."""
        sent = 0
        for index, (flat, slots) in enumerate(buckets):
            sent += self._send_flat(flat.to(self.device), slots, index)
        self._broadcast(torch.zeros(1, dtype=torch.uint8, device=self.device))  # "no more buckets"
        return {"sync/bytes": float(sent)}

    def send(
        self, named: Iterator[tuple[str, torch.Tensor]], bucket_mb: float, dtype: torch.dtype | None
    ) -> dict[str, float]:
        """Member 0 (training rank 0) packs and broadcasts `named`, the actor's full tensors (the
        other training ranks walk them too, for the all-gathers, but are not members). Returns
        {"sync/bytes": ...}."""
        sent = 0
        for index, bucket in enumerate(self._buckets(named, bucket_mb, dtype)):
            flat, slots = _flatten(bucket)
            sent += self._send_flat(flat.to(self.device), slots, index)
        self._broadcast(torch.zeros(1, dtype=torch.uint8, device=self.device))  # "no more buckets"
        return {"sync/bytes": float(sent)}

    def _buckets(
        self, named: Iterator[tuple[str, torch.Tensor]], bucket_mb: float, dtype: torch.dtype | None
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """`named` in the engines' dtype, grouped into buckets of at most `bucket_mb` MiB (a larger
        tensor gets a bucket of its own)."""
        if self.member != 0:
            raise RuntimeError("only member 0 (training rank 0) sends weights")
        limit = int(bucket_mb * (1 << 20))
        size, bucket = 0, list[tuple[str, torch.Tensor]]()
        for name, tensor in named:
            tensor = tensor.detach()
            if dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(dtype)
            nbytes = tensor.numel() * tensor.element_size()
            if bucket and size + nbytes > limit:
                yield bucket
                size, bucket = 0, []
            bucket.append((name, tensor.contiguous()))
            size += nbytes
        if bucket:
            yield bucket

    def _send_flat(self, flat: torch.Tensor, slots: list[TensorSlot], index: int) -> int:
        """Broadcast "one more bucket", its byte count, then its bytes; the first sync also writes the
        bucket's slots to the store (before its bytes, so a receiver never waits on them)."""
        if self.layout is None or index >= len(self.layout):
            self.layout = [*(self.layout or []), slots]
            self.store.set(f"{LAYOUT_KEY}/{index}", pickle.dumps(slots))
        self._broadcast(torch.ones(1, dtype=torch.uint8, device=self.device))
        self._broadcast(torch.tensor([flat.numel()], dtype=torch.int64, device=self.device))
        self._broadcast(flat)
        return flat.numel()

    # ------------------------------------------------------------------ rollout side
    def receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of one sync, bucket by bucket (pass it to the engine's `load_weights`)."""
        self.syncs += 1
        index = 0
        while True:
            more = torch.zeros(1, dtype=torch.uint8, device=self.device)
            self._broadcast(more)
            if int(more.item()) == 0:
                return
            size = torch.zeros(1, dtype=torch.int64, device=self.device)
            self._broadcast(size)
            buffer = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
            self._broadcast(buffer)
            for slot in self._slots(index):
                raw = buffer[slot.offset : slot.offset + slot.nbytes]
                yield slot.name, raw.view(slot.dtype).reshape(slot.shape)
            index += 1

    def _slots(self, index: int) -> list[TensorSlot]:
        """Bucket `index`'s slots: read from the store once, at the first sync."""
        layout = self.layout if self.layout is not None else []
        if index >= len(layout):
            layout.append(pickle.loads(self.store.get(f"{LAYOUT_KEY}/{index}")))
        self.layout = layout
        return layout[index]

    def _broadcast(self, tensor: torch.Tensor) -> None:
        self.group.broadcast([tensor], _root_zero()).wait()


def _flatten(bucket: list[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, list[TensorSlot]]:
    """One bucket's tensors as one flat uint8 tensor and their slots in it."""
    flat, slots, offset = [], [], 0
    for name, tensor in bucket:
        raw = tensor.reshape(-1).view(torch.uint8)
        slots.append(TensorSlot(name, tuple(tensor.shape), tensor.dtype, offset, raw.numel()))
        flat.append(raw)
        offset += raw.numel()
    return torch.cat(flat), slots


def _root_zero() -> Any:
    from torch.distributed import BroadcastOptions

    options = BroadcastOptions()
    options.rootRank = 0
    return options
