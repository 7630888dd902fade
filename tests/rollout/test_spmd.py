"""Two ranks in SPMD: each its own vLLM engine (TP=1), weights synced from FSDP2 shards, own prompts."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from rollout_helpers import free_port, greedy_hf, load_hf_model, perturb, prompt_batch
from spmd_job import run


@pytest.mark.slow
def test_two_ranks_generate_their_shards(tiny_model, tmp_path):
    path = tiny_model("qwen2_5_vl")
    mp.start_processes(run, args=(2, free_port(), path, str(tmp_path)), nprocs=2, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert [r["dp_rank"] for r in ranks] == [0, 1]
    assert ranks[0]["own_groups"].tolist() == [100, 100, 101, 101]
    assert ranks[1]["own_groups"].tolist() == [102, 102]
    model = load_hf_model(path)
    full_bytes = sum(t.numel() * 4 for t in model.state_dict().values())
    assert all(r["metrics"]["sync/bytes"] == full_bytes for r in ranks)
    # Seeds: each rank repeats itself; the ranks differ (seed + dp_rank).
    assert all(r["probe"].equal(r["probe_again"]) for r in ranks)
    assert not ranks[0]["probe"].equal(ranks[1]["probe"])
    # Both ranks hold the synced weights: greedy equals transformers on the same weights.
    perturb(model, seed=4)
    expected = greedy_hf(path, model, prompt_batch(path), 12)
    assert all(r["greedy"].equal(expected) for r in ranks)
