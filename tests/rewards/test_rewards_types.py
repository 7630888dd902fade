"""RewardInput, build_reward_inputs, RewardResult and scores_to_token_level."""

from __future__ import annotations

import pickle

import pytest
import torch

from vlrl.rewards import RewardInput, RewardResult, build_reward_inputs, scores_to_token_level


def test_reward_input_is_a_dict_with_attribute_access():
    x = RewardInput(response="r", ground_truth="g")
    assert x["response"] == x.response == "r"
    x.score_hint = 3
    assert x["score_hint"] == 3
    assert isinstance(x, dict)
    with pytest.raises(AttributeError, match="no key 'missing'"):
        _ = x.missing
    assert pickle.loads(pickle.dumps(x)) == x and type(pickle.loads(pickle.dumps(x))) is RewardInput


def test_build_reward_inputs_keys_extras_and_collisions():
    (x,) = build_reward_inputs(["resp"], [7], ["prompt"], ["gt"], [{"source": "s", "response": "col"}])
    assert x == {
        "response": "resp",
        "response_length": 7,
        "ground_truth": "gt",
        "prompt": "prompt",
        "source": "s",
        "extra_response": "col",
    }
    assert build_reward_inputs(["a"], [1], ["p"], [None], None)[0].ground_truth is None


def test_build_reward_inputs_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="lengths differ"):
        build_reward_inputs(["a", "b"], [1], ["p", "p"], ["g", "g"], [{}, {}])
    with pytest.raises(ValueError, match="already taken"):
        build_reward_inputs(["a"], [1], ["p"], ["g"], [{"prompt": 1, "extra_prompt": 2}])


def test_reward_result_metrics():
    result = RewardResult(scores=[{"overall": 1.0, "acc": 1.0}, {"overall": 0.0, "acc": 0.5}], failures=1)
    assert result.metrics() == {"reward/overall": 0.5, "reward/acc": 0.75, "reward/failures": 1.0}
    assert result.metrics("val")["val/acc"] == 0.75
    assert result.overall == [1.0, 0.0]
    assert RewardResult(scores=[]).metrics() == {"reward/failures": 0.0}


@pytest.mark.parametrize(
    "mask, expected_col",
    [
        ([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], [2, 0, None]),  # right padding, fully masked row
        ([[0, 1, 1, 1], [0, 0, 1, 0], [1, 1, 1, 1]], [3, 2, 3]),  # left padding, holes
    ],
)
def test_scores_to_token_level(mask, expected_col):
    overall = torch.tensor([0.5, -1.0, 2.0])
    out = scores_to_token_level(overall, torch.tensor(mask))
    assert out.shape == (3, 4) and out.dtype == torch.float32
    for row, col in enumerate(expected_col):
        expected = torch.zeros(4)
        if col is not None:
            expected[col] = overall[row]
        assert torch.equal(out[row], expected)


def test_scores_to_token_level_dtype_and_shape_checks():
    out = scores_to_token_level(torch.tensor([1, 2]), torch.ones(2, 3, dtype=torch.bool))
    assert out.dtype == torch.float32 and out[:, -1].tolist() == [1.0, 2.0]
    assert (
        scores_to_token_level(torch.ones(2, dtype=torch.bfloat16), torch.ones(2, 3)).dtype == torch.bfloat16
    )
    with pytest.raises(ValueError, match="expected overall"):
        scores_to_token_level(torch.ones(3), torch.ones(2, 3))


def test_check_score_accepts_real_scalars_only():
    import numpy as np

    from vlrl.rewards.calling import check_score

    ok = check_score(
        {"overall": np.float32(0.5), "a": torch.tensor(2), "b": True, "c": np.array(3.0), "d": 1}
    )
    assert ok == {"overall": 0.5, "a": 2.0, "b": 1.0, "c": 3.0, "d": 1.0}
    assert all(type(v) is float for v in ok.values())
    for bad in (torch.tensor([1.0]), np.array([1.0]), 1j, "1", torch.tensor(float("nan")), 10**400):
        assert not isinstance(check_score({"overall": bad}), dict)
