"""The vLLM engine on one CUDA GPU (one-rank NCCL world): the model runner vLLM picks there (V2 by
default in vLLM 0.32) takes our token-ban processor, per-request seeds repeat, sleep mode round-trips
at level 1 and level 2 (weights discarded), and the log-probs are those of the truncated distribution.

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


def _weight_allocations() -> list:
    """The CuMem allocator's `weights` allocations (vllm/device_allocator/cumem.py): the engine runs
    in this process (external_launcher), so the allocator is this process's singleton."""
    from vllm.device_allocator.cumem import CuMemAllocator

    return [d for d in CuMemAllocator.get_instance().pointer_to_data.values() if d.tag == "weights"]


def _weight_bytes(engine) -> int:
    def count(worker) -> int:
        return sum(p.numel() * p.element_size() for p in worker.model_runner.get_model().parameters())

    return int(engine.llm.collective_rpc(count)[0])


def test_level_2_sleep_discards_the_weights_and_a_sync_restores_them(gpu):
    """`sleep(weights_replaced_next=True)` (level 2, `vllm_engine.sleep_level`): the weights' GPU memory
    is released without a host copy, generate refuses until a sync, and after the sync the samples and
    log-probs are the awake engine's. Level 1 keeps a host copy (the contrast)."""
    from vlrl.rollout import NoWeightsError

    awake = gpu.engine.generate(gpu.prompts, {"seed": 9})
    weight_bytes = _weight_bytes(gpu.engine)
    gpu.engine.sleep()  # level 1: the weights are backed up to host memory
    assert gpu.engine.has_weights and all(d.cpu_backup_tensor is not None for d in _weight_allocations())
    gpu.engine.wake_up()

    torch.cuda.synchronize()
    free_awake = torch.cuda.mem_get_info()[0]
    gpu.engine.sleep(weights_replaced_next=True)
    torch.cuda.synchronize()
    freed = torch.cuda.mem_get_info()[0] - free_awake
    weights = _weight_allocations()
    assert weights and all(d.is_asleep and d.cpu_backup_tensor is None for d in weights)  # no host copy
    assert freed >= weight_bytes  # the weights (and the KV cache) left the GPU
    assert gpu.engine.weights_discarded and not gpu.engine.has_weights
    with pytest.raises(NoWeightsError, match="level 2"):
        gpu.engine.generate(gpu.prompts, {"seed": 9})

    sync_weights(gpu.base, gpu.engine, bucket_mb=4)  # wakes the weights into fresh memory, loads all
    again = gpu.engine.generate(gpu.prompts, {"seed": 9})
    assert again.responses.equal(awake.responses)
    mask = awake.response_mask.bool()
    torch.testing.assert_close(
        again.rollout_log_probs[mask], awake.rollout_log_probs[mask], rtol=0, atol=1e-5
    )


def test_log_probs_are_those_of_the_truncated_distribution(gpu):
    """The runner vLLM picks on CUDA (V2 by default) returns the log-probs of the distribution it
    sampled from, top-k/top-p applied (vllm_settings.LOGPROBS_MODE): with one token kept they are 0."""
    for overrides in ({"top_k": 1, "seed": 3}, {"top_p": 1e-6, "seed": 3}):
        out = gpu.engine.generate(gpu.prompts, overrides)
        assert out.rollout_log_probs[out.response_mask.bool()].abs().max().item() == 0.0
    full = gpu.engine.generate(gpu.prompts, {"seed": 3})
    assert full.rollout_log_probs[full.response_mask.bool()].lt(-1e-3).any()
