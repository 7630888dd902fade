"""REINFORCE++ on a CUDA rank: the whitening's sums are CPU float64 tensors, all-reduced through the
CPU (gloo) backend of the default group that a CUDA rank initialises with NCCL for its GPU tensors
(`process_group_backend("cuda")`); without a CPU backend the all-reduce raises. World of one: the
advantages equal the estimator's on one process."""

import socket

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_token_level_advantages_all_reduce_on_a_nccl_rank() -> None:
    from vlrl.algorithms import compute_advantages
    from vlrl.batch.rows import RolloutBatch, TokenRewards
    from vlrl.rewards import scores_to_token_level
    from vlrl.workers.rank_worker import process_group_backend
    from vlrl.workers.token_advantages import token_level_advantages

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(
        process_group_backend("cuda"), init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
    )
    try:
        lengths = torch.tensor([3, 5, 0, 2])
        mask = (torch.arange(5)[None] < lengths[:, None]).long()
        n = len(lengths)
        batch = RolloutBatch(
            input_ids=torch.ones(n, 6, dtype=torch.long), attention_mask=torch.ones(n, 6, dtype=torch.long),
            position_ids=torch.arange(6).repeat(n, 1), responses=torch.ones(n, 5, dtype=torch.long),
            response_mask=mask, group_ids=torch.arange(n), prompt_length=1, images=[[]] * n,
            prompts=["p"] * n, ground_truths=[None] * n, extras=[{}] * n,
        )  # fmt: skip
        scores = torch.tensor([1.0, 0.0, 1.0, 0.5])
        advantages, stats = token_level_advantages(batch, TokenRewards("reinforce_plus_plus", scores, 0.9), 1)
        expected, _ = compute_advantages(
            "reinforce_plus_plus", scores_to_token_level(scores, mask), mask, batch.group_ids, gamma=0.9
        )
        assert torch.equal(advantages, expected)
        assert stats["critic/advantages/max"] == expected[mask.bool()].double().max().item()
    finally:
        dist.destroy_process_group()
