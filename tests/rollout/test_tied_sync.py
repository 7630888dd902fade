"""A model with tied embeddings (Qwen2.5-VL-3B, Qwen2.5-3B): the sync gathers the shared weight once
(cast to the engine's dtype before the all-gather) and sends it under both names, and both engines
generate what transformers does."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from rollout_helpers import (
    data_config,
    free_port,
    greedy_hf_batch,
    init_world,
    one_rank_engine,
    perturb,
    prompt_batch,
    rollout_config,
    save_model,
)

from vlrl.rollout import sync_weights
from vlrl.rollout.weight_sync import full_named_tensors, tied_aliases

GREEDY = {"temperature": 0.0, "n": 1}
HEAD, EMBED = "lm_head.weight", "model.language_model.embed_tokens.weight"


@pytest.fixture(scope="module")
def tied(tiny_model, tmp_path_factory):
    """(folder, model): the tiny Qwen2.5-VL rebuilt with `tie_word_embeddings` and perturbed."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    path = tiny_model("qwen2_5_vl")
    config = AutoConfig.from_pretrained(path)
    config.tie_word_embeddings = config.text_config.tie_word_embeddings = True
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    assert model.lm_head.weight is model.get_input_embeddings().weight
    out = save_model(model, path, str(tmp_path_factory.mktemp("tied")))
    perturb(model, seed=3)  # weights the engine can only have from the sync
    return out, model


def test_the_tied_head_is_gathered_once_and_cast_before(tied, monkeypatch):
    """Under FSDP2 (one-rank world) the head is not gathered again: it follows the embedding as the
    same tensor; every tensor comes in bf16, equal to the cast full tensor (casting shards then
    gathering is elementwise the same)."""
    from torch.distributed.tensor import DTensor

    from vlrl.config import FSDPConfig
    from vlrl.workers.fsdp import apply_fsdp

    _, model = tied
    expected = {k: v.bfloat16() for k, v in model.state_dict().items()}
    init_world(0, 1, free_port())
    try:
        sharded = apply_fsdp(copy.deepcopy(model), torch.device("cpu"), FSDPConfig())
        assert tied_aliases(sharded) == {EMBED: [HEAD]}
        gathers = []
        full_tensor = DTensor.full_tensor
        monkeypatch.setattr(
            DTensor, "full_tensor", lambda self: gathers.append(self.shape) or full_tensor(self)
        )
        received = list(full_named_tensors(sharded, torch.bfloat16))
    finally:
        dist.destroy_process_group()
    names = [name for name, _ in received]
    assert sorted(names) == sorted(expected) and names[names.index(EMBED) + 1] == HEAD
    assert len(gathers) == len(expected) - 1  # one all-gather per distinct parameter
    assert received[names.index(HEAD)][1] is received[names.index(EMBED)][1]
    for name, tensor in received:
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, expected[name]), name


def test_vllm_and_hf_engines_generate_the_tied_model(tied):
    from vlrl.models.processor import load_processor
    from vlrl.rollout.hf_engine import HFRolloutEngine

    path, model = tied
    prompts = prompt_batch(path)
    expected = greedy_hf_batch(path, model, prompts, 12)
    with one_rank_engine(path) as engine:
        metrics = sync_weights(model, engine, bucket_mb=1)
        assert engine.generate(prompts, GREEDY).responses.equal(expected.responses)
    assert metrics["sync/bytes"] == sum(t.numel() * 4 for t in model.state_dict().values())
    tokenizer, processor = load_processor(path)
    hf = HFRolloutEngine(rollout_config(), data_config(), path, tokenizer, processor)
    sync_weights(model, hf, bucket_mb=1)
    assert hf.generate(prompts, GREEDY).responses.equal(expected.responses)
