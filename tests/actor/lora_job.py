"""What each of the 2 gloo ranks runs for tests/actor/test_lora.py (LoRA actor sharded with FSDP2).

One spawn for all checks (starting ranks is the slow part on these CPUs); plain numbers go to
`rank{r}.pt`.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from actor_helpers import init_gloo, make_batch, make_config
from actor_multirank_job import max_diff
from actor_single_job import err, plain_log_probs, train_fields

from vlrl.config import RefConfig
from vlrl.models.loading import load_model
from vlrl.models.processor import load_processor
from vlrl.rollout.weight_sync import full_named_tensors, runtime_name
from vlrl.workers.actor import Actor, _UpdateStats, gathered_grads
from vlrl.workers.from_config import build_actor
from vlrl.workers.fsdp import reshard
from vlrl.workers.reference import AdapterOffReference

SPLIT = ([0, 3, 4, 7], [1, 2, 5, 6])  # rows per rank: both ranks get image and text samples
LORA = {"worker__actor__model__lora__rank": 4, "worker__actor__model__lora__alpha": 8}


def full_params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Gathered full parameters (collective). A forward without backward leaves the root unsharded
    (plain tensors): reshard first, as after a backward."""
    reshard(module)
    return {n: p.full_tensor().detach().clone() for n, p in module.named_parameters()}


def lora_config(model_dir: str, world: int, **overrides: Any):
    return make_config(model_dir, world, worker__actor__optim__lr=1e-2, **LORA, **overrides)


def build(model_dir: str, processor, world: int, **overrides: Any) -> Actor:
    torch.manual_seed(0)  # rank 0 draws lora_A; the other rank receives it
    return build_actor(lora_config(model_dir, world, **overrides), processor, "cpu", model_path=model_dir)


def check_wrapping(actor: Actor, results: dict) -> None:
    names = [n for n, p in actor.model.module.named_parameters() if p.requires_grad]
    results["trainable"] = names
    results["all_names"] = [n for n, _ in actor.model.module.named_parameters()]
    optimized = {id(p) for group in actor.optimizer.param_groups for p in group["params"]}
    results["optimizer_params_are_trainable"] = optimized == {id(p) for p in actor.params} and len(
        optimized
    ) == len(names)


def check_update(actor: Actor, batch, expected: torch.Tensor, rank: int, results: dict) -> None:
    """Training moves only the adapters; the base weights and the vision tower stay bit-identical."""
    before = full_params(actor.model.module)
    mine = batch.select(SPLIT[rank])
    losses = [actor.update_policy(mine)["actor/pg_loss"] for _ in range(4)]
    after = full_params(actor.model.module)
    base = [k for k in before if "lora_" not in k]
    results["losses"] = losses
    results["base_err"] = max_diff(after, before, base)
    results["lora_B_moved"] = max_diff(after, before, [k for k in before if "lora_B" in k])
    state_params = {id(p) for p in actor.optimizer.state}
    names = {id(p): n for n, p in actor.model.module.named_parameters()}
    results["optimizer_state_names"] = sorted(names[i] for i in state_params)
    now = actor.compute_log_probs(batch)
    results["policy_moved"] = err(now, expected, batch)
    reference = AdapterOffReference(actor.model, RefConfig(micro_batch_size_per_device_for_experience=3), 1.0)
    results["ref_err"] = err(reference.compute_log_probs(batch), expected, batch)
    results["after_ref_err"] = err(actor.compute_log_probs(batch), now, batch)  # adapters back on


def check_merged(actor: Actor, model_dir: str, batch, rank: int, results: dict) -> None:
    """The merged weights the engines get, loaded into a plain model, give the actor's log-probs."""
    merged = dict(full_named_tensors(actor.model.module))  # collective
    actor_logp = actor.compute_log_probs(batch)
    if rank == 0:
        plain = load_model(model_dir, padding_free=False)
        missing, unexpected = plain.load_state_dict(
            {runtime_name(k): v for k, v in merged.items()}, strict=False
        )
        results["merged_keys"] = (sorted(missing), sorted(unexpected))
        results["merged_err"] = err(plain_log_probs(model_dir, batch, plain), actor_logp, batch)


