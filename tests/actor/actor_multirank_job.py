"""What each of the 2 spawned gloo ranks runs for tests/actor/test_multirank.py.

All multi-rank checks share one spawn (starting a rank costs ~15 s of imports on these CPUs).
Each check stores plain numbers in `results`; rank files are read back by the test.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from actor_helpers import init_gloo, make_batch, make_config, sampling_for
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

import vlrl.workers.actor as actor_module
from vlrl.algorithms import compute_kl_loss, compute_policy_loss, count_tokens_and_seqs
from vlrl.batch.rows import RolloutBatch
from vlrl.models.loading import load_model
from vlrl.models.packing import build_padded_inputs, forward_log_probs
from vlrl.models.processor import load_processor
from vlrl.workers.actor import Actor, gathered_grads
from vlrl.workers.from_config import build_actor
from vlrl.workers.optim import global_grad_norm
from vlrl.workers.vision import VisionCache

TEMPERATURE = 0.9
SPLIT = ([0, 3, 4, 7], [1, 2, 5, 6])  # rows per rank: both ranks get image and text samples
MODES = ("token", "seq", "seq-mean-token-sum")


def full_params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Gathered full parameters (collective)."""
    return {n: p.full_tensor().detach().clone() for n, p in module.named_parameters()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], keys=None) -> float:
    keys = keys if keys is not None else a.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in keys)


def training_batch(model_dir: str) -> RolloutBatch:
    """8 samples (4 prompts x 2), images in groups 0 and 2, with old/ref log-probs and advantages."""
    batch = make_batch(model_dir, [(True, 6), (False, 9), (True, 3), (False, 5)], group_size=2, seed=1)
    gen = torch.Generator().manual_seed(7)
    n, r = batch.responses.shape
    batch.old_log_probs = -6.5 + 0.4 * torch.randn(n, r, generator=gen)  # far enough to clip some tokens
    batch.ref_log_probs = -6.5 + 0.4 * torch.randn(n, r, generator=gen)
    batch.advantages = (
        torch.tensor([1.0, -1.0, 0.5, -0.5, -1.0, 1.0, 2.0, -2.0])[:, None] * batch.response_mask
    )
    return batch


def reference_gradients(
    model_dir: str, batch: RolloutBatch, actor: Actor, mode: str
) -> dict[str, torch.Tensor]:
    """Plain single-process, padded, full-batch gradient of the same loss (no FSDP, no micro-batches)."""
    model = load_model(model_dir, padding_free=False)
    _, processor = load_processor(model_dir)
    pv, grid = VisionCache(processor.image_processor).collate(batch.images)
    inputs = build_padded_inputs(
        batch.input_ids,
        batch.attention_mask,
        batch.position_ids,
        batch.prompt_length,
        pixel_values=pv,
        image_grid_thw=grid,
    )
    out = forward_log_probs(model, inputs, sampling_for(model_dir, TEMPERATURE))
    tokens, seqs = count_tokens_and_seqs(batch.response_mask)
    agg = {"loss_avg_mode": mode, "num_tokens": tokens, "num_seqs": seqs}
    cfg = actor.cfg
    loss, _ = compute_policy_loss(
        cfg.policy_loss, batch.old_log_probs, out.log_probs, batch.advantages, batch.response_mask,
        clip_ratio_low=cfg.clip_ratio_low, clip_ratio_high=cfg.clip_ratio_high,
        clip_ratio_dual=cfg.clip_ratio_dual, **agg,
    )  # fmt: skip
    kl = compute_kl_loss(out.log_probs, batch.ref_log_probs, batch.response_mask, "low_var_kl", **agg)
    (loss + actor.algorithm.kl_coef * kl).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def check_gradients(actor: Actor, batch: RolloutBatch, model_dir: str, rank: int, results: dict) -> None:
    """2 ranks x 2 micro-batches (and dynamic batching) == single-process full-batch gradient."""
    mine = batch.select(SPLIT[rank])
    for mode in (*MODES, "token-dynamic"):
        actor.cfg.loss_avg_mode = mode.split("-dynamic")[0]
        actor.model.spec = replace(actor.model.spec, dynamic_batching=mode.endswith("dynamic"))
        actor.model.module.train()
        actor.forward_backward(mine, actor_module._UpdateStats(with_kl_loss=True), image_anchor=True)
        grads = gathered_grads(actor.model.module)
        norm = global_grad_norm(actor.params)
        # torch's own clip_grad_norm_ on DTensor grads (what the brief asked to check); inf: no clipping
        torch_norm = torch.nn.utils.clip_grad_norm_(actor.params, float("inf"))
        torch_norm = float(torch_norm.full_tensor() if isinstance(torch_norm, DTensor) else torch_norm)
        actor.optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            ref = reference_gradients(model_dir, batch, actor, actor.cfg.loss_avg_mode)
            scale = max(float(g.abs().max()) for g in ref.values())
            results[f"grad_err/{mode}"] = max_diff(grads, ref, ref.keys()) / scale
            results[f"grad_keys_match/{mode}"] = set(grads) == set(ref)
            ref_norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in ref.values()])))
            results[f"grad_norm_err/{mode}"] = abs(norm - ref_norm) / ref_norm
            results[f"torch_clip_norm_err/{mode}"] = abs(torch_norm - ref_norm) / ref_norm
    actor.cfg.loss_avg_mode = "token"
    actor.model.spec = replace(actor.model.spec, dynamic_batching=False)


