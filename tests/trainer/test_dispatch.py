"""Splitting a step over ranks and joining rows: padding to common widths keeps every token where
it belongs, on the ranks (`concat_padded`, `take`) and on the driver (`StepSamples.join`)."""

import pytest
import torch

from vlrl.batch.held import Held, concat_padded, take
from vlrl.batch.rows import PromptBatch, RolloutBatch
from vlrl.batch.samples import SAMPLE_RESPONSE_FIELDS, StepSamples
from vlrl.trainer.dispatch import (
    balanced_shards,
    gather_penalized,
    gather_rows,
    merge_samples,
    split_prompts,
    update_inputs,
)

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
    merged = concat_padded([a, b], pad_token_id=PAD)
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
    a, b = _rollout([1], [2], 1, 0), _rollout([3], [4, 5], 1, 1)
    sa, sb = StepSamples.of(a, Held(a)), StepSamples.of(b, Held(b))
    merged = merge_samples([sa, sa, sb, sb], tp_size=2, pad_token_id=PAD)
    assert merged.group_ids.tolist() == [0, 1] and merged.responses.tolist() == [[2, 0], [4, 5]]
    # the peers return None (RankWorker.generate_stream): the same merge
    assert torch.equal(
        merge_samples([sa, None, sb, None], tp_size=2, pad_token_id=PAD).responses, merged.responses
    )


def test_ranks_take_their_rows_from_where_they_are_held() -> None:
    """Rows of a step come from several published batches (ranks, rounds) of different widths: a
    rank's plan takes them in its order, equal to padding the batches together and selecting."""
    a = RolloutBatch.concat([_rollout([0, 5, 6], [7, 8], 2, 0), _rollout([1, 2, 3], [4, 5], 1, 0)])
    b = RolloutBatch.concat([_rollout([9, 10], [11, 12, 13, 14], 3, 1), _rollout([6, 6], [1, 2, 3, 4], 4, 1)])
    held_a, held_b = Held(a), Held(b)
    samples = StepSamples.join([StepSamples.of(a, held_a), StepSamples.of(b, held_b)], PAD)
    rows = [3, 0, 1, 2]
    plan = samples.plan(rows)
    assert [(source is held_b, index) for source, index in plan.runs] == [
        (True, [1]),
        (False, [0, 1]),
        (True, [0]),
    ]
    assert (plan.prompt_width, plan.response_width) == (3, 4)  # the step's widest, whatever the rank takes
    one = take(samples.plan([0]), PAD)  # a rank with one short row still gets the step's shapes
    assert one.input_ids.shape == (1, 7) and one.responses.tolist() == [[7, 8, PAD, PAD]]
    taken = take(plan, PAD)
    expected = concat_padded([a, b], PAD).select(rows)
    for name in (
        "input_ids",
        "attention_mask",
        "position_ids",
        "responses",
        "response_mask",
        "rollout_log_probs",
    ):
        assert torch.equal(getattr(taken, name), getattr(expected, name)), name
    assert taken.prompt_length == expected.prompt_length
    # what the driver holds says the same about each sample
    assert samples.sequence_lengths[rows].tolist() == expected.attention_mask.sum(-1).tolist()
    assert torch.equal(samples.responses[rows], expected.responses)


def test_rows_generated_without_keep_cannot_be_taken() -> None:
    a = _rollout([1], [2], 1, 0)
    with pytest.raises(ValueError, match="not held"):
        StepSamples.of(a, None).plan([0])


