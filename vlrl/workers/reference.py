"""The reference policy: a frozen `ShardedModel` (`Reference`), or a LoRA actor's own model with its
adapters off (`AdapterOffReference`). Both give `compute_log_probs(batch)`, at the rollout's
sampling temperature (given at construction, as to the actor)."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from vlrl.batch.rows import RolloutBatch
from vlrl.config import RefConfig
from vlrl.workers.fsdp import move_params
from vlrl.workers.sharded_model import ShardedModel, ShardSpec
from vlrl.workers.vision import VisionCache

logger = logging.getLogger(__name__)


class Reference:
    """The frozen reference policy: loaded and sharded like the actor, no optimizer.

    Built from `worker.ref` and the actor's `ShardSpec`: the model, its Ulysses and batching settings
    are the actor's; sharding (`worker.ref.fsdp`), padding-free mode and micro-batch size its own.
    With `worker.ref.offload.offload_params` (GPU only) its shards live on CPU and move to the GPU only
    for `compute_log_probs`. On GPU its weights are stored in bf16 (the actor's compute dtype) unless
    `worker.ref.fsdp.torch_dtype` is set; on CPU in `torch_dtype` (default fp32, the actor's default),
    so an untouched actor and its reference agree exactly.
    """

    def __init__(
        self,
        ref: RefConfig,
        actor_spec: ShardSpec,
        processor: Any,
        device: torch.device | str,
        temperature: float,
        *,
        vision_cache: VisionCache | None = None,
    ) -> None:
        """`vision_cache`: the actor's, to reuse its pixel values (else a private cache, cleared per call)."""
        fsdp_cfg = ref.fsdp
        if torch.device(device).type == "cuda" and fsdp_cfg.torch_dtype is None:
            # no optimizer to feed: keep bf16 weights (half the memory)
            fsdp_cfg = replace(ref.fsdp, torch_dtype="bfloat16")
        spec = replace(
            actor_spec,
            fsdp=fsdp_cfg,
            padding_free=bool(ref.padding_free),
            micro_batch_size=ref.micro_batch_size_per_device_for_experience or 1,
        )
        self.model = ShardedModel(spec, processor, device, trainable=False, vision_cache=vision_cache)
        self.temperature = temperature
        # with FSDP's CPU offload the shards already stay on CPU and FSDP moves them in itself
        self.offload = (
            ref.offload.offload_params
            and self.model.device.type == "cuda"
            and not fsdp_cfg.enable_cpu_offload
        )
        if self.offload:
            move_params(self.model.module, "cpu")

    def compute_log_probs(self, batch: RolloutBatch) -> Tensor:
        """Reference log-probs [N, R]; loads the weights onto the device for the call when offloaded."""
        model = self.model
        if self.offload:
            move_params(model.module, model.device)
        try:
            return model.compute_log_probs(batch, self.temperature)  # reshards every unit at its end
        finally:
            if self.offload:
                move_params(model.module, "cpu")
            if model.vision is not None and model.owns_vision_cache:
                model.vision.clear()  # nobody else reads a private cache: free its pixels now


class AdapterOffReference:
    """The reference policy of a LoRA actor: the actor's own model with its adapters switched off.

    LoRA never changes the base weights, so the base model is exactly the initial policy: no second
    copy of the weights is loaded. `worker.ref.micro_batch_size_per_device_for_experience` applies;
    the rest of `worker.ref` (padding-free mode, fsdp, offload) has no weights of its own to act on.
    """

    def __init__(self, actor_model: ShardedModel, ref: RefConfig, temperature: float) -> None:
        self.model, self.temperature = actor_model, temperature
        self.micro_batch_size = ref.micro_batch_size_per_device_for_experience
        spec = actor_model.spec
        unused = {
            "worker.ref.offload.offload_params": ref.offload.offload_params,
            "worker.ref.padding_free": ref.padding_free not in (None, spec.padding_free),
            "worker.ref.fsdp": ref.fsdp != spec.fsdp,
        }
        if any(unused.values()):
            logger.info(
                "LoRA: the reference policy is the actor with its adapters off, so %s do not apply "
                "(the actor's settings do)",
                ", ".join(k for k, v in unused.items() if v),
            )

    def compute_log_probs(self, batch: RolloutBatch) -> Tensor:
        """Reference log-probs [N, R]: the actor's forward with every adapter disabled."""
        module: Any = self.model.module  # an FSDP-sharded peft.PeftModel
        with module.disable_adapter():
            return self.model.compute_log_probs(batch, self.temperature, self.micro_batch_size)
