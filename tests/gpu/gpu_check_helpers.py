"""Shared by the tests/gpu/*_gpu.py files: run one gpu_check check on CUDA and assert it passed.

The checks live in vlrl.tools.gpu_check (one command writes them all into a report, docs/gpu.md);
these tests run the same code under pytest so a failure shows its traceback and numbers."""

from __future__ import annotations

from pathlib import Path

import torch

from vlrl.tools.gpu_check.context import Context
from vlrl.tools.gpu_check.report import Outcome


def cuda_context(workdir: Path, small: bool = False) -> Context:
    return Context(device=torch.device("cuda:0"), small=small, workdir=workdir)


def run_and_expect_pass(check, ctx: Context) -> Outcome:
    outcome = Outcome()
    check(ctx, outcome)
    assert outcome.skipped is None, outcome.skipped
    assert not outcome.failures, (outcome.failures, outcome.summary, outcome.details)
    return outcome
