"""vLLM rollout engine, SPMD: one in-process engine per rank, in the trainer's torch.distributed world.

Layout: world W ranks, tensor-parallel size T (divides W). vLLM's `external_launcher` backend joins
the existing process group and cuts it into W / T tensor-parallel groups of consecutive ranks; every
rank runs its own scheduler. TP peers receive the same prompts and the same seed, so they schedule
and sample identically; data-parallel groups (dp_rank = rank // T) get different prompt shards and
seeds (`seed + dp_rank`).

The engine starts from random weights (load format `vlrl_dummy`) and refuses to generate until it
has received the actor's weights (`sync_weights` / `load_weights`).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from vlrl.protocol import PromptBatch, RolloutBatch
from vlrl.rollout import vllm_hooks
from vlrl.rollout.base import (
    NoWeightsError,
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
from vlrl.rollout.weight_sync import checkpoint_name

VLLM_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
               "fp32": "float32", "float32": "float32"}  # fmt: skip
_FAMILIES = {"qwen2_vl": "qwen2_vl", "qwen2_5_vl": "qwen2_5_vl", "qwen3_vl": "qwen3_vl"}


def model_family(hf_config: Any) -> str:
    """qwen2_vl | qwen2_5_vl | qwen3_vl | text: selects the weight-name mapping."""
    return _FAMILIES.get(getattr(hf_config, "model_type", ""), "text")


def _dist_layout(tp: int) -> tuple[int, int]:
    """(rank, dp_rank) in the initialized world; sets the env vars `external_launcher` reads."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError(
            "the vLLM rollout engine joins an existing torch.distributed world (external_launcher): "
            "call torch.distributed.init_process_group first (gloo on CPU, nccl on GPU), even for one rank"
        )
    rank, world = dist.get_rank(), dist.get_world_size()
    if tp < 1 or world % tp:
        raise ValueError(f"worker.rollout.tensor_parallel_size={tp} must divide the world size {world}")
    if os.environ.setdefault("RANK", str(rank)) != str(rank):
        raise RuntimeError(f"env RANK={os.environ['RANK']} differs from torch.distributed rank {rank}")
    os.environ.setdefault("LOCAL_RANK", str(rank if not torch.cuda.is_available() else 0))
    os.environ.setdefault("WORLD_SIZE", str(world))
    # external_launcher needs the in-process engine core (vLLM asserts it; set before LLM()).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return rank, rank // tp


