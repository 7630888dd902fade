"""Fixtures for the reward tests."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture
def write_reward(tmp_path: Path) -> Callable[..., str]:
    """Write `source` (dedented) to tmp_path/<name> and return its path."""

    def write(source: str, name: str = "reward.py") -> str:
        path = tmp_path / name
        path.write_text(textwrap.dedent(source))
        return str(path)

    return write
