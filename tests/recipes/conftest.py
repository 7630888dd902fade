"""Shared by the recipe runs: one Ray cluster, and the EasyR1-shaped assets (built once)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from recipe_assets import easyr1_workdir


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    """One local Ray cluster that every run of a module joins through RAY_ADDRESS, as runs on a
    cluster do: a run then skips the ~10 s of starting its own. Stopped with the module, so the
    test process is Ray-free again for the tests after it (in-process rank workers check
    `ray.is_initialized()`)."""
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="session")
def easyr1_assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return easyr1_workdir(tmp_path_factory.getbasetemp() / "recipes")


@pytest.fixture
def easyr1_dir(easyr1_assets: Path, tmp_path: Path) -> Path:
    """This test's own EasyR1 folder (its checkpoints/ apart): links to the shared assets."""
    for entry in easyr1_assets.iterdir():
        (tmp_path / entry.name).symlink_to(entry, target_is_directory=True)
    return tmp_path
