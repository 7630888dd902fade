"""What the world-size-1 rank runs for tests/actor/test_single_rank.py (one forked process).

FSDP2 needs a process group, so these checks run in a child process with a 1-rank gloo group
instead of initializing one inside pytest. Results are plain numbers saved to `out_dir`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from actor_helpers import init_gloo, make_batch, make_config, sampling_for
from bare_loop import check_bare_loop

from vlrl.batch.rows import RolloutBatch
from vlrl.config import PPOConfig
from vlrl.models.loading import load_model
from vlrl.models.packing import build_padded_inputs, forward_log_probs
from vlrl.models.processor import load_processor
from vlrl.workers.actor import _UpdateStats, gathered_grads
from vlrl.workers.from_config import build_actor, build_reference
from vlrl.workers.optim import lr_factor
from vlrl.workers.vision import VisionCache

SPECS = [(True, 6), (False, 9), (True, 3), (False, 5)]


def plain_log_probs(model_dir: str, batch: RolloutBatch, model=None) -> torch.Tensor:
    """Padded log-probs of an unsharded model (the model on disk unless `model` is given)."""
    model = model or load_model(model_dir, padding_free=False)
    pv = grid = None
    if any(batch.images):
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
        return forward_log_probs(model, inputs, sampling_for(model_dir)).log_probs


def err(a: torch.Tensor, b: torch.Tensor, batch: RolloutBatch) -> float:
    return float((a - b)[batch.response_mask.bool()].abs().max())


def train_fields(batch: RolloutBatch, log_probs: torch.Tensor | None) -> RolloutBatch:
    batch.old_log_probs = log_probs
    signs = torch.tensor([1.0, -1.0] * len(batch))[: len(batch)]
    batch.advantages = signs[:, None] * batch.response_mask
    return batch


def check_vlm(model_dir: str, out_dir: str, results: dict[str, Any]) -> None:
    _, processor = load_processor(model_dir)
    batch = make_batch(model_dir, SPECS, group_size=2, seed=5)
    expected = plain_log_probs(model_dir, batch)
    variants = {
        "packed": make_config(model_dir),
        "padded": make_config(model_dir, worker__actor__padding_free=False),
        "dynamic": make_config(
            model_dir, worker__actor__dynamic_batching=True, worker__actor__max_token_len_per_device=100
        ),
    }
    for name, config in variants.items():
        actor = build_actor(config, processor, "cpu", model_path=model_dir)
        results[f"logp_err/{name}"] = err(actor.compute_log_probs(batch), expected, batch)
    reference = build_reference(variants["packed"], processor, "cpu", model_path=model_dir)
    results["ref_err"] = err(reference.compute_log_probs(batch), expected, batch)
    # Update, export, reload with plain transformers: same log-probs as the actor now has.
    train_fields(batch, expected)
    for _ in range(2):
        actor.update_policy(batch)
    now = actor.compute_log_probs(batch)
    results["moved"] = err(now, expected, batch)
    hf_dir = os.path.join(out_dir, "hf_vlm")
    actor.save_hf(hf_dir)
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    reloaded = AutoModelForImageTextToText.from_pretrained(hf_dir, attn_implementation="sdpa")
    results["hf_err"] = err(plain_log_probs(model_dir, batch, reloaded), now, batch)
    results["hf_processor"] = type(AutoProcessor.from_pretrained(hf_dir)).__name__
    results["hf_attn"] = AutoConfig.from_pretrained(hf_dir).text_config._attn_implementation


def check_gradient_checkpointing(model_dir: str, results: dict[str, Any]) -> None:
    """Checkpointed layers must still see the packed-attention kwargs: same gradients."""
    _, processor = load_processor(model_dir)
    batch = train_fields(make_batch(model_dir, SPECS, seed=6), torch.full((4, 9), -6.5))
    grads = []
    for flag in (False, True):
        actor = build_actor(
            make_config(model_dir, worker__actor__model__enable_gradient_checkpointing=flag),
            processor,
            "cpu",
            model_path=model_dir,
        )
        actor.model.module.train()
        results[f"ckpting_layers/{flag}"] = sum(
            bool(getattr(m, "gradient_checkpointing", False)) for m in actor.model.module.modules()
        )
        actor.forward_backward(batch, _UpdateStats(with_kl_loss=True), image_anchor=True)
        grads.append(gathered_grads(actor.model.module))
    results["ckpting_grad_err"] = max(float((grads[0][k] - grads[1][k]).abs().max()) for k in grads[0])


def check_schedule(model_dir: str, results: dict[str, Any]) -> None:
    """Warm-up + cosine with adamw_bf16 and an entropy bonus: the lr per step follows the formula."""
    _, processor = load_processor(model_dir)
    config = make_config(
        model_dir, worker__actor__optim__strategy="adamw_bf16", worker__actor__optim__lr_warmup_steps=2,
        worker__actor__optim__lr_scheduler_type="cosine", worker__actor__optim__min_lr_ratio=0.1,
        worker__actor__entropy_coeff=0.01,
    )  # fmt: skip
    actor = build_actor(config, processor, "cpu", model_path=model_dir, total_steps=5)
    batch = train_fields(make_batch(model_dir, SPECS, seed=7), torch.full((4, 9), -6.5))
    results["lrs"] = [actor.update_policy(batch)["actor/lr"] for _ in range(5)]
    results["lrs_expected"] = [
        config.worker.actor.optim.lr * lr_factor(s, config.worker.actor.optim, 5) for s in range(5)
    ]


def check_on_policy(model_dir: str, results: dict[str, Any]) -> None:
    """One optimizer step per batch: the update without old log-probs (its own, detached, ratio 1)
    moves the weights as with separately computed old log-probs, and fills them in."""
    _, processor = load_processor(model_dir)
    config = make_config(model_dir, algorithm__disable_kl=True)
    results["on_policy/config"] = config.plan.old_log_probs == "update"
    after, filled = [], None
    for given in (True, False):
        actor = build_actor(config, processor, "cpu", model_path=model_dir)
        batch = make_batch(model_dir, SPECS, seed=12)
        old = actor.compute_log_probs(batch)
        train_fields(batch, old if given else None)
        actor.update_policy(batch, on_policy=config.plan.old_log_probs == "update")
        after.append(actor.compute_log_probs(batch))
        filled = err(batch.old_log_probs, old, batch)
    results["on_policy/filled_err"] = filled
    results["on_policy/moved"] = err(after[0], old, batch)
    results["on_policy/after_err"] = err(after[0], after[1], batch)
    # 4 rows in 2 mini-batches
    two_steps = make_config(model_dir, algorithm__disable_kl=True, worker__actor__global_batch_size=2)
    results["mixed/config"] = two_steps.plan.old_log_probs
    actor = build_actor(two_steps, processor, "cpu", model_path=model_dir)
    batch = train_fields(make_batch(model_dir, SPECS, seed=12), None)
    try:
        actor.update_policy(batch, on_policy=True)
        results["on_policy/two_steps_error"] = ""
    except ValueError as exc:
        results["on_policy/two_steps_error"] = str(exc)
    check_mixed_old(model_dir, two_steps, processor, results)


def check_mixed_old(model_dir: str, config: PPOConfig, processor: Any, results: dict[str, Any]) -> None:
    """Two mini-batches (`old_log_probs=mixed`): the first one's old log-probs from the update's own
    first forward (the given ones for its rows are garbage, never read) move the weights as the
    full old pass does, through both optimizer steps, and are filled in."""
    after = []
    for own_first in (False, True):
        actor = build_actor(config, processor, "cpu", model_path=model_dir)
        batch = make_batch(model_dir, SPECS, seed=14)
        old = actor.compute_log_probs(batch)
        given = old.clone()
        if own_first:
            given[: actor.samples_per_minibatch] = 7.0  # not a log-prob: reading it would show
        train_fields(batch, given)
        metrics = actor.update_policy(batch, on_policy=own_first)
        after.append(actor.compute_log_probs(batch))
        results[f"mixed/steps/{own_first}"] = actor.global_step
        if own_first:
            results["mixed/filled_err"] = err(batch.tensor("old_log_probs"), old, batch)
            results["mixed/ppo_kl"] = metrics["actor/ppo_kl"]
    results["mixed/moved"] = err(after[0], old, batch)
    results["mixed/after_err"] = err(after[0], after[1], batch)


def check_no_advantage_guard(model_dir: str, results: dict[str, Any]) -> None:
    """All advantages 0 with an entropy bonus: the guard skips the step (weights and Adam state
    unchanged, LR schedule advanced); without it the entropy gradient alone moves the weights."""
    _, processor = load_processor(model_dir)
    for guard in (True, False):
        config = make_config(
            model_dir, worker__actor__entropy_coeff=0.01, worker__actor__skip_steps_without_advantage=guard
        )
        actor = build_actor(config, processor, "cpu", model_path=model_dir)
        batch = make_batch(model_dir, SPECS, seed=13)
        train_fields(batch, actor.compute_log_probs(batch))
        batch.advantages = torch.zeros_like(batch.advantages)
        before = actor.compute_log_probs(batch)
        metrics = actor.update_policy(batch)
        results[f"guard/{guard}/moved"] = err(actor.compute_log_probs(batch), before, batch)
        results[f"guard/{guard}/no_advantage_steps"] = metrics["actor/no_advantage_steps"]
        results[f"guard/{guard}/optimizer_state"] = len(actor.optimizer.state)
        results[f"guard/{guard}/global_step"] = actor.global_step
        batch.advantages[0] = batch.response_mask[0]  # one token of signal: a normal step again
        actor.update_policy(batch)
        results[f"guard/{guard}/signal_moved"] = err(actor.compute_log_probs(batch), before, batch)


def check_nonfinite_guard(model_dir: str, out_dir: str, results: dict[str, Any]) -> None:
    """A corrupt Adam state (a moment at 3e38, as a flipped checkpoint byte made it) turns the weights
    to inf/nan at the next optimizer step: the update stops the run and no checkpoint is written.
    Non-finite gradients are skipped, up to `max_nonfinite_steps` in a row."""
    from vlrl.workers.actor import NonFiniteTraining

    _, processor = load_processor(model_dir)
    actor = build_actor(make_config(model_dir), processor, "cpu", model_path=model_dir)
    batch = make_batch(model_dir, SPECS, seed=21)
    train_fields(batch, actor.compute_log_probs(batch))
    actor.update_policy(batch)  # creates the Adam state
    state = actor.optimizer.state[actor.params[0]]
    state["exp_avg"].to_local().fill_(3e38)
    state["exp_avg_sq"].to_local().fill_(1e-30)
    try:
        actor.update_policy(batch)
        results["nonfinite/update_error"] = ""
    except NonFiniteTraining as exc:
        results["nonfinite/update_error"] = str(exc)
    try:
        actor.save_checkpoint(os.path.join(out_dir, "nonfinite_ckpt"))
        results["nonfinite/save_error"] = ""
    except NonFiniteTraining as exc:
        results["nonfinite/save_error"] = str(exc)
    results["nonfinite/ckpt_written"] = os.path.exists(os.path.join(out_dir, "nonfinite_ckpt"))
    actor = build_actor(make_config(model_dir, worker__actor__max_nonfinite_steps=2), processor, "cpu",
                        model_path=model_dir)  # fmt: skip
    batch.advantages = torch.full_like(batch.advantages, float("nan"))
    skipped = [actor.update_policy(batch)["actor/skipped_steps"]]
    try:
        skipped.append(actor.update_policy(batch)["actor/skipped_steps"])
        results["nonfinite/skip_error"] = ""
    except NonFiniteTraining as exc:
        results["nonfinite/skip_error"] = str(exc)
    results["nonfinite/skipped"] = skipped


def check_other_arch(model_dir: str, arch: str, out_dir: str, results: dict[str, Any]) -> None:
    """Text-only Qwen2 and Qwen3-VL: log-probs match the plain model, updates run, HF export loads."""
    tokenizer, processor = load_processor(model_dir)
    batch = make_batch(model_dir, SPECS, seed=8)
    expected = plain_log_probs(model_dir, batch)
    actor = build_actor(make_config(model_dir), processor, "cpu", model_path=model_dir)
    results[f"{arch}/logp_err"] = err(actor.compute_log_probs(batch), expected, batch)
    train_fields(batch, expected)
    results[f"{arch}/losses"] = [actor.update_policy(batch)["actor/pg_loss"] for _ in range(3)]
    if arch == "qwen2":
        from transformers import AutoTokenizer

        actor.save_hf(os.path.join(out_dir, "hf_text"))
        results["text_tokenizer_vocab"] = len(AutoTokenizer.from_pretrained(os.path.join(out_dir, "hf_text")))
        results["text_vocab"] = len(tokenizer)


def check_tied_embeddings(model_dir: str, out_dir: str, results: dict[str, Any]) -> None:
    """A model with tie_word_embeddings (Qwen2.5-VL-3B style) trains, exports and reloads tied."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForImageTextToText

    tied = os.path.join(out_dir, "tied_model")
    shutil.copytree(model_dir, tied)
    config_path = Path(tied) / "config.json"
    config = json.loads(config_path.read_text())
    config["tie_word_embeddings"] = config["text_config"]["tie_word_embeddings"] = True
    config_path.write_text(json.dumps(config))
    weights = load_file(os.path.join(tied, "model.safetensors"))
    weights.pop("lm_head.weight")
    save_file(weights, os.path.join(tied, "model.safetensors"), metadata={"format": "pt"})
    _, processor = load_processor(tied)
    actor = build_actor(make_config(tied), processor, "cpu", model_path=tied)
    module = actor.model.module
    results["tied/in_actor"] = module.lm_head.weight is module.model.language_model.embed_tokens.weight
    batch = make_batch(tied, SPECS, seed=9)
    train_fields(batch, actor.compute_log_probs(batch))
    actor.update_policy(batch)
    now = actor.compute_log_probs(batch)
    actor.save_hf(os.path.join(out_dir, "hf_tied"))
    reloaded = AutoModelForImageTextToText.from_pretrained(os.path.join(out_dir, "hf_tied"))
    results["tied/reloaded"] = reloaded.lm_head.weight is reloaded.model.language_model.embed_tokens.weight
    results["tied/err"] = err(plain_log_probs(tied, batch, reloaded), now, batch)


def run(rank: int, world: int, port: int, models: dict[str, str], out_dir: str) -> None:
    init_gloo(rank, world, port)
    results: dict[str, Any] = {}
    try:
        check_vlm(models["qwen2_5_vl"], out_dir, results)
        check_bare_loop(models["qwen2_5_vl"], results)
        check_gradient_checkpointing(models["qwen2_5_vl"], results)
        check_schedule(models["qwen2_5_vl"], results)
        check_on_policy(models["qwen2_5_vl"], results)
        check_no_advantage_guard(models["qwen2_5_vl"], results)
        check_nonfinite_guard(models["qwen2_5_vl"], out_dir, results)
        check_tied_embeddings(models["qwen2_5_vl"], out_dir, results)
        for arch in ("qwen2", "qwen3_vl"):
            check_other_arch(models[arch], arch, out_dir, results)
    finally:
        dist.destroy_process_group()
    torch.save(results, os.path.join(out_dir, "results.pt"))
