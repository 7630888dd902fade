"""vLLM rollout engine, SPMD: one in-process engine per rank, in the trainer's torch.distributed world.

Layout: world W ranks, tensor-parallel size T (divides W). vLLM's `external_launcher` backend joins
the existing process group and cuts it into W / T tensor-parallel groups of consecutive ranks; every
rank runs its own scheduler. TP peers receive the same prompts and the same seed, so they schedule
and sample identically; data-parallel groups (dp_rank = rank // T) get different prompt shards and
seeds (`seed + dp_rank`).

The engine starts from random weights (load format `vlrl_dummy`) and refuses to generate until it
has received the actor's weights (`sync_weights` / `load_weights`), and again after a sleep that
discarded them (level 2, `sleep_level`) until the next sync.
"""

from __future__ import annotations

import gc
import logging
import os
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from vlrl.batch.rows import FinishedGroups, PromptBatch, RolloutBatch
from vlrl.models.families import engine_errors, family_of
from vlrl.models.moe import check_engine_config as check_moe_config
from vlrl.rollout import vllm_hooks, vllm_settings
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
from vlrl.rollout.vllm_inputs import ImageIds, vllm_request
from vlrl.rollout.weight_sync import checkpoint_name, checkpoint_tensor
from vlrl.utils.library_logs import progress_bars_wanted

logger = logging.getLogger(__name__)

VLLM_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
               "fp32": "float32", "float32": "float32"}  # fmt: skip


def tensor_parallel_errors(hf_config: Any, tp: int) -> list[str]:
    """The model dimensions vLLM 0.32 splits over `tp` ranks that `tp` does not divide (empty: none).

    vLLM shards the text and vision attention heads, the dense MLP width and every expert's width
    over the TP group, and refuses indivisible ones late (after start-up) or with a bare
    assertion (`FusedMoEConfig.__post_init__`: `assert self.intermediate_size % tp_size == 0`).
    KV heads are split when `tp` divides them and replicated when they divide `tp`
    (`QKVParallelLinear`)."""
    if tp <= 1:
        return []
    from vlrl.models.moe import is_moe_config, is_sparse_layer

    text = getattr(hf_config, "text_config", None)
    prefix = "text_config." if text is not None else ""
    text = text if text is not None else hf_config
    dims = [("num_attention_heads", text.num_attention_heads)]
    if any(not is_sparse_layer(text, i) for i in range(text.num_hidden_layers)):
        dims.append(("intermediate_size", text.intermediate_size))  # a dense MLP layer
    if is_moe_config(text):
        dims.append(("moe_intermediate_size", text.moe_intermediate_size))
    errors = [f"{prefix}{name}={value}" for name, value in dims if int(value) % tp]
    kv = int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
    if kv % tp and tp % kv:
        errors.append(f"{prefix}num_key_value_heads={kv} (nor does it divide {tp})")
    vision = getattr(hf_config, "vision_config", None)
    heads = getattr(vision, "num_heads", None)
    if heads is not None and int(heads) % tp:
        errors.append(f"vision_config.num_heads={heads}")
    return errors


ROLLOUT_ONLY_GPU_MEMORY_UTILIZATION = 0.85
"""Least fraction of GPU memory a rollout-only engine (asynchronous mode) takes.

Hybrid ranks keep `worker.rollout.gpu_memory_utilization` (default 0.6): the actor's and the
reference's shards come back to the same GPU while the engine sleeps. A rollout-only rank has its own
GPU (Ray, `num_gpus=1`) and holds nothing else there, so the KV cache can grow into what the hybrid
cap leaves for training. Not the whole GPU: vLLM's budget is this fraction of the *total* memory and
must be free when the engine starts (vLLM 0.32, vllm/v1/worker/utils.py, `request_memory`), and the
process also needs, outside that budget, its CUDA context, the NCCL communicator of the weight
broadcast, one received bucket of `sync_bucket_mb` (vlrl/rollout/weight_broadcast.py,
`WeightBroadcast.receive`) and the layer the reload is building (`vllm_hooks.reload_on_worker`):
about 2 GiB, and 15% is 12 GiB on an 80 GiB GPU, 3.6 GiB on a 24 GiB one."""


def uses_sleep_mode(config: Any, *, on_gpu: bool, rollout_only: bool) -> bool:
    """Whether the engine sleeps between generations (vLLM sleep mode, `LLM.sleep`; the level is
    `sleep_level`'s).

    Only hybrid ranks on GPU: they free the GPU for the actor's update. vLLM refuses sleep mode on
    CPU. A rollout-only rank holds no actor or optimizer, so sleeping would only move its weights to
    host memory and drop its KV cache every step, and wake them again for the next generation."""
    return bool(config.enable_sleep_mode) and on_gpu and not rollout_only


