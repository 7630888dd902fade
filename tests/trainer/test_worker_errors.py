"""A rank's failure as the driver reports it: the root cause plainly, and with VLRL_DEBUG=1 the
worker's own traceback as well (no Ray cluster needed: `ray.get` raises a built Ray error)."""

from __future__ import annotations

import traceback

import pytest
import ray

from vlrl.trainer import ray_workers


def _worker_setup() -> None:
    raise RuntimeError("The size of tensor a (128) must match the size of tensor b (96)")


def _ray_task_error() -> ray.exceptions.RayTaskError:
    """What `ray.get` raises for a remote method that failed (Ray carries the worker's traceback)."""
    try:
        _worker_setup()
    except RuntimeError as exc:
        error = ray.exceptions.RayTaskError("RankWorker.setup", traceback.format_exc(), exc)
        return error.as_instanceof_cause()
    raise AssertionError("unreachable")


def _failure(monkeypatch: pytest.MonkeyPatch) -> ray_workers.WorkerError:
    def failing_get(refs):
        raise _ray_task_error()

    monkeypatch.setattr(ray_workers.ray, "get", failing_get)
    with pytest.raises(ray_workers.WorkerError) as info:
        ray_workers.Pending("setup", [], ray_workers.RankGroup([])).result()
    return info.value


@pytest.mark.parametrize("debug", [False, True])
def test_worker_traceback_is_shown_only_with_vlrl_debug(monkeypatch, debug):
    if debug:
        monkeypatch.setenv("VLRL_DEBUG", "1")
    else:
        monkeypatch.delenv("VLRL_DEBUG", raising=False)
    error = _failure(monkeypatch)
    assert str(error) == (
        "rank worker failed in setup: RuntimeError: "
        "The size of tensor a (128) must match the size of tensor b (96)"
    )
    shown = "".join(traceback.format_exception(error))
    assert ("in _worker_setup" in shown) is debug  # the worker's frame
    assert isinstance(error.__cause__, ray.exceptions.RayTaskError) is debug
