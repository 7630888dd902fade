"""The "at GPU scale" checks on CUDA (`python -m vlrl.tools.gpu_check --preset scale` runs them in
one command and writes the report): the 3B-shaped log-prob pass at 16 x 8k tokens stays far below
full-logits memory, and the update reports MFU, peak memory and allocator retries per
checkpointing policy. Several minutes: the model folder (7.5 GB in bf16) is written once."""

from __future__ import annotations

from pathlib import Path

from gpu_check_helpers import cuda_context, run_and_expect_pass

from vlrl.tools.gpu_check.scale_check import check_logprob_memory, check_update_mfu


def test_scale_checks(tmp_path: Path) -> None:
    ctx = cuda_context(tmp_path)
    logprob = run_and_expect_pass(check_logprob_memory, ctx)
    assert logprob.summary["vocab"] == 151936 and logprob.summary["response_tokens"] == 16 * 8192
    assert logprob.summary["peak_mib"] is not None
    update = run_and_expect_pass(check_update_mfu, ctx)
    assert update.summary["mfu_all"] > 0 and update.summary["alloc_retries_all"] is not None
    assert update.details["fused_adamw"] is True