def sleep_level(*, sleep_mode: bool, weights_replaced_next: bool) -> int:
    """vLLM sleep level for one `sleep`: 0 stays awake, 1 keeps the weights, 2 discards them.

    What the levels do in vLLM 0.32 (CUDA, the default `cumem` backend):
    - `CuMemBackend.suspend` (vllm/device_allocator/sleep_mode_backend.py) backs up the
      `runtime` and `cudagraph` allocations to host memory at every level, and the `weights` ones
      only at level 1; everything else, the `kv_cache` pool included, is unmapped without a copy
      (`CuMemAllocator.sleep`, vllm/device_allocator/cumem.py). Level 1 thus copies every weight to
      pinned host memory when it sleeps and back when it wakes (`CuMemAllocator.wake_up`).
    - Level 2 also keeps the model's buffers (rotary caches and the like): `Worker.sleep` copies
      `named_buffers()` to the CPU and `Worker.wake_up` copies them back when `"weights"` is among
      the tags (vllm/v1/worker/gpu_worker.py). `wake_up(tags=["weights"])` maps fresh, uninitialised
      memory at the same addresses, which the next load fills: our reload
      (`vllm_hooks.reload_on_worker`) copies every processed tensor into those original storages
      (`_copy_and_restore_kernel_tensors`, vllm/model_executor/model_loader/reload/layerwise.py).

    `weights_replaced_next`: the caller knows that the engine's next use is a full weight sync
    (hybrid rank: the last generation of a training step; the update's `sync_weights` follows), so
    the copy level 1 would make is overwritten unread: level 2 skips both transfers and the pinned
    host copy. Otherwise (validation, ReMax's greedy pass, a step with more generation rounds) the
    engine must generate again with the weights it has: level 1.

    A LoRA actor does not change this: its sync sends the merged full weights under the base names
    (`weight_sync.full_named_tensors` -> `vlrl.models.lora.merged_named_tensors`), the engine has no
    adapter slots (no `enable_lora` in `llm_kwargs`), and `VLLMRolloutEngine._load_buckets` refuses
    a load that leaves any vLLM parameter unset. Every sync replaces every weight.
    """
    if not sleep_mode:
        return 0
    return 2 if weights_replaced_next else 1


def memory_fraction(config: Any, *, on_gpu: bool, rollout_only: bool) -> float:
    """`gpu_memory_utilization` for the engine: the configured fraction, raised to
    `ROLLOUT_ONLY_GPU_MEMORY_UTILIZATION` for a rollout-only rank on GPU. On CPU the fraction is of
    host RAM, which a rollout rank shares with the training ranks: unchanged there."""
    fraction = float(config.gpu_memory_utilization)
    if on_gpu and rollout_only:
        return max(fraction, ROLLOUT_ONLY_GPU_MEMORY_UTILIZATION)
    return fraction


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


def eager_small_helpers() -> None:
    """CPU only: run eagerly the small tensor helpers vLLM wraps in `torch.compile` with its
    platform's `simple_compile_backend` (inductor on CPU; vllm 0.32, vllm/platforms/interface.py),
    which the engine's own `enforce_eager` does not reach. On CPU inductor compiles each to C++
    (needs a C++ compiler) at the first generation of every rank process: on a cold cache that
    generation took 18.5 s here, on a warm one a TP=2 run's first step took 6-7 s against 2.5 s
    eager (tracing and loading the kernel per rank, the TP peer waiting). The uncompiled functions
    give the same values; on GPU the compiled ones stay (they avoid (tokens x vocab) temporaries).
    - `batched_count_greater_than` (vllm/v1/sample/ops/logprobs.py): each sampled token's rank,
      called from `Sampler` (vllm/v1/sample/sampler.py) whenever log-probs are asked for;
    - `get_masked_input_and_mask` (vllm/model_executor/layers/vocab_parallel_embedding.py): the
      embedding's vocabulary-shard mask, called at every step with tensor parallelism > 1."""
    from vllm.model_executor.layers import vocab_parallel_embedding
    from vllm.v1.sample import sampler

    for module, name in ((sampler, "batched_count_greater_than"),
                         (vocab_parallel_embedding, "get_masked_input_and_mask")):  # fmt: skip
        eager = getattr(getattr(module, name), "_torchdynamo_orig_callable", None)
        if eager is not None:
            setattr(module, name, eager)


def freeze_start_up_heap() -> None:
    """Move the objects alive before `LLM()` out of the collector's reach, as vLLM itself does once
    its engine has started (`freeze_gc_heap`, vllm/utils/gc_utils.py, from `EngineCore.__init__`).
    Engine start-up runs full collections (`BaseModelLoader.load_model` twice,
    vllm/model_executor/model_loader/base_loader.py) that otherwise walk the rank's whole heap
    (torch, transformers and vLLM modules, the processor): seconds per rank on CPU. It collects
    first, so no garbage is frozen; vLLM's shutdown and `VLLMRolloutEngine.close` unfreeze."""
    from vllm.utils.gc_utils import freeze_gc_heap

    freeze_gc_heap()


