"""REINFORCE++ on the ranks: each rank whitens the returns of its own rows with the whole batch's
mean and std (sums added up by an all-reduce), and gets what the whole batch gives on one process."""

from __future__ import annotations

import torch
import torch.distributed as dist
from actor_helpers import init_gloo, launch

from vlrl.algorithms import compute_advantages

SHARDS = [[0, 5, 2, 7], [1, 3, 4, 6]]


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([5, 1, 9, 0, 3, 9, 7, 2])  # one response without a token
    mask = (torch.arange(9)[None] < lengths[:, None]).long()
    return torch.randn(8, 9, generator=g) * mask, mask


def _rank(rank: int, world: int, port: int, out: dict) -> None:
    init_gloo(rank, world, port)
    rewards, mask = _batch()
    rows = SHARDS[rank]

    def sum_over_ranks(local: torch.Tensor) -> torch.Tensor:
        total = local.clone()
        dist.all_reduce(total)
        return total

    adv, _ = compute_advantages(
        "reinforce_plus_plus", rewards[rows], mask[rows], torch.zeros(len(rows)), gamma=0.9,
        sum_over_ranks=sum_over_ranks,
    )  # fmt: skip
    out[rank] = adv
    dist.destroy_process_group()


def test_ranks_whiten_their_rows_with_the_whole_batchs_statistics() -> None:
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        out = manager.dict()
        launch(_rank, 2, out)
        per_rank = dict(out)
    rewards, mask = _batch()
    whole, _ = compute_advantages("reinforce_plus_plus", rewards, mask, torch.zeros(8), gamma=0.9)
    for rank, rows in enumerate(SHARDS):
        torch.testing.assert_close(per_rank[rank], whole[rows], rtol=0, atol=1e-6)
    # and the statistics are the whole batch's: its valid tokens have mean 0 and std 1
    valid = torch.cat([per_rank[r][mask[SHARDS[r]].bool()] for r in range(2)]).double()
    assert abs(valid.mean().item()) < 1e-6 and abs(valid.std(unbiased=False).item() - 1) < 1e-5
