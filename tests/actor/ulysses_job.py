"""What each of the spawned gloo ranks runs for tests/actor/test_ulysses.py.

`run` (2 ranks): the same batch goes through an actor with ulysses_size=1 (the 2 ranks split the
rows) and one with ulysses_size=2 (both ranks get all rows and split every packed micro-batch by
tokens). `run_dp_sp` (4 ranks): ulysses_size=1 (4 ranks, 4 row shares) against ulysses_size=2 with
2 data-parallel groups (ranks 0-1 and 2-3, each a half of the rows), so the groups, their
collectives and the loss normalisation are checked with dp and sp both above 1. Log-probs, every
parameter's gradient, an update's metrics and weights, and the reference's log-probs must agree.
Rank 0 stores the differences (plain numbers) for the test.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from actor_helpers import init_gloo, make_batch, make_config
from actor_multirank_job import full_params, max_diff

import vlrl.workers.actor as actor_module
from vlrl.batch.rows import RolloutBatch
from vlrl.models.attention import make_varlen_info, varlen_attention_forward
from vlrl.models.packing import build_packed_inputs
from vlrl.models.processor import load_processor
from vlrl.models.ulysses import build_sequence_parallel, token_bounds
from vlrl.workers.actor import gathered_grads
from vlrl.workers.from_config import build_actor
from vlrl.workers.reference import Reference
from vlrl.workers.vision import VisionCache

TEMPERATURE = 0.9
SPLIT = ([0, 3, 4, 7], [1, 2, 5, 6])  # rows per rank with ulysses_size=1 (per group at world 4, sp 2)
SPLIT4 = ([0, 3], [4, 7], [1, 2], [5, 6])  # rows per rank with ulysses_size=1 at world 4
# (loss_avg_mode, policy_loss, dynamic batching): gspo's ratio is per sequence, and a sequence's
# tokens lie on both ranks, so it needs the gathered log-probs
ADAM_STEADY_GRAD = 1e-6  # |g| above which Adam's first step is lr * sign(g) to within 1%
VARIANTS = (("token", "ppo", False), ("seq-mean-token-sum", "ppo", False), ("seq", "gspo", False),
            ("token", "ppo", True))  # fmt: skip


def training_batch(model_dir: str) -> RolloutBatch:
    """8 samples with 0, 1 or 2 images, old/ref log-probs and advantages. In micro-batches of 2
    rows, split over 2 ranks, two images straddle the split and two micro-batches have their images
    on one rank only (`image_splits`; the test checks it)."""
    specs = [(0, 2), (1, 6), (2, 3), (0, 14), (1, 11), (0, 2), (0, 5), (2, 7)]
    batch = make_batch(model_dir, specs, group_size=1, seed=1)
    gen = torch.Generator().manual_seed(7)
    n, r = batch.responses.shape
    batch.old_log_probs = -6.5 + 0.4 * torch.randn(n, r, generator=gen)
    batch.ref_log_probs = -6.5 + 0.4 * torch.randn(n, r, generator=gen)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, -1.0, 1.0, 2.0, -2.0])
    batch.advantages = advantages[:, None] * batch.response_mask
    return batch


def gather_rows(rank_rows: list[int], values: torch.Tensor, n: int) -> torch.Tensor:
    """Rows of every rank put back in batch order (ulysses_size=1: the ranks hold different rows)."""
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (rank_rows, values))
    out = torch.zeros(n, *values.shape[1:])
    for rows, value in parts:
        out[rows] = value
    return out


def ulysses_config(model_dir: str, sp: int, checkpointing: bool = False, world: int = 2):
    return make_config(
        model_dir, world, worker__rollout__temperature=TEMPERATURE, algorithm__use_kl_loss=True,
        algorithm__kl_penalty="low_var_kl", algorithm__kl_coef=0.1, worker__actor__ulysses_size=sp,
        worker__actor__max_token_len_per_device=60, worker__actor__entropy_coeff=0.01,
        worker__actor__model__enable_gradient_checkpointing=checkpointing,
    )  # fmt: skip


def rank_rows(rank: int, world: int, sp: int, n: int) -> list[int]:
    """The rows a rank holds: its own share with sp 1; its group's share (the same on the group's
    ranks) with sp 2: all rows at world 2, half of them at world 4."""
    if world == 2:
        return SPLIT[rank] if sp == 1 else list(range(n))
    return SPLIT4[rank] if sp == 1 else SPLIT[rank // sp]


def run_actor(
    model_dir: str, processor, batch: RolloutBatch, sp: int, rank: int, world: int = 2
) -> dict[str, Any]:
    """Log-probs, gradients per variant, one update's metrics and weights for ulysses_size=sp."""
    config = ulysses_config(model_dir, sp, world=world)
    actor = build_actor(config, processor, "cpu", model_path=model_dir)
    rows = rank_rows(rank, world, sp, len(batch))
    mine = batch.select(rows)
    out: dict[str, Any] = {"log_probs": gather_rows(rows, actor.compute_log_probs(mine), len(batch))}
    for mode, loss, dynamic in VARIANTS:
        actor.cfg.loss_avg_mode, actor.cfg.policy_loss = mode, loss
        actor.model.spec = replace(actor.model.spec, dynamic_batching=dynamic)
        actor.model.module.train()
        actor.forward_backward(mine, actor_module._UpdateStats(with_kl_loss=True), image_anchor=True)
        out[f"grads/{mode}/{loss}/{dynamic}"] = gathered_grads(actor.model.module)
        actor.optimizer.zero_grad(set_to_none=True)
    actor.cfg.loss_avg_mode, actor.cfg.policy_loss = "token", "ppo"
    actor.model.spec = replace(actor.model.spec, dynamic_batching=False)
    out["metrics"] = actor.update_policy(mine)
    out["weights"] = full_params(actor.model.module)
    reference = Reference(
        config.worker.ref,
        actor.model.spec,
        processor,
        "cpu",
        TEMPERATURE,
        vision_cache=VisionCache(processor.image_processor),
    )
    out["ref_log_probs"] = gather_rows(rows, reference.compute_log_probs(mine), len(batch))
    return out