def _scored_batch(rows: int = 12, width: int = 6) -> StepSamples:
    from vlrl.algorithms import compute_advantages

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    mask = (torch.arange(width)[None] < lengths[:, None]).long()  # [rows, width] varied lengths
    scores = torch.zeros(rows, width)
    scores[torch.arange(rows), lengths - 1] = torch.rand(rows, generator=g)
    rollout = RolloutBatch.concat(
        [_rollout([1, 2], [3] * width, eos_at=width, gid=i // 4) for i in range(rows)]
    )
    batch = StepSamples.of(rollout, Held(rollout))
    batch.response_mask = mask
    batch.advantages, _ = compute_advantages("grpo", scores, mask, batch.group_ids)
    return batch


def test_outcome_advantages_cross_as_one_float_per_row_and_spread_back_exactly() -> None:
    import pickle

    from vlrl.batch.rows import spread_over_response

    batch, shards = _scored_batch(), [[5, 0, 7, 2, 9, 11], [1, 3, 4, 6, 8, 10]]
    per_row = update_inputs(batch, shards)
    for kept, rows in zip(per_row, shards):
        assert kept.rows == rows and not kept.columns and kept.per_row["advantages"].shape == (6,)
        rebuilt = spread_over_response(kept.per_row["advantages"], batch.response_mask[rows])
        assert torch.equal(rebuilt, batch.advantages[rows])  # what the rank's update gets
    # per-token advantages (truncated importance weights) go whole
    batch.advantages = batch.advantages * torch.linspace(0.5, 1.5, 6)
    per_token = update_inputs(batch, shards)
    assert all(
        not k.per_row and torch.equal(k.columns["advantages"], batch.advantages[r])
        for k, r in zip(per_token, shards)
    )
    assert len(pickle.dumps(per_row)) < len(pickle.dumps(per_token))


def test_gather_rows_restores_order_and_width() -> None:
    shards = [[2, 0], [1, 3]]
    # the second rank's rows are narrower: it padded to its own widest response
    values = [torch.tensor([[20.0, 21.0], [0.0, 1.0]]), torch.tensor([[10.0], [30.0]])]
    assert gather_rows(shards, values, 4, 2).tolist() == [[0.0, 1.0], [10.0, 0.0], [20.0, 21.0], [30.0, 0.0]]


def test_unfilled_stage_outputs_fail_naming_the_field() -> None:
    rollout = _rollout([1, 2], [3, 4], eos_at=2, gid=0)
    batch = StepSamples.of(rollout, None)
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
    batch = concat_padded(parts, pad_token_id=PAD)
    shards = balanced_shards(batch.attention_mask.sum(-1), world_size=4, ulysses_size=2)
    assert shards[0] == shards[1] and shards[2] == shards[3]  # a group's ranks split the same rows by tokens
    assert sorted(shards[0] + shards[2]) == list(range(8))  # the two groups split the batch
    tokens = [sum(lengths[i] + 1 for i in s) for s in (shards[0], shards[2])]
    assert tokens[0] == tokens[1]
    values = [torch.tensor(s, dtype=torch.float32)[:, None] for s in shards]
    assert gather_rows(shards, values, 8, 1)[:, 0].tolist() == list(range(8))


def test_streamed_groups_land_on_their_batch_rows() -> None:
    """A group the engine reports finished is scored at the rows its samples have in the rank's
    batch: (its prompt's row in the shard) x n + sample."""
    from vlrl.batch.rows import FinishedGroups
    from vlrl.workers.scoring import batch_rows

    # prompts 2 and 0 of the shard finished, with 2 samples each
    assert batch_rows(FinishedGroups(prompt_rows=[2, 0], responses=[[1], [2], [3], [4]])) == [4, 5, 0, 1]


def test_every_tensor_field_has_a_padding_kind() -> None:
    """Merging pads each tensor field by its kind; a field in no kind would keep its old width and
    break the concatenation (the multi-round crash: token_level_scores was missed)."""
    from dataclasses import fields

    from vlrl.batch.rows import PER_ROW_FIELDS, RESPONSE_FIELDS, SEQUENCE_FIELDS

    tensors = [f.name for f in fields(RolloutBatch) if "Tensor" in str(f.type)]
    kinds = [*SEQUENCE_FIELDS, *RESPONSE_FIELDS, *PER_ROW_FIELDS]
    assert sorted(tensors) == sorted(kinds) and len(set(kinds)) == len(kinds)
    # the driver's samples: every [N, R] field is padded when rounds are joined, the rest are [N, ...]
    per_sample = ["group_ids", "prompt_lengths", "turn_lengths", "sequence_rewards", "version_stats"]
    tensors = [f.name for f in fields(StepSamples) if "Tensor" in str(f.type)]
    assert sorted(tensors) == sorted([*SAMPLE_RESPONSE_FIELDS, *per_sample])


def test_merge_pads_the_scored_fields_of_rounds_of_different_widths() -> None:
    """Two generation rounds (DAPO's mini_rollout_batch_size, online filtering) are scored before
    they are merged: every [N, R] field filled by then is padded with the rest."""
    a = _rollout([1, 2], [3, 4, 5], eos_at=3, gid=0)
    b = _rollout([6, 7], [8, 9], eos_at=1, gid=1)
    for batch, width in ((a, 3), (b, 2)):
        batch.old_log_probs = torch.full((1, width), -0.5)
    merged = concat_padded([a, b], pad_token_id=PAD)
    assert merged.tensor("old_log_probs").tolist() == [[-0.5] * 3, [-0.5, -0.5, 0]]
    assert merged.rollout_log_probs.tolist() == [[-1, -1, -1], [-1, -1, 0]]
    assert a.responses.shape == (1, 3) and b.responses.shape == (1, 2)  # inputs are not modified
    # the driver joins the rounds' samples, scored, the same way
    sa, sb = StepSamples.of(a, Held(a)), StepSamples.of(b, Held(b))
    sa.token_level_scores, sb.token_level_scores = torch.tensor([[1.0, 2, 3]]), torch.tensor([[1.0, 2]])
    joined = StepSamples.join([sa, sb], PAD)
    assert joined.tensor("token_level_scores").tolist() == [[1, 2, 3], [1, 2, 0]]
    assert joined.responses.tolist() == [[3, 4, 5], [8, 9, PAD]]
    assert joined.response_mask.tolist() == [[1, 1, 1], [1, 0, 0]]


def test_the_kl_penalty_on_the_ranks_shards_gives_the_whole_batchs_rewards_and_advantages() -> None:
    """KL in the reward: each rank penalises its rows' rewards and sends one value per response; put
    back in batch order they equal the whole batch's, and so do the outcome advantages and the
    controller's KL."""
    from vlrl.algorithms import compute_advantages, penalized_rewards
    from vlrl.rewards import scores_to_token_level

    g = torch.Generator().manual_seed(0)
    n, width = 12, 37
    lengths = torch.randint(1, width + 1, (n,), generator=g)
    lengths[3] = 0  # a response without a token
    mask = (torch.arange(width)[None] < lengths[:, None]).long()
    scores = scores_to_token_level(torch.rand(n, generator=g), mask)
    old, ref = torch.randn(n, width, generator=g), torch.randn(n, width, generator=g)
    group_ids = torch.arange(n) // 4
    whole = penalized_rewards(scores, old, ref, mask, 0.05, "low_var_kl")
    shards = [[0, 5, 7, 11, 2, 9], [1, 3, 4, 6, 8, 10]]
    parts = [
        penalized_rewards(scores[r], old[r], ref[r], mask[r], 0.05, "low_var_kl", per_token=False)
        for r in shards
    ]
    got = gather_penalized(shards, parts, n)
    assert got.token_rewards is None
    for name in ("sequence_scores", "sums", "sequence_kl", "has_tokens"):
        assert torch.equal(getattr(got, name), getattr(whole, name)), name
    assert got.current_kl() == whole.current_kl()
    assert whole.token_rewards is not None
    by_token = compute_advantages("grpo", whole.token_rewards, mask, group_ids)[0]
    by_response = compute_advantages("grpo", got.sequence_scores[:, None], torch.ones(n, 1), group_ids)[0]
    assert torch.equal(by_response * mask, by_token)
