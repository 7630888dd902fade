"""The transformers fallback engine: batches with 0/1/2 images, banned tokens, weight loading."""

from __future__ import annotations

import copy

import pytest
import torch
from rollout_helpers import (
    data_config,
    greedy_hf,
    load_hf_model,
    make_token_argmax,
    perturb,
    prompt_batch,
    rollout_config,
)

from vlrl.models.processor import load_processor
from vlrl.rollout import create_rollout_engine


@pytest.fixture(scope="module")
def hf(tiny_model):
    path = tiny_model("qwen2_5_vl")
    tokenizer, processor = load_processor(path)
    config = rollout_config(name="hf", calculate_log_probs=True)
    engine = create_rollout_engine(config, data_config(), path, tokenizer, processor)
    return path, engine, prompt_batch(path)


def test_mixed_image_batch(hf):
    path, engine, prompts = hf
    batch = engine.generate(prompts, {"seed": 3})
    n, width_p = 2, prompts.input_ids.shape[1]
    assert len(batch) == 3 * n and batch.prompt_length == width_p
    assert batch.group_ids.tolist() == [100, 100, 101, 101, 102, 102]
    assert [len(images) for images in batch.images] == [1, 1, 2, 2, 0, 0]
    assert batch.input_ids[:, :width_p].equal(prompts.input_ids.repeat_interleave(n, 0))
    assert batch.position_ids.shape == (6, 3, batch.input_ids.shape[1])
    last = prompts.position_ids.amax(dim=(1, 2)).repeat_interleave(n)  # [N]
    assert batch.position_ids[:, :, width_p].equal(last[:, None].expand(6, 3) + 1)
    mask = batch.response_mask.bool()
    assert (batch.rollout_log_probs[mask] <= 0).all() and (batch.rollout_log_probs[~mask] == 0).all()
    assert not torch.isin(batch.responses, torch.tensor(engine.banned_token_ids)).any()
    again = engine.generate(prompts, {"seed": 3})
    assert again.responses.equal(batch.responses)  # same seed, same samples


def test_banned_token_is_never_generated(hf):
    path, engine, prompts = hf
    tokenizer, _ = load_processor(path)
    image_pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    model = copy.deepcopy(engine.model)
    make_token_argmax(model, image_pad)
    plain = model.generate(input_ids=prompts.input_ids[2:], attention_mask=prompts.attention_mask[2:],
                           max_new_tokens=3, do_sample=False)  # fmt: skip
    assert (plain[0, -3:] == image_pad).all()  # unbanned: the placeholder is the argmax
    original = copy.deepcopy(engine.model.state_dict())
    engine.load_weights(model.state_dict().items())
    try:
        for overrides in ({"temperature": 0.0, "n": 1}, {"seed": 1}):
            out = engine.generate(prompts, overrides)
            assert not torch.isin(out.responses, torch.tensor(engine.banned_token_ids)).any()
    finally:
        engine.load_weights(original.items())


def test_load_weights_changes_generation(hf):
    path, engine, prompts = hf
    before = engine.generate(prompts, {"temperature": 0.0, "n": 1}).responses
    model = load_hf_model(path)
    perturb(model, seed=1)
    engine.load_weights(model.state_dict().items(), bucket_mb=0.5)
    try:
        after = engine.generate(prompts, {"temperature": 0.0, "n": 1}).responses
        assert after.equal(greedy_hf(path, model, prompts, 12)) and not after.equal(before)
    finally:
        engine.load_weights(load_hf_model(path).state_dict().items())


def test_text_model(tiny_model):
    path = tiny_model("qwen2")
    tokenizer, processor = load_processor(path)
    engine = create_rollout_engine(rollout_config(name="hf", n=3), data_config(), path, tokenizer, processor)
    prompts = prompt_batch(path)
    batch = engine.generate(prompts, {"seed": 0, "max_tokens": 5})
    assert batch.responses.shape[1] <= 5 and batch.position_ids.dim() == 2 and len(batch) == 9


def test_hf_engine_refuses_videos():
    """The backstop for direct use (the trainer refuses this at data set-up, tests/trainer/test_data_setup.py):
    refused before any model is loaded."""
    with pytest.raises(ValueError, match="only the vLLM engine takes: set worker.rollout.name=vllm"):
        create_rollout_engine(
            rollout_config(name="hf"), data_config(), "/no/model", None, None, limit_videos=1
        )
