"""The actor and the reference policy of a `PPOConfig`.

The one place that hands them their config sections and the numbers derived from the whole config
(`PPOConfig.optimizer_steps_per_step`, `samples_per_minibatch_per_rank`, the rollout temperature):
`Actor`, `Reference` and `ShardedModel` never see the whole `PPOConfig`. Used by `RankWorker.setup`,
the tests and the GPU check.
"""

from __future__ import annotations

from typing import Any

import torch

from vlrl.config import PPOConfig
from vlrl.workers.actor import Actor
from vlrl.workers.reference import AdapterOffReference, Reference
from vlrl.workers.sharded_model import ShardSpec


def default_total_steps(config: PPOConfig) -> int | None:
    """Optimizer steps of the whole run when `trainer.max_steps` is set, else None (unknown)."""
    if not config.trainer.max_steps:
        return None
    return config.trainer.max_steps * config.optimizer_steps_per_step


def build_actor(
    config: PPOConfig,
    processor: Any,
    device: torch.device | str,
    *,
    model_path: str | None = None,
    total_steps: int | None = None,
) -> Actor:
    """The actor of `worker.actor`; `model_path` defaults to `worker.actor.model.model_path` and
    `total_steps` (optimizer steps of the run) to `default_total_steps(config)`."""
    actor = config.worker.actor
    return Actor(
        actor,
        model_path or actor.model.model_path,
        processor,
        device,
        algorithm=config.algorithm,
        optimizer_steps_per_step=config.optimizer_steps_per_step,
        samples_per_minibatch=config.samples_per_minibatch_per_rank,
        temperature=config.worker.rollout.temperature,
        total_steps=total_steps if total_steps is not None else default_total_steps(config),
    )


def build_reference(
    config: PPOConfig,
    processor: Any,
    device: torch.device | str,
    *,
    actor: Actor | None = None,
    model_path: str | None = None,
) -> Reference | AdapterOffReference:
    """The reference policy of `worker.ref`. With `actor`: a LoRA actor's own model with its adapters
    off, else a frozen copy that shares the actor's spec and per-step image cache (each image is
    processed once). Without: a frozen copy built from `worker.actor`'s spec and `model_path`."""
    temperature = config.worker.rollout.temperature  # log-probs of the distribution the engine samples
    if actor is not None and actor.lora:
        # the actor's base weights with the adapters off: no second copy of the model
        return AdapterOffReference(actor.model, config.worker.ref, temperature)
    if actor is not None:
        return Reference(
            config.worker.ref,
            actor.model.spec,
            processor,
            device,
            temperature,
            vision_cache=actor.model.vision,
        )
    spec = ShardSpec.of_actor(config.worker.actor, model_path or config.worker.actor.model.model_path)
    return Reference(config.worker.ref, spec, processor, device, temperature)
