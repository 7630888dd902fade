"""Both ends of asynchronous mode's weight broadcast, as a rank worker holds them.

`WeightSender` (every training rank; training rank 0 is the broadcast's member 0) walks the
actor's full tensors and, on rank 0, broadcasts them: at once, or packed into a host snapshot and
sent from a thread (a staleness bound above 1: the engines take the weights while they generate).
`WeightIntake` (a rollout rank) loads what arrives into its engine and labels the engine with the
weights' version, so every sampled token records the policy that sampled it. With partial
rollouts (`worker.rollout.partial_rollouts`) the engine asks between two of its steps whether a
sync was announced (`WeightBroadcast.announced`) and takes it there, inside the generation.

Every rollout rank takes every sync, in order (the broadcasts are collectives of the group): the
driver's `receive` for version v, queued behind a generation that already took v between its steps,
finds nothing left to take.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import torch

from vlrl.rollout.base import RolloutEngine
from vlrl.rollout.weight_broadcast import WeightBroadcast
from vlrl.utils.background import in_background
from vlrl.utils.busy_clock import BusyClock

POLL_EVERY_S = 0.01  # partial rollouts: how often an engine asks whether a sync was announced


class WeightSender:
    """A training rank's side (member 0 of the broadcast on rank 0; `broadcast` None elsewhere)."""

    def __init__(
        self,
        broadcast: WeightBroadcast | None,
        bucket_mb: float,
        dtype: torch.dtype,
        clock: BusyClock | None = None,
    ) -> None:
        self.broadcast, self.bucket_mb, self.dtype = broadcast, bucket_mb, dtype
        self.clock = clock or BusyClock()  # the rank's: waiting for the engines is idle time
        self.sending: Future[dict[str, float]] | None = None  # a background send

    def send(
        self, named: Iterator[tuple[str, torch.Tensor]], version: int, background: bool
    ) -> dict[str, float]:
        """Broadcast `named` (the actor's full tensors in the engines' dtype; every training rank
        walks them, for the all-gathers) as the weights of `version`, updates done.

        `background`: rank 0 packs a host copy now and broadcasts it from a thread while the
        training ranks go on; the previous such send is waited for first (its metrics are returned
        then: one sync late)."""
        start = time.perf_counter()
        if self.broadcast is None:  # not a member: join the gathers only
            for _ in named:
                pass
            return {}
        if not background:
            self.broadcast.announce(version)
            metrics = self.broadcast.send(named, self.bucket_mb, self.dtype)
            return {**metrics, "sync/time_s": time.perf_counter() - start}
        with self.clock.waiting():  # until the engines took the previous sync
            previous = self.finish()
        packed = self.broadcast.pack(named, self.bucket_mb, self.dtype)
        broadcast = self.broadcast
        broadcast.announce(version)  # after the previous send ended: syncs are taken in order
        self.sending = in_background(lambda: broadcast.send_packed(packed), "vlrl-weight-send")
        return {**previous, "sync/pack_s": time.perf_counter() - start}

    def finish(self) -> dict[str, float]:
        """Wait for a background send; its metrics, or {}."""
        sending, self.sending = self.sending, None
        return sending.result() if sending is not None else {}


class WeightIntake:
    """A rollout rank's side: the syncs it takes and the version its engine holds."""

    def __init__(
        self,
        broadcast: WeightBroadcast,
        engine: RolloutEngine,
        partial: bool,
        poll_every_s: float = POLL_EVERY_S,
        clock: BusyClock | None = None,
    ) -> None:
        self.broadcast, self.engine = broadcast, engine
        self.clock = clock or BusyClock()  # the rank's: waiting for a sync to be announced is idle time
        self.version = -1  # the weights' version the engine holds; -1: none received yet
        self.in_flight = 0  # syncs taken inside a generation (partial rollouts)
        self.poll_every_s, self.polled = poll_every_s, float("-inf")
        if partial:
            engine.between_steps = self.between_steps

    def receive(self, version: int) -> None:
        """Take the syncs announced up to `version` (waiting for them); none when a generation
        already took them between its steps."""
        while self.version < version:
            self._take(self.engine.load_weights)

    def between_steps(self) -> None:
        """Partial rollouts, between two engine steps: take a sync that was announced, if any. The
        store is asked at most every `poll_every_s` (a round trip to training rank 0's node; a GPU
        decode step can be a few milliseconds), so a sync waits at most that long for the engine."""
        now = time.perf_counter()
        if now - self.polled < self.poll_every_s:
            return
        self.polled = now
        while self.broadcast.announced():
            self._take(self.engine.load_weights_in_flight)
            self.in_flight += 1

    def _take(self, load: Callable[[Iterator[tuple[str, torch.Tensor]]], None]) -> None:
        with self.clock.waiting():  # for training rank 0 to announce it
            version = self.broadcast.next_version()
        load(self.broadcast.receive())
        self.engine.set_policy_version(version)
        self.version = version
