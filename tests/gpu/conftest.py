"""GPU acceptance tests: skipped on machines without CUDA (CI never has one; see docs/gpu.md)."""

from __future__ import annotations

import pytest
import torch


def pytest_runtest_setup(item: pytest.Item) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
