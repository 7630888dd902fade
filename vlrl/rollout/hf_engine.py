"""HF rollout engine: transformers `generate` on a left-padded batch. For machines without vLLM and
for debugging; slow (no paged KV cache, the vision tower runs once per sample).

Same inputs, outputs, banned tokens and weight-sync API as the vLLM engine. It loads the checkpoint
from `model_path`, so it can generate before the first sync. `sleep`/`wake_up` are no-ops.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from vlrl.batch.rows import PromptBatch, RolloutBatch
from vlrl.data.encoded_images import decoded
from vlrl.rollout.base import (
    RolloutEngine,
    SamplingSettings,
    banned_token_ids,
    check_prompts,
    eos_token_ids,
    pad_token_id,
    resolve_limit_images,
    resolve_sampling,
    seeded_rng,
)
from vlrl.rollout.output import assemble_rollout_batch
from vlrl.rollout.weight_sync import runtime_name

HF_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
             "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}  # fmt: skip


class HFRolloutEngine(RolloutEngine):
    """`model.generate` behind the `RolloutEngine` interface (data-parallel like the vLLM engine)."""

    def __init__(
        self,
        config: Any,
        data_config: Any,
        model_path: str,
        tokenizer: Any,
        processor: Any | None = None,
        limit_images: int | None = None,
    ) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

        if config.dtype not in HF_DTYPES:
            raise ValueError(
                f"worker.rollout.dtype={config.dtype!r} is unknown; choose one of {sorted(HF_DTYPES)}"
            )
        self.config, self.data_config, self.processor = config, data_config, processor
        self.dp_rank = _dp_rank(config.tensor_parallel_size)
        self.hf_config = AutoConfig.from_pretrained(model_path)
        self.is_vision = getattr(self.hf_config, "vision_config", None) is not None
        self.limit_images = resolve_limit_images(config, limit_images) if self.is_vision else 0
        self.max_model_len = int(
            config.max_model_len or data_config.max_prompt_length + data_config.max_response_length
        )
        self.eos_token_ids = eos_token_ids(tokenizer, model_path)
        self.pad_token_id = pad_token_id(tokenizer)
        self.banned_token_ids = banned_token_ids(tokenizer, self.hf_config)
        self.bucket_mb = config.sync_bucket_mb
        self.device = torch.device(
            f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        )
        model_cls = AutoModelForImageTextToText if self.is_vision else AutoModelForCausalLM
        self.model = (
            model_cls.from_pretrained(model_path, dtype=HF_DTYPES[config.dtype]).to(self.device).eval()
        )
        ids = ("image_token_id", "video_token_id")
        # -1 (never a token) for a kind the model lacks: comparing ids with None would give a bool
        self.mm_ids = [int(getattr(self.hf_config, k, None) or -1) for k in ids] if self.is_vision else []
        if self.is_vision and self.processor is None:
            raise ValueError("a vision-language model needs its processor for the HF rollout engine")

    @property
    def weight_dtype(self) -> torch.dtype:
        return HF_DTYPES[self.config.dtype]

    # ------------------------------------------------------------------------ generation
    def generation_config(self, s: SamplingSettings) -> Any:
        from transformers import GenerationConfig

        # Sampling knobs only when sampling (transformers warns about them in greedy mode).
        knobs = {} if s.greedy else {"temperature": s.temperature, "top_p": s.top_p, "top_k": max(0, s.top_k)}
        return GenerationConfig(
            max_new_tokens=s.max_tokens,
            do_sample=not s.greedy,
            **knobs,  # top_k 0 disables it (transformers' own default is 50)
            eos_token_id=[] if s.ignore_eos else list(self.eos_token_ids),
            pad_token_id=self.pad_token_id,
            suppress_tokens=list(self.banned_token_ids) or None,
            return_dict_in_generate=True,
            output_scores=s.logprobs,
        )

    def vision_inputs(self, prompts: PromptBatch, n: int, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """pixel_values / image_grid_thw for the N = B x n rows, and the mm_token_type_ids mrope needs."""
        if not self.is_vision:
            return {}
        image_id, video_id = self.mm_ids
        types = input_ids.eq(image_id).int() + 2 * input_ids.eq(video_id).int()  # [N, P]
        images = [decoded(img) for row in prompts.images for _ in range(n) for img in row]
        if not images:
            return {"mm_token_type_ids": types}
        # Images were resized by the data pipeline (their token counts are in input_ids): no resize.
        assert self.processor is not None  # checked in __init__ for vision models
        pixels = self.processor.image_processor(images=images, do_resize=False, return_tensors="pt")
        return {
            "mm_token_type_ids": types,
            "pixel_values": pixels["pixel_values"].to(self.device, self.weight_dtype),
            "image_grid_thw": pixels["image_grid_thw"].to(self.device),
        }

    @torch.no_grad()
    def generate(self, prompts: PromptBatch, overrides: Mapping[str, Any] | None = None) -> RolloutBatch:
        s = resolve_sampling(self.config, self.data_config.max_response_length, overrides)
        check_prompts(prompts, self.max_model_len, s.max_tokens, self.limit_images)
        if len(prompts) == 0:
            return assemble_rollout_batch(prompts, [], s.n, self.pad_token_id, self.eos_token_ids)
        input_ids = prompts.input_ids.repeat_interleave(s.n, 0)  # [N, P] left-padded
        attention_mask = prompts.attention_mask.repeat_interleave(s.n, 0)
        extra = self.vision_inputs(prompts, s.n, input_ids)
        with seeded_rng(self.call_seed(s)):
            out = self.model.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=attention_mask.to(self.device),
                generation_config=self.generation_config(s),
                **{k: v.to(self.device) for k, v in extra.items()},
            )
        new = out.sequences[:, input_ids.shape[1] :].cpu()  # [N, T]; pad after a row's EOS
        responses = [_cut(row, self.eos_token_ids, s.ignore_eos) for row in new.tolist()]
        log_probs = None
        if s.logprobs:
            # scores: T x [N, V] after temperature, top-k/p and the ban; log-prob of the sampled token.
            scores = torch.stack(out.scores, dim=1).float().log_softmax(-1).cpu()  # [N, T, V]
            picked = scores.gather(-1, new.unsqueeze(-1)).squeeze(-1)  # [N, T]
            log_probs = [picked[i, : len(r)].tolist() for i, r in enumerate(responses)]
        return assemble_rollout_batch(
            prompts, responses, s.n, self.pad_token_id, self.eos_token_ids, log_probs
        )

    # ------------------------------------------------------------------------ weights
    def map_weight_name(self, name: str) -> str:
        return runtime_name(name)  # same transformers model: only wrapper prefixes go

    def _load_buckets(self, buckets: Iterator[list[tuple[str, torch.Tensor]]]) -> None:
        expected = set(self.model.state_dict())
        seen: set[str] = set()
        for bucket in buckets:
            result = self.model.load_state_dict(dict(bucket), strict=False)
            if result.unexpected_keys:
                raise RuntimeError(
                    f"weights not in the HF rollout model: {sorted(result.unexpected_keys)[:4]}"
                )
            seen.update(name for name, _ in bucket)
        missing = sorted(expected - seen)
        if missing:
            raise RuntimeError(
                f"weight load left {len(missing)} HF rollout parameters unset, e.g. {missing[:4]}"
            )


def _cut(tokens: list[int], eos_ids: list[int], ignore_eos: bool) -> list[int]:
    """A generated row up to and including its first EOS (transformers pads after it)."""
    if ignore_eos:
        return tokens
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[: i + 1]
    return tokens


def _dp_rank(tp: int) -> int:
    """Data-parallel rank: rank // tensor_parallel_size in an initialized world, else 0."""
    import torch.distributed as dist

    return dist.get_rank() // max(1, tp) if dist.is_available() and dist.is_initialized() else 0
