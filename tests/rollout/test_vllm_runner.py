"""vLLM's two model runners on CPU, without an engine: which runner a CUDA machine gets, the token-ban
processor built for it, per-request seeds, the LLM arguments for GPU layouts, the reload warnings."""

from __future__ import annotations

import logging
import random
from types import SimpleNamespace

import pytest
import torch
from rollout_helpers import rollout_config

from vlrl.rollout import vllm_hooks
from vlrl.rollout.base import resolve_sampling
from vlrl.rollout.vllm_engine import VLLMRolloutEngine, llm_kwargs

VOCAB = 12
BANNED = [3, 7, 40]  # 40 is outside the vocabulary: ignored


def vllm_picks_v2(
    monkeypatch: pytest.MonkeyPatch, model_path: str, has_triton: bool, env: str | None
) -> tuple[bool, dict]:
    """vLLM 0.32's own runner choice (`VllmConfig.use_v2_model_runner`) for the engine config our
    `llm_kwargs` builds for a GPU rank, and those kwargs. `has_triton`: True as with the CUDA wheel."""
    import vllm.config.vllm as vllm_config_module
    import vllm.envs
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", has_triton)
    # vllm.envs caches values once an engine ran in this process: set the attribute it returns.
    monkeypatch.setattr(
        vllm.envs, "VLLM_USE_V2_MODEL_RUNNER", vllm.envs.maybe_convert_bool(env), raising=False
    )
    use_v2 = vllm_hooks.uses_v2_runner(has_triton=has_triton)
    kwargs = gpu_kwargs(use_v2, tp=1, model_path=model_path)
    # `LLM()` turns its arguments into EngineArgs the same way; this CPU platform refuses sleep mode.
    engine_args = EngineArgs(**{k: v for k, v in kwargs.items() if k != "enable_sleep_mode"})
    return engine_args.create_engine_config().use_v2_model_runner, kwargs


@pytest.mark.parametrize(("has_triton", "env"), [(True, None), (False, None), (True, "0"), (True, "1")])
def test_runner_choice_matches_vllm(monkeypatch, tiny_model, has_triton, env):
    """CUDA (Triton present, nothing set) -> V2; CPU build (no Triton) -> V1; the env var wins."""
    if env is None:
        monkeypatch.delenv(vllm_hooks.V2_RUNNER_ENV, raising=False)
    else:
        monkeypatch.setenv(vllm_hooks.V2_RUNNER_ENV, env)
    ours = vllm_hooks.uses_v2_runner(has_triton=has_triton)
    vllm_choice, _ = vllm_picks_v2(monkeypatch, tiny_model("qwen2_5_vl"), has_triton, env)
    assert ours == vllm_choice == (has_triton if env is None else env == "1")


def gpu_kwargs(use_v2: bool, tp: int = 2, visible_gpus: int = 1, model_path: str = "/m", **config) -> dict:
    """`LLM(...)` arguments for a simulated GPU rank (Ray: one visible GPU per rank by default)."""
    return llm_kwargs(
        rollout_config(tensor_parallel_size=tp, dtype="bf16", **config),
        model_path=model_path,
        tokenizer_path=model_path,
        max_model_len=1024,
        seed=3,
        limit_images=2,
        banned_token_ids=BANNED,
        on_gpu=True,
        visible_gpus=visible_gpus,
        use_v2_runner=use_v2,
    )


def test_processor_class_passes_the_check_of_the_runner_vllm_picks_on_cuda(monkeypatch, tiny_model):
    """The check `LLM()` runs in its frontend (`InputProcessor._build_logits_processors_params_validator`)
    accepts our class for the runner vLLM picks on CUDA; the V1 class (vlrl before the fix) fails it."""
    from vllm.v1.sample.logits_processor import validate_logits_processors_parameters
    from vllm.v1.worker.gpu.sample.logits_processor import build_custom_logits_processors_params_validator

    monkeypatch.delenv(vllm_hooks.V2_RUNNER_ENV, raising=False)
    runs_v2, kwargs = vllm_picks_v2(monkeypatch, tiny_model("qwen2_5_vl"), True, None)
    assert runs_v2
    build_custom_logits_processors_params_validator(kwargs["logits_processors"])  # raises for a non-V2 class
    with pytest.raises(ValueError, match="is not a subclass"):
        build_custom_logits_processors_params_validator([vllm_hooks.ban_tokens_processor(BANNED, False)])
    # And the V1 runner (CPU) accepts the V1 class.
    from vllm import SamplingParams

    validate_logits_processors_parameters([vllm_hooks.ban_tokens_processor(BANNED, False)], SamplingParams())


