"""Sampling settings, token sets and start-up/prompt checks shared by the engines."""

from __future__ import annotations

import pytest
import torch
from rollout_helpers import prompt_batch, rollout_config

from vlrl.models.processor import load_processor
from vlrl.rollout.base import (
    banned_token_ids,
    check_prompts,
    eos_token_ids,
    resolve_limit_images,
    resolve_sampling,
    seeded_rng,
)


def test_overrides_apply_and_validate():
    config = rollout_config(n=5, temperature=1.0, top_k=-1, calculate_log_probs=True)
    s = resolve_sampling(config, 64, None)
    assert (s.n, s.temperature, s.top_k, s.seed, s.max_tokens, s.logprobs) == (5, 1.0, -1, None, 64, True)
    s = resolve_sampling(config, 64, {"n": 1, "temperature": 0, "top_k": 0, "seed": 7, "max_tokens": 3})
    assert (s.n, s.greedy, s.top_k, s.seed, s.max_tokens) == (1, True, -1, 7, 3)
    with pytest.raises(ValueError, match="unknown sampling override"):
        resolve_sampling(config, 64, {"beam_width": 2})
    with pytest.raises(ValueError, match="top_p"):
        resolve_sampling(config, 64, {"top_p": 0.0})


def test_token_sets(tiny_model):
    from transformers import AutoConfig

    path = tiny_model("qwen2_5_vl")
    tokenizer, _ = load_processor(path)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>", "<|image_pad|>")}
    assert eos_token_ids(tokenizer, path) == sorted([ids["<|im_end|>"], ids["<|endoftext|>"]])
    banned = banned_token_ids(tokenizer, AutoConfig.from_pretrained(path))
    assert ids["<|image_pad|>"] in banned and len(banned) == 4
    assert ids["<|im_end|>"] not in banned


def test_prompt_checks(tiny_model):
    batch = prompt_batch(tiny_model("qwen2_5_vl"))
    longest = int(batch.attention_mask.sum(-1).max())
    check_prompts(batch, max_model_len=longest + 8, max_tokens=8, limit_images=2)
    with pytest.raises(ValueError, match="max_model_len"):
        check_prompts(batch, max_model_len=longest + 7, max_tokens=8, limit_images=2)
    with pytest.raises(ValueError, match="limit_images"):
        check_prompts(batch, max_model_len=1024, max_tokens=8, limit_images=1)


def test_limit_images_resolution():
    assert resolve_limit_images(rollout_config(limit_images=3), 5) == 3
    assert resolve_limit_images(rollout_config(limit_images=0), 5) == 5
    assert resolve_limit_images(rollout_config(limit_images=0), None) >= 1


def test_seeded_rng_restores_caller_state():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    with seeded_rng(123):
        inside = torch.rand(3)
    assert torch.equal(torch.rand(3), expected)
    with seeded_rng(123):
        assert torch.equal(torch.rand(3), inside)
