"""What each of the 2 spawned gloo ranks runs for tests/actor/test_moe.py (Qwen3-VL-MoE under FSDP2)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from actor_helpers import init_gloo
from actor_multirank_job import (
    check_gradients,
    check_loss_decreases,
    full_params,
    kl_loss_actor,
    max_diff,
    training_batch,
)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

EXPERTS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def expert_shards(module: torch.nn.Module) -> dict[str, Any]:
    """Per fused expert parameter: its placements, local and full shapes."""
    out = {}
    for name, param in module.named_parameters():
        if name.endswith(EXPERTS):
            assert isinstance(param, DTensor), name
            out[name] = (str(param.placements), tuple(param.to_local().shape), tuple(param.shape))
    return out


def moe_units(module: torch.nn.Module) -> int:
    """MoE decoder layers that are FSDP units of their own."""
    return sum(
        isinstance(m, FSDPModule) and type(m).__name__ == "FSDPQwen3VLMoeTextDecoderLayer"
        for m in module.modules()
    )


def run(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    init_gloo(rank, world, port)
    results: dict[str, Any] = {}
    try:
        actor = kl_loss_actor(model_dir, world)
        results["shards"] = expert_shards(actor.model.module)
        results["moe_units"] = moe_units(actor.model.module)
        batch = training_batch(model_dir)
        check_gradients(actor, batch, model_dir, rank, results)
        before = full_params(actor.model.module)
        check_loss_decreases(actor, batch, rank, results)
        after = full_params(actor.model.module)
        experts = [n for n in before if n.endswith(EXPERTS)]
        routers = [n for n in before if n.endswith(".mlp.gate.weight")]
        results["experts_moved"] = min(max_diff(after, before, [n]) for n in experts)
        results["routers_moved"] = min(max_diff(after, before, [n]) for n in routers)
        actor.save_hf(os.path.join(out_dir, "hf"))
        if rank == 0:
            from transformers import AutoModelForImageTextToText

            saved = AutoModelForImageTextToText.from_pretrained(os.path.join(out_dir, "hf"))
            results["hf_reload_err"] = max_diff(dict(saved.named_parameters()), after)
    finally:
        dist.destroy_process_group()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
