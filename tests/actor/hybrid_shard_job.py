"""What each of the 4 spawned gloo ranks runs for tests/actor/test_hybrid_shard.py.

One spawn, several checks (starting a rank costs ~15 s of imports on these CPUs): the same rows go
through a flat actor (fsdp_size -1: one 1-D mesh of 4) and a hybrid one (fsdp_size 2: a 2-D mesh
[2 replicate, 2 shard]), and a hybrid one with Ulysses (ulysses_size 2, so 2 data-parallel groups
of 2 ranks each get half the rows). Their log-probs, update metrics (loss, grad norm) over a few
optimizer steps and final weights must agree; so must a LoRA actor's (flat vs hybrid) and a hybrid
reference's log-probs. The hybrid actor then goes through full_state_dict, the rollout weight
sync's gathered tensors, the non-finite weight check and a checkpoint round trip. Last, flat and
hybrid again with 2 micro-batches per mini-batch: gradients, training and the count of
cross-replica all-reduces (once per mini-batch, on the last micro-batch's backward).
Each rank stores plain numbers in `results`; rank files are read back by the test.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from actor_helpers import init_gloo, make_config
from actor_multirank_job import full_params, max_diff, training_batch
from torch.distributed.fsdp import FSDPModule
from ulysses_job import SPLIT, SPLIT4

from vlrl.batch.rows import RolloutBatch
from vlrl.models.processor import load_processor
from vlrl.rollout.weight_sync import full_named_tensors
from vlrl.workers.actor import Actor, _UpdateStats, gathered_grads
from vlrl.workers.from_config import build_actor
from vlrl.workers.fsdp import full_state_dict, pending_replica_reduce
from vlrl.workers.reference import Reference
from vlrl.workers.sharded_model import ShardSpec

TEMPERATURE = 0.9
STEPS = 3  # update_policy calls; one optimizer step each (8 rows per step, 2 per rank)


def hybrid_actor(
    model_dir: str, fsdp_size: int, sp: int = 1, lora_rank: int = 0, micro_rows: int | None = None
) -> Actor:
    """`micro_rows`: fixed micro-batches of that many rows (dynamic batching off); None: the default."""
    fixed = {} if micro_rows is None else {
        "worker__actor__dynamic_batching": False, "worker__actor__micro_batch_size_per_device_for_update": micro_rows,
    }  # fmt: skip
    config = make_config(
        model_dir, 4, worker__rollout__temperature=TEMPERATURE, algorithm__use_kl_loss=True,
        algorithm__kl_penalty="low_var_kl", algorithm__kl_coef=0.1, worker__actor__fsdp__fsdp_size=fsdp_size,
        worker__actor__ulysses_size=sp, worker__actor__model__lora__rank=lora_rank,
        worker__actor__model__lora__alpha=8, **fixed,
    )  # fmt: skip
    torch.manual_seed(0)  # the LoRA A factors: rank 0 draws them, the same for both actors
    return build_actor(config, load_processor(model_dir)[1], "cpu", model_path=model_dir)


def train(actor: Actor, rows: list[int], model_dir: str) -> dict[str, Any]:
    """Log-probs of `rows`, then STEPS updates (losses and grad norms, reduced over ranks) and the weights."""
    mine = training_batch(model_dir).select(rows)
    out: dict[str, Any] = {"log_probs": actor.compute_log_probs(mine)}
    metrics = [actor.update_policy(mine) for _ in range(STEPS)]
    out["losses"] = [m["actor/pg_loss"] for m in metrics]
    out["grad_norms"] = [m["actor/grad_norm"] for m in metrics]
    out["weights"] = full_params(actor.model.module)
    return out


def check_layout(actor: Actor, results: dict[str, Any]) -> None:
    """Every parameter is a DTensor on the 2-D mesh, replicated over dim 0 and sharded over dim 1."""
    params = list(actor.model.module.parameters())
    results["mesh_shapes"] = sorted({tuple(p.device_mesh.shape) for p in params})
    results["mesh_names"] = sorted({p.device_mesh.mesh_dim_names for p in params})
    results["placements"] = sorted({str(p.placements) for p in params})


def check_gathers(actor: Actor, rank: int, results: dict[str, Any]) -> None:
    """full_state_dict (rank 0) and the weight sync's gathered tensors equal the gathered parameters."""
    params = full_params(actor.model.module)
    state = full_state_dict(actor.model.module)
    synced = dict(full_named_tensors(actor.model.module))
    results["sync_err"] = max_diff(synced, params, params.keys())
    if rank == 0:
        results["full_state_err"] = max_diff(state, params, params.keys())
    else:
        results["full_state_len"] = len(state)


