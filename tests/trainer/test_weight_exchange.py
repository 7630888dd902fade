"""Each rank's side of the weight broadcast (vlrl.workers.weight_exchange), with a scripted group.

The broadcast itself runs across processes in tests/rollout/test_weight_broadcast.py; here: which
syncs a rollout rank takes, when, and how it labels its engine."""

from __future__ import annotations

from vlrl.workers.weight_exchange import WeightIntake, WeightSender


class _Group:
    """Syncs announced as versions; `receive` hands out the next one's tensors, in order."""

    def __init__(self, versions: list[int]) -> None:
        self.versions, self.syncs, self.sent = versions, 0, []

    def announced(self) -> bool:
        return len(self.versions) > self.syncs

    def next_version(self) -> int:
        return self.versions[self.syncs]

    def receive(self):
        self.syncs += 1
        return iter([("w", self.syncs)])

    def announce(self, version: int) -> None:
        self.sent.append(("announce", version))

    def send(self, named, bucket_mb, dtype):
        self.sent.append(("send", [name for name, _ in named]))
        return {"sync/bytes": 4.0}


class _Engine:
    between_steps = None
    policy_version = None

    def __init__(self) -> None:
        self.loads: list[tuple[str, list]] = []

    def load_weights(self, named) -> None:
        self.loads.append(("after", list(named)))

    def load_weights_in_flight(self, named) -> None:
        self.loads.append(("inside", list(named)))

    def set_policy_version(self, version: int) -> None:
        self.policy_version = version


def test_a_generation_takes_announced_syncs_between_its_steps_and_the_queued_receive_finds_none() -> None:
    group, engine = _Group([0]), _Engine()
    intake = WeightIntake(group, engine, partial=True, poll_every_s=0.0)
    assert engine.between_steps == intake.between_steps  # the engine calls it between two steps
    intake.receive(0)  # the first sync, before any generation: the driver's receive takes it
    assert engine.loads == [("after", [("w", 1)])] and engine.policy_version == 0
    intake.between_steps()  # nothing announced since
    group.versions.append(1)  # training rank 0 announced update 1 while a generation runs
    intake.between_steps()
    assert engine.loads[-1] == ("inside", [("w", 2)]) and engine.policy_version == 1 and intake.in_flight == 1
    intake.receive(1)  # the driver's receive, queued behind that generation: already taken
    assert len(engine.loads) == 2 and group.syncs == 2
    group.versions += [2, 3]  # two syncs while the engine was idle: the receive for 3 takes both, in order
    intake.receive(3)
    assert [where for where, _ in engine.loads] == ["after", "inside", "after", "after"]
    assert engine.policy_version == 3 and intake.version == 3


def test_the_store_is_asked_at_most_every_poll_interval() -> None:
    group, engine = _Group([0, 1]), _Engine()
    intake = WeightIntake(group, engine, partial=True, poll_every_s=3600.0)
    intake.between_steps()  # the first call asks: both announced syncs are taken
    group.versions.append(2)
    intake.between_steps()  # within the interval: not asked again
    assert group.syncs == 2 and intake.version == 1


def test_without_partial_rollouts_the_engine_is_never_interrupted() -> None:
    engine = _Engine()
    WeightIntake(_Group([0]), engine, partial=False)
    assert engine.between_steps is None


def test_a_sync_is_announced_with_its_version_before_it_is_sent() -> None:
    group = _Group([])
    sender = WeightSender(group, bucket_mb=1, dtype=None)
    metrics = sender.send(iter([("a", 1), ("b", 2)]), version=5, background=False)
    assert group.sent == [("announce", 5), ("send", ["a", "b"])] and metrics["sync/bytes"] == 4.0
    assert WeightSender(None, 1, None).send(iter([("a", 1)]), 5, background=False) == {}  # not a member
