"""The actor path on one CUDA GPU: a RankWorker end to end on NCCL (HF rollout, KL loss, reference
and optimizer offload, checkpoint/resume) and packed vs padded log-probs/gradients in bf16, fp32
GPU vs CPU. CUDA-only: NCCL, mixed precision (FSDP2 `MixedPrecisionPolicy` is ignored on CPU by
vlrl.workers.fsdp.mixed_precision) and the offloads (no-ops on CPU) only act on a GPU."""

from __future__ import annotations

from pathlib import Path

from gpu_check_helpers import cuda_context, run_and_expect_pass

from vlrl.tools.gpu_check.logprob_check import check_moe_packed_vs_padded, check_packed_vs_padded
from vlrl.tools.gpu_check.worker_check import check_rank_worker


def test_rank_worker_cycle_on_nccl(tmp_path: Path) -> None:
    outcome = run_and_expect_pass(check_rank_worker, cuda_context(tmp_path))
    memory = outcome.details["memory"]
    assert list(memory)[0] == "setup" and list(memory)[-1] == "model_only_save"
    assert all(m["peak_allocated_mib"] > 0 for m in memory.values())


def test_packed_matches_padded_in_bf16_and_fp32_matches_cpu(tmp_path: Path) -> None:
    outcome = run_and_expect_pass(check_packed_vs_padded, cuda_context(tmp_path))
    assert outcome.summary["fp32_vs_cpu_lp"] <= 1e-3


def test_moe_packed_matches_padded_in_bf16_and_fp32_matches_cpu(tmp_path: Path) -> None:
    """The tiny Qwen3-VL-MoE: transformers' grouped_mm experts in bf16, routing included."""
    outcome = run_and_expect_pass(check_moe_packed_vs_padded, cuda_context(tmp_path))
    assert outcome.summary["fp32_vs_cpu_lp"] <= 1e-3
