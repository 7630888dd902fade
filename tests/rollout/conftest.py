"""Fixtures for the rollout tests: tiny model folders, built once per session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    """`tiny_model(arch)`: path of a tiny model folder for `arch`, built on first use."""
    from vlrl.models.tiny import build_tiny_model

    built: dict[str, Path] = {}

    def get(arch: str = "qwen2_5_vl") -> str:
        if arch not in built:
            built[arch] = build_tiny_model(tmp_path_factory.mktemp(f"rollout_{arch}"), arch=arch)
        return str(built[arch])

    return get


@pytest.fixture(scope="session")
def taught_tool_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Qwen2.5-VL with tool tokens, fitted to answer every `mt_helpers.CUES` prompt with its
    tool call and then its answer (built once: several multi-turn test files read it)."""
    from mt_helpers import taught_model

    from vlrl.models.tiny import build_tiny_model

    path = str(build_tiny_model(tmp_path_factory.mktemp("mt_model"), "qwen2_5_vl", tool_tokens=True))
    stats = taught_model(path, steps=120)
    assert stats["loss_last"] < 0.05, stats
    return path