def llm_kwargs(
    config: Any,
    *,
    model_path: str,
    tokenizer_path: str,
    max_model_len: int,
    seed: int,
    limit_images: int | None,
    banned_token_ids: Sequence[int],
    limit_videos: int = 0,
    on_gpu: bool,
    visible_gpus: int,
    use_v2_runner: bool,
    kv_cache_bytes: int | None = None,
    device_normalize: bool = True,
    rollout_only: bool = False,
) -> dict[str, Any]:
    """The `vllm.LLM(...)` arguments for one rank (pure: tested without building an engine).

    limit_images: images per prompt, None for a text model; limit_videos: videos per prompt. visible_gpus: GPUs this process sees
    (`torch.cuda.device_count()`; 1 under Ray). use_v2_runner: `vllm_hooks.uses_v2_runner()`.
    kv_cache_bytes: CPU only, the explicit KV-cache size (`vllm_hooks.cpu_kv_cache_bytes`).
    device_normalize: False turns off vLLM's on-device pixel normalisation, which would normalise
    videos with the image processor's mean/std (`vllm_hooks.device_normalization_ok`).
    rollout_only: an engine on a rank that only generates (asynchronous mode): no sleep mode and a
    larger memory fraction on GPU (`uses_sleep_mode`, `memory_fraction`).
    Under Ray with TP >= 2 the all-reduce is NCCL only (`vllm_settings.all_reduce_settings`; its
    environment variables are set by the engine, `vllm_settings.apply_engine_env`).
    """
    c = config
    kwargs: dict[str, Any] = dict(
        model=model_path,
        tokenizer=tokenizer_path,
        dtype=VLLM_DTYPES[c.dtype],
        seed=seed,
        tensor_parallel_size=c.tensor_parallel_size,
        distributed_executor_backend="external_launcher",
        load_format=vllm_hooks.DUMMY_LOAD_FORMAT,
        max_model_len=max_model_len,
        max_num_batched_tokens=c.max_num_batched_tokens,
        max_num_seqs=c.max_num_seqs,
        enable_chunked_prefill=c.enable_chunked_prefill,
        enforce_eager=c.enforce_eager or not on_gpu,  # CPU: no graphs, skip compilation
        gpu_memory_utilization=memory_fraction(c, on_gpu=on_gpu, rollout_only=rollout_only),
        logits_processors=[vllm_hooks.ban_tokens_processor(banned_token_ids, use_v2_runner)],
        # log-probs of the distribution each token was drawn from, on both runners (temperature,
        # token ban, top-k/top-p and renormalisation applied; vllm_settings.LOGPROBS_MODE)
        logprobs_mode=vllm_settings.LOGPROBS_MODE,
        disable_log_stats=c.disable_log_stats,
    )
    if limit_images is not None:
        kwargs["limit_mm_per_prompt"] = {"image": limit_images, "video": limit_videos}
        if not device_normalize:
            kwargs["mm_device_do_normalize"] = False
    if uses_sleep_mode(c, on_gpu=on_gpu, rollout_only=rollout_only):
        kwargs["enable_sleep_mode"] = True
    # Each rank sees only its own GPU (Ray): vLLM's custom all-reduce would index
    # CUDA_VISIBLE_DEVICES by peer rank and fail, and the other non-NCCL paths could set up on one
    # peer and not the other; NCCL does every all-reduce then.
    kwargs.update(vllm_settings.all_reduce_settings(c.tensor_parallel_size, visible_gpus, on_gpu).llm_kwargs)
    if not on_gpu:
        kwargs["block_size"] = vllm_hooks.CPU_BLOCK_SIZE
    if kv_cache_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = kv_cache_bytes
    return kwargs


