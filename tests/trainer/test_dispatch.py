"""Driver-side split and merge: padding to common widths keeps every token where it belongs."""

import pytest
import torch

from vlrl.batch.rows import PromptBatch, RolloutBatch
from vlrl.trainer.dispatch import balanced_shards, gather_rows, merge_rollouts, split_prompts

PAD = 0


def _prompts(n: int) -> PromptBatch:
    return PromptBatch(
        input_ids=torch.arange(n * 2).view(n, 2), attention_mask=torch.ones(n, 2, dtype=torch.long),
        position_ids=torch.zeros(n, 2, dtype=torch.long), raw_prompt_ids=[[i] for i in range(n)],
        images=[[] for _ in range(n)], prompts=[f"p{i}" for i in range(n)], ground_truths=list(range(n)),
        extras=[{} for _ in range(n)], uids=list(range(n)),
    )  # fmt: skip


def _rollout(prompt: list[int], response: list[int], eos_at: int, gid: int) -> RolloutBatch:
    p, r = len(prompt), len(response)
    ids = torch.tensor([prompt + response])
    return RolloutBatch(
        input_ids=ids, attention_mask=(ids != PAD).long(), position_ids=torch.arange(p + r).view(1, -1),
        responses=torch.tensor([response]), response_mask=torch.tensor([[1] * eos_at + [0] * (r - eos_at)]),
        group_ids=torch.tensor([gid]), prompt_length=p, images=[[]], prompts=["x"], ground_truths=[None],
        extras=[{}], rollout_log_probs=torch.full((1, r), -1.0),
    )  # fmt: skip


def test_split_prompts_by_data_parallel_group() -> None:
    shards = split_prompts(_prompts(5), world_size=4, tp_size=2)
    # two DP groups of 2 ranks; TP peers get identical prompts; sizes differ by at most one
    assert [s.uids for s in shards] == [[0, 1], [0, 1], [2, 3, 4], [2, 3, 4]]


def test_merge_pads_prompt_left_and_response_right() -> None:
    a = _rollout([0, 5, 6], [7, 8], eos_at=2, gid=0)  # P=3 (one left pad), R=2
    b = _rollout([9, 10], [11, 12, 13, 14], eos_at=3, gid=1)  # P=2, R=4
    merged = merge_rollouts([a, b], tp_size=1, pad_token_id=PAD)
    assert merged.prompt_length == 3
    assert merged.input_ids.tolist() == [[0, 5, 6, 7, 8, 0, 0], [0, 9, 10, 11, 12, 13, 14]]
    assert merged.attention_mask.tolist() == [[0, 1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 1]]
    assert merged.responses.tolist() == [[7, 8, 0, 0], [11, 12, 13, 14]]
    assert merged.response_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 0]]
    # the response columns of input_ids are exactly `responses`
    assert torch.equal(merged.input_ids[:, merged.prompt_length :], merged.responses)
    assert merged.rollout_log_probs.tolist() == [[-1, -1, 0, 0], [-1, -1, -1, -1]]
    assert merged.group_ids.tolist() == [0, 1]


def test_merge_takes_one_rank_per_tensor_parallel_group() -> None:
    a, b = _rollout([1], [2], 1, 0), _rollout([3], [4], 1, 1)
    merged = merge_rollouts([a, a, b, b], tp_size=2, pad_token_id=PAD)
    assert merged.group_ids.tolist() == [0, 1]
    # the peers return None (RankWorker.generate_stream): the same merge
    assert torch.equal(
        merge_rollouts([a, None, b, None], tp_size=2, pad_token_id=PAD).input_ids, merged.input_ids
    )