def image_splits(model_dir: str, batch: RolloutBatch, rows_per_micro_batch: int) -> dict[str, int]:
    """Over the update's micro-batches (consecutive rows): how many have an image whose tokens lie
    on both ranks, and how many have images on one rank's slice only."""
    tokenizer, _ = load_processor(model_dir)
    image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    counts = {"straddling": 0, "one_sided": 0}
    for start in range(0, len(batch), rows_per_micro_batch):
        mb = batch.select(list(range(start, start + rows_per_micro_batch)))
        ids = build_packed_inputs(mb.input_ids, mb.attention_mask, mb.position_ids, mb.prompt_length)
        ids = ids.model_kwargs["input_ids"][0]
        half = (ids.numel() + 1) // 2
        counts["straddling"] += int(ids[half - 1] == image_id and ids[half] == image_id)
        left, right = int((ids[:half] == image_id).sum()), int((ids[half:] == image_id).sum())
        counts["one_sided"] += int((left == 0) != (right == 0))
    return counts


def run_checkpointed(model_dir: str, processor, batch: RolloutBatch) -> dict[str, Any]:
    """ulysses_size=2 with gradient checkpointing (the backward re-runs the forward's all-to-alls):
    the token-mean gradient, and an empty micro-batch (only the anchor, one token and one pad token
    over two ranks) with and without the dummy image, which must run and add a zero gradient."""
    actor = build_actor(
        ulysses_config(model_dir, 2, checkpointing=True), processor, "cpu", model_path=model_dir
    )
    actor.model.module.train()
    actor.forward_backward(batch, actor_module._UpdateStats(with_kl_loss=True), image_anchor=True)
    out: dict[str, Any] = {"grads": gathered_grads(actor.model.module)}
    actor.optimizer.zero_grad(set_to_none=True)
    empty = batch.select([])
    for image_anchor in (False, True):
        result = actor.model.forward_micro_batch(empty, TEMPERATURE, image_anchor, with_entropy=True)
        (result.log_probs.sum() + result.anchor).backward()
    out["empty_grad_max"] = max(float(g.abs().max()) for g in gathered_grads(actor.model.module).values())
    out["empty_grad_count"] = len(gathered_grads(actor.model.module))
    out["num_params"] = len(list(actor.model.module.parameters()))
    return out


