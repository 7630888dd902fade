"""The vLLM engine on one CUDA GPU (one-rank NCCL world): the model runner vLLM picks there (V2 by
default in vLLM 0.32) takes our token-ban processor, per-request seeds repeat, sleep mode round-trips.

Needs vLLM (skipped where it is not installed, e.g. the bare GPU machine of docs/gpu.md). The
CPU-side logic is tested in tests/rollout/test_vllm_runner.py; these tests prove it on the real runner.
"""

from __future__ import annotations

import copy
import datetime
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("vllm")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rollout"))
from rollout_helpers import (  # noqa: E402
    close_world,
    data_config,
    free_port,
    load_hf_model,
    make_token_argmax,
    prompt_batch,
    rollout_config,
)

from vlrl.models.processor import load_processor  # noqa: E402
from vlrl.models.tiny import build_tiny_model  # noqa: E402
from vlrl.rollout import create_rollout_engine, sync_weights, vllm_hooks  # noqa: E402


@pytest.fixture(scope="module")
def gpu(tmp_path_factory):
    """One bf16 engine with sleep mode in a one-rank NCCL world, given the checkpoint's weights."""
    path = str(build_tiny_model(tmp_path_factory.mktemp("gpu_vllm"), arch="qwen2_5_vl"))
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))  # fmt: skip
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, timeout=datetime.timedelta(seconds=300))
    runner_env_before = os.environ.get(vllm_hooks.V2_RUNNER_ENV)  # the engine pins it
    tokenizer, processor = load_processor(path)
    config = rollout_config(dtype="bf16", calculate_log_probs=True, enable_sleep_mode=True)
    engine = create_rollout_engine(config, data_config(), path, tokenizer, processor)
    base = load_hf_model(path)
    sync_weights(base, engine, bucket_mb=1)
    yield SimpleNamespace(
        engine=engine, base=base, prompts=prompt_batch(path), runner_env_before=runner_env_before
    )
    engine.close()
    close_world()


def test_runner_and_processor_agree(gpu):
    """vLLM ran the runner the engine predicted, with the processor class of that runner."""
    from vllm.v1.sample.logits_processor import LogitsProcessor as V1LogitsProcessor
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as V2LogitsProcessor

    vllm_config = gpu.engine.llm.llm_engine.vllm_config
    runs_v2 = vllm_config.use_v2_model_runner
    assert runs_v2 == gpu.engine.use_v2
    if gpu.runner_env_before is None:
        from vllm.triton_utils import HAS_TRITON

        assert runs_v2 == HAS_TRITON  # vLLM's CUDA default: V2 whenever Triton works
    (processor,) = vllm_config.model_config.logits_processors
    assert issubclass(processor, V2LogitsProcessor if runs_v2 else V1LogitsProcessor)


def test_seeded_sampling_repeats_and_differs(gpu):
    first = gpu.engine.generate(gpu.prompts, {"seed": 5})
    assert gpu.engine.generate(gpu.prompts, {"seed": 5}).responses.equal(first.responses)
    assert not gpu.engine.generate(gpu.prompts, {"seed": 6}).responses.equal(first.responses)
    assert any(not g[0].equal(g[1]) for g in first.responses.view(3, 2, -1))  # samples of a prompt differ
    mask = first.response_mask.bool()
    log_probs = first.rollout_log_probs[mask]
    assert torch.isfinite(log_probs).all() and (log_probs <= 0).all() and log_probs.lt(-1e-3).any()


def test_image_token_is_never_sampled(gpu):
    """`<|image_pad|>` is the argmax after every prefix; greedy and sampling never emit a banned id."""
    model = copy.deepcopy(gpu.base)
    make_token_argmax(model, gpu.engine.hf_config.image_token_id)
    sync_weights(model, gpu.engine, bucket_mb=1)
    banned = torch.tensor(gpu.engine.banned_token_ids)
    try:
        for overrides in ({"temperature": 0.0, "n": 1}, {"seed": 1}, {"seed": 2, "temperature": 2.0}):
            out = gpu.engine.generate(gpu.prompts, overrides)
            assert not torch.isin(out.responses, banned).any()
    finally:
        sync_weights(gpu.base, gpu.engine, bucket_mb=64)


def test_sleep_sync_wake_round_trip(gpu):
    """Asleep (weights offloaded, KV cache dropped), a weight sync and a generate give what an awake
    engine gives."""
    awake = gpu.engine.generate(gpu.prompts, {"seed": 9}).responses
    gpu.engine.sleep()
    assert gpu.engine.asleep
    sync_weights(gpu.base, gpu.engine, bucket_mb=4)
    again = gpu.engine.generate(gpu.prompts, {"seed": 9}).responses
    assert not gpu.engine.asleep
    assert again.equal(awake)