def check_non_finite(actor: Actor, rank: int, results: dict[str, Any]) -> None:
    """A nan in one shard of one replica (rank 3) is seen by every rank."""
    results["finite_before"] = actor.weights_finite()
    shard = next(p for p in actor.params if p.to_local().numel()).to_local()
    saved = shard.detach().clone()
    if rank == 3:
        shard.data.view(-1)[0] = float("nan")
    results["finite_with_nan"] = actor.weights_finite()
    shard.data.copy_(saved)


def check_checkpoint(
    actor: Actor, rows: list[int], model_dir: str, path: str, results: dict[str, Any]
) -> None:
    """save -> step (P1) -> load -> the saved weights and moments -> step -> P1 again."""
    mine = training_batch(model_dir).select(rows)
    mine.old_log_probs = actor.compute_log_probs(mine)
    saved = full_params(actor.model.module)
    saved_moments = _moments(actor)
    actor.save_checkpoint(path)
    actor.update_policy(mine)
    p1 = full_params(actor.model.module)
    actor.load_checkpoint(path)
    results["ckpt_moved"] = max_diff(p1, saved)
    results["ckpt_weights_err"] = max_diff(full_params(actor.model.module), saved)
    results["ckpt_optim_err"] = max_diff(_moments(actor), saved_moments)
    actor.update_policy(mine)
    results["ckpt_resume_err"] = max_diff(full_params(actor.model.module), p1)


def _moments(actor: Actor) -> dict[str, torch.Tensor]:
    """Gathered AdamW moments by parameter name (the states are DTensors like their parameters)."""
    names = {id(p): n for n, p in actor.model.module.named_parameters()}
    return {
        f"{names[id(p)]}/{k}": v.full_tensor().clone()
        for p, s in actor.optimizer.state.items()
        for k, v in s.items()
        if k != "step"
    }


def check_reference(model_dir: str, rank: int, flat_log_probs: torch.Tensor, results: dict[str, Any]) -> None:
    """The reference policy on a 2-D mesh (`worker.ref.fsdp.fsdp_size` 2) scores like the untrained actor."""
    config = make_config(
        model_dir, 4, worker__rollout__temperature=TEMPERATURE, worker__ref__fsdp__fsdp_size=2
    )
    processor = load_processor(model_dir)[1]
    spec = ShardSpec.of_actor(config.worker.actor, model_dir)
    reference = Reference(config.worker.ref, spec, processor, "cpu", TEMPERATURE)
    results["ref_mesh_shapes"] = sorted(
        {tuple(p.device_mesh.shape) for p in reference.model.module.parameters()}
    )
    log_probs = reference.compute_log_probs(training_batch(model_dir).select(SPLIT4[rank]))
    results["ref_log_prob_err"] = float((log_probs - flat_log_probs).abs().max())


def check_lora(model_dir: str, rank: int, results: dict[str, Any]) -> None:
    """LoRA adapters (frozen base) on the 2-D mesh: the same training and merged weights as flat."""
    merged = {}
    for name, fsdp_size in (("flat", -1), ("hybrid", 2)):
        actor = hybrid_actor(model_dir, fsdp_size, lora_rank=4)
        out = train(actor, SPLIT4[rank], model_dir)
        results[f"lora/{name}/losses"], results[f"lora/{name}/grad_norms"] = out["losses"], out["grad_norms"]
        merged[name] = dict(full_named_tensors(actor.model.module))  # what the engines receive
    results["lora/merged_err"] = max_diff(merged["hybrid"], merged["flat"])
    results["lora/merged_keys_match"] = set(merged["hybrid"]) == set(merged["flat"])


class ReplicaAllReduces:
    """Counts `dist.all_reduce` calls on this rank's replicate group (the mesh's dim 0: FSDP2's
    cross-replica gradient all-reduce, _fsdp_collectives.py `foreach_reduce`) while installed."""

    def __init__(self, actor: Actor) -> None:
        mesh = next(actor.model.module.parameters()).device_mesh
        self.ranks = dist.get_process_group_ranks(mesh.get_group("replicate"))
        self.calls = 0
        self.original = dist.all_reduce

    def __enter__(self) -> ReplicaAllReduces:
        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group", args[1] if len(args) > 1 else None)
            if group is not None and dist.get_process_group_ranks(group) == self.ranks:
                self.calls += 1
            return self.original(tensor, *args, **kwargs)

        dist.all_reduce = counted
        return self

    def __exit__(self, *exc: object) -> None:
        dist.all_reduce = self.original