def test_v2_processor_bans_tokens_as_the_v2_sampler_calls_it():
    """Instantiated by vLLM's V2 builder (as `GPUModelRunner` does), claimed for every request, and
    `apply(logits, ctx)` sets the banned columns to -inf and leaves the rest."""
    import numpy as np
    from vllm import SamplingParams
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext, build_custom_logits_processors

    cls = vllm_hooks.ban_tokens_processor(BANNED, use_v2=True)
    req_states = SimpleNamespace(device=torch.device("cpu"), max_num_reqs=4, vocab_size=VOCAB, all_token_ids=None,
                                 prompt_len=None, prefill_len=None, total_len=None)  # fmt: skip
    (processor,) = build_custom_logits_processors(None, req_states, False, [cls])
    # Plain temperature-1 sampling: the sampler would skip all processing unless we claim the request.
    assert processor.add_request(0, SamplingParams(temperature=1.0)) is True
    rows = 3
    logits = torch.randn(rows, VOCAB)
    ctx = LogitsContext(
        expanded_idx_mapping=torch.arange(rows), idx_mapping=torch.arange(rows), idx_mapping_np=np.arange(rows),
        expanded_local_pos=torch.zeros(rows, dtype=torch.long), input_ids=torch.zeros(rows, dtype=torch.long),
        pos=torch.zeros(rows, dtype=torch.long), seq_lens_upper_bound_np=np.ones(rows, dtype=np.int64),
    )  # fmt: skip
    out = processor.apply(logits.clone(), ctx)
    banned = torch.zeros(VOCAB, dtype=torch.bool)
    banned[[3, 7]] = True
    assert torch.isneginf(out[:, banned]).all()
    assert out[:, ~banned].equal(logits[:, ~banned])


def test_request_seeds_are_distinct_repeatable_and_int64():
    n, prompts = 5, 64
    seeds = vllm_hooks.request_seeds(11, prompts, n)
    assert seeds == vllm_hooks.request_seeds(11, prompts, n)
    samples = {s + j for s in seeds for j in range(n)}  # vLLM's seed for sample j of a prompt
    assert len(samples) == prompts * n
    assert samples.isdisjoint(s + j for s in vllm_hooks.request_seeds(12, prompts, n) for j in range(n))
    assert all(0 <= s < 2**63 for s in samples)


def v2_engine(dp_rank: int = 1) -> VLLMRolloutEngine:
    """An engine object with the V2 runner (no `vllm.LLM`: only the call parameters are asked for)."""
    engine = VLLMRolloutEngine.__new__(VLLMRolloutEngine)
    engine.config, engine.dp_rank, engine.use_v2 = rollout_config(seed=4), dp_rank, True
    engine.eos_token_ids = [2]
    engine._call_seeds = random.Random(4 + dp_rank)
    return engine


def test_v2_calls_pass_a_seed_per_request():
    """V2 samples from per-request seeds: prompt i gets request_seeds(call seed + dp_rank)[i]; without
    a seed override the engine's own seed stream decides, the same on every run (TP peers agree)."""
    engine = v2_engine(dp_rank=1)
    seeded = resolve_sampling(engine.config, 8, {"seed": 9, "n": 3})
    params, torch_seed = engine._call_params(4, seeded)
    assert torch_seed is None  # V2 does not sample from torch's generator
    assert [p.seed for p in params] == vllm_hooks.request_seeds(10, 4, 3)
    assert all(p.n == 3 for p in params)
    unseeded = resolve_sampling(engine.config, 8, {})

    def two_unseeded_calls(engine: VLLMRolloutEngine) -> list[list[int]]:
        calls = [engine._call_params(2, unseeded)[0] for _ in range(2)]
        return [[p.seed for p in params] for params in calls]

    first = two_unseeded_calls(v2_engine(dp_rank=1))
    assert first == two_unseeded_calls(v2_engine(dp_rank=1))  # a restarted engine repeats its stream
    assert first[0] != first[1]  # and the stream moves on between calls
    assert first != two_unseeded_calls(v2_engine(dp_rank=0))  # data-parallel replicas differ


