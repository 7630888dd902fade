"""A model sharded with FSDP2 that scores responses: what the actor and the reference policy each hold.

`ShardedModel` loads and shards the weights, prepares vision inputs, plans micro-batches and
computes response log-probs. It is built from a `ShardSpec` (the model, FSDP and batching settings
of one role), never from the whole `PPOConfig`.

Every rank must run the same number of forward passes (each one all-gathers the layers' shards), so
the number of micro-batches is agreed with an all-reduce(max) and a rank with fewer samples runs
empty micro-batches (an anchor sequence only; see vlrl.workers.vision for the matching trick that
keeps the vision tower in step).

With `ulysses_size = sp > 1` (vlrl.models.ulysses) the ranks form groups of sp that receive the same
rows; each rank of a group runs 1/sp of every packed micro-batch's tokens. The model stays sharded
over all ranks; the data is split over `dp_size = world / sp` groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from vlrl.batch.rows import RolloutBatch
from vlrl.config import ActorConfig, FSDPConfig, ModelConfig
from vlrl.models.families import family_of
from vlrl.models.loading import load_model
from vlrl.models.lora import apply_lora
from vlrl.models.packing import LogProbOutput, build_packed_inputs, build_padded_inputs, forward_log_probs
from vlrl.models.sampling import SamplingDistribution, banned_token_ids
from vlrl.models.ulysses import build_sequence_parallel, head_errors
from vlrl.workers.balance import count_micro_batches, micro_batches_by_tokens
from vlrl.workers.fsdp import (
    apply_fsdp,
    broadcast_weights_from_rank0,
    frozen_dtype,
    master_dtype,
    reshard,
    world_info,
)
from vlrl.workers.vision import VisionCache, dummy_image_anchor, text_anchor


@dataclass(frozen=True)
class ShardSpec:
    """What a `ShardedModel` is built from: one role's model, sharding and batching settings."""

    model_path: str
    model: ModelConfig  # loading: config overrides, checkpointing, LoRA, tokenizer path, remote code
    fsdp: FSDPConfig
    padding_free: bool  # pack sequences (else padded rows)
    micro_batch_size: int  # samples per forward of `compute_log_probs`
    ulysses_size: int = 1  # sequence-parallel group size (vlrl.models.ulysses)
    dynamic_batching: bool = False  # micro-batches by a token budget instead of a sample count
    max_token_len_per_device: int | None = None  # that budget; None: micro-batch size x widest row
    use_torch_compile: bool = False  # compile the per-token log-prob/entropy function

    @classmethod
    def of_actor(cls, actor: ActorConfig, model_path: str) -> ShardSpec:
        """The actor's spec (`worker.actor`); the reference keeps its model, Ulysses and batching parts."""
        return cls(
            model_path=model_path,
            model=actor.model,
            fsdp=actor.fsdp,
            padding_free=actor.padding_free,
            micro_batch_size=actor.micro_batch_size_per_device_for_experience,
            ulysses_size=actor.ulysses_size,
            dynamic_batching=actor.dynamic_batching,
            max_token_len_per_device=actor.max_token_len_per_device,
            use_torch_compile=actor.use_torch_compile,
        )


