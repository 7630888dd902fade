"""A model sharded with FSDP2 that scores responses (`ShardedModel`), and the frozen `Reference`.

`ShardedModel` is the part the actor and the reference policy share: loading, sharding, vision
inputs, micro-batch planning and `compute_log_probs`. Every rank must run the same number of
forward passes (each one all-gathers the layers' shards), so the number of micro-batches is agreed
with an all-reduce(max) and a rank with fewer samples runs empty micro-batches (an anchor sequence
only; see vlrl.workers.vision for the matching trick that keeps the vision tower in step).

With `worker.actor.ulysses_size = sp > 1` (vlrl.models.ulysses) the ranks form groups of sp that
receive the same rows; each rank of a group runs 1/sp of every packed micro-batch's tokens. The
model stays sharded over all ranks; the data is split over `dp_size = world / sp` groups.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from vlrl.config import FSDPConfig, ModelConfig, PPOConfig
from vlrl.models.loading import is_vision_model, load_model
from vlrl.models.lora import apply_lora
from vlrl.models.packing import LogProbOutput, build_packed_inputs, build_padded_inputs, forward_log_probs
from vlrl.models.sampling import SamplingDistribution, banned_token_ids
from vlrl.models.ulysses import build_sequence_parallel, head_errors
from vlrl.protocol import RolloutBatch
from vlrl.workers.balance import count_micro_batches, micro_batches_by_tokens
from vlrl.workers.fsdp import (
    apply_fsdp,
    broadcast_weights_from_rank0,
    master_dtype,
    move_params,
    reshard,
    world_info,
)
from vlrl.workers.vision import VisionCache, dummy_image_anchor, text_anchor

logger = logging.getLogger(__name__)


class ShardedModel:
    """Load `model_path`, shard it over all ranks and compute response log-probs in micro-batches."""

    attention_backend = "auto"  # packed attention kernel (vlrl.models.attention.BACKENDS)

    def __init__(
        self,
        config: PPOConfig,
        model_path: str,
        processor: Any,
        device: torch.device | str,
        *,
        model_cfg: ModelConfig,
        fsdp_cfg: FSDPConfig,
        padding_free: bool,
        micro_batch_size: int,
        trainable: bool,
        vision_cache: VisionCache | None = None,
    ) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "initialize torch.distributed (gloo on CPU, nccl on GPU) before building the model"
            )
        self.config = config
        self.model_path = model_path
        self.rank, self.world_size = world_info()
        self.device = torch.device(device)
        self.padding_free = padding_free
        self.micro_batch_size = micro_batch_size
        self.dynamic_batching = config.worker.actor.dynamic_batching
        self.use_torch_compile = config.worker.actor.use_torch_compile
        self.max_token_len = config.worker.actor.max_token_len_per_device  # None: EasyR1's rule, per batch
        self.sp_size = config.worker.actor.ulysses_size
        self.dp_size = self.world_size // self.sp_size  # groups that see different rows
        self.module = self._build(model_path, model_cfg, fsdp_cfg, trainable)
        self.hf_config: Any = self.module.config  # a transformers PretrainedConfig
        self.sp = self._sequence_parallel()
        self.is_vlm = is_vision_model(self.hf_config)
        self.mrope = self.is_vlm
        self.processor = processor
        self.vision = None
        if self.is_vlm:
            if vision_cache is None and processor is None:
                raise ValueError("a vision-language model needs its processor (for the image processor)")
            # (not `or`: an empty cache is falsy, it has __len__)
            self.vision = (
                vision_cache
                if vision_cache is not None
                else VisionCache(
                    processor.image_processor, video_processor=getattr(processor, "video_processor", None)
                )
            )
        self.owns_vision_cache = vision_cache is None
        # dummy vision inputs by (image, video) need: keep the vision tower's FSDP calls in step
        self.vision_anchors = (
            {
                (i, v): dummy_image_anchor(self.hf_config, self.mrope, self.device, image=i, video=v)
                for i, v in ((True, False), (False, True), (True, True))
            }
            if self.is_vlm
            else {}
        )
        pad_id = getattr(self.hf_config, "pad_token_id", None)
        if pad_id is None:
            pad_id = getattr(getattr(self.hf_config, "text_config", None), "pad_token_id", None) or 0
        self.pad_token_id = int(pad_id)
        self.text_anchor = text_anchor(pad_id, self.mrope, self.device)
        # the engines' ban list (same function, same tokenizer and config): log-probs and entropy
        # are taken on the distribution that was sampled from (vlrl.models.sampling)
        self.banned_token_ids = tuple(banned_token_ids(self.tokenizer_or_processor(), self.hf_config))

    def sampling(self, temperature: float) -> SamplingDistribution:
        """The engines' sampling distribution at `temperature` (the rollout's)."""
        return SamplingDistribution(temperature, self.banned_token_ids)

    def tokenizer_or_processor(self) -> Any:
        """The processor given at construction, else the tokenizer of the model folder."""
        if self.processor is not None:
            return self.processor
        from vlrl.models.processor import load_processor

        tokenizer_path = self.config.worker.actor.model.tokenizer_path or self.model_path
        return load_processor(tokenizer_path)[0]

    # ------------------------------------------------------------------------------ building
    def _sequence_parallel(self):
        """This rank's Ulysses group (None for ulysses_size 1); refuses what cannot be split."""
        if self.sp_size == 1:
            return None
        errors = head_errors(self.hf_config, self.sp_size)
        if self.world_size % self.sp_size:
            errors.append(
                f"worker.actor.ulysses_size={self.sp_size} must divide the world size {self.world_size}"
            )
        if not self.padding_free:
            errors.append(
                "worker.actor.ulysses_size > 1 splits packed rows: set padding_free=true (actor and ref)"
            )
        if errors:
            raise ValueError("sequence parallelism cannot run: " + "; ".join(errors))
        return build_sequence_parallel(self.sp_size)

    def _build(
        self, path: str, model_cfg: ModelConfig, fsdp_cfg: FSDPConfig, trainable: bool
    ) -> torch.nn.Module:
        """Rank 0 reads the weights; other ranks build on meta and receive them after sharding
        (`fsdp.enable_rank0_init`; without it every rank reads the weights itself)."""
        rank0_init = fsdp_cfg.enable_rank0_init and self.world_size > 1
        on_meta = rank0_init and self.rank != 0
        model = load_model(
            path,
            dtype=master_dtype(fsdp_cfg),
            overrides=dict(model_cfg.override_config),
            padding_free=self.padding_free,
            gradient_checkpointing=trainable and model_cfg.enable_gradient_checkpointing,
            freeze_vision=trainable and model_cfg.freeze_vision_tower,
            trust_remote_code=model_cfg.trust_remote_code,
            on_meta=on_meta,
        )
        if not trainable:
            model.requires_grad_(False)
        elif model_cfg.lora.rank > 0:
            # adapters on the text decoder's linears; every base weight is frozen (vlrl.models.lora)
            model = apply_lora(model, model_cfg.lora)
        full = model.state_dict() if rank0_init and self.rank == 0 else None
        apply_fsdp(model, self.device, fsdp_cfg)
        if rank0_init:
            if on_meta:
                model.to_empty(device=self.device)
            broadcast_weights_from_rank0(model, full)
        return model

    # ------------------------------------------------------------------------ collectives
    def _all_reduce(
        self, values: list[float], op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
    ) -> list[float]:
        """Element-wise all-reduce of a few numbers (float64 on this rank's device)."""
        if self.world_size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op)
        return t.tolist()

    def any_rank_has_media(self, batch: RolloutBatch) -> tuple[bool, bool]:
        """(images, videos): whether some rank holds an image / a video. Then every micro-batch must
        run the vision tower for that modality (each is a separate call with its own FSDP collectives)."""
        if not self.is_vlm:
            return False, False
        images = float(any(len(imgs) > 0 for imgs in batch.images))
        videos = float(any(len(v) > 0 for v in (batch.videos or [])))
        flags = self._all_reduce([images, videos], dist.ReduceOp.MAX)
        return flags[0] > 0, flags[1] > 0

    def plan_micro_batches(self, batch: RolloutBatch, micro_batch_size: int) -> list[list[int]]:
        """Row indices of each micro-batch; the same count on every rank (extra ones are empty)."""
        n = len(batch)
        if self.dynamic_batching:
            # Padded rows cost their full width; packed rows only their real tokens.
            lengths = (
                batch.attention_mask.sum(-1).tolist() if self.padding_free else [batch.input_ids.shape[1]] * n
            )
            # the budget is per device: a group of sp ranks holds sp times as many tokens
            count = count_micro_batches(lengths, self.token_budget(batch, micro_batch_size) * self.sp_size)
            count = int(self._all_reduce([count], dist.ReduceOp.MAX)[0])
            return micro_batches_by_tokens(lengths, count)
        parts = [list(range(i, min(i + micro_batch_size, n))) for i in range(0, n, micro_batch_size)]
        count = int(self._all_reduce([len(parts)], dist.ReduceOp.MAX)[0])
        return parts + [[] for _ in range(count - len(parts))]

    def token_budget(self, batch: RolloutBatch, micro_batch_size: int) -> int:
        """Tokens per dynamic micro-batch: `max_token_len_per_device`, or (when unset) the
        micro-batch size times the batch's padded sequence width, agreed over ranks (the widest)."""
        if self.max_token_len is not None:
            return self.max_token_len
        width = int(self._all_reduce([float(batch.input_ids.shape[1])], dist.ReduceOp.MAX)[0])
        return micro_batch_size * max(width, 1)

    # ---------------------------------------------------------------------------- forward
    def forward_micro_batch(
        self,
        mb: RolloutBatch,
        temperature: float,
        image_anchor: bool | tuple[bool, bool],
        with_entropy: bool = False,
        entropy_grad: bool = False,
    ) -> LogProbOutput:
        """Log-probs [n, R] of one micro-batch (n may be 0: then only the anchor runs).

        `image_anchor`: (images, videos) some rank has (`any_rank_has_media`; a bool means images
        only); a modality this micro-batch lacks gets a dummy input in the anchor sequence."""
        media = image_anchor if isinstance(image_anchor, tuple) else (bool(image_anchor), False)
        dev = self.device
        pv = grid = index = None
        videos = None
        if self.vision is not None:
            # the vision tower encodes each distinct image / video once (vlrl.models.shared_images)
            pv, grid, index = self.vision.collate_shared(mb.images)
            pv, grid = (pv.to(dev), grid.to(dev)) if pv is not None and grid is not None else (None, None)
            vpv, vgrid, vindex = self.vision.collate_shared_videos(mb.videos or [])
            if vpv is not None and vgrid is not None:
                videos = (vpv.to(dev), vgrid.to(dev), vindex)
        anchor = None
        need = (media[0] and pv is None, media[1] and videos is None)
        if any(need):
            anchor = self.vision_anchors[need]
        elif len(mb) == 0:
            anchor = self.text_anchor
        args = (mb.input_ids.to(dev), mb.attention_mask.to(dev), mb.position_ids.to(dev), mb.prompt_length)
        kwargs: dict[str, Any] = {
            "pixel_values": pv,
            "image_grid_thw": grid,
            "image_index": index,
            "anchor": anchor,
            "videos": videos,
        }
        if self.padding_free:
            inputs = build_packed_inputs(
                *args,
                **kwargs,
                attention_backend=self.attention_backend,
                sp=self.sp,
                pad_token_id=self.pad_token_id,
                image_token_id=getattr(self.hf_config, "image_token_id", None),
            )
        else:
            inputs = build_padded_inputs(*args, **kwargs)
        return forward_log_probs(
            self.module,
            inputs,
            self.sampling(temperature),
            with_entropy,
            entropy_grad,
            self.use_torch_compile,
        )

    @torch.no_grad()
    def compute_log_probs(
        self, batch: RolloutBatch, temperature: float, micro_batch_size: int | None = None
    ) -> Tensor:
        """Log-probs [N, R] (fp32, CPU) of `batch.responses` under this model; 0 on padding.

        Taken on the sampling distribution at `temperature` (banned tokens removed), in micro-batches
        of `micro_batch_size` samples (default: this model's experience micro-batch size)."""
        self.module.eval()
        media_anchor = self.any_rank_has_media(batch)
        out = torch.zeros(batch.responses.shape, dtype=torch.float32)
        for rows in self.plan_micro_batches(batch, micro_batch_size or self.micro_batch_size):
            result = self.forward_micro_batch(batch.select(rows), temperature, media_anchor)
            if rows:
                out[rows] = result.log_probs.cpu()
        return out