def check_mixed_ranks(actor: Actor, model_dir: str, rank: int, results: dict) -> None:
    """Rank 0 holds 3 image samples, rank 1 one text sample: no hang, and rank 1 runs empty micro-batches
    (micro-batches of 2) with a dummy image, which must not change its log-probs."""
    specs = [(True, 4), (True, 7), (True, 2)] if rank == 0 else [(False, 5)]
    batch = make_batch(model_dir, specs, group_size=1, seed=3 + rank)
    logp = actor.compute_log_probs(batch)
    model = load_model(model_dir, padding_free=False)
    _, processor = load_processor(model_dir)
    pv, grid = VisionCache(processor.image_processor).collate(batch.images)
    inputs = build_padded_inputs(
        batch.input_ids,
        batch.attention_mask,
        batch.position_ids,
        batch.prompt_length,
        pixel_values=pv,
        image_grid_thw=grid,
    )
    with torch.no_grad():
        expected = forward_log_probs(model, inputs, sampling_for(model_dir, TEMPERATURE)).log_probs
    mask = batch.response_mask.bool()
    results["mixed_logp_err"] = float((logp - expected)[mask].abs().max())
    batch.old_log_probs, batch.ref_log_probs = logp, logp
    batch.advantages = torch.tensor([1.0, -1.0, 0.5][: len(batch)])[:, None] * batch.response_mask
    results["mixed_update"] = actor.update_policy(batch)


def check_loss_decreases(actor: Actor, batch: RolloutBatch, rank: int, results: dict) -> None:
    mine = batch.select(SPLIT[rank])
    mine.old_log_probs = actor.compute_log_probs(mine)
    results["losses"] = [actor.update_policy(mine)["actor/pg_loss"] for _ in range(5)]


def check_checkpoint(actor: Actor, batch: RolloutBatch, rank: int, path: str, results: dict) -> None:
    """save -> step (P1) -> load -> same weights/optimizer as saved -> step -> P1 again (exact resume)."""
    mine = batch.select(SPLIT[rank])
    saved = full_params(actor.model.module)
    saved_optim = {k: v._local_tensor.clone() for k, v in _optim_tensors(actor).items()}
    actor.save_checkpoint(path)
    actor.update_policy(mine)
    p1 = full_params(actor.model.module)
    lr1 = actor.optimizer.param_groups[0]["lr"]
    actor.load_checkpoint(path)
    results["ckpt_weights_err"] = max_diff(full_params(actor.model.module), saved)
    results["ckpt_optim_err"] = max(
        float((v._local_tensor - saved_optim[k]).abs().max()) for k, v in _optim_tensors(actor).items()
    )
    results["ckpt_moved"] = max_diff(p1, saved)
    actor.update_policy(mine)
    results["ckpt_resume_err"] = max_diff(full_params(actor.model.module), p1)
    results["ckpt_lr"] = (lr1, actor.optimizer.param_groups[0]["lr"])