def test_llm_kwargs_for_gpu_layouts():
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as V2LogitsProcessor

    """Ray (one visible GPU per rank) with TP 2: custom all-reduce off; torchrun (all GPUs visible) keeps it."""
    ray = gpu_kwargs(True, tp=2, visible_gpus=1, enable_sleep_mode=True)
    assert ray["disable_custom_all_reduce"] is True
    assert ray["enable_sleep_mode"] is True and ray["enforce_eager"] is False
    assert "kv_cache_memory_bytes" not in ray and "block_size" not in ray  # vLLM's GPU default
    assert issubclass(ray["logits_processors"][0], V2LogitsProcessor)
    assert "disable_custom_all_reduce" not in gpu_kwargs(True, tp=2, visible_gpus=8)
    assert "disable_custom_all_reduce" not in gpu_kwargs(True, tp=1, visible_gpus=1)
    cpu = llm_kwargs(rollout_config(tensor_parallel_size=2), model_path="/m", tokenizer_path="/m",
                     max_model_len=512, seed=1, limit_images=None, banned_token_ids=BANNED, on_gpu=False,
                     visible_gpus=0, use_v2_runner=False, kv_cache_bytes=123)  # fmt: skip
    assert "disable_custom_all_reduce" not in cpu and "enable_sleep_mode" not in cpu
    assert cpu["enforce_eager"] is True and cpu["kv_cache_memory_bytes"] == 123
    assert cpu["block_size"] == vllm_hooks.CPU_BLOCK_SIZE == 32
    assert "limit_mm_per_prompt" not in cpu


def test_device_normalization_only_when_videos_normalise_like_images(tiny_model):
    """vLLM 0.32 normalises video pixels on the device with the image processor's mean/std: fine
    when the video processor's agree (Qwen2/2.5-VL, and real Qwen3-VL folders: 0.5/0.5 for both),
    turned off otherwise (the tiny Qwen3-VL: CLIP values for images, 0.5/0.5 for videos)."""
    from vlrl.models.processor import load_processor

    assert vllm_hooks.device_normalization_ok(load_processor(tiny_model("qwen2_5_vl"))[1])
    assert not vllm_hooks.device_normalization_ok(load_processor(tiny_model("qwen3_vl"))[1])
    half = dict(
        do_rescale=True, rescale_factor=1 / 255, do_normalize=True, image_mean=[0.5] * 3, image_std=[0.5] * 3
    )
    same = SimpleNamespace(image_processor=SimpleNamespace(**half), video_processor=SimpleNamespace(**half))
    assert vllm_hooks.device_normalization_ok(same)
    off = SimpleNamespace(**{**half, "do_normalize": False})
    assert not vllm_hooks.device_normalization_ok(
        SimpleNamespace(image_processor=same.image_processor, video_processor=off)
    )
    assert vllm_hooks.device_normalization_ok(SimpleNamespace(image_processor=off, video_processor=off))
    no_videos = SimpleNamespace(image_processor=same.image_processor)
    assert vllm_hooks.device_normalization_ok(no_videos)

    def kwargs(**extra):
        return llm_kwargs(rollout_config(), model_path="/m", tokenizer_path="/m", max_model_len=512, seed=1,
                          limit_images=1, limit_videos=1, banned_token_ids=BANNED, on_gpu=False, visible_gpus=0,
                          use_v2_runner=False, **extra)  # fmt: skip

    assert "mm_device_do_normalize" not in kwargs()  # vLLM's default (on)
    assert kwargs(device_normalize=False)["mm_device_do_normalize"] is False


class _Rope(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cos_sin_cache", torch.ones(4), persistent=False)


def test_reload_warning_dropped_only_for_buffer_only_layers():
    """vLLM warns "<Layer>: Failed to load weights" for every layer that got no tensor in a reload:
    dropped for layers without parameters (their buffers are kept), kept for the others."""
    model = torch.nn.Sequential(_Rope(), torch.nn.Linear(2, 2), torch.nn.Sequential())
    assert vllm_hooks.buffer_only_layers(model) == {"_Rope"}
    logger = logging.getLogger(vllm_hooks.RELOAD_WARNING_LOGGER)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        with vllm_hooks.dropped_reload_warnings(vllm_hooks.buffer_only_layers(model)):
            for name in ("_Rope", "Linear"):
                logger.warning(vllm_hooks.RELOAD_WARNING, name)
            logger.warning("_Rope: something else")
        logger.warning(vllm_hooks.RELOAD_WARNING, "_Rope")  # outside the reload: kept
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == [
        "Linear: Failed to load weights",
        "_Rope: something else",
        "_Rope: Failed to load weights",
    ]