class Reference(ShardedModel):
    """The frozen reference policy: same loading and sharding as the actor, no optimizer.

    Sharded by `worker.ref.fsdp` (its own settings). With `worker.ref.offload.offload_params` (GPU only) its shards live on CPU and move to the GPU only for
    `compute_log_probs`. On GPU its weights are stored in bf16 (the actor's compute dtype) unless
    `worker.ref.fsdp.torch_dtype` is set; on CPU in `torch_dtype` (default fp32, the actor's default),
    so an untouched actor and its reference agree exactly.
    """

    def __init__(
        self,
        config: PPOConfig,
        model_path: str,
        processor: Any,
        device: torch.device | str,
        *,
        vision_cache: VisionCache | None = None,
    ) -> None:
        ref, actor = config.worker.ref, config.worker.actor
        fsdp_cfg = ref.fsdp
        if torch.device(device).type == "cuda" and fsdp_cfg.torch_dtype is None:
            # no optimizer to feed: keep bf16 weights (half the memory)
            fsdp_cfg = replace(ref.fsdp, torch_dtype="bfloat16")
        super().__init__(
            config,
            model_path,
            processor,
            device,
            model_cfg=actor.model,
            fsdp_cfg=fsdp_cfg,
            padding_free=bool(ref.padding_free),
            micro_batch_size=ref.micro_batch_size_per_device_for_experience or 1,
            trainable=False,
            vision_cache=vision_cache,
        )
        # with FSDP's CPU offload the shards already stay on CPU and FSDP moves them in itself
        self.offload = (
            ref.offload.offload_params and self.device.type == "cuda" and not fsdp_cfg.enable_cpu_offload
        )
        if self.offload:
            move_params(self.module, "cpu")

    def compute_log_probs(
        self, batch: RolloutBatch, temperature: float, micro_batch_size: int | None = None
    ) -> Tensor:
        """Reference log-probs [N, R]; loads the weights onto the device for the call when offloaded.

        Pass the actor's `vision_cache` at construction to reuse its pixel values (else a private
        cache is filled and cleared per call).
        """
        if self.offload:
            move_params(self.module, self.device)
        try:
            return super().compute_log_probs(batch, temperature, micro_batch_size)
        finally:
            reshard(self.module)  # no backward follows: free what the forward gathered
            if self.offload:
                move_params(self.module, "cpu")
            if self.vision is not None and self.owns_vision_cache:
                self.vision.clear()  # nobody else reads a private cache: free its pixels now


