"""What each of the 2 spawned ranks of tests/rollout/test_spmd.py runs (one job, all checks)."""

from __future__ import annotations

from pathlib import Path

import torch
from rollout_helpers import (
    close_world,
    data_config,
    init_world,
    load_hf_model,
    perturb,
    prompt_batch,
    rollout_config,
)

from vlrl.models.processor import load_processor
from vlrl.rollout import create_rollout_engine, sync_weights


def run(rank: int, world_size: int, port: int, model_dir: str, out_dir: str) -> None:
    """Own engine (TP=1) per rank, weights synced from an FSDP2-sharded module, then generate."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)  # two ranks share the machine's cores
    init_world(rank, world_size, port)
    tokenizer, processor = load_processor(model_dir)
    engine = create_rollout_engine(
        rollout_config(max_num_seqs=16), data_config(), model_dir, tokenizer, processor
    )
    model = load_hf_model(model_dir)
    perturb(model, seed=4)  # the same "trained" weights on both ranks
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))  # parameters become DTensor shards
    metrics = sync_weights(model, engine, bucket_mb=1)
    prompts = prompt_batch(model_dir)
    shard = prompts.select([0, 1] if rank == 0 else [2])  # this rank's data-parallel shard
    result = {
        "metrics": metrics,
        "dp_rank": engine.dp_rank,
        "own_groups": engine.generate(shard, {"seed": 7}).group_ids,
        "probe": engine.generate(prompts, {"seed": 7}).responses,  # same prompts and seed on both ranks
        "probe_again": engine.generate(prompts, {"seed": 7}).responses,
        "greedy": engine.generate(prompts, {"temperature": 0.0, "n": 1}).responses,
    }
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    engine.close()
    close_world()