def _scored_batch(rows: int = 12, width: int = 6) -> RolloutBatch:
    from vlrl.algorithms import compute_advantages

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    mask = (torch.arange(width)[None] < lengths[:, None]).long()  # [rows, width] varied lengths
    scores = torch.zeros(rows, width)
    scores[torch.arange(rows), lengths - 1] = torch.rand(rows, generator=g)
    batch = RolloutBatch.concat(
        [_rollout([1, 2], [3] * width, eos_at=width, gid=i // 4) for i in range(rows)]
    )
    batch.response_mask = mask
    batch.advantages, _ = compute_advantages("grpo", scores, mask, batch.group_ids)
    return batch


def test_outcome_advantages_cross_as_one_float_per_row_and_spread_back_exactly() -> None:
    import pickle

    from vlrl.batch.rows import spread_over_response
    from vlrl.trainer.ppo_trainer import PPOTrainer

    batch, shards = _scored_batch(), [[5, 0, 7, 2, 9, 11], [1, 3, 4, 6, 8, 10]]
    per_row = PPOTrainer._update_shards(batch, shards, kept=True)
    for kept, rows in zip(per_row, shards):
        assert kept.rows == rows and not kept.columns and kept.per_row["advantages"].shape == (6,)
        rebuilt = spread_over_response(kept.per_row["advantages"], batch.response_mask[rows])
        assert torch.equal(rebuilt, batch.advantages[rows])  # what the rank's update gets
    # per-token advantages (truncated importance weights) go whole
    batch.advantages = batch.advantages * torch.linspace(0.5, 1.5, 6)
    per_token = PPOTrainer._update_shards(batch, shards, kept=True)
    assert all(
        not k.per_row and torch.equal(k.columns["advantages"], batch.advantages[r])
        for k, r in zip(per_token, shards)
    )
    assert len(pickle.dumps(per_row)) < len(pickle.dumps(per_token))


def test_gather_rows_restores_order() -> None:
    shards = [[2, 0], [1, 3]]
    values = [torch.tensor([[20.0], [0.0]]), torch.tensor([[10.0], [30.0]])]
    assert gather_rows(shards, values, 4).flatten().tolist() == [0.0, 10.0, 20.0, 30.0]


def test_unfilled_stage_outputs_fail_naming_the_field() -> None:
    batch = _rollout([1, 2], [3, 4], eos_at=2, gid=0)
    with pytest.raises(ValueError, match="'advantages'"):
        batch.tensor("advantages")
    with pytest.raises(ValueError, match="not been scored"):
        batch.scored_parts()
    batch.advantages = torch.ones(1, 2)
    batch.reward_parts = [{"overall": 1.0}]
    assert batch.tensor("advantages").shape == (1, 2)
    assert batch.select([0, 0]).scored_parts() == [{"overall": 1.0}, {"overall": 1.0}]


def test_ulysses_groups_get_identical_balanced_shards() -> None:
    lengths = [9, 1, 8, 2, 7, 3, 6, 4]
    parts = [_rollout([5] * n, [7], eos_at=1, gid=i) for i, n in enumerate(lengths)]
    batch = merge_rollouts(parts, tp_size=1, pad_token_id=PAD)
    shards = balanced_shards(batch, world_size=4, ulysses_size=2)
    assert shards[0] == shards[1] and shards[2] == shards[3]  # a group's ranks split the same rows by tokens
    assert sorted(shards[0] + shards[2]) == list(range(8))  # the two groups split the batch
    tokens = [sum(lengths[i] + 1 for i in s) for s in (shards[0], shards[2])]
    assert tokens[0] == tokens[1]
    values = [torch.tensor(s, dtype=torch.float32)[:, None] for s in shards]
    assert gather_rows(shards, values, 8)[:, 0].tolist() == list(range(8))


def test_streamed_groups_land_on_their_merged_rows() -> None:
    """A group reported by rank r goes to the rows its samples will have in the merged batch:
    (prompts of earlier data-parallel groups + its row in the shard) x n + sample."""
    from vlrl.batch.rows import FinishedGroups
    from vlrl.trainer.scoring import merged_rows, prompt_offsets

    shards = split_prompts(_prompts(5), world_size=4, tp_size=2)  # groups of 2 and 3 prompts
    assert prompt_offsets(shards, tp_size=2) == [0, 0, 2, 2]
    # rank 2 (second group) finished its prompts 2 and 0, with 2 samples each
    groups = FinishedGroups(prompt_rows=[2, 0], responses=[[1], [2], [3], [4]])
    merged_uids = [uid for s in shards[::2] for uid in s.uids for _ in range(2)]  # the merged rows' prompts
    rows = merged_rows(groups, prompt_offsets(shards, 2)[2])
    assert rows == [8, 9, 4, 5]
    assert [merged_uids[r] for r in rows] == [shards[2].uids[2]] * 2 + [shards[2].uids[0]] * 2


def test_every_tensor_field_has_a_padding_kind() -> None:
    """Merging pads each tensor field by its kind; a field in no kind would keep its old width and
    break the concatenation (the multi-round crash: token_level_scores was missed)."""
    from dataclasses import fields

    from vlrl.batch.rows import PER_ROW_FIELDS, RESPONSE_FIELDS, SEQUENCE_FIELDS

    tensors = [f.name for f in fields(RolloutBatch) if "Tensor" in str(f.type)]
    kinds = [*SEQUENCE_FIELDS, *RESPONSE_FIELDS, *PER_ROW_FIELDS]
    assert sorted(tensors) == sorted(kinds) and len(set(kinds)) == len(kinds)


def test_merge_pads_the_scored_fields_of_rounds_of_different_widths() -> None:
    """Two generation rounds (DAPO's mini_rollout_batch_size, online filtering) are scored before
    they are merged: every [N, R] field filled by then is padded with the rest."""
    a = _rollout([1, 2], [3, 4, 5], eos_at=3, gid=0)
    b = _rollout([6, 7], [8, 9], eos_at=1, gid=1)
    for batch, width in ((a, 3), (b, 2)):
        batch.token_level_scores = torch.arange(1.0, width + 1).view(1, -1)
        batch.old_log_probs = torch.full((1, width), -0.5)
    merged = merge_rollouts([a, b], tp_size=1, pad_token_id=PAD)
    assert merged.tensor("token_level_scores").tolist() == [[1, 2, 3], [1, 2, 0]]
    assert merged.tensor("old_log_probs").tolist() == [[-0.5] * 3, [-0.5, -0.5, 0]]
    assert merged.rollout_log_probs.tolist() == [[-1, -1, -1], [-1, -1, 0]]
    assert a.responses.shape == (1, 3) and b.responses.shape == (1, 2)  # inputs are not modified