def check_attention_kv_repeat(rank: int, results: dict) -> None:
    """4 query heads, 1 kv head over 2 ranks (kv repeated): output and q/k/v gradients equal the
    unsplit attention's, on 3 packed sequences of 5 + 4 + 3 tokens."""
    sp = build_sequence_parallel(2)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 12, 8, generator=gen) for h in (4, 1, 1))
    weight = torch.randn(1, 12, 4, 8, generator=gen)
    lengths = [5, 4, 3]
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out_full, _ = varlen_attention_forward(
        None, *full, None, scaling=0.3, vlrl_varlen=make_varlen_info(lengths, "cpu")
    )
    (out_full * weight).sum().backward()
    start, end = token_bounds(12, sp)
    part = [t[:, :, start:end].clone().requires_grad_(True) for t in (q, k, v)]
    info = make_varlen_info(lengths, "cpu", sp=sp)
    out_part, _ = varlen_attention_forward(None, *part, None, scaling=0.3, vlrl_varlen=info)
    (out_part * weight[:, start:end]).sum().backward()
    errs = [float((out_part - out_full[:, start:end]).detach().abs().max())]
    errs += [float((p.grad - f.grad[:, :, start:end]).abs().max()) for p, f in zip(part[:1], full[:1])]
    # k/v gradients: each rank's slice gets the gradient summed over every query that read it
    errs += [float((p.grad - f.grad[:, :, start:end]).abs().max()) for p, f in zip(part[1:], full[1:])]
    results[f"attention_kv_repeat_err/rank{rank}"] = max(errs)


def run(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    init_gloo(rank, world, port)
    results: dict[str, Any] = {}
    try:
        check_attention_kv_repeat(rank, results)
        _, processor = load_processor(model_dir)
        batch = training_batch(model_dir)
        results["image_splits"] = image_splits(model_dir, batch, 2)
        one = run_actor(model_dir, processor, batch, 1, rank)
        two = run_actor(model_dir, processor, batch, 2, rank)
        checkpointed = run_checkpointed(model_dir, processor, batch)
        ref = one["grads/token/ppo/False"]
        scale = max(float(g.abs().max()) for g in ref.values())
        results["checkpointed_grad_err"] = max_diff(checkpointed["grads"], ref, ref.keys()) / scale
        results["empty_grad_max"] = checkpointed["empty_grad_max"]
        results["empty_grad_count"] = checkpointed["empty_grad_count"]
        results["num_params"] = checkpointed["num_params"]
        compare(batch, one, two, model_dir, results)
    finally:
        dist.destroy_process_group()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def run_dp_sp(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    """World 4: dp 4 x sp 1 against dp 2 x sp 2 on the same batch."""
    init_gloo(rank, world, port)
    results: dict[str, Any] = {}
    try:
        _, processor = load_processor(model_dir)
        batch = training_batch(model_dir)
        one = run_actor(model_dir, processor, batch, 1, rank, world=world)
        two = run_actor(model_dir, processor, batch, 2, rank, world=world)
        compare(batch, one, two, model_dir, results)
    finally:
        dist.destroy_process_group()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def compare(
    batch: RolloutBatch, one: dict[str, Any], two: dict[str, Any], model_dir: str, results: dict
) -> None:
    """The differences between the ulysses_size=1 run `one` and the ulysses_size=2 run `two`."""
    mask = batch.response_mask.bool()
    results["log_prob_err"] = float((one["log_probs"] - two["log_probs"])[mask].abs().max())
    results["ref_log_prob_err"] = float((one["ref_log_probs"] - two["ref_log_probs"])[mask].abs().max())
    results["ref_vs_actor_err"] = float((two["ref_log_probs"] - one["log_probs"])[mask].abs().max())
    for key in one:
        if key.startswith("grads/"):
            ref = one[key]
            scale = max(float(g.abs().max()) for g in ref.values())
            results[f"grad_keys_match/{key}"] = set(ref) == set(two[key])
            results[f"grad_err/{key}"] = max_diff(two[key], ref, ref.keys()) / scale
    results["metrics"] = (one["metrics"], two["metrics"])
    # Adam's first step moves a weight by lr * g / (|g| + eps): a sign times lr where |g| >> eps,
    # but anywhere in (-lr, lr) where |g| is near eps (1e-8), so there the reduction order of the
    # gradient (thread counts, gloo) decides the step. The update took the token/ppo gradient.
    update_grads = one["grads/token/ppo/False"]
    steady, at_eps = 0.0, 0.0
    for name, grad in update_grads.items():
        diff = (two["weights"][name] - one["weights"][name]).abs()
        big = grad.abs() > ADAM_STEADY_GRAD
        steady = max(steady, float(torch.where(big, diff, 0.0).max()))
        at_eps = max(at_eps, float(torch.where(big, 0.0, diff).max()))
    results["weights_err"], results["weights_err_near_eps"] = steady, at_eps
    results["weights_moved"] = max_diff(two["weights"], full_params_initial(model_dir))


def full_params_initial(model_dir: str) -> dict[str, torch.Tensor]:
    from vlrl.models.loading import load_model

    return {n: p.detach() for n, p in load_model(model_dir, padding_free=False).named_parameters()}
