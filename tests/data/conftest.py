"""Fixtures for the data-pipeline tests: tiny model folders (built once per session), their
tokenizer/processor, small images and data-file writers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from vlrl.config import DataConfig

# Small pixel bounds keep every image at a handful of tokens.
MIN_PIXELS = 28 * 28 * 4
MAX_PIXELS = 28 * 28 * 16


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`tiny_model(arch)`: path of a tiny model folder for arch, built on first use."""
    from vlrl.models.tiny import build_tiny_model

    built: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in built:
            built[arch] = build_tiny_model(tmp_path_factory.mktemp(arch), arch=arch)
        return built[arch]

    return get


@pytest.fixture(scope="session")
def tokenizer_processor(tiny_model: Callable[[str], Path]) -> Callable[[str], tuple[Any, Any]]:
    """`tokenizer_processor(arch)`: (tokenizer, processor) loaded once per arch."""
    from vlrl.models.processor import load_processor

    loaded: dict[str, tuple[Any, Any]] = {}

    def get(arch: str = "qwen2_5_vl") -> tuple[Any, Any]:
        if arch not in loaded:
            loaded[arch] = load_processor(str(tiny_model(arch)))
        return loaded[arch]

    return get


@pytest.fixture
def make_config() -> Callable[..., DataConfig]:
    """A DataConfig with small pixel bounds; keyword arguments override fields."""

    def make(**overrides: Any) -> DataConfig:
        values = dict(
            min_pixels=MIN_PIXELS,
            max_pixels=MAX_PIXELS,
            max_prompt_length=256,
            rollout_batch_size=4,
            prompt_key="problem",
        )
        values.update(overrides)
        return DataConfig(**values)

    return make


@pytest.fixture(autouse=True)
def image_check_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test gets its own start-up image-check cache folder (not ~/.cache)."""
    folder = tmp_path_factory.mktemp("image_checks")
    monkeypatch.setattr("vlrl.data.image_check.default_cache_dir", lambda: str(folder))
    return folder
