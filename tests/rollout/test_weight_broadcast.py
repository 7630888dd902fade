"""Asynchronous mode's weight path: a training rank broadcasts to rollout ranks in other worlds."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from broadcast_job import run
from rollout_helpers import free_port, greedy_hf, load_hf_model, perturb, prompt_batch


@pytest.mark.slow
def test_rollout_ranks_generate_with_the_broadcast_weights(tiny_model, tmp_path):
    path = tiny_model("qwen2_5_vl")
    ports = [free_port() for _ in range(3)]
    mp.start_processes(run, args=(ports, free_port(), path, str(tmp_path)), nprocs=3, start_method="spawn")
    train, engine, recorder = (torch.load(tmp_path / f"member{m}.pt", weights_only=False) for m in range(3))
    model = load_hf_model(path)
    expected_bytes = sum(t.numel() * 4 for t in model.state_dict().values())
    assert train["bytes4"] == train["bytes5"] == expected_bytes
    assert train["buckets"] > 1  # several buckets (0.25 MiB each), so the layout spans buckets
    prompts = prompt_batch(path)
    for sync, seed in ((1, 4), (2, 5)):
        perturb(model, seed=seed)  # the trainer's weights after this sync
        state = model.state_dict()
        received = recorder["received"][sync - 1]
        assert received.keys() == state.keys()
        assert all(torch.equal(received[name], state[name]) for name in state)  # bit for bit
        # the engine's greedy output equals transformers' on the trainer's weights
        assert engine[f"greedy{sync}"].equal(greedy_hf(path, model, prompts, 12))
        # ...and every token it sampled carries the announced version of those weights
        assert engine[f"versions{sync}"].eq(sync + 2).all()
    assert recorder["versions"] == [3, 4] and recorder["announced_after"] is False