def _optim_tensors(actor: Actor) -> dict[str, Any]:
    names = {id(p): n for n, p in actor.model.module.named_parameters()}
    return {
        f"{names[id(p)]}/{k}": v
        for p, s in actor.optimizer.state.items()
        for k, v in s.items()
        if k != "step"
    }


def check_non_finite(actor: Actor, batch: RolloutBatch, rank: int, results: dict) -> None:
    """An inf loss on rank 0 only: both ranks skip the step, weights stay, the skip is counted."""
    mine = batch.select(SPLIT[rank])
    before = full_params(actor.model.module)
    original = actor_module.compute_policy_loss

    def poisoned(*args, **kwargs):
        loss, metrics = original(*args, **kwargs)
        return loss * float("inf"), metrics

    if rank == 0:
        actor_module.compute_policy_loss = poisoned
    try:
        metrics = actor.update_policy(mine)
    finally:
        actor_module.compute_policy_loss = original
    results["nonfinite_skipped"] = metrics["actor/skipped_steps"]
    results["nonfinite_weights_err"] = max_diff(full_params(actor.model.module), before)
    results["nonfinite_total"] = actor.skipped_steps
    results["after_skip_update"] = actor.update_policy(mine)["actor/skipped_steps"]


def check_frozen_vision(model_dir: str, processor, batch: RolloutBatch, rank: int, results: dict) -> None:
    config = make_config(model_dir, 2, worker__actor__model__freeze_vision_tower=True)
    actor = build_actor(config, processor, "cpu", model_path=model_dir)
    mine = batch.select(SPLIT[rank])
    before = full_params(actor.model.module)
    actor.update_policy(mine)
    after = full_params(actor.model.module)
    vision = [k for k in before if ".visual." in f".{k}"]
    text = [k for k in before if k not in vision]
    results["frozen_vision_err"] = max_diff(after, before, vision)
    results["frozen_text_moved"] = max_diff(after, before, text)
    results["frozen_num_vision"] = len(vision)


def kl_loss_actor(model_dir: str, world: int) -> Actor:
    """The actor both multi-rank jobs check: KL in the loss, token-budget micro-batches."""
    config = make_config(
        model_dir, world, worker__rollout__temperature=TEMPERATURE, algorithm__use_kl_loss=True,
        algorithm__kl_penalty="low_var_kl", algorithm__kl_coef=0.1, worker__actor__max_token_len_per_device=120,
        worker__actor__micro_batch_size_per_device_for_experience=2,
    )  # fmt: skip
    _, processor = load_processor(model_dir)
    return build_actor(config, processor, "cpu", model_path=model_dir)


def run(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    init_gloo(rank, world, port)
    results: dict[str, Any] = {}
    try:
        actor = kl_loss_actor(model_dir, world)
        disk = load_model(model_dir, padding_free=False).state_dict()
        results["broadcast_err"] = max_diff(
            full_params(actor.model.module), disk, [n for n, _ in actor.model.module.named_parameters()]
        )
        batch = training_batch(model_dir)
        check_gradients(actor, batch, model_dir, rank, results)
        check_mixed_ranks(actor, model_dir, rank, results)
        check_loss_decreases(actor, batch, rank, results)
        check_checkpoint(actor, batch, rank, os.path.join(out_dir, "ckpt"), results)
        check_non_finite(actor, batch, rank, results)
        check_frozen_vision(model_dir, load_processor(model_dir)[1], batch, rank, results)
        actor.save_hf(os.path.join(out_dir, "hf"))
        if rank == 0:
            saved = load_file(os.path.join(out_dir, "hf", "model.safetensors"))
            results["hf_num_tensors"] = len(saved)
    finally:
        dist.destroy_process_group()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