def check_checkpoint(actor: Actor, batch, rank: int, path: str, results: dict) -> None:
    """save -> step (P1) -> load -> same as saved -> step -> P1 again; only adapters on disk."""
    mine = batch.select(SPLIT[rank])
    saved = full_params(actor.model.module)
    actor.save_checkpoint(path)
    actor.update_policy(mine)
    p1 = full_params(actor.model.module)
    actor.load_checkpoint(path)
    results["ckpt_weights_err"] = max_diff(full_params(actor.model.module), saved)
    results["ckpt_moved"] = max_diff(p1, saved)
    actor.update_policy(mine)
    results["ckpt_resume_err"] = max_diff(full_params(actor.model.module), p1)
    if rank == 0:
        from vlrl.workers.checkpoint_io import SafeFileSystemReader

        metadata = SafeFileSystemReader(os.path.join(path, "dcp")).read_metadata()
        results["ckpt_model_keys"] = sorted(k for k in metadata.state_dict_metadata if k.startswith("model."))


def check_gradient_checkpointing(model_dir: str, processor, batch, rank: int, results: dict) -> None:
    """Non-reentrant checkpointing with frozen embeddings still gives the adapters their gradients."""
    mine = train_fields(batch.select(SPLIT[rank]), torch.zeros(len(SPLIT[rank]), batch.responses.shape[1]))
    grads = {}
    for flag in (False, True):
        actor = build(model_dir, processor, 2, worker__actor__model__enable_gradient_checkpointing=flag)
        with torch.no_grad():  # non-zero B, so A gets a gradient too
            for name, p in actor.model.module.named_parameters():
                if "lora_B" in name:
                    p.add_(0.01)
        actor.model.module.train()
        actor.forward_backward(mine, _UpdateStats(with_kl_loss=True), image_anchor=True)
        grads[flag] = gathered_grads(actor.model.module)
        results[f"ckpting_layers/{flag}"] = sum(
            bool(getattr(m, "gradient_checkpointing", False)) for m in actor.model.module.modules()
        )
    results["ckpting_grad_keys"] = sorted(grads[True]) == sorted(grads[False])
    results["ckpting_grad_names"] = sorted(grads[True])
    results["ckpting_grad_err"] = max(
        float((grads[True][k] - grads[False][k]).abs().max()) for k in grads[False]
    )
    results["ckpting_grad_norm"] = max(float(g.abs().max()) for g in grads[True].values())


def save_for_merger(actor: Actor, path: str, rank: int) -> None:
    """What the rank worker writes beside a checkpoint (for vlrl.tools.model_merger)."""
    actor.save_checkpoint(path)
    if rank == 0:
        actor.model.hf_config.save_pretrained(os.path.join(path, "hf_config"))
        actor.model.tokenizer_or_processor().save_pretrained(os.path.join(path, "hf_config"))
        actor.save_adapter_config(os.path.join(path, "hf_config"))
    dist.barrier()


def run(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    init_gloo(rank, world, port)
    results: dict[str, Any] = {}
    try:
        _, processor = load_processor(model_dir)
        batch = make_batch(model_dir, [(True, 6), (False, 9), (True, 3), (False, 5)], group_size=2, seed=1)
        expected = plain_log_probs(model_dir, batch)
        train_fields(batch, expected)
        actor = build(model_dir, processor, world)
        check_wrapping(actor, results)
        results["init_err"] = err(actor.compute_log_probs(batch), expected, batch)  # B = 0: no change
        check_update(actor, batch, expected, rank, results)
        check_merged(actor, model_dir, batch, rank, results)
        check_checkpoint(actor, batch, rank, os.path.join(out_dir, "ckpt"), results)
        results["actor_logp"] = actor.compute_log_probs(batch)
        actor.save_hf(os.path.join(out_dir, "hf"))
        save_for_merger(actor, os.path.join(out_dir, "merger", "actor"), rank)
        check_gradient_checkpointing(model_dir, processor, batch, rank, results)
        if rank == 0:
            torch.save(batch, os.path.join(out_dir, "batch.pt"))
    finally:
        dist.destroy_process_group()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
