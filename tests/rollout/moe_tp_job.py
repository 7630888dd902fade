"""What each of the 2 spawned ranks of tests/rollout/test_vllm_moe.py's TP=2 test runs: one
Qwen3-VL-MoE engine split over both ranks (TP=2), synced twice, greedy with log-probs."""

from __future__ import annotations

from pathlib import Path

import torch
from rollout_helpers import (
    close_world,
    data_config,
    init_world,
    load_hf_model,
    perturb,
    prompt_batch,
    rollout_config,
)

from vlrl.models.processor import load_processor
from vlrl.rollout import create_rollout_engine, sync_weights

GREEDY = {"temperature": 0.0, "n": 1}


def run(rank: int, world_size: int, port: int, model_dir: str, out_dir: str) -> None:
    """Sync perturbed weights, generate; sync the checkpoint's back, generate (a reload after a reload)."""
    torch.set_num_threads(1)  # two ranks share the machine's cores
    init_world(rank, world_size, port)
    tokenizer, processor = load_processor(model_dir)
    config = rollout_config(tensor_parallel_size=2, max_num_seqs=8, calculate_log_probs=True)
    engine = create_rollout_engine(config, data_config(), model_dir, tokenizer, processor)
    prompts = prompt_batch(model_dir)
    base = load_hf_model(model_dir)
    model = load_hf_model(model_dir)
    perturb(model, seed=3)
    result = {}
    for key, weights in (("perturbed", model), ("base", base)):
        sync_weights(weights, engine, bucket_mb=1)
        out = engine.generate(prompts, GREEDY)
        result[key] = (out.responses, out.rollout_log_probs)
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    engine.close()
    close_world()
