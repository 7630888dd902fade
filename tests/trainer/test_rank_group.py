"""Rank groups on a real local Ray cluster. A hung rank stops the run: limits from
`trainer.hang_timeout` and the measured call times, and a group whose rank never answers raises
RankHang naming it (a real Ray actor that sleeps). The training world's rendezvous address."""

from __future__ import annotations

import socket
import sys
import time

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from vlrl.trainer import ray_workers
from vlrl.trainer.deadlines import CallDeadlines, RankHang
from vlrl.trainer.ray_workers import RankGroup, rendezvous_address


def test_limits_grow_with_the_longest_call() -> None:
    deadlines = CallDeadlines(30)
    assert deadlines.limit("update") == 30  # nothing measured: the floor
    deadlines.record("update", 2.0)
    assert deadlines.limit("update") == 30
    deadlines.record("update", 7.5)
    deadlines.record("update", 1.0)  # the longest counts
    assert deadlines.limit("update") == 75
    assert deadlines.limit("generate") == 30  # each method its own
    assert CallDeadlines(0).limit("update") is None  # 0: no limit


class _Sleeper:
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def process(self) -> tuple[int, str]:
        return 1000 + self.rank, "node-a"

    def nap(self, seconds_by_rank: dict[int, float]) -> int:
        time.sleep(seconds_by_rank.get(self.rank, 0.0))
        return self.rank

    def fail(self) -> None:
        raise ValueError("bad shard")


@pytest.fixture(scope="module")
def local_ray():
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import tests/
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_a_rank_that_does_not_answer_is_named(local_ray) -> None:
    group = RankGroup([ray.remote(_Sleeper).remote(r) for r in range(2)])
    group.identify()  # without a limit: starting the actors may take seconds on a loaded machine
    assert group.call_all(_Sleeper.nap, {}) == [0, 1]
    group.deadlines = CallDeadlines(3)
    start = time.monotonic()
    with pytest.raises(RankHang, match=r"^rank 1 \(pid 1001 on node-a\) did not finish nap within 3 s"):
        group.call_all(_Sleeper.nap, {1: 60.0})
    assert time.monotonic() - start < 30
    with pytest.raises(Exception, match="bad shard"):  # a failure is raised at once, not waited out
        group.call_all(_Sleeper.fail)
    group.shutdown()


def test_the_rendezvous_on_the_drivers_node_is_picked_there_and_elsewhere_by_a_task(
    local_ray, monkeypatch
) -> None:
    placement = placement_group([{"CPU": 1}])
    ray.get(placement.ready(), timeout=60)
    strategy = PlacementGroupSchedulingStrategy(placement, placement_group_bundle_index=0)
    with monkeypatch.context() as patch:  # one node: no task (it would start a worker process)
        patch.setattr(ray, "remote", lambda *args, **kwargs: pytest.fail("a task was started"))
        ip, port = rendezvous_address(placement, 0, strategy)
    assert ip == ray.util.get_node_ip_address()
    with socket.socket() as free:
        free.bind((ip, port))  # the port is free
    # the bundle on another node: a task placed there answers with that node's address
    elsewhere = {"bundles_to_node_id": {0: "another-node"}}
    monkeypatch.setattr(ray_workers, "placement_group_table", lambda placement: elsewhere)
    assert rendezvous_address(placement, 0, strategy)[0] == ip  # the bundle's real node is this one
    remove_placement_group(placement)
