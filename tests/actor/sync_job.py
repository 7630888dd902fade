"""What the 1-rank gloo process runs for tests/actor/test_update_syncs.py: host syncs counted
(tests/actor/sync_counter.py) during `update_policy`, for several micro-batch splits of the same rows."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from actor_helpers import init_gloo, make_batch, make_config, with_training_fields
from sync_counter import SyncCounter

from vlrl.models.processor import load_processor
from vlrl.workers.from_config import build_actor

SPECS = [(True, 6), (False, 9), (True, 3), (False, 5), (False, 7), (True, 4), (False, 2), (True, 8)]
MINI_BATCH = 4  # rows per optimizer step: 8 rows make 2 mini-batches


def count_update(
    model_dir: str, on_policy: bool = False, mini_batches: int = 2, **overrides: Any
) -> dict[str, Any]:
    """Sync counts of one `update_policy` (with a KL loss and an entropy bonus) on this rank."""
    _, processor = load_processor(model_dir)
    rows = mini_batches * MINI_BATCH if not on_policy else MINI_BATCH
    world = dist.get_world_size()  # each rank's mini-batch is MINI_BATCH of its `rows` rows
    values = {
        "worker__actor__global_batch_size": MINI_BATCH * world,
        "data__rollout_batch_size": rows * world,
        "algorithm__use_kl_loss": True,
        "worker__actor__entropy_coeff": 0.01,
        **overrides,
    }
    config = make_config(model_dir, world_size=world, **values)
    actor = build_actor(config, processor, "cpu", model_path=model_dir)
    specs = (SPECS * 2)[:rows]
    batch = with_training_fields(make_batch(model_dir, specs, seed=3 + dist.get_rank()), kl=True)
    if on_policy:
        batch.old_log_probs = None
    with SyncCounter(actor.model.device, actor.model.module) as counter:
        metrics = actor.update_policy(batch, on_policy=on_policy)
    return {"counts": dict(counter.counts), "where": dict(counter.where), "metrics": metrics}


def count_log_probs(model_dir: str, **overrides: Any) -> dict[str, Any]:
    """Sync counts of one `compute_log_probs` (the old-log-prob / reference pass)."""
    _, processor = load_processor(model_dir)
    config = make_config(model_dir, **overrides)
    actor = build_actor(config, processor, "cpu", model_path=model_dir)
    batch = make_batch(model_dir, SPECS, seed=3)
    with SyncCounter(actor.model.device, actor.model.module) as counter:
        actor.compute_log_probs(batch)
    return {"counts": dict(counter.counts), "where": dict(counter.where)}


def split_gradients(model_dir: str, results: dict[str, Any]) -> None:
    """One mini-batch's loss metrics and gradient with fixed-count micro-batches (1 and 4 rows) and
    with token budgets (the default budget, and one that splits the rows unevenly)."""
    from vlrl.workers.actor import _UpdateStats, gathered_grads

    _, processor = load_processor(model_dir)
    variants = {
        "fixed/1": {
            "worker__actor__dynamic_batching": False,
            "worker__actor__micro_batch_size_per_device_for_update": 1,
        },
        "fixed/4": {
            "worker__actor__dynamic_batching": False,
            "worker__actor__micro_batch_size_per_device_for_update": 4,
        },
        "budget/default": {"worker__actor__dynamic_batching": True},
        "budget/40": {"worker__actor__dynamic_batching": True, "worker__actor__max_token_len_per_device": 40},
    }
    for name, overrides in variants.items():
        config = make_config(
            model_dir,
            worker__actor__global_batch_size=MINI_BATCH,
            data__rollout_batch_size=MINI_BATCH,
            algorithm__use_kl_loss=True,
            worker__actor__entropy_coeff=0.01,
            **overrides,
        )
        actor = build_actor(config, processor, "cpu", model_path=model_dir)
        batch = with_training_fields(make_batch(model_dir, SPECS[:MINI_BATCH], seed=4), kl=True)
        batch.old_log_probs = batch.old_log_probs - 3.0  # ratios away from 1: the clip is active
        stats = _UpdateStats(with_kl_loss=True)
        actor.model.module.train()
        micro = actor.model.plan_micro_batches(batch, actor.cfg.micro_batch_size_per_device_for_update)
        actor.forward_backward(batch, stats, image_anchor=True)
        stats.steps = 1
        results[f"split/{name}"] = {
            "micro_batches": [len(rows) for rows in micro],
            "grads": gathered_grads(actor.model.module),
            "metrics": stats.finish(actor.model.all_reduce),
        }


def run(rank: int, world: int, port: int, models: dict[str, str], out_dir: str) -> None:
    init_gloo(rank, world, port)
    results: dict[str, Any] = {}
    try:
        split_gradients(models["qwen2_5_vl"], results)
        for micro in (8, 1):
            results[f"log_probs/fixed/{micro}"] = count_log_probs(
                models["qwen2"],
                worker__actor__dynamic_batching=False,
                worker__actor__micro_batch_size_per_device_for_experience=micro,
            )
            results[f"log_probs/budget/{micro}"] = count_log_probs(
                models["qwen2"], worker__actor__micro_batch_size_per_device_for_experience=micro
            )
        for arch, model_dir in models.items():
            for micro in (MINI_BATCH, 1):
                results[f"{arch}/packed/{micro}"] = count_update(
                    model_dir, worker__actor__micro_batch_size_per_device_for_update=micro
                )
                results[f"{arch}/padded/{micro}"] = count_update(
                    model_dir,
                    worker__actor__micro_batch_size_per_device_for_update=micro,
                    worker__actor__padding_free=False,
                )
                results[f"{arch}/on_policy/{micro}"] = count_update(
                    model_dir,
                    on_policy=True,
                    worker__actor__micro_batch_size_per_device_for_update=micro,
                    algorithm__disable_kl=True,
                    algorithm__use_kl_loss=False,
                )
            for budget in (1000, 40):  # one micro-batch per mini-batch, then several
                results[f"{arch}/dynamic/{budget}"] = count_update(
                    model_dir,
                    worker__actor__dynamic_batching=True,
                    worker__actor__max_token_len_per_device=budget,
                )
    finally:
        dist.destroy_process_group()
    torch.save(results, os.path.join(out_dir, "results.pt"))


def run_two_ranks(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    """The same counts on 2 ranks, where `ShardedModel.all_reduce` really reads the device: 2 and 4
    mini-batches, 1 and 4 rows per micro-batch."""
    init_gloo(rank, world, port)
    results: dict[str, Any] = {}
    try:
        for minis in (2, 4):
            for micro in (MINI_BATCH, 1):
                results[f"{minis}/{micro}"] = count_update(
                    model_dir, mini_batches=minis, worker__actor__micro_batch_size_per_device_for_update=micro
                )
    finally:
        dist.destroy_process_group()
    torch.save(results, os.path.join(out_dir, f"two_ranks_{rank}.pt"))
