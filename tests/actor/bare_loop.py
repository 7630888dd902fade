"""The actor's update against a bare loop (run in the 1-rank job of test_single_rank.py).

The bare loop is transformers' model, torch's AdamW and grad-norm clipping, and the GRPO loss
written out here: per token max(-r A, -clip(r, 1 - low, 1 + high) A) (dual clip: for A < 0 at most
-A * dual) plus kl_coef * k3 (clamped to [-bound, bound] when a bound is set; times r when
weighted), summed over a mini-batch's response tokens and divided by their number, one optimizer
step per mini-batch. With no dual clip, no bound and the weight it is what TRL 1.16's GRPOTrainer
computes (loss_type="dapo", k3 KL, use_bias_correction_kl=True, its default).
Nothing of vlrl's forward is used: the model computes its own positions from the token ids.
"""

from __future__ import annotations

from typing import Any

import torch
from actor_helpers import make_batch, make_config, sampling_for
from torch import Tensor
from transformers import AutoModelForImageTextToText

from vlrl.batch.rows import RolloutBatch
from vlrl.models.processor import load_processor
from vlrl.workers.from_config import build_actor

LR, CLIP_LOW, CLIP_HIGH, KL_COEF = 1e-2, 0.2, 0.28, 0.1
SPECS = [(True, 12), (True, 20), (True, 7), (True, 15)]  # 4 prompts with an image, x 4 samples


def row_log_probs(
    model: Any, processor: Any, batch: RolloutBatch, row: int, banned: tuple[int, ...]
) -> Tensor:
    """[response tokens] log-probs of one row, unpadded, at temperature 1 over the vocabulary the
    engines sample from (their banned tokens excluded)."""
    keep = batch.attention_mask[row].bool()
    ids = batch.input_ids[row][keep][None]  # [1, L]
    vision = processor.image_processor(images=batch.images[row], return_tensors="pt")
    # transformers 5.19 (qwen2_5_vl `get_rope_index`): without mm_token_type_ids every token gets
    # text positions, the image's 3-D rope positions only with it
    mm = (ids == model.config.image_token_id).int()
    out = model(input_ids=ids, mm_token_type_ids=mm, **vision)
    prompt = int(batch.attention_mask[row, : batch.prompt_length].sum())
    length = int(batch.response_mask[row].sum())
    logits = out.logits[0, prompt - 1 : prompt - 1 + length].float()  # [length, V]
    logits[:, list(banned)] = float("-inf")
    return torch.log_softmax(logits, -1).gather(-1, batch.responses[row, :length, None]).squeeze(-1)


def token_losses(logp: Tensor, old: Tensor, ref: Tensor, adv: float, setting: tuple) -> Tensor:
    """[tokens] the policy loss plus kl_coef * k3 (times r when weighted) of one row."""
    dual, bound, weighted = setting
    ratio = torch.exp(logp - old)
    policy = torch.max(-ratio * adv, -ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH) * adv)
    if dual is not None and adv < 0:
        policy = torch.clamp(policy, max=-adv * dual)
    d = (ref - logp).clamp(-20, 20)
    k3 = d.exp() - d - 1
    kl = k3 if bound is None else k3.clamp(-bound, bound)
    return policy + KL_COEF * (kl * ratio if weighted else kl)


