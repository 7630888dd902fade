"""What the world-size-1 rank runs for tests/actor/test_resume.py (one forked process, gloo).

Checks that need a real FSDP2 module: resume keeps every optimizer state tensor's dtype, device
and value, and continues exactly; the reference model reshards after its forward.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from actor_helpers import init_gloo, make_batch, make_config, with_training_fields

from vlrl.models.processor import load_processor
from vlrl.workers.actor import Actor

SPECS = [(False, 6), (False, 9), (False, 3), (False, 5)]


def optimizer_tensors(actor: Actor) -> dict[str, torch.Tensor]:
    """Every optimizer state tensor (moments and step), local shard, by 'param name/key'."""
    names = {id(p): n for n, p in actor.module.named_parameters()}
    out = {}
    for param, state in actor.optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if hasattr(value, "to_local") else value
                out[f"{names[id(param)]}/{key}"] = local.detach().clone()
    return out


def full_params(actor: Actor) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in actor.module.named_parameters()}


def check_resume(model_dir: str, out_dir: str, results: dict[str, Any]) -> None:
    """bf16-moment AdamW on fp32 weights: save -> step (P1) -> load -> same states -> step -> P1."""
    _, processor = load_processor(model_dir)
    config = make_config(model_dir, worker__actor__optim__strategy="adamw_bf16")
    actor = Actor(config, model_dir, processor, "cpu")
    batch = with_training_fields(make_batch(model_dir, SPECS, seed=3), seed=1)
    actor.update_policy(batch)
    saved = optimizer_tensors(actor)
    path = os.path.join(out_dir, "ckpt")
    actor.save_checkpoint(path)
    actor.update_policy(batch)
    p1 = full_params(actor)
    lr1 = actor.optimizer.param_groups[0]["lr"]
    actor.load_checkpoint(path)
    loaded = optimizer_tensors(actor)
    results["resume/keys_equal"] = sorted(saved) == sorted(loaded)
    results["resume/dtypes"] = {k: (str(saved[k].dtype), str(loaded[k].dtype)) for k in saved}
    results["resume/devices"] = {k: (str(saved[k].device), str(loaded[k].device)) for k in saved}
    results["resume/value_err"] = max(
        float((saved[k].float() - loaded[k].float()).abs().max()) for k in saved
    )
    actor.update_policy(batch)
    p2 = full_params(actor)
    results["resume/continue_err"] = max(float((p1[k] - p2[k]).abs().max()) for k in p1)
    results["resume/lr"] = (lr1, actor.optimizer.param_groups[0]["lr"])
    results["resume/extra_file"] = os.path.join(path, "extra_state_rank0.pt")


def run(rank: int, world: int, port: int, models: dict[str, str], out_dir: str) -> None:
    init_gloo(rank, world, port)
    results: dict[str, Any] = {}
    try:
        check_resume(models["qwen2"], out_dir, results)
    finally:
        dist.destroy_process_group()
    torch.save(results, os.path.join(out_dir, "results.pt"))
