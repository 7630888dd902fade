"""What each spawned process of tests/rollout/test_weight_broadcast.py runs.

Member 0 is a training rank (its own gloo world, the model FSDP2-sharded in it); member 1 is a
rollout rank with a vLLM engine (its own world, as vLLM's external_launcher wants) that takes the
syncs through `WeightIntake`; member 2 is a rollout rank that only records what it receives and
the versions announced. Two syncs, announced as versions 3 and 4: the second reuses the first's
layout, and is the background form (a staleness bound above 1): packed into host buckets, the
weights then changed, the packed copy broadcast from a thread.
"""

from __future__ import annotations

import copy
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

from vlrl.rollout.weight_broadcast import WeightBroadcast
from vlrl.utils.background import in_background
from vlrl.workers.weight_exchange import WeightIntake


def run(member: int, world_ports: list[int], group_port: int, model_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    init_world(0, 1, world_ports[member])  # each member's own world: the group is separate from it
    group = WeightBroadcast("127.0.0.1", group_port, member, 3)
    result: dict[str, object] = {}
    if member == 0:
        _train_side(group, model_dir, result)
    elif member == 1:
        _engine_side(group, model_dir, result)
    else:
        versions, received = [], []
        for _ in range(2):
            versions.append(group.next_version())
            received.append({n: t.clone() for n, t in group.receive()})
        result.update(versions=versions, received=received, announced_after=group.announced())
    torch.save(result, Path(out_dir) / f"member{member}.pt")
    close_world()


def _train_side(group: WeightBroadcast, model_dir: str, result: dict[str, object]) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from vlrl.rollout.weight_sync import full_named_tensors

    model = load_hf_model(model_dir)
    for seed in (4, 5):
        perturb(model, seed=seed)  # "trained" further before each sync
        sharded = copy.deepcopy(model)
        fully_shard(sharded, mesh=init_device_mesh("cpu", (1,)))  # DTensor parameters, as the actor has
        group.announce(seed - 1)
        if seed == 4:
            metrics = group.send(full_named_tensors(sharded), bucket_mb=0.25, dtype=torch.float32)
        else:
            packed = group.pack(full_named_tensors(sharded), bucket_mb=0.25, dtype=torch.float32)
            with torch.no_grad():
                for param in sharded.parameters():  # the next update, while the send is pending
                    param.to_local().zero_()
            sending = in_background(lambda packed=packed: group.send_packed(packed), "test-send")
            metrics = sending.result()
        result[f"bytes{seed}"] = metrics["sync/bytes"]
    result["buckets"] = len(group.layout or [])


def _engine_side(group: WeightBroadcast, model_dir: str, result: dict[str, object]) -> None:
    from vlrl.models.processor import load_processor
    from vlrl.rollout import create_rollout_engine

    tokenizer, processor = load_processor(model_dir)
    engine = create_rollout_engine(
        rollout_config(max_num_seqs=16), data_config(), model_dir, tokenizer, processor
    )
    prompts = prompt_batch(model_dir)
    intake = WeightIntake(group, engine, partial=False)
    for sync in (1, 2):
        intake.receive(sync + 2)
        intake.receive(sync + 2)  # taken already: nothing to wait for
        out = engine.generate(prompts, {"temperature": 0.0, "n": 1})
        result[f"greedy{sync}"], result[f"versions{sync}"] = out.responses, out.rollout_versions
    engine.close()