class VLLMRolloutEngine(RolloutEngine):
    """`vllm.LLM` in SPMD mode behind the `RolloutEngine` interface."""

    def __init__(
        self,
        config: Any,
        data_config: Any,
        model_path: str,
        tokenizer: Any,
        processor: Any | None = None,
        limit_images: int | None = None,
    ) -> None:
        from transformers import AutoConfig

        self.config, self.data_config = config, data_config
        self.rank, self.dp_rank = _dist_layout(config.tensor_parallel_size)
        self.hf_config = AutoConfig.from_pretrained(model_path)
        self.family = model_family(self.hf_config)
        self.is_vision = getattr(self.hf_config, "vision_config", None) is not None
        self.limit_images = resolve_limit_images(config, limit_images) if self.is_vision else 0
        self.max_model_len = int(
            config.max_model_len or data_config.max_prompt_length + data_config.max_response_length
        )
        self.eos_token_ids = eos_token_ids(tokenizer, model_path)
        self.pad_token_id = pad_token_id(tokenizer)
        self.banned_token_ids = banned_token_ids(tokenizer, self.hf_config)
        self.bucket_mb = config.sync_bucket_mb
        self.on_gpu = torch.cuda.is_available()
        self.sleep_enabled = bool(config.enable_sleep_mode) and self.on_gpu  # refused on CPU by vLLM
        self._check_limits()
        self.llm = self._build_llm(model_path, tokenizer)
        self.has_weights = False
        self.asleep = False
        self._asleep_tags: set[str] = set()

    # ------------------------------------------------------------------------ start-up
    def _check_limits(self) -> None:
        c, data = self.config, self.data_config
        errors = []
        if self.max_model_len <= data.max_response_length:
            errors.append(f"max_model_len={self.max_model_len} leaves no room for a prompt next to "
                          f"data.max_response_length={data.max_response_length}")  # fmt: skip
        if not c.enable_chunked_prefill and c.max_num_batched_tokens < self.max_model_len:
            errors.append(f"worker.rollout.max_num_batched_tokens={c.max_num_batched_tokens} < max_model_len="
                          f"{self.max_model_len}; raise it or set worker.rollout.enable_chunked_prefill=true")  # fmt: skip
        limit = getattr(self.hf_config, "max_position_embeddings", None)
        limit = limit or getattr(
            getattr(self.hf_config, "text_config", None), "max_position_embeddings", None
        )
        if limit and self.max_model_len > limit:
            errors.append(f"max_model_len={self.max_model_len} > the model's max_position_embeddings={limit}")
        if c.dtype not in VLLM_DTYPES:
            errors.append(f"worker.rollout.dtype={c.dtype!r} is unknown; choose one of {sorted(VLLM_DTYPES)}")
        if errors:
            raise ValueError("rollout engine limits:\n  - " + "\n  - ".join(errors))

    def _build_llm(self, model_path: str, tokenizer: Any) -> Any:
        from vllm import LLM

        vllm_hooks.silence_repeated_logs()
        c = self.config
        kwargs: dict[str, Any] = {}
        if self.is_vision:
            kwargs["limit_mm_per_prompt"] = {"image": self.limit_images, "video": 0}
        if self.sleep_enabled:
            kwargs["enable_sleep_mode"] = True
        if not self.on_gpu and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            import psutil

            cap = int(c.gpu_memory_utilization * psutil.virtual_memory().total)
            kwargs["kv_cache_memory_bytes"] = vllm_hooks.cpu_kv_cache_bytes(
                self.hf_config, self.weight_dtype, self.max_model_len, c.max_num_seqs, cap
            )
        return LLM(
            model=model_path,
            tokenizer=getattr(tokenizer, "name_or_path", None) or model_path,
            dtype=VLLM_DTYPES[c.dtype],
            seed=c.seed + self.dp_rank,
            tensor_parallel_size=c.tensor_parallel_size,
            distributed_executor_backend="external_launcher",
            load_format=vllm_hooks.register_dummy_loader(),
            max_model_len=self.max_model_len,
            max_num_batched_tokens=c.max_num_batched_tokens,
            max_num_seqs=c.max_num_seqs,
            enable_chunked_prefill=c.enable_chunked_prefill,
            enforce_eager=c.enforce_eager or not self.on_gpu,  # CPU: no graphs, skip compilation
            gpu_memory_utilization=c.gpu_memory_utilization,
            logits_processors=[vllm_hooks.ban_tokens_processor(self.banned_token_ids)],
            # log-probs after temperature and the token ban: what the actor recomputes
            logprobs_mode="processed_logprobs",
            disable_log_stats=True,
            **kwargs,
        )

    @property
    def weight_dtype(self) -> torch.dtype:
        return getattr(torch, VLLM_DTYPES[self.config.dtype])

    # ------------------------------------------------------------------------ generation
    def sampling_params(self, s: SamplingSettings) -> Any:
        """vLLM `SamplingParams` for one call (token ids only: no detokenization)."""
        from vllm import SamplingParams

        return SamplingParams(
            n=1 if s.greedy else s.n,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k if s.top_k > 0 else 0,
            max_tokens=s.max_tokens,
            ignore_eos=s.ignore_eos,
            stop_token_ids=[] if s.ignore_eos else list(self.eos_token_ids),
            logprobs=0 if s.logprobs else None,  # 0: only the sampled token's log-prob
            flat_logprobs=True,
            detokenize=False,
            skip_special_tokens=False,
        )

    def requests(self, prompts: PromptBatch) -> list[dict[str, Any]]:
        """vLLM inputs: unexpanded ids (vLLM expands the image placeholders itself) + PIL images."""
        out = []
        for ids, images in zip(prompts.raw_prompt_ids, prompts.images):
            request: dict[str, Any] = {"prompt_token_ids": list(ids)}
            if images:
                request["multi_modal_data"] = {"image": list(images)}
            out.append(request)
        return out

    def generate(self, prompts: PromptBatch, overrides: Mapping[str, Any] | None = None) -> RolloutBatch:
        if not self.has_weights:
            raise NoWeightsError(
                "the vLLM engine starts with random weights: sync the actor's weights first "
                "(vlrl.rollout.sync_weights(actor_module, engine, bucket_mb) or engine.load_weights(...))"
            )
        if self.asleep:
            self.wake_up()
        s = resolve_sampling(self.config, self.data_config.max_response_length, overrides)
        check_prompts(prompts, self.max_model_len, s.max_tokens, self.limit_images)
        if len(prompts) == 0:  # a data-parallel shard can be empty
            return assemble_rollout_batch(prompts, [], s.n, self.pad_token_id, self.eos_token_ids)
        # An empty cache makes a call's scheduling, hence its sampling, a function of its inputs only.
        self.llm.reset_prefix_cache()
        with seeded_rng(self.call_seed(s)):
            outputs = self.llm.generate(self.requests(prompts), self.sampling_params(s), use_tqdm=False)
        # vLLM refuses n > 1 with greedy sampling: ask for one and repeat it (the copies are equal).
        copies = s.n if s.greedy else 1
        responses, log_probs = [], []
        for output in outputs:  # in prompt order
            for sample in sorted(output.outputs, key=lambda o: o.index):
                responses += [list(sample.token_ids)] * copies
                if s.logprobs:
                    values = list(sample.logprobs.logprobs) if sample.logprobs is not None else []
                    log_probs += [values] * copies
        return assemble_rollout_batch(
            prompts, responses, s.n, self.pad_token_id, self.eos_token_ids, log_probs if s.logprobs else None
        )

    # ------------------------------------------------------------------------ weights
    def map_weight_name(self, name: str) -> str:
        return checkpoint_name(name, self.family)

    def _load_buckets(self, buckets: Iterator[list[tuple[str, torch.Tensor]]]) -> None:
        if self.asleep:
            self._wake(["weights"])  # the KV cache stays released until generate()
        loaded, expected = self.llm.collective_rpc(vllm_hooks.reload_on_worker, args=(buckets,))[0]
        missing = sorted(expected - loaded)
        if missing:
            raise RuntimeError(
                f"weight load left {len(missing)} of {len(expected)} vLLM parameters unset, e.g. {missing[:4]}: "
                f"the names given do not cover the {self.family} model (see vlrl.rollout.weight_sync)"
            )
        # Cached KV blocks and vision embeddings (scheduler bookkeeping and storage) are stale now.
        self.llm.reset_prefix_cache()
        self.llm.llm_engine.reset_encoder_cache()
        self.has_weights = True

    # ------------------------------------------------------------------------ memory
    def sleep(self) -> None:
        """GPU with sleep mode: offload weights to CPU and drop the KV cache (level 1). CPU: no-op."""
        if self.sleep_enabled and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True
            self._asleep_tags = {"weights", "kv_cache"}

    def wake_up(self) -> None:
        if self.sleep_enabled and self.asleep:
            self._wake(sorted(self._asleep_tags))

    def _wake(self, tags: list[str]) -> None:
        self.llm.wake_up(tags=tags)
        self._asleep_tags -= set(tags)
        self.asleep = bool(self._asleep_tags)

    def close(self) -> None:
        """Release the engine; the trainer's torch.distributed world stays up.

        vLLM's own in-process shutdown (`EngineCore.shutdown`, also run by a finalizer when the client
        is garbage-collected) ends with `cleanup_dist_env_and_memory()`, which destroys the default
        process group. We detach that finalizer and do the rest of the shutdown ourselves.
        """
        from vllm.distributed.parallel_state import destroy_model_parallel

        if getattr(self, "llm", None) is None:
            return
        client = self.llm.llm_engine.engine_core  # InprocClient (external_launcher runs in-process)
        client._finalizer.detach()
        core = client.engine_core
        core.model_executor.shutdown()
        core.scheduler.shutdown()
        gc.unfreeze()  # vLLM froze start-up objects; let the collector free the weights and KV cache
        self.llm = None
        destroy_model_parallel()
        gc.collect()
