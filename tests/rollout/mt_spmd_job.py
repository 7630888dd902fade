"""What each of the 2 spawned ranks of test_mt_vllm.py::test_two_ranks_multi_turn runs: its own vLLM
engine (TP=1) and tool pool, multi-turn rollouts of its own shard, results saved for the parent."""

from __future__ import annotations

from pathlib import Path

import torch
from mt_helpers import CUES, mt_rollout_config
from rollout_helpers import close_world, data_config, init_world, load_hf_model, prompt_batch

from vlrl.models.processor import load_processor
from vlrl.rollout import create_rollout_engine, sync_weights

SHARDS = [[0, 1], [0, 3]]  # rank -> CUES rows: both show the image tool, then add / a malformed call


def run(rank: int, world_size: int, port: int, model_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)  # two ranks share the machine's cores
    init_world(rank, world_size, port)
    tokenizer, processor = load_processor(model_dir)
    config = mt_rollout_config(gpu_memory_utilization=0.05, max_num_seqs=8)
    engine = create_rollout_engine(config, data_config(160), model_dir, tokenizer, processor)
    sync_weights(load_hf_model(model_dir), engine, bucket_mb=1)  # the taught weights, as the actor holds them
    prompts = prompt_batch(model_dir, [CUES[i][0] for i in SHARDS[rank]])
    batch = engine.generate(prompts, {"temperature": 0.0, "n": 1, "seed": 3})
    result = {
        "dp_rank": engine.dp_rank,
        "trajectories": batch.trajectories,
        "responses": batch.responses,
        "response_mask": batch.response_mask,
        "attention_mask": batch.attention_mask,
        "prompt_length": batch.prompt_length,
        "image_sizes": [[img.size for img in images] for images in batch.images],
    }
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    engine.close()
    close_world()