class VLLMRolloutEngine(RolloutEngine):
    """`vllm.LLM` in SPMD mode behind the `RolloutEngine` interface."""

    in_flight_load: bool = False  # a load inside a generation (partial rollouts) is running

    def __init__(
        self,
        config: Any,
        data_config: Any,
        model_path: str,
        tokenizer: Any,
        processor: Any | None = None,
        limit_images: int | None = None,
        limit_videos: int = 0,
        rollout_only: bool = False,
    ) -> None:
        """`rollout_only`: this rank only generates (asynchronous mode, `worker.rollout.async_ranks`):
        the engine never sleeps and takes more GPU memory (`uses_sleep_mode`, `memory_fraction`)."""
        from transformers import AutoConfig

        vllm_settings.check_vllm_version()  # before anything else, so the version is the one message
        self.config, self.data_config = config, data_config
        self.rollout_only = rollout_only
        self.rank, self.dp_rank = _dist_layout(config.tensor_parallel_size)
        self.hf_config = AutoConfig.from_pretrained(model_path)
        self.family = family_of(self.hf_config)
        check_moe_config(self.hf_config)
        self.is_vision = getattr(self.hf_config, "vision_config", None) is not None
        self.limit_images = resolve_limit_images(config, limit_images) if self.is_vision else 0
        self.limit_videos = limit_videos if self.is_vision else 0  # most videos in one prompt of the data
        self.max_model_len = int(
            config.max_model_len or data_config.max_prompt_length + data_config.max_response_length
        )
        self.eos_token_ids = eos_token_ids(tokenizer, model_path)
        self.pad_token_id = pad_token_id(tokenizer)
        self.banned_token_ids = banned_token_ids(tokenizer, self.hf_config)
        self.bucket_mb = config.sync_bucket_mb
        self.on_gpu = torch.cuda.is_available()
        self.sleep_enabled = uses_sleep_mode(config, on_gpu=self.on_gpu, rollout_only=rollout_only)
        self.use_v2 = vllm_hooks.uses_v2_runner()
        # vLLM's per-call progress bar: rank 0, asked for, and someone watching (library_logs)
        self.show_progress = self.rank == 0 and not config.disable_tqdm and progress_bars_wanted()
        # V2 runner, calls without a seed: the engine's own stream of call seeds (TP peers agree).
        self._call_seeds = random.Random(config.seed + self.dp_rank)
        self.image_ids = ImageIds()
        self.multi_turn = None
        mt = getattr(config, "multi_turn", None)
        if mt is not None and mt.enable:
            from vlrl.rollout.multi_turn.loop import MultiTurnRollout
            from vlrl.rollout.multi_turn.shared_tools import build_tp_group

            # tool images join the request's images: room for one batch of them per assistant turn
            self.limit_images += mt.max_assistant_turns * mt.max_tool_images if self.is_vision else 0
            # TP > 1: the peers' tools run on the group's first rank only (collective: every rank builds every group)
            tp_group = build_tp_group(config.tensor_parallel_size)
            self.multi_turn = MultiTurnRollout(mt, data_config, tokenizer, processor, self.hf_config,
                                               self.eos_token_ids, self.pad_token_id, self.max_model_len,
                                               tp_group)  # fmt: skip
        # vLLM would normalise video pixels with the image processor's mean/std: refuse that when
        # the video processor's differ (vllm_hooks.device_normalization_ok).
        self.device_normalize = not self.limit_videos or vllm_hooks.device_normalization_ok(processor)
        self._check_limits()
        self.llm = self._build_llm(model_path, tokenizer)
        self.has_weights = False  # False: the weights are random, discarded or half-loaded
        self.weights_discarded = False  # by a level-2 sleep (`sleep_level`); a full sync restores them
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
        errors += [f"worker.rollout.tensor_parallel_size={c.tensor_parallel_size} does not divide the model's {dim}"
                   for dim in tensor_parallel_errors(self.hf_config, c.tensor_parallel_size)]  # fmt: skip
        errors += engine_errors(self.family, c, self.on_gpu)
        if c.dtype not in VLLM_DTYPES:
            errors.append(f"worker.rollout.dtype={c.dtype!r} is unknown; choose one of {sorted(VLLM_DTYPES)}")
        if errors:
            raise ValueError("rollout engine limits:\n  - " + "\n  - ".join(errors))

    def _build_llm(self, model_path: str, tokenizer: Any) -> Any:
        from vllm import LLM

        vllm_hooks.silence_repeated_logs()
        vllm_hooks.register_dummy_loader()
        c = self.config
        kv_cache_bytes = None
        if not self.on_gpu and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            import psutil

            cap = int(c.gpu_memory_utilization * psutil.virtual_memory().total)
            kv_cache_bytes = vllm_hooks.cpu_kv_cache_bytes(
                self.hf_config, self.weight_dtype, self.max_model_len, c.max_num_seqs, cap
            )
        visible_gpus = torch.cuda.device_count() if self.on_gpu else 0
        kwargs = llm_kwargs(
            c,
            model_path=model_path,
            tokenizer_path=getattr(tokenizer, "name_or_path", None) or model_path,
            max_model_len=self.max_model_len,
            seed=c.seed + self.dp_rank,
            limit_images=self.limit_images if self.is_vision else None,
            limit_videos=self.limit_videos,
            banned_token_ids=self.banned_token_ids,
            on_gpu=self.on_gpu,
            visible_gpus=visible_gpus,
            use_v2_runner=self.use_v2,
            kv_cache_bytes=kv_cache_bytes,
            device_normalize=self.device_normalize,
            rollout_only=self.rollout_only,
        )
        self._set_all_reduce_env(visible_gpus)
        # Pin the runner the processor class was built for (vLLM reads this in `LLM()`).
        os.environ[vllm_hooks.V2_RUNNER_ENV] = "1" if self.use_v2 else "0"
        self._shm_ident: str | None = None
        if not self.on_gpu:  # the CPU all-reduce's shared memory, named after this run (vllm_hooks)
            self._shm_ident = vllm_hooks.next_cpu_shm_ident(c.tensor_parallel_size)
            vllm_hooks.use_cpu_shm_ident(self._shm_ident)
        if not self.on_gpu:
            eager_small_helpers()
        freeze_start_up_heap()
        try:
            llm = LLM(**kwargs)
        except BaseException:
            if self._shm_ident:  # no engine to close: drop the segments it may have made
                vllm_hooks.remove_cpu_shm(f"{self._shm_ident}-")
            raise
        vllm_settings.check_logprobs_mode(llm.llm_engine.vllm_config.model_config.logprobs_mode)
        runs_v2 = bool(llm.llm_engine.vllm_config.use_v2_model_runner)
        if runs_v2 != self.use_v2:
            raise RuntimeError(
                f"vLLM chose its {'V2' if runs_v2 else 'V1'} model runner although vlrl pinned "
                f"{vllm_hooks.V2_RUNNER_ENV}={os.environ[vllm_hooks.V2_RUNNER_ENV]}: this vLLM version is not "
                "the one vlrl supports (0.32); see vlrl/rollout/vllm_hooks.py::uses_v2_runner"
            )
        return llm

    def _set_all_reduce_env(self, visible_gpus: int) -> None:
        """Set the all-reduce environment that goes with `llm_kwargs` (every TP peer computes the
        same) and say once per run (world rank 0) which all-reduce paths are on."""
        tp = self.config.tensor_parallel_size
        settings = vllm_settings.all_reduce_settings(tp, visible_gpus, self.on_gpu)
        vllm_settings.apply_engine_env(settings.env)
        if self.rank == 0 and self.on_gpu and tp > 1:
            logger.info(settings.describe())

    @property
    def weight_dtype(self) -> torch.dtype:
        return getattr(torch, VLLM_DTYPES[self.config.dtype])

    # ------------------------------------------------------------------------ generation
    def _require_weights(self) -> None:
        """Refuse to generate from weights the engine does not have (random, discarded by a level-2
        sleep, or left half-loaded by a failed sync): that would sample garbage silently."""
        if self.has_weights:
            return
        if self.weights_discarded:
            cause = (
                "the engine slept at level 2 (sleep(weights_replaced_next=True)), which discards its "
                "weights, and no full weight sync has reloaded them since; sync before generating, or "
                "sleep with weights_replaced_next=False (level 1) when a generation comes first"
            )
        else:
            cause = "the vLLM engine starts with random weights (or its last weight load failed)"
        raise NoWeightsError(
            f"{cause}: sync the actor's weights first "
            "(vlrl.rollout.sync_weights(actor_module, engine, bucket_mb) or engine.load_weights(...))"
        )

    def sampling_params(
        self, s: SamplingSettings, seed: int | None = None, stop_token_ids: list[int] | None = None
    ) -> Any:
        """vLLM `SamplingParams` for one call or one request (token ids only: no detokenization).

        `stop_token_ids`: extra stop tokens (multi-turn: the end of a tool call)."""
        from vllm import SamplingParams

        return SamplingParams(
            seed=seed,
            n=1 if s.greedy else s.n,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k if s.top_k > 0 else 0,
            max_tokens=s.max_tokens,
            ignore_eos=s.ignore_eos,
            stop_token_ids=([] if s.ignore_eos else list(self.eos_token_ids)) + list(stop_token_ids or []),
            logprobs=0 if s.logprobs else None,  # 0: only the sampled token's log-prob
            flat_logprobs=True,
            detokenize=False,
            skip_special_tokens=False,
        )

    def requests(self, prompts: PromptBatch) -> list[dict[str, Any]]:
        """vLLM inputs (`vllm_request`): unexpanded ids, PIL images with their content ids, and
        videos as (frames [T, H, W, 3], metadata) already sampled by the data pipeline."""
        videos = prompts.videos or [[] for _ in range(len(prompts))]
        return [
            vllm_request(ids, images, [clip.vllm_item() for clip in clips], self.image_ids)
            for ids, images, clips in zip(prompts.raw_prompt_ids, prompts.images, videos)
        ]

    def _check_videos(self, prompts: PromptBatch) -> None:
        has_videos = any(prompts.videos or [])
        # backstop for direct use: the trainer refuses videos with multi-turn at start-up (check_data_media)
        if has_videos and self.multi_turn is not None:
            raise ValueError(
                "multi-turn rollouts do not take videos yet; drop the videos or multi_turn.enable"
            )
        for row, clips in enumerate(prompts.videos or []):
            if len(clips) > self.limit_videos:
                raise ValueError(
                    f"prompt {row} has {len(clips)} video(s) but the engine was built for {self.limit_videos} "
                    "per prompt (the most any prompt of the data has, passed at start-up)"
                )

    def generate(self, prompts: PromptBatch, overrides: Mapping[str, Any] | None = None) -> RolloutBatch:
        *_, batch = self.generate_stream(prompts, overrides)
        assert isinstance(batch, RolloutBatch)
        return batch

    def generate_stream(
        self, prompts: PromptBatch, overrides: Mapping[str, Any] | None = None
    ) -> Iterator[FinishedGroups | RolloutBatch]:
        """Single-turn: each engine step's finished groups as they end, then the shard's batch.
        Multi-turn: the batch only."""
        self._require_weights()
        if self.asleep:
            self.wake_up()
        s = resolve_sampling(self.config, self.data_config.max_response_length, overrides)
        check_prompts(prompts, self.max_model_len, s.max_tokens, self.limit_images)
        self._check_videos(prompts)
        if len(prompts) == 0:  # a data-parallel shard can be empty
            yield assemble_rollout_batch(prompts, [], s.n, self.pad_token_id, self.eos_token_ids)
            return
        # An empty cache makes a call's scheduling, hence its sampling, a function of its inputs only.
        self.llm.reset_prefix_cache()
        self.image_ids.clear()  # content ids live for one call (vllm_inputs.ImageIds)
        if self.multi_turn is not None:
            yield self._multi_turn(prompts, s)
            return
        # vLLM refuses n > 1 with greedy sampling: ask for one and repeat it (the copies are equal).
        copies = s.n if s.greedy else 1
        # prompt row -> (ids, log-probs, policy versions) x n
        samples: dict[int, list[tuple[list[int], list[float], list[int]]]] = {}
        for finished in self._steps(self.requests(prompts), s):
            for row, output in finished:
                samples[row] = [
                    (list(o.token_ids), list(o.logprobs.logprobs) if o.logprobs is not None else [],
                     self._token_versions(o))
                    for o in sorted(output.outputs, key=lambda o: o.index)
                    for _ in range(copies)
                ]  # fmt: skip
            rows = [row for row, _ in finished]
            yield FinishedGroups(rows, [sample[0] for row in rows for sample in samples[row]])
        in_order = [sample for row in range(len(prompts)) for sample in samples[row]]
        yield assemble_rollout_batch(
            prompts, [ids for ids, *_ in in_order], s.n, self.pad_token_id, self.eos_token_ids,
            [values for _, values, _ in in_order] if s.logprobs else None,
            [versions for *_, versions in in_order] if self.policy_version is not None else None,
        )  # fmt: skip

    def _token_versions(self, output: Any) -> list[int]:
        """The policy version that sampled each token of one completion (vLLM labels spans of output
        tokens with the engine's weight version, `set_policy_version`); [] when no version is set."""
        if self.policy_version is None:
            return []
        return [
            int(span.version) for span in output.weight_versions or [] for _ in range(span.end - span.start)
        ]

    def _steps(self, requests: list[dict[str, Any]], s: SamplingSettings) -> Iterator[list[tuple[int, Any]]]:
        """Run one call as `LLM.generate` does (queue every request, then step the engine until
        none is left; vllm/entrypoints/common/offline.py, `_run_completion`), so sampling is the
        same, but yield each step's finished requests as (request row, `RequestOutput`)."""
        from tqdm import tqdm

        params, torch_seed = self._call_params(len(requests), s)
        engine = self.llm.llm_engine
        progress = tqdm(total=len(requests), desc="Processed prompts", disable=not self.show_progress)
        with seeded_rng(torch_seed), progress:
            # `enqueue` returns "<id>-<suffix>"; outputs carry "<id>" (see VLLMTurns.submit)
            request_ids = [
                rid.rsplit("-", 1)[0] for rid in self.llm.enqueue(requests, params, use_tqdm=False)
            ]
            row_of = {rid: row for row, rid in enumerate(request_ids)}
            try:
                while engine.has_unfinished_requests():
                    if self.between_steps is not None:
                        self.between_steps()
                    finished = [(row_of.pop(o.request_id), o) for o in engine.step() if o.finished]
                    if finished:
                        progress.update(len(finished))
                        yield finished
            finally:  # a consumer that stops early must not leave requests for the next call
                if row_of:
                    engine.abort_request(list(row_of))

    def _call_params(self, n_requests: int, s: SamplingSettings) -> tuple[Any, int | None]:
        """A call's `SamplingParams` and the seed for torch's generator, the way the engine's
        model runner samples.

        V1 runner (CPU): from torch's default generator, reseeded for the call (`seeded_rng`); no
        per-request generators, which would cost a Python loop per request per step
        (`random_sample`, vllm/v1/sample/ops/topk_topp_sampler.py). V2 runner (CUDA default): from
        per-request seeds (`vllm_hooks.request_seeds`), which also keep TP peers in step.
        """
        if not self.use_v2:
            return self.sampling_params(s), self.call_seed(s)
        seed = self.call_seed(s)
        if seed is None:
            seed = self._call_seeds.getrandbits(62)
        n = 1 if s.greedy else s.n
        return [self.sampling_params(s, r) for r in vllm_hooks.request_seeds(seed, n_requests, n)], None

    continuous_turns: bool = True
    """Multi-turn: drive the engine request by request (`run_continuous`); False: one `generate`
    call per turn (`run`, the reference the tests and the benchmark compare with)."""

    def _multi_turn(self, prompts: PromptBatch, s: SamplingSettings) -> RolloutBatch:
        import dataclasses

        from vlrl.rollout.multi_turn.vllm_turns import VLLMTurns

        mt = self.multi_turn
        assert mt is not None
        if not self.continuous_turns:

            def turn_fn(
                reqs: list[tuple[list[int], list[Any]]], budgets: list[int], turn: int
            ) -> list[tuple[list[int], Sequence[float] | None]]:
                return self._turn(reqs, budgets, turn, s, mt.call_end_id)

            return mt.run(prompts, s.n, turn_fn, s.max_tokens)
        seed = self.call_seed(s)
        if self.use_v2 and seed is None:
            seed = self._call_seeds.getrandbits(62)

        def params_for(budget: int, request_seed: int | None) -> Any:
            return self.sampling_params(
                dataclasses.replace(s, n=1, max_tokens=budget), request_seed, [mt.call_end_id]
            )

        turns = VLLMTurns(self.llm, params_for, seed if self.use_v2 else None, s.logprobs, self.image_ids)
        with seeded_rng(None if self.use_v2 else seed):  # V1: one torch stream for the whole call
            return mt.run_continuous(prompts, s.n, turns, s.max_tokens)

    def _turn(
        self,
        requests: list[tuple[list[int], list[Any]]],
        budgets: list[int],
        turn: int,
        s: SamplingSettings,
        call_end_id: int,
    ) -> list[tuple[list[int], Sequence[float] | None]]:
        """One assistant turn of every active trajectory: one sample per request, its own budget.

        Seeded like `_generate`, with the turn added to the call seed (each turn its own draws)."""
        import dataclasses

        inputs = [vllm_request(ids, images, image_ids=self.image_ids) for ids, images in requests]
        stop = [call_end_id]
        call_seed = self.call_seed(s)
        if not self.use_v2:
            params = [
                self.sampling_params(dataclasses.replace(s, n=1, max_tokens=b), None, stop) for b in budgets
            ]
            with seeded_rng(None if call_seed is None else call_seed + 7919 * turn):
                outputs = self.llm.generate(inputs, params, use_tqdm=False)
        else:
            seed = (call_seed if call_seed is not None else self._call_seeds.getrandbits(62)) + 7919 * turn
            seeds = vllm_hooks.request_seeds(seed, len(inputs), 1)
            params = [self.sampling_params(dataclasses.replace(s, n=1, max_tokens=b), r, stop)
                      for b, r in zip(budgets, seeds)]  # fmt: skip
            outputs = self.llm.generate(inputs, params, use_tqdm=False)
        result: list[tuple[list[int], Sequence[float] | None]] = []
        for output in outputs:
            sample = output.outputs[0]
            log_probs = list(sample.logprobs.logprobs) if s.logprobs and sample.logprobs is not None else None
            result.append((list(sample.token_ids), log_probs))
        return result

    # ------------------------------------------------------------------------ weights
    def map_weight_name(self, name: str) -> str:
        return checkpoint_name(name, self.family)

    def map_weight_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return checkpoint_tensor(name, tensor, self.family)

    def _load_buckets(self, buckets: Iterator[list[tuple[str, torch.Tensor]]]) -> None:
        if self.asleep:
            # After a level-2 sleep this maps fresh memory and restores the buffers; the load below
            # writes every parameter into it (`sleep_level`). The KV cache stays released until
            # generate().
            self._wake(["weights"])
        self.has_weights = False  # until the load has covered every parameter
        loaded, expected = self.llm.collective_rpc(vllm_hooks.reload_on_worker, args=(buckets,))[0]
        missing = sorted(expected - loaded)
        if missing:
            raise RuntimeError(
                f"weight load left {len(missing)} of {len(expected)} vLLM parameters unset, e.g. {missing[:4]}: "
                f"the names given do not cover the {self.family.name} model (see vlrl.rollout.weight_sync)"
            )
        # Cached KV blocks and vision embeddings (scheduler bookkeeping and storage) are stale now;
        # inside a generation the embeddings stay (`load_weights_in_flight`).
        self.llm.reset_prefix_cache()
        if not self.in_flight_load:
            self.llm.llm_engine.reset_encoder_cache()
        self.has_weights, self.weights_discarded = True, False

    def set_policy_version(self, version: int) -> None:
        """Label the tokens sampled from now on with `version` (vLLM's weight version: the finished
        outputs' `weight_versions` spans, vllm/v1/engine/output_processor.py, vLLM 0.32)."""
        self.policy_version = version
        self.llm.llm_engine.set_weight_version(str(version))

    def load_weights_in_flight(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Partial rollouts: new weights between two engine steps of a generation. The requests in
        flight keep their sampled tokens and are preempted, so they recompute their KV cache (prompt
        and tokens so far) under the new weights; cached prefixes are dropped. The images' vision
        embeddings already computed are kept: vLLM sends an image's pixels to the model runner once
        per content hash, so a request whose image another request encoded has no pixels to encode
        again (resetting the encoder cache here made the next such request fail, "Expected number of
        multimodal embeddings to match number of input items", vllm/v1/worker/utils.py, vLLM 0.32).
        So after a switch the text side samples from the new weights over image embeddings of the
        weights that first encoded each image: the new policy exactly when the vision tower is frozen
        (`worker.actor.model.freeze_vision_tower`), close to it otherwise; every token's log-prob is
        still that of what sampled it. A batch still running on the device (vLLM's async
        scheduling, on GPU) finishes first: its tokens are resampled (`drop_stale_output`,
        vllm/v1/core/sched/scheduler.py `reset_prefix_cache`, vLLM 0.32)."""
        self.llm.collective_rpc("synchronize_device")
        self.llm.reset_prefix_cache(reset_running_requests=True)
        self.in_flight_load = True
        try:
            self.load_weights(named_tensors)
        finally:
            self.in_flight_load = False

    # ------------------------------------------------------------------------ memory
    def sleep(self, weights_replaced_next: bool = False) -> None:
        """GPU with sleep mode: drop the KV cache, and offload the weights to host memory (level 1)
        or, with `weights_replaced_next`, discard them (level 2: the next use must be a full sync,
        generate refuses until then). CPU and rollout-only ranks: a no-op (`sleep_level`)."""
        level = sleep_level(sleep_mode=self.sleep_enabled, weights_replaced_next=weights_replaced_next)
        if level == 0 or self.asleep:
            return
        self.llm.sleep(level=level)
        self.asleep = True
        self._asleep_tags = {"weights", "kv_cache"}
        if level == 2:
            self.has_weights, self.weights_discarded = False, True

    def wake_up(self) -> None:
        if self.sleep_enabled and self.asleep:
            self._wake(sorted(self._asleep_tags))

    def _wake(self, tags: list[str]) -> None:
        self.llm.wake_up(tags=tags)
        self._asleep_tags -= set(tags)
        self.asleep = bool(self._asleep_tags)

    def close(self, process_ends: bool = False) -> None:
        """Release the engine; the trainer's torch.distributed world stays up.

        vLLM's own in-process shutdown (`EngineCore.shutdown`, also run by a finalizer when the client
        is garbage-collected) ends with `cleanup_dist_env_and_memory()`, which destroys the default
        process group. We detach that finalizer and do the rest of the shutdown ourselves.

        `process_ends`: this process exits next (a Ray rank worker, killed by the driver after its
        `shutdown`), so the memory is the OS's to reclaim and the engine is not torn down: that
        teardown is mostly full garbage collections of the rank's whole heap (vLLM's
        `Worker.shutdown` unfreezes it and `_cleanup_profiling_kv_cache` collects,
        vllm/v1/worker/gpu_worker.py and gpu_model_runner.py; then ours below), seconds per rank at
        the end of every run. The multi-turn tools and the CPU all-reduce segments, which outlive
        the process, are released either way.
        """
        multi_turn = getattr(self, "multi_turn", None)
        if multi_turn is not None:
            multi_turn.close()
        if getattr(self, "llm", None) is None:
            return
        client = self.llm.llm_engine.engine_core  # InprocClient (external_launcher runs in-process)
        client._finalizer.detach()
        if not process_ends:
            self._tear_down(client.engine_core)
        self.llm = None
        # vLLM unlinks its CPU all-reduce segments only at a normal process exit, which Ray's
        # workers do not reach (vllm_hooks, "CPU shared memory"): remove this engine's now.
        if getattr(self, "_shm_ident", None):
            vllm_hooks.remove_cpu_shm(f"{self._shm_ident}-")

    def _tear_down(self, core: Any) -> None:
        """Free the engine's memory in this process (its weights, KV cache and parallel groups)."""
        from vllm.distributed.parallel_state import destroy_model_parallel

        core.model_executor.shutdown()
        core.scheduler.shutdown()
        gc.unfreeze()  # vLLM froze start-up objects; let the collector free the weights and KV cache
        self.llm = None
        destroy_model_parallel()
        gc.collect()
