"""Configs, prompt batches and rollout batches for the checks, built with vlrl's own data path,
plus the few calls into the actor's internals (kept here, in one place, so a change of those
signatures is fixed once).

PPOConfig is built from its dataclasses directly (no YAML loader)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from vlrl.batch.rows import PromptBatch, RolloutBatch
from vlrl.batch.samples import StepSamples
from vlrl.config import PPOConfig

WORDS = "what colour is the shape how many circles are there answer one word".split()


def make_config(model_dir: str, device: torch.device, **values: Any) -> PPOConfig:
    """A one-rank PPOConfig for `model_dir`; `values` maps dotted keys to values ('a.b.c': v)."""
    config = PPOConfig()
    settings: dict[str, Any] = {
        "worker.actor.model.model_path": model_dir,
        "worker.actor.model.enable_gradient_checkpointing": False,
        "worker.actor.optim.lr": 1e-4,
        "worker.actor.optim.weight_decay": 0.0,
        "worker.actor.global_batch_size": 4,
        "worker.actor.micro_batch_size_per_device_for_update": 4,
        "worker.actor.micro_batch_size_per_device_for_experience": 8,
        "worker.actor.max_grad_norm": 1.0,
        "worker.ref.micro_batch_size_per_device_for_experience": 8,
        "worker.rollout.n": 1,
        "data.rollout_batch_size": 4,
        "data.max_prompt_length": 512,
        "data.max_response_length": 16,
        "data.min_pixels": 28 * 28 * 4,
        "data.max_pixels": 28 * 28 * 16,
        "trainer.nnodes": 1,
        "trainer.n_gpus_per_node": 1,
        "trainer.device": device.type,
        "trainer.logger": ["console"],
    }
    settings.update(values)
    for key, value in settings.items():
        *path, last = key.split(".")
        node: Any = config
        for name in path:
            node = getattr(node, name)
        if not hasattr(node, last):
            raise KeyError(f"no config key {key!r}")
        setattr(node, last, value)
    config.derive()  # not validate(): it wants data files and a reward function these checks do not use
    return config


def _image(rng: np.random.RandomState, height: int, width: int):
    from PIL import Image

    return Image.fromarray((rng.rand(height, width, 3) * 255).astype("uint8"))


def prompt_batch(
    model_dir: str, data_config: Any, count: int, image_size: int | None, seed: int = 0
) -> PromptBatch:
    """`count` prompts through the real data path (chat template, resize, token expansion, mrope).

    Every other prompt has one image of `image_size` x `image_size` pixels (None: no images)."""
    from transformers import AutoConfig

    from vlrl.data.collate import collate_prompts
    from vlrl.data.prepare import RowPreparer
    from vlrl.models.processor import load_processor

    tokenizer, processor = load_processor(model_dir)
    rng, np_rng = random.Random(seed), np.random.RandomState(seed)
    preparer = RowPreparer(data_config, tokenizer, processor, AutoConfig.from_pretrained(model_dir))
    samples = []
    for i in range(count):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 10)))
        with_image = image_size is not None and processor is not None and i % 2 == 0
        side = image_size or 0
        row = {
            data_config.prompt_key: ("<image> " if with_image else "") + text,
            data_config.answer_key: "red",
            data_config.image_key: [_image(np_rng, side, side)] if with_image else [],
        }
        samples.append(preparer.sample(row, "", 1000 + i, use_processor=False))
    return collate_prompts(samples, tokenizer.pad_token_id)


def random_rollout(
    model_dir: str, prompts: PromptBatch, n: int, lengths: list[int], vocab_limit: int, seed: int = 0
) -> RolloutBatch:
    """Prompts x n with random responses of `lengths` (cycled) ending in EOS (token ids < vocab_limit)."""
    from vlrl.models.processor import load_processor
    from vlrl.rollout.output import assemble_rollout_batch

    tokenizer, _ = load_processor(model_dir)
    gen = torch.Generator().manual_seed(seed)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    limit = min(vocab_limit, pad)  # ordinary tokens only (specials follow the trained vocabulary)
    responses = []
    for i in range(len(prompts) * n):
        length = lengths[i % len(lengths)]
        body = torch.randint(0, limit, (max(length - 1, 0),), generator=gen).tolist()
        responses.append(body + [eos])
    return assemble_rollout_batch(prompts, responses, n, pad, [eos])


def training_fields(batch: RolloutBatch, seed: int = 0) -> RolloutBatch:
    """Advantages (+-1 per sample) on the response tokens: enough to drive an update."""
    gen = torch.Generator().manual_seed(seed)
    n, r = batch.responses.shape
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    batch.advantages = sign[:, None] * batch.response_mask.float()
    return batch


def scores_on_last_token(batch: RolloutBatch | StepSamples, seed: int = 0) -> torch.Tensor:
    """[N, R] a random 0/1 score on each sample's last response token (a stand-in reward)."""
    gen = torch.Generator().manual_seed(seed)
    n, r = batch.response_mask.shape
    scores = torch.zeros(n, r)
    last = (batch.response_mask.sum(-1) - 1).clamp(min=0)
    scores[torch.arange(n), last] = (torch.rand(n, generator=gen) < 0.5).float()
    return scores


# ------------------------------------------------------------------------------------------
# The actor's internals used by the checks: `compute_log_probs(batch)` (at the temperature the
# Actor / Reference was built with) and `forward_micro_batch(mb, temperature, image_anchor)`; only
# these two functions need to follow them.


def actor_log_probs(model: Any, batch: RolloutBatch) -> torch.Tensor:
    """[N, R] fp32 CPU log-probs of `batch.responses` under an Actor / Reference (no grad)."""
    return model.compute_log_probs(batch)


def actor_log_prob_grads(
    model: Any, batch: RolloutBatch, weights: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Log-probs [N, R] of one forward of a `ShardedModel` (an actor's `.model`) with autograd, and the full gradients of
    sum(weights * log_probs) by parameter name (CPU fp32). `weights` [N, R]."""
    from vlrl.workers.actor import gathered_grads

    model.module.train()
    model.module.zero_grad(set_to_none=True)
    out = model.forward_micro_batch(batch, 1.0, model.any_rank_has_media(batch))
    loss = (out.log_probs * weights.to(out.log_probs.device)).sum() + out.anchor
    loss.backward()
    grads = {k: v.float() for k, v in gathered_grads(model.module).items()}
    model.module.zero_grad(set_to_none=True)
    return out.log_probs.detach().float().cpu(), grads
