"""What the world-size-1 rank runs for tests/actor/test_checkpoint_policy.py (one forked process,
gloo): a Qwen2.5-VL model of 5 decoder layers and 5 vision blocks, sharded with FSDP2 as the actor
shards it (vlrl.workers.fsdp.apply_fsdp, after `load_model` set the checkpointing flags), one
forward with an image and one backward per policy. Observed: the gradients (full tensors) and how
often each layer's forward ran (a forward pre-hook; a checkpointed layer runs again in the
backward to recompute its activations)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from actor_helpers import init_gloo, make_config

from vlrl.config import FSDPConfig
from vlrl.models.loading import checkpointable_stacks, load_model
from vlrl.workers.fsdp import apply_fsdp

LAYERS = 5
POLICIES: list[str | None] = [None, "every_k:2", "every_k:3", "all"]


def five_layer_model(tiny_dir: str, out_dir: str) -> str:
    """The tiny Qwen2.5-VL with 5 decoder layers and 5 vision blocks (the last one full-attention)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(tiny_dir)
    config.text_config.num_hidden_layers = LAYERS
    config.text_config.layer_types = ["full_attention"] * LAYERS
    config.vision_config.depth = LAYERS
    config.vision_config.fullatt_block_indexes = [LAYERS - 1]
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    path = os.path.join(out_dir, "five_layers")
    model.save_pretrained(path)
    return path


def inputs(config: Any) -> dict[str, torch.Tensor]:
    """One row: text, an image of 8 x 12 patches (24 image tokens), text."""
    vc = config.vision_config
    grid = torch.tensor([[1, 8, 12]])
    tokens = 8 * 12 // vc.spatial_merge_size**2
    ids = [
        11,
        12,
        config.vision_start_token_id,
        *[config.image_token_id] * tokens,
        config.vision_end_token_id,
    ]
    ids += [13, 14, 15, 16]
    gen = torch.Generator().manual_seed(0)
    pixels = torch.randn(8 * 12, 3 * vc.temporal_patch_size * vc.patch_size**2, generator=gen)
    input_ids = torch.tensor([ids])
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "pixel_values": pixels,
        "image_grid_thw": grid,
    }


def run_policy(path: str, policy: str | None) -> dict[str, Any]:
    model = load_model(
        path, padding_free=False, gradient_checkpointing=policy is not None, checkpoint_layers=policy or "all"
    )
    stacks = checkpointable_stacks(model)  # [vision blocks, decoder layers]
    flags = [[bool(layer.gradient_checkpointing) for layer in stack] for stack in stacks]
    apply_fsdp(model, torch.device("cpu"), FSDPConfig())
    calls = [[0] * len(stack) for stack in stacks]
    for s, stack in enumerate(stacks):
        for i, layer in enumerate(stack):
            layer.register_forward_pre_hook(lambda *_, s=s, i=i: calls[s].__setitem__(i, calls[s][i] + 1))
    model.train()
    out = model(**inputs(model.config))
    calls_after_forward = [list(c) for c in calls]
    out.logits.float().pow(2).sum().backward()  # gradients of order 1: atol 1e-6 means something
    grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters() if p.grad is not None}
    names = [type(stack[0]).__name__ for stack in stacks]
    return {"flags": flags, "forward": calls_after_forward, "calls": calls, "grads": grads, "stacks": names}


def actor_flags(tiny_dir: str) -> list[list[bool]]:
    """The flags of the actor's model when built from the config (the key reaches `load_model`)."""
    from vlrl.models.processor import load_processor
    from vlrl.workers.from_config import build_actor

    _, processor = load_processor(tiny_dir)
    config = make_config(
        tiny_dir,
        worker__actor__model__enable_gradient_checkpointing=True,
        worker__actor__model__gradient_checkpointing_layers="every_k:2",
    )
    actor = build_actor(config, processor, "cpu", model_path=tiny_dir)
    return [
        [bool(layer.gradient_checkpointing) for layer in s] for s in checkpointable_stacks(actor.model.module)
    ]


def run(rank: int, world: int, port: int, tiny_dir: str, out_dir: str) -> None:
    init_gloo(rank, world, port)
    results: dict[str, Any] = {}
    try:
        path = five_layer_model(tiny_dir, out_dir)
        for policy in POLICIES:
            results[str(policy)] = run_policy(path, policy)
        results["actor_flags"] = actor_flags(tiny_dir)
    finally:
        dist.destroy_process_group()
    torch.save(results, os.path.join(out_dir, "results.pt"))