class ShardedModel:
    """Load `spec.model_path`, shard it over all ranks and compute response log-probs in micro-batches."""

    attention_backend = "auto"  # packed attention kernel (vlrl.models.attention.BACKENDS)

    def __init__(
        self,
        spec: ShardSpec,
        processor: Any,
        device: torch.device | str,
        *,
        trainable: bool,
        vision_cache: VisionCache | None = None,
    ) -> None:
        """`trainable`: gradients on (LoRA adapters when `spec.model.lora.rank > 0`), else frozen.
        `vision_cache`: another model's per-step cache of image tensors, to share (None: a private one)."""
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "initialize torch.distributed (gloo on CPU, nccl on GPU) before building the model"
            )
        self.spec = spec
        self.rank, self.world_size = world_info()
        self.device = torch.device(device)
        self.dp_size = self.world_size // spec.ulysses_size  # groups that see different rows
        self.module = self._build(trainable)
        self.hf_config: Any = self.module.config  # a transformers PretrainedConfig
        self.sp = self._sequence_parallel()
        self.family = family_of(self.hf_config)
        self.is_vlm = self.family.vision
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
                    processor.image_processor,
                    video_processor=getattr(processor, "video_processor", None),
                    family=self.family,
                )
            )
        self.owns_vision_cache = vision_cache is None
        # dummy vision inputs by (image, video) need: keep the vision tower's FSDP calls in step
        self.vision_anchors = (
            {
                (i, v): dummy_image_anchor(self.hf_config, self.family.mrope, self.device, image=i, video=v)
                for i, v in ((True, False), (False, True), (True, True))
                if i or self.family.dummy_image is None  # a family's own dummy holds images only
            }
            if self.is_vlm
            else {}
        )
        pad_id = getattr(self.hf_config, "pad_token_id", None)
        if pad_id is None:
            pad_id = getattr(getattr(self.hf_config, "text_config", None), "pad_token_id", None) or 0
        self.pad_token_id = int(pad_id)
        self.text_anchor = text_anchor(pad_id, self.family.mrope, self.device)
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

        return load_processor(self.spec.model.tokenizer_path or self.spec.model_path)[0]

    # ------------------------------------------------------------------------------ building
    def _sequence_parallel(self):
        """This rank's Ulysses group (None for ulysses_size 1); refuses what cannot be split."""
        sp_size = self.spec.ulysses_size
        if sp_size == 1:
            return None
        errors = head_errors(self.hf_config, sp_size)
        if self.world_size % sp_size:
            errors.append(f"worker.actor.ulysses_size={sp_size} must divide the world size {self.world_size}")
        if not self.spec.padding_free:
            errors.append(
                "worker.actor.ulysses_size > 1 splits packed rows: set padding_free=true (actor and ref)"
            )
        if errors:
            raise ValueError("sequence parallelism cannot run: " + "; ".join(errors))
        return build_sequence_parallel(sp_size)

    def _build(self, trainable: bool) -> torch.nn.Module:
        """Rank 0 reads the weights; other ranks build on meta and receive them after sharding
        (`fsdp.enable_rank0_init`; without it every rank reads the weights itself)."""
        model_cfg, fsdp_cfg = self.spec.model, self.spec.fsdp
        rank0_init = fsdp_cfg.enable_rank0_init and self.world_size > 1
        on_meta = rank0_init and self.rank != 0
        lora = trainable and model_cfg.lora.rank > 0
        model = load_model(
            self.spec.model_path,
            # a LoRA base is frozen: compute dtype on GPU (`frozen_dtype`), adapters fp32 below
            dtype=frozen_dtype(fsdp_cfg, self.device) if lora else master_dtype(fsdp_cfg),
            overrides=dict(model_cfg.override_config),
            padding_free=self.spec.padding_free,
            gradient_checkpointing=trainable and model_cfg.enable_gradient_checkpointing,
            checkpoint_layers=model_cfg.gradient_checkpointing_layers,
            freeze_vision=trainable and model_cfg.freeze_vision_tower,
            trust_remote_code=model_cfg.trust_remote_code,
            on_meta=on_meta,
        )
        if not trainable:
            model.requires_grad_(False)
        elif lora:
            # adapters on the text decoder's linears; every base weight is frozen (vlrl.models.lora)
            model = apply_lora(model, model_cfg.lora)
            for param in model.parameters():
                if param.requires_grad:  # the adapters: trained, so kept in the master dtype
                    param.data = param.data.to(master_dtype(fsdp_cfg))
        full = model.state_dict() if rank0_init and self.rank == 0 else None
        apply_fsdp(model, self.device, fsdp_cfg)
        if rank0_init:
            if on_meta:
                model.to_empty(device=self.device)
            broadcast_weights_from_rank0(model, full)
        return model

    # ------------------------------------------------------------------------ collectives
    def all_reduce(self, values: list[float], op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> list[float]:
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
        flags = self.all_reduce([images, videos], dist.ReduceOp.MAX)
        return flags[0] > 0, flags[1] > 0

    def plan_micro_batches(self, batch: RolloutBatch, micro_batch_size: int) -> list[list[int]]:
        """Row indices of each micro-batch; the same count on every rank (extra ones are empty)."""
        return self.plan_mini_batches(batch, [list(range(len(batch)))], micro_batch_size)[0]

    def plan_mini_batches(
        self, batch: RolloutBatch, minis: list[list[int]], micro_batch_size: int
    ) -> list[list[list[int]]]:
        """`plan_micro_batches` of each mini-batch `batch.select(minis[i])` (indices into the
        mini-batch), every count agreed over ranks in one all-reduce for all of them (a rank may
        hold fewer or shorter rows); plus one for the default token budget's width."""
        if self.spec.dynamic_batching:
            # Padded rows cost their full width; packed rows only their real tokens.
            width = batch.input_ids.shape[1]
            all_lengths = (
                batch.attention_mask.sum(-1).tolist() if self.spec.padding_free else [width] * len(batch)
            )
            lengths = [[all_lengths[i] for i in rows] for rows in minis]
            # the budget is per device: a group of sp ranks holds sp times as many tokens
            budget = self.token_budget(batch, micro_batch_size) * self.spec.ulysses_size
            local = [count_micro_batches(mini, budget) for mini in lengths]
        else:
            local = [-(-len(rows) // micro_batch_size) for rows in minis]
        counts = [int(c) for c in self.all_reduce([float(c) for c in local], dist.ReduceOp.MAX)]
        if self.spec.dynamic_batching:
            return [micro_batches_by_tokens(mini, count) for mini, count in zip(lengths, counts)]
        return [_fixed_split(len(rows), micro_batch_size, count) for rows, count in zip(minis, counts)]

    def token_budget(self, batch: RolloutBatch, micro_batch_size: int) -> int:
        """Tokens per dynamic micro-batch: `max_token_len_per_device`, or (when unset) the
        micro-batch size times the batch's padded sequence width, agreed over ranks (the widest)."""
        if self.spec.max_token_len_per_device is not None:
            return self.spec.max_token_len_per_device
        width = int(self.all_reduce([float(batch.input_ids.shape[1])], dist.ReduceOp.MAX)[0])
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
            if self.family.shared_image_encoding:
                pv, grid, index = self.vision.collate_shared(mb.images)
            else:
                (pv, grid), index = self.vision.collate(mb.images), None
            # non-blocking: a blocking host-to-GPU copy waits for the queued kernels
            pv, grid = (
                (pv.to(dev, non_blocking=True), grid.to(dev, non_blocking=True))
                if pv is not None and grid is not None
                else (None, None)
            )
            vpv, vgrid, vindex = self.vision.collate_shared_videos(mb.videos or [])
            if vpv is not None and vgrid is not None:
                videos = (vpv.to(dev, non_blocking=True), vgrid.to(dev, non_blocking=True), vindex)
        anchor = None
        need = (media[0] and pv is None, media[1] and videos is None)
        if any(need):
            anchor = self.vision_anchors[need]
        elif len(mb) == 0:
            anchor = self.text_anchor
        # host rows: the builders index on the host and copy the finished tensors to `dev` once
        args = (mb.input_ids, mb.attention_mask, mb.position_ids, mb.prompt_length)
        kwargs: dict[str, Any] = {
            "device": dev,
            "pixel_values": pv,
            "image_grid_thw": grid,
            "image_index": index,
            "anchor": anchor,
            "videos": videos,
        }
        if self.spec.padding_free:
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
        self.family.model_inputs(inputs.model_kwargs)
        return forward_log_probs(
            self.module,
            inputs,
            self.sampling(temperature),
            with_entropy,
            entropy_grad,
            self.spec.use_torch_compile,
        )

    @torch.no_grad()
    def compute_log_probs(
        self, batch: RolloutBatch, temperature: float, micro_batch_size: int | None = None
    ) -> Tensor:
        """Log-probs [N, R] (fp32, CPU) of `batch.responses` under this model; 0 on padding.

        Taken on the sampling distribution at `temperature` (banned tokens removed), in micro-batches
        of `micro_batch_size` samples (default: `spec.micro_batch_size`). Every FSDP unit is
        resharded afterwards: no backward follows to free what the forwards gathered (`reshard`).
        The result is gathered on the device and copied to the host once (a copy per micro-batch
        would wait for the device's queue each time)."""
        self.module.eval()
        media_anchor = self.any_rank_has_media(batch)
        out = torch.zeros(batch.responses.shape, dtype=torch.float32, device=self.device)  # [N, R]
        try:
            for rows in self.plan_micro_batches(batch, micro_batch_size or self.spec.micro_batch_size):
                result = self.forward_micro_batch(batch.select(rows), temperature, media_anchor)
                if rows:
                    out[torch.tensor(rows).to(self.device, non_blocking=True)] = result.log_probs
        finally:
            reshard(self.module)
        return out.cpu()


def _fixed_split(n: int, size: int, count: int) -> list[list[int]]:
    """Rows 0..n-1 in consecutive micro-batches of `size`, padded with empty ones to `count`."""
    parts = [list(range(i, min(i + size, n))) for i in range(0, n, size)]
    return parts + [[] for _ in range(count - len(parts))]
