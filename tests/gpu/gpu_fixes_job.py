"""What the 1-rank NCCL process runs for tests/gpu/test_gpu_fixes.py (spawned; CUDA only).

Each check exercises a GPU-only path of issue 14 with the real FSDP2 actor on a tiny model.
"""

from __future__ import annotations

import datetime
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "actor"))
from actor_helpers import make_batch, make_config, with_training_fields  # noqa: E402

from vlrl.models.processor import load_processor  # noqa: E402
from vlrl.workers.actor import Actor  # noqa: E402
from vlrl.workers.from_config import build_actor  # noqa: E402
from vlrl.workers.rank_worker import process_group_backend  # noqa: E402

SPECS = [(True, 6), (False, 9), (True, 3), (False, 5)]


def _devices(tensors) -> set[str]:
    return {t.device.type for t in tensors}


def _optimizer_tensors(actor: Actor) -> list[torch.Tensor]:
    return [v for s in actor.optimizer.state.values() for k, v in s.items() if k != "step"]


def check_fsdp_cpu_offload(model_dir: str, results: dict[str, Any]) -> None:
    """fsdp.enable_cpu_offload: shards and optimizer states on CPU; grad norm and the full-weight
    gather (CPU collectives, gloo half of the group) work; the update changes the weights."""
    _, processor = load_processor(model_dir)
    config = make_config(
        model_dir, trainer__device="cuda", worker__actor__fsdp__enable_cpu_offload=True,
        worker__actor__offload__offload_params=True, worker__actor__offload__offload_optimizer=True,
    )  # fmt: skip
    actor = build_actor(config, processor, "cuda", model_path=model_dir)
    batch = with_training_fields(make_batch(model_dir, SPECS, seed=1), seed=2)
    before = {n: p.full_tensor().clone() for n, p in actor.model.module.named_parameters()}
    metrics = actor.update_policy(batch)
    after = {n: p.full_tensor() for n, p in actor.model.module.named_parameters()}
    results["cpu_offload/grad_norm"] = metrics["actor/grad_norm"]
    results["cpu_offload/moved"] = max(float((after[n] - before[n]).abs().max()) for n in before)
    results["cpu_offload/param_devices"] = _devices(actor.model.module.parameters())
    results["cpu_offload/optim_devices"] = _devices(_optimizer_tensors(actor))
    results["cpu_offload/manual"] = (actor.offload_params, actor.offload_optimizer)


def check_offload_and_resume(model_dir: str, out_dir: str, results: dict[str, Any]) -> None:
    """offload_params/offload_optimizer move shards and states; resume keeps bf16 states on CPU."""
    _, processor = load_processor(model_dir)
    config = make_config(
        model_dir, trainer__device="cuda", worker__actor__optim__strategy="adamw_bf16",
        worker__actor__offload__offload_params=True, worker__actor__offload__offload_optimizer=True,
    )  # fmt: skip
    actor = build_actor(config, processor, "cuda", model_path=model_dir)
    batch = with_training_fields(make_batch(model_dir, SPECS, seed=1), seed=2)
    actor.update_policy(batch)
    results["offload/optim_after_update"] = _devices(_optimizer_tensors(actor))
    torch.cuda.synchronize()
    on_gpu = torch.cuda.memory_allocated()
    actor.offload_to_cpu()
    results["offload/params_offloaded"] = _devices(actor.model.module.parameters())
    results["offload/freed_bytes"] = on_gpu - torch.cuda.memory_allocated()
    actor.load_to_device()
    results["offload/params_back"] = _devices(actor.model.module.parameters())
    saved = [(t.dtype, t.device.type) for t in _optimizer_tensors(actor)]
    path = os.path.join(out_dir, "ckpt")
    actor.save_checkpoint(path)
    actor.load_checkpoint(path)
    results["resume/saved"] = saved
    results["resume/loaded"] = [(t.dtype, t.device.type) for t in _optimizer_tensors(actor)]


def run(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    dist.init_process_group(
        process_group_backend("cuda"), rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300)
    )
    results: dict[str, Any] = {}
    try:
        check_fsdp_cpu_offload(model_dir, results)
        check_offload_and_resume(model_dir, out_dir, results)
    finally:
        dist.destroy_process_group()
    torch.save(results, os.path.join(out_dir, "results.pt"))
