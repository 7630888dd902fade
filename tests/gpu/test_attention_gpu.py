"""Packed attention kernels on CUDA in bf16 with GQA, forward and gradients (vlrl.models.attention).

CUDA-only because the "torch_varlen" backend is `torch.nn.attention.varlen.varlen_attn`, a
FlashAttention kernel with no CPU implementation (torch 2.13: torch/nn/attention/varlen.py,
`varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale, window_size,
enable_gqa, ...)`; on torch 2.9/2.10 it takes `is_causal` instead of `window_size`)."""

from __future__ import annotations

from pathlib import Path

import torch
from gpu_check_helpers import cuda_context, run_and_expect_pass

from vlrl.tools.gpu_check.attention_check import backends_to_test, check_attention


def test_every_backend_matches_per_sequence_sdpa(tmp_path: Path) -> None:
    outcome = run_and_expect_pass(check_attention, cuda_context(tmp_path))
    assert outcome.details["lengths"][0] == 1 and max(outcome.details["lengths"]) == 2048
    assert {"loop", "mask", "torch_varlen"} <= set(backends_to_test(torch.device("cuda")))


def test_auto_picks_a_varlen_kernel_on_cuda(tmp_path: Path) -> None:
    """On CUDA, `auto` must not fall back to the per-sequence Python loop (torch >= 2.9 has varlen_attn)."""
    outcome = run_and_expect_pass(check_attention, cuda_context(tmp_path, small=True))
    assert outcome.summary["auto_is"] in ("flash", "torch_varlen")
