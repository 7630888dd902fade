"""An actor update at Qwen2.5-VL-3B's shapes on one GPU (random init, tiny tokenizer): it fits in
memory, trains without a skipped step and reports tokens/s and MFU (vlrl.models.flops). Several
minutes: the model folder (7.5 GB in bf16) is written and loaded like a real checkpoint."""

from __future__ import annotations

from pathlib import Path

from gpu_check_helpers import cuda_context, run_and_expect_pass

from vlrl.tools.gpu_check.qwen3b_check import check_qwen3b_update


def test_qwen25_vl_3b_shaped_update(tmp_path: Path) -> None:
    outcome = run_and_expect_pass(check_qwen3b_update, cuda_context(tmp_path))
    assert 3.7 < outcome.summary["params_b"] < 3.8
    assert outcome.summary["mfu"] is not None and outcome.summary["mfu"] > 0