class AdapterOffReference:
    """The reference policy of a LoRA actor: the actor's own model with its adapters switched off.

    LoRA never changes the base weights, so the base model is exactly the initial policy: no second
    copy of the weights is loaded. `worker.ref.micro_batch_size_per_device_for_experience` applies;
    the rest of `worker.ref` (padding-free mode, fsdp, offload) has no weights of its own to act on.
    """

    def __init__(self, actor: ShardedModel, micro_batch_size: int | None) -> None:
        self.actor = actor
        self.micro_batch_size = micro_batch_size
        ref = actor.config.worker.ref
        unused = {
            "worker.ref.offload.offload_params": ref.offload.offload_params,
            "worker.ref.padding_free": ref.padding_free not in (None, actor.padding_free),
            "worker.ref.fsdp": ref.fsdp != actor.config.worker.actor.fsdp,
        }
        if any(unused.values()):
            logger.info(
                "LoRA: the reference policy is the actor with its adapters off, so %s do not apply "
                "(the actor's settings do)",
                ", ".join(k for k, v in unused.items() if v),
            )

    def compute_log_probs(self, batch: RolloutBatch, temperature: float) -> Tensor:
        """Reference log-probs [N, R]: the actor's forward with every adapter disabled."""
        module: Any = self.actor.module  # an FSDP-sharded peft.PeftModel
        with module.disable_adapter():
            try:
                return self.actor.compute_log_probs(batch, temperature, self.micro_batch_size)
            finally:
                reshard(module)  # no backward follows: free what the forward gathered
