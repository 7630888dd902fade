"""Hand-computed tests of the advantage estimators (expected values worked out in the comments)."""

import math

import pytest
import torch

from vlrl.algorithms import ADV_ESTIMATORS, GROUP_ESTIMATORS, compute_advantages
from vlrl.algorithms.advantages import discounted_returns, masked_whiten

# Six responses in three groups, ids deliberately unsorted and non-contiguous:
#   group 5 -> samples 0, 2, 4 with scores 0, 1, 2: mean 1, unbiased std 1
#   group 9 -> samples 1, 3 with scores 3, 5:     mean 4, unbiased std sqrt(2) (population std: 1)
#   group 42 -> sample 5 alone with score 7
GROUP_IDS = torch.tensor([5, 9, 5, 9, 5, 42])
SCORES = [0.0, 3.0, 1.0, 5.0, 2.0, 7.0]
LENGTHS = [3, 1, 2, 3, 1, 2]
T = 3


def _batch():
    """Outcome rewards: the score sits on the first token, the mask has the given lengths."""
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(T)] for n in LENGTHS])
    rewards = torch.zeros(len(SCORES), T)
    rewards[:, 0] = torch.tensor(SCORES)
    return rewards, mask


def _seq_adv(name, **kwargs):
    rewards, mask = _batch()
    adv, ret = compute_advantages(name, rewards, mask, GROUP_IDS, **kwargs)
    assert torch.equal(adv, ret), "outcome estimators return their advantages as returns"
    return adv[:, 0]


def test_grpo_uses_unbiased_std():
    # group 5: (0-1)/1, (1-1)/1, (2-1)/1 = -1, 0, 1
    # group 9: (3-4)/sqrt(2), (5-4)/sqrt(2) = -0.7071, 0.7071 (population std would give -1, 1)
    # group 42: single sample -> 0
    s2 = 1 / math.sqrt(2)
    expected = torch.tensor([-1.0, -s2, 0.0, s2, 1.0, 0.0])
    torch.testing.assert_close(_seq_adv("grpo", eps=1e-12), expected)


def test_grpo_without_std_and_dr_grpo():
    # s - group mean: group 5 -> -1, 0, 1; group 9 -> -1, 1; group 42 -> 0
    expected = torch.tensor([-1.0, -1.0, 0.0, 1.0, 1.0, 0.0])
    torch.testing.assert_close(_seq_adv("grpo", norm_by_std=False), expected)
    torch.testing.assert_close(_seq_adv("dr_grpo", norm_by_std=True), expected)  # flag ignored


def test_outcome_advantage_broadcast_over_mask():
    rewards, mask = _batch()
    adv, _ = compute_advantages("dr_grpo", rewards, mask.bool(), GROUP_IDS)  # bool masks work too
    # sample 3 (score 5, group 9, 3 tokens): +1 on every token; sample 1 (1 token): -1 then padding
    torch.testing.assert_close(adv[3], torch.tensor([1.0, 1.0, 1.0]))
    torch.testing.assert_close(adv[1], torch.tensor([-1.0, 0.0, 0.0]))
    assert torch.all(adv[~mask.bool()] == 0)


def test_rloo():
    # group 5: 0 - (1+2)/2 = -1.5; 1 - (0+2)/2 = 0; 2 - (0+1)/2 = 1.5
    # group 9: 3 - 5 = -2; 5 - 3 = 2; group 42: alone -> 0
    expected = torch.tensor([-1.5, -2.0, 0.0, 2.0, 1.5, 0.0])
    torch.testing.assert_close(_seq_adv("rloo"), expected)


def test_remax():
    # score - greedy score: [0-1, 3-3, 1-0, 5-6, 2-2, 7-5]
    baseline = torch.tensor([1.0, 3.0, 0.0, 6.0, 2.0, 5.0])
    expected = torch.tensor([-1.0, 0.0, 1.0, -1.0, 0.0, 2.0])
    torch.testing.assert_close(_seq_adv("remax", baseline_scores=baseline), expected)
    with pytest.raises(ValueError, match="baseline_scores"):
        _seq_adv("remax")


def test_grpo_passk():
    # group 5: best 2 (sample 4), second 1 -> gap 1, std 1 -> 1; others 0
    # group 9: best 5 (sample 3), second 3 -> gap 2, std sqrt(2) -> sqrt(2); sample 1 -> 0
    # group 42: alone -> 0
    expected = torch.tensor([0.0, 0.0, 0.0, math.sqrt(2), 1.0, 0.0])
    torch.testing.assert_close(_seq_adv("grpo_passk", eps=1e-12), expected)
    expected_raw = torch.tensor([0.0, 0.0, 0.0, 2.0, 1.0, 0.0])
    torch.testing.assert_close(_seq_adv("grpo_passk", norm_by_std=False), expected_raw)


def test_grpo_passk_tie_for_best_gives_zero():
    # scores 1, 1, 0 in one group: best - second best = 0 -> every advantage is 0
    rewards = torch.tensor([[1.0], [1.0], [0.0]])
    adv, _ = compute_advantages("grpo_passk", rewards, torch.ones(3, 1), torch.tensor([4, 4, 4]))
    assert torch.all(adv == 0)


@pytest.mark.parametrize("name", sorted(GROUP_ESTIMATORS))
@pytest.mark.parametrize("value", [0.0, 1.0, 0.1, 0.7])
def test_all_equal_rewards_give_zero(name, value):
    # equal scores -> mean == score; 0.1 / 0.7 are not exact in binary: float64 stats keep ~1e-17 noise
    rewards = torch.full((4, 2), value / 2)
    adv, _ = compute_advantages(name, rewards, torch.ones(4, 2), torch.tensor([1, 1, 1, 1]))
    assert adv.abs().max() < 1e-8