def bare_update(model_dir: str, batch: RolloutBatch, inputs: dict[str, Any], setting: tuple) -> dict[str, Tensor]:  # fmt: skip
    """The weights after one optimizer step per mini-batch (`inputs["minis"]`, lists of rows)."""
    _, processor = load_processor(model_dir)
    banned = sampling_for(model_dir).banned_token_ids
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    for rows in inputs["minis"]:
        optimizer.zero_grad()
        tokens = sum(int(batch.response_mask[i].sum()) for i in rows)
        loss = sum(
            token_losses(row_log_probs(model, processor, batch, i, banned), inputs["old"][i], inputs["ref"][i],
                         float(inputs["adv"][i]), setting).sum()
            for i in rows
        ) / tokens  # fmt: skip
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def actor_update(model_dir: str, batch: RolloutBatch, setting: tuple) -> tuple[dict[str, Tensor], dict[str, float]]:  # fmt: skip
    """vlrl's actor on the same rows (2 mini-batches of 2 prompts x 4 samples): its weights after
    `update_policy`, by transformers' parameter names, and its metrics."""
    _, processor = load_processor(model_dir)
    dual, bound, weighted = setting
    config = make_config(
        model_dir, worker__rollout__n=4, data__rollout_batch_size=4, worker__actor__global_batch_size=2,
        worker__actor__micro_batch_size_per_device_for_update=3, worker__actor__max_grad_norm=1.0,
        worker__actor__optim__lr=LR, worker__actor__clip_ratio_low=CLIP_LOW,
        worker__actor__clip_ratio_high=CLIP_HIGH, worker__actor__clip_ratio_dual=dual or 1e30,
        algorithm__disable_kl=False, algorithm__use_kl_loss=True, algorithm__kl_penalty="low_var_kl",
        algorithm__kl_coef=KL_COEF, algorithm__low_var_kl_clamp=bound,
        algorithm__kl_loss_ratio_weighted=weighted,
    )  # fmt: skip
    actor = build_actor(config, processor, "cpu", model_path=model_dir)
    metrics = actor.update_policy(batch)
    weights = {}
    for name, value in actor.model.module.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        weights[name] = full.detach().clone()
    return weights, metrics


def check_bare_loop(model_dir: str, results: dict[str, Any]) -> None:
    """The actor's two optimizer steps move the weights as the bare loop's do: with EasyR1's dual
    clip and k3 bound, with the clip alone, with neither, and with neither and the KL weighted by
    the ratio (TRL's loss). Results: the relative size of the gap
    between the two updates, per setting, and how far the settings' own updates part."""
    batch = make_batch(model_dir, SPECS, group_size=4, seed=3)  # 16 rows
    _, processor = load_processor(model_dir)
    banned = sampling_for(model_dir).banned_token_ids
    start = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        old = [row_log_probs(start, processor, batch, i, banned) for i in range(len(batch))]
    inputs = {
        "minis": [list(range(0, 8)), list(range(8, 16))],
        # the second mini-batch as if an older policy sampled it: ratios near e^1.2 = 3.3, past the dual clip
        "old": [o - (1.2 if i >= 8 else 0.0) for i, o in enumerate(old)],
        "ref": [o + 2.0 * torch.randn(o.shape, generator=gen) for o in old],  # a reference further off
        "adv": 2 * torch.randn(len(batch), generator=gen),
    }
    batch.old_log_probs, batch.ref_log_probs = (_padded(inputs[k], batch) for k in ("old", "ref"))
    batch.advantages = inputs["adv"][:, None] * batch.response_mask
    initial = dict(start.named_parameters())
    updates = {}
    settings = {  # (dual clip, k3 bound, KL weighted by the ratio)
        "easyr1": (3.0, 10.0, False),
        "dual_only": (3.0, None, False),
        "unweighted": (None, None, False),
        "trl": (None, None, True),
    }
    for name, setting in settings.items():
        bare = bare_update(model_dir, batch, inputs, setting)
        ours, metrics = actor_update(model_dir, batch, setting)
        moved = torch.cat([(bare[k] - initial[k].detach()).flatten() for k in bare])
        ours_moved = torch.cat([(ours[k] - initial[k].detach()).flatten() for k in bare])
        results[f"bare/{name}/gap"] = float((ours_moved - moved).norm() / moved.norm())
        results[f"bare/{name}/clamped"] = metrics["actor/kl_clamped_share"]
        updates[name] = moved
    for name in (
        "easyr1",
        "dual_only",
        "unweighted",
    ):  # each setting matters here (else the check could not tell)
        results[f"bare/{name}/vs_trl"] = float(
            (updates[name] - updates["trl"]).norm() / updates["trl"].norm()
        )


def _padded(rows: list[Tensor], batch: RolloutBatch) -> Tensor:
    out = torch.zeros(batch.responses.shape)
    for i, values in enumerate(rows):
        out[i, : values.numel()] = values
    return out
