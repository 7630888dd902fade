"""Shared by the recipe runs: one Ray cluster, and the EasyR1-shaped assets (built once)."""

from __future__ import annotations

from pathlib import Path

import pytest
import shared_ray
from recipe_assets import easyr1_workdir


@pytest.fixture
def ray_address() -> str:
    """The suite's one Ray cluster, which every recipe run joins through RAY_ADDRESS (shared_ray.py)."""
    return shared_ray.address()


@pytest.fixture(scope="session")
def easyr1_assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return easyr1_workdir(tmp_path_factory.getbasetemp() / "recipes")


@pytest.fixture
def easyr1_dir(easyr1_assets: Path, tmp_path: Path) -> Path:
    """This test's own EasyR1 folder (its checkpoints/ apart): links to the shared assets."""
    for entry in easyr1_assets.iterdir():
        (tmp_path / entry.name).symlink_to(entry, target_is_directory=True)
    return tmp_path
