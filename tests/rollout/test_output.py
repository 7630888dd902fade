"""Output assembly on hand-built engine outputs: masks, padding, groups, positions, log-probs."""

from __future__ import annotations

import torch

from vlrl.batch.rows import PromptBatch
from vlrl.rollout.output import assemble_rollout_batch, response_mask_from_eos

PAD, EOS, EOS2 = 0, 9, 8


def prompts(mrope: bool = False) -> PromptBatch:
    """Two left-padded prompts (widths 3 and 2 in a P=3 batch); the second has an mrope image block."""
    ids = torch.tensor([[5, 6, 7], [PAD, 6, 7]])
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    if mrope:
        # [B, 3, P]: row 1's last tokens have spatial positions up to 4 on the width axis.
        pos = torch.tensor([[[0, 1, 2]] * 3, [[0, 0, 1], [0, 0, 3], [0, 0, 4]]])
    else:
        pos = torch.tensor([[0, 1, 2], [0, 0, 1]])
    return PromptBatch(
        input_ids=ids, attention_mask=mask, position_ids=pos, raw_prompt_ids=[[5, 6, 7], [6, 7]],
        images=[[], ["img"]], prompts=["a", "b"], ground_truths=["x", "y"], extras=[{}, {"k": 1}], uids=[11, 22],
    )  # fmt: skip


def test_eos_mid_response_none_and_first():
    responses = [[1, 2, EOS, 3], [1, 2, 3], [EOS], [EOS2, 4]]  # EOS mid (ignore_eos), none, first, other EOS
    batch = assemble_rollout_batch(prompts(), responses, n=2, pad_token_id=PAD, eos_token_ids=[EOS, EOS2])
    assert batch.responses.tolist() == [
        [1, 2, EOS, 3],
        [1, 2, 3, PAD],
        [EOS, PAD, PAD, PAD],
        [EOS2, 4, PAD, PAD],
    ]
    assert batch.response_mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 0], [1, 0, 0, 0], [1, 0, 0, 0]]
    assert batch.response_mask.sum(-1).tolist() == [3, 3, 1, 1]


def test_layout_groups_and_prompt_part():
    batch = assemble_rollout_batch(
        prompts(), [[1], [2, EOS], [3], [4]], n=2, pad_token_id=PAD, eos_token_ids=[EOS]
    )
    assert batch.prompt_length == 3 and batch.input_ids.shape == (4, 5)
    assert batch.group_ids.tolist() == [11, 11, 22, 22]
    assert batch.input_ids[:, :3].tolist() == [[5, 6, 7]] * 2 + [[PAD, 6, 7]] * 2
    assert batch.input_ids[:, 3:].equal(batch.responses)
    assert batch.attention_mask.tolist() == [
        [1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1],
        [0, 1, 1, 1, 0],
        [0, 1, 1, 1, 0],
    ]
    assert (
        batch.prompts == ["a", "a", "b", "b"] and batch.extras[2] == {"k": 1} and batch.images[3] == ["img"]
    )
    assert batch.rollout_log_probs is None


def test_text_positions_continue():
    batch = assemble_rollout_batch(prompts(), [[1, 2]] * 2, n=1, pad_token_id=PAD, eos_token_ids=[EOS])
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 0, 1, 2, 3]]


def test_mrope_positions_continue_from_max_over_axes():
    batch = assemble_rollout_batch(
        prompts(mrope=True), [[1, 2, 3]] * 2, n=1, pad_token_id=PAD, eos_token_ids=[EOS]
    )
    assert batch.position_ids.shape == (2, 3, 6)
    assert batch.position_ids[0, :, 3:].tolist() == [[3, 4, 5]] * 3
    assert batch.position_ids[1, :, 3:].tolist() == [[5, 6, 7]] * 3  # max over all axes (4) + 1


def test_log_probs_padded_with_zero():
    batch = assemble_rollout_batch(
        prompts(),
        [[1, EOS], [2]],
        n=1,
        pad_token_id=PAD,
        eos_token_ids=[EOS],
        log_probs=[[-0.5, -1.0], [-2.0]],
    )
    assert batch.rollout_log_probs.dtype == torch.float32
    assert batch.rollout_log_probs.tolist() == [[-0.5, -1.0], [-2.0, 0.0]]


def test_wrong_count_and_empty_batch():
    try:
        assemble_rollout_batch(prompts(), [[1]], n=2, pad_token_id=PAD, eos_token_ids=[EOS])
    except ValueError as err:
        assert "2 x 2" in str(err)
    else:
        raise AssertionError("expected a ValueError")
    empty = assemble_rollout_batch(prompts().select([]), [], n=3, pad_token_id=PAD, eos_token_ids=[EOS])
    assert len(empty) == 0 and empty.input_ids.shape == (0, 4)


def test_mask_ignores_eos_in_padding():
    responses = torch.tensor([[1, EOS, EOS], [EOS, 2, 3]])
    mask = response_mask_from_eos(responses, torch.tensor([1, 3]), [EOS])
    assert mask.tolist() == [[1, 0, 0], [1, 0, 0]]
