"""What the world-size-1 rank runs for tests/actor/test_fsdp_state.py (one forked process, gloo).

Checks that need a real FSDP2 module: resume keeps every optimizer state tensor's dtype, device
and value, and continues exactly; the reference model reshards after its forward; the root unit
stays gathered from forward to backward. A unit's parameters are DTensors while it is sharded and
plain tensors while it is gathered (FSDP2 swaps the registered parameters), which is what the
`sharded` observable reads.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from actor_helpers import init_gloo, make_batch, make_config, with_training_fields
from torch.distributed.tensor import DTensor

from vlrl.models.processor import load_processor
from vlrl.workers.actor import Actor
from vlrl.workers.from_config import build_actor, build_reference

SPECS = [(False, 6), (False, 9), (False, 3), (False, 5)]


def optimizer_tensors(actor: Actor) -> dict[str, torch.Tensor]:
    """Every optimizer state tensor (moments and step), local shard, by 'param name/key'."""
    names = {id(p): n for n, p in actor.model.module.named_parameters()}
    out = {}
    for param, state in actor.optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if hasattr(value, "to_local") else value
                out[f"{names[id(param)]}/{key}"] = local.detach().clone()
    return out


def full_params(actor: Actor) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in actor.model.module.named_parameters()}


def check_resume(model_dir: str, out_dir: str, results: dict[str, Any]) -> None:
    """bf16-moment AdamW on fp32 weights: save -> step (P1) -> load -> same states -> step -> P1."""
    _, processor = load_processor(model_dir)
    config = make_config(model_dir, worker__actor__optim__strategy="adamw_bf16")
    actor = build_actor(config, processor, "cpu", model_path=model_dir)
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


def sharded(module: torch.nn.Module) -> dict[str, bool]:
    """Parameter name -> whether it is currently registered as a shard (DTensor)."""
    return {n: isinstance(p, DTensor) for n, p in module.named_parameters()}


def check_reference_reshards(model_dir: str, results: dict[str, Any]) -> None:
    """enable_full_shard=false: no unit frees its weights after forward; the reference must still."""
    _, processor = load_processor(model_dir)
    config = make_config(model_dir, worker__actor__fsdp__enable_full_shard=False)
    reference = build_reference(config, processor, "cpu", model_path=model_dir)
    batch = make_batch(model_dir, SPECS, seed=4)
    results["ref/before"] = all(sharded(reference.model.module).values())
    results["ref/log_probs_finite"] = bool(torch.isfinite(reference.compute_log_probs(batch)).all())
    results["ref/after"] = sharded(reference.model.module)


def check_actor_log_probs_reshard(model_dir: str, results: dict[str, Any]) -> None:
    """The actor's old log-prob pass (no backward follows) leaves only shards, root unit included,
    with the default full shard and with enable_full_shard=false."""
    _, processor = load_processor(model_dir)
    batch = make_batch(model_dir, SPECS, seed=5)
    for full_shard in (True, False):
        config = make_config(model_dir, worker__actor__fsdp__enable_full_shard=full_shard)
        actor = build_actor(config, processor, "cpu", model_path=model_dir)
        actor.compute_log_probs(batch)
        results[f"actor_lp/after/{full_shard}"] = sharded(actor.model.module)


def check_root_stays_gathered_for_backward(model_dir: str, results: dict[str, Any]) -> None:
    """Default (full shard): after a training forward the layers are freed, the root is not."""
    _, processor = load_processor(model_dir)
    actor = build_actor(make_config(model_dir), processor, "cpu", model_path=model_dir)
    ids = torch.arange(1, 9)[None]
    loss = actor.model.module(input_ids=ids, position_ids=torch.arange(8)[None]).logits.float().mean()
    state = sharded(actor.model.module)
    results["root/after_forward"] = {n: state[n] for n in state if ".layers." not in n}
    results["root/layers_after_forward"] = {n: state[n] for n in state if ".layers." in n}
    loss.backward()
    results["root/after_backward"] = all(sharded(actor.model.module).values())


def run(rank: int, world: int, port: int, models: dict[str, str], out_dir: str) -> None:
    init_gloo(rank, world, port)
    results: dict[str, Any] = {}
    try:
        check_resume(models["qwen2"], out_dir, results)
        check_reference_reshards(models["qwen2"], results)
        check_actor_log_probs_reshard(models["qwen2"], results)
        check_root_stays_gathered_for_backward(models["qwen2"], results)
    finally:
        dist.destroy_process_group()
    torch.save(results, os.path.join(out_dir, "results.pt"))
