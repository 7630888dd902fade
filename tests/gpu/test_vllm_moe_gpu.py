"""Qwen3-VL-MoE in vLLM on one CUDA GPU: weight sync into the CUDA fused-MoE engine.

On CUDA vLLM's reload path differs from the CPU one (tests/rollout/test_vllm_moe.py): the experts
are converted by the CUDA kernel's own `process_weights_after_loading` (no CPU prepack to redo:
`vllm_hooks.repack_cpu_moe_experts` skips CUDA models) and the V2 model runner generates. Needs vLLM
(skipped where it is not installed, e.g. the bare GPU machine of docs/gpu.md).
"""

from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("vllm")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rollout"))
from rollout_helpers import (  # noqa: E402
    close_world,
    data_config,
    free_port,
    greedy_hf_batch,
    load_hf_model,
    perturb,
    prompt_batch,
    rollout_config,
)

from vlrl.models.processor import load_processor  # noqa: E402
from vlrl.models.tiny import build_tiny_model  # noqa: E402
from vlrl.rollout import create_rollout_engine, sync_weights  # noqa: E402

GREEDY = {"temperature": 0.0, "n": 1}


def test_synced_moe_engine_equals_transformers_on_cuda(tmp_path: Path) -> None:
    path = str(build_tiny_model(tmp_path / "moe", arch="qwen3_vl_moe"))
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))  # fmt: skip
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, timeout=datetime.timedelta(seconds=300))
    tokenizer, processor = load_processor(path)
    # fp32 so that vLLM and transformers (on the CPU) agree token for token, as in the CPU test
    engine = create_rollout_engine(
        rollout_config(dtype="fp32", calculate_log_probs=True), data_config(), path, tokenizer, processor
    )
    try:
        prompts = prompt_batch(path)
        model = load_hf_model(path)
        perturb(model, seed=3)
        for _ in range(2):  # the second reload must give the same engine
            sync_weights(model, engine, bucket_mb=1)
            got = engine.generate(prompts, GREEDY)
            expected = greedy_hf_batch(path, model, prompts, 12)
            assert got.responses.equal(expected.responses)
            torch.testing.assert_close(got.rollout_log_probs, expected.rollout_log_probs, atol=2e-3, rtol=0)
    finally:
        engine.close()
        close_world()
