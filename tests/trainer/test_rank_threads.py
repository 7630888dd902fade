"""CPU threads of a rank worker (issue 31, finding 10): Ray leaves OMP_NUM_THREADS=1 in an actor
that asks for one CPU; a rank uses the node's CPUs / its ranks instead, unless the user chose."""

import inspect
import os

import pytest
import torch

from vlrl.utils import rank_threads
from vlrl.utils.rank_threads import (
    USER_THREADS_ENV,
    rank_cpu_threads,
    set_rank_threads,
    user_thread_env,
    user_thread_setting,
)


@pytest.mark.parametrize(
    "cpus, ranks, user, expected",
    [
        (16, 8, None, 2),  # one H100 node of the GPU machine type: 16 cores, 8 ranks
        (16, 1, None, 16),
        (96, 8, None, 12),
        (4, 8, None, 1),  # fewer CPUs than ranks: at least one
        (2, 0, None, 2),
        (16, 8, "6", 6),  # the user's choice wins
        (16, 8, "0", 2),  # not a positive count: the rule
        (16, 8, "many", 2),
    ],
)
def test_thread_count_rule(cpus: int, ranks: int, user: str | None, expected: int) -> None:
    assert rank_cpu_threads(cpus, ranks, user) == expected


def test_whose_setting_it_is() -> None:
    # under Ray, "1" is what Ray itself sets for a one-CPU actor: not the user's
    assert user_thread_setting({"OMP_NUM_THREADS": "1"}, under_ray=True) is None
    assert user_thread_setting({"OMP_NUM_THREADS": "4"}, under_ray=True) == "4"  # exported before `ray start`
    assert user_thread_setting({"OMP_NUM_THREADS": "1", USER_THREADS_ENV: "1"}, under_ray=True) == "1"
    assert user_thread_setting({"OMP_NUM_THREADS": "1"}, under_ray=False) == "1"  # no Ray to set it
    assert user_thread_setting({}, under_ray=True) is None


def test_driver_forwards_only_a_users_setting() -> None:
    assert user_thread_env({}) == {}
    assert user_thread_env({"OMP_NUM_THREADS": "3"}) == {"OMP_NUM_THREADS": "3", USER_THREADS_ENV: "3"}


def test_a_ray_rank_sets_torch_and_its_children(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.setattr(rank_threads, "node_cpus", lambda: 16)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as Ray leaves it
    monkeypatch.delenv(USER_THREADS_ENV, raising=False)
    note = set_rank_threads(8, under_ray=True)
    assert calls == [2] and os.environ["OMP_NUM_THREADS"] == "2"
    assert note == "2 CPU threads per rank (16 CPUs / 8 rank(s) on the node)"
    monkeypatch.setenv(USER_THREADS_ENV, "5")
    assert set_rank_threads(8, under_ray=True) == "5 CPU threads per rank (OMP_NUM_THREADS=5, the user's)"
    assert calls == [2, 5]


def test_in_process_leaves_the_environment_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    monkeypatch.setattr(rank_threads, "node_cpus", lambda: 16)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv(USER_THREADS_ENV, raising=False)
    set_rank_threads(2, under_ray=False)
    assert "OMP_NUM_THREADS" not in os.environ


def test_ray_still_sets_omp_num_threads_when_unset() -> None:
    """The Ray behaviour this works around (ray 2.60, python/ray/_private/utils.py): a worker's
    OMP_NUM_THREADS, when unset, becomes its assigned CPUs (at least 1); a set one is left alone."""
    from ray._private import utils

    source = inspect.getsource(utils.set_omp_num_threads_if_unset)
    assert 'os.environ["OMP_NUM_THREADS"] = str(omp_num_threads)' in source
    assert 'os.environ.get("OMP_NUM_THREADS")' in source