@pytest.mark.parametrize("name", sorted(GROUP_ESTIMATORS))
def test_single_sample_groups_give_zero_not_nan(name):
    rewards = torch.tensor([[1.0, 2.0], [3.0, 0.0], [0.0, 0.0]])
    adv, ret = compute_advantages(name, rewards, torch.ones(3, 2), torch.tensor([-7, 100, 2**40]))
    assert torch.all(adv == 0) and torch.all(ret == 0)


def test_discounted_returns_skip_masked_positions():
    # gamma 0.5, row 0: r = [0, 0, 1] -> G = [0.25, 0.5, 1]
    # row 1: r = [1, 0, (9 masked)] -> G = [1, 0, 0]
    # row 2: mask [1, 0, 1], r = [0, (5 masked), 1] -> the hole is skipped: G = [0 + 0.5 * 1, 0, 1]
    rewards = torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 9.0], [0.0, 5.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    expected = torch.tensor([[0.25, 0.5, 1.0], [1.0, 0.0, 0.0], [0.5, 0.0, 1.0]])
    torch.testing.assert_close(discounted_returns(rewards, mask, 0.5), expected)
    # gamma 1 takes the cumsum path: row 2 -> [1, 0, 1]
    torch.testing.assert_close(discounted_returns(rewards, mask, 1.0)[2], torch.tensor([1.0, 0.0, 1.0]))


def test_reinforce_plus_plus():
    # gamma 0.5: returns row 0 [0.25, 0.5, 1], row 1 [1, 0, -]
    # valid returns 0.25, 0.5, 1, 1, 0: mean 0.55; deviations -0.3, -0.05, 0.45, 0.45, -0.55;
    # population var = (0.09 + 0.0025 + 0.2025 + 0.2025 + 0.3025) / 5 = 0.16 -> std 0.4
    # whitened: -0.75, -0.125, 1.125, 1.125, -1.375
    rewards = torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = compute_advantages(
        "reinforce_plus_plus", rewards, mask, torch.tensor([0, 1]), gamma=0.5, eps=0.0
    )
    torch.testing.assert_close(ret, torch.tensor([[0.25, 0.5, 1.0], [1.0, 0.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[-0.75, -0.125, 1.125], [1.125, -1.375, 0.0]]))


def test_masked_whiten_empty_batch_is_zero():
    out = masked_whiten(torch.randn(2, 3), torch.zeros(2, 3))
    assert torch.all(out == 0)


def test_fully_masked_rows_stay_finite_for_every_estimator():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [1.0, 0.0], [0.0, 0.0]])
    mask = torch.tensor([[1, 1], [0, 0], [1, 0], [0, 0]])
    kw = {"baseline_scores": torch.zeros(4)}
    for name in ADV_ESTIMATORS:
        adv, ret = compute_advantages(name, rewards, mask, torch.tensor([3, 3, 8, 8]), **kw)
        assert torch.isfinite(adv).all() and torch.isfinite(ret).all(), name
        assert torch.all(adv[1] == 0) and torch.all(adv[3] == 0), name


def test_unknown_estimator_and_bad_shapes():
    with pytest.raises(ValueError, match="valid:.*grpo"):
        compute_advantages("ppo", torch.zeros(1, 1), torch.ones(1, 1), torch.tensor([0]))
    with pytest.raises(ValueError, match=r"\[B\]"):
        compute_advantages("grpo", torch.zeros(2, 1), torch.ones(2, 1), torch.tensor([0]))


def test_registries_match_config_checks():
    from vlrl.algorithms import KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES

    assert set(ADV_ESTIMATORS) == {
        "grpo",
        "dr_grpo",
        "rloo",
        "reinforce_plus_plus",
        "remax",
        "grpo_passk",
    }
    assert isinstance(GROUP_ESTIMATORS, frozenset)
    assert set(GROUP_ESTIMATORS) == {"grpo", "dr_grpo", "rloo", "grpo_passk"}
    assert set(KL_ESTIMATORS) == {"kl", "abs", "mse", "low_var_kl", "full"}
    assert set(POLICY_LOSSES) == {"ppo", "gspo", "gspo_token", "cispo", "sapo"}
    assert LOSS_AGG_MODES == ("token", "seq", "seq-mean-token-sum")


@pytest.mark.parametrize(("b", "t"), [(64, 5), (100, 5), (1000, 3)])
@pytest.mark.parametrize("value", [0.9, 0.7])
def test_equal_inexact_returns_whiten_to_zero(b, t, value):
    """Every valid return equal and not exact in float32: advantages must be ~0.

    With float32 statistics the mean is off by ~1e-8 (how much depends on the summation order of
    the dot product: here (64, 5) happened to be exact, (1000, 3) with 0.9 gave 0.15) and
    (x - mean) / (std + eps) blew that residue up to advantages of order 0.1."""
    rewards = torch.zeros(b, t)
    rewards[:, -1] = value  # gamma = 1: every token's return is `value`
    mask = torch.ones(b, t)
    adv, _ = compute_advantages("reinforce_plus_plus", rewards, mask, torch.arange(b))
    assert adv.dtype == torch.float32
    assert adv.abs().max() < 1e-6


def test_masked_whiten_equal_values_with_padding_is_zero():
    torch.manual_seed(0)
    values = torch.full((1000, 5), 0.7)
    mask = (torch.arange(5)[None] < torch.randint(1, 6, (1000, 1))).float()
    values[mask == 0] = 123.0  # padding must not enter the statistics
    assert masked_whiten(values, mask).abs().max() < 1e-6