def first_gradients(actor: Actor, mine: RolloutBatch) -> dict[str, torch.Tensor]:
    """The gathered gradients of one mini-batch (all of `mine`), before any optimizer step."""
    actor.model.module.train()
    actor.forward_backward(mine, _UpdateStats(with_kl_loss=True), actor.model.any_rank_has_media(mine))
    grads = gathered_grads(actor.model.module)
    actor.optimizer.zero_grad(set_to_none=True)
    return grads


def check_micro_batches(model_dir: str, rank: int, results: dict[str, Any]) -> None:
    """Mini-batches of 2 micro-batches per rank (1 row each): hybrid gives flat's gradients, losses
    and weights, with one cross-replica all-reduce per FSDP unit per mini-batch (not per micro-batch)."""
    mine = training_batch(model_dir).select(SPLIT4[rank])
    out: dict[str, Any] = {}
    for name, fsdp_size in (("flat", -1), ("hybrid", 2)):
        actor = hybrid_actor(model_dir, fsdp_size, micro_rows=1)
        out[f"{name}/micro_batches"] = len(actor.model.plan_micro_batches(mine, 1))
        out[f"{name}/grads"] = first_gradients(actor, mine)
        if fsdp_size == -1:
            out["flat/trained"] = train(actor, SPLIT4[rank], model_dir)
            continue
        with ReplicaAllReduces(actor) as counter:
            out["hybrid/trained"] = train(actor, SPLIT4[rank], model_dir)
        results["micro/replica_all_reduces"] = counter.calls
        results["micro/fsdp_units"] = sum(isinstance(m, FSDPModule) for m in actor.model.module.modules())
        results["micro/pending"] = pending_replica_reduce(actor.model.module)
        results["micro/mini_batches"] = STEPS  # one per update_policy
    results["micro/micro_batches"] = [out["flat/micro_batches"], out["hybrid/micro_batches"]]
    results["micro/grad_norm"] = max(float(g.abs().max()) for g in out["flat/grads"].values())
    results["micro/grads_err"] = max_diff(out["hybrid/grads"], out["flat/grads"])
    flat, hybrid = out["flat/trained"], out["hybrid/trained"]
    for key in ("losses", "grad_norms"):
        results[f"micro/flat/{key}"], results[f"micro/hybrid/{key}"] = flat[key], hybrid[key]
    results["micro/weights_err"] = max_diff(hybrid["weights"], flat["weights"])


def run(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    init_gloo(rank, world, port)
    results: dict[str, Any] = {}
    try:
        flat = train(hybrid_actor(model_dir, -1), SPLIT4[rank], model_dir)
        check_reference(model_dir, rank, flat["log_probs"], results)
        actor = hybrid_actor(model_dir, 2)
        check_layout(actor, results)
        hybrid = train(actor, SPLIT4[rank], model_dir)
        results["log_prob_err"] = float((hybrid["log_probs"] - flat["log_probs"]).abs().max())
        results["weights_err"] = max_diff(hybrid["weights"], flat["weights"])
        for key in ("losses", "grad_norms"):
            results[f"flat/{key}"], results[f"hybrid/{key}"] = flat[key], hybrid[key]
        check_gathers(actor, rank, results)
        check_non_finite(actor, rank, results)
        check_checkpoint(actor, SPLIT4[rank], model_dir, os.path.join(out_dir, "ckpt"), results)
        del actor
        # Ulysses groups are ranks {0,1} and {2,3} (vlrl.models.ulysses), as are the shard groups
        sp = train(hybrid_actor(model_dir, 2, sp=2), SPLIT[rank // 2], model_dir)
        results["ulysses/losses"], results["ulysses/grad_norms"] = sp["losses"], sp["grad_norms"]
        results["ulysses/weights_err"] = max_diff(sp["weights"], flat["weights"])
        check_lora(model_dir, rank, results)
        check_micro_batches(model_dir, rank, results)
    finally:
        dist.destroy_process_group()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
