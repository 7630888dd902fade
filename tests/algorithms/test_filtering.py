"""Hand-computed tests of DAPO group filtering."""

import torch

from vlrl.algorithms import filter_groups

# group 3 -> samples 0, 2: scores 1, 0 (mean 0.5)   keep
# group 8 -> samples 1, 3: scores 1, 1 (mean 1.0)   drop (all right)
# group 11 -> samples 4, 5: scores 0, 0 (mean 0.0)  drop (all wrong)
# group -20 -> sample 6 alone: 0.5                  keep
SCORES = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5])
IDS = torch.tensor([3, 8, 3, 8, 11, 11, -20])


def test_keeps_groups_strictly_inside_the_bounds():
    keep = filter_groups(SCORES, IDS, low=0.01, high=0.99)
    assert keep.dtype == torch.bool
    assert keep.tolist() == [True, False, True, False, False, False, True]


def test_bounds_are_strict():
    # the two kept groups have mean exactly 0.5: low = 0.5 drops them, high = 0.5 too
    assert not filter_groups(SCORES, IDS, low=0.5, high=1.0).any()
    assert not filter_groups(SCORES, IDS, low=0.0, high=0.5)[[0, 2, 6]].any()
    # low = -1, high = 2 keeps everything, including the all-0 and all-1 groups
    assert filter_groups(SCORES, IDS, low=-1.0, high=2.0).all()


def test_empty_batch():
    assert filter_groups(torch.zeros(0), torch.zeros(0, dtype=torch.long), 0.0, 1.0).numel() == 0
