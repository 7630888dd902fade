"""Loss aggregation: hand-computed values, and exactness under micro-batch + data-parallel splitting."""

import pytest
import torch

from vlrl.algorithms import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    aggregate_loss,
    compute_policy_loss,
    count_tokens_and_seqs,
)

NAN, INF = float("nan"), float("inf")
# Masked positions hold NaN / inf: they must not leak into the result.
LOSS = torch.tensor([[1.0, 2.0, NAN], [4.0, INF, 6.0], [NAN, 8.0, 9.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # row 2 is fully masked


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token", (1 + 2 + 4) / 3),  # 7 valid-token loss / 3 tokens
        ("seq", (1.5 + 4.0 + 0.0) / 2),  # row means 1.5, 4, (fully masked row adds 0) / 2 sequences
        ("seq-mean-token-sum", (3.0 + 4.0) / 2),  # row sums 3, 4 / 2 sequences
    ],
)
def test_aggregate_loss_values(mode, expected):
    assert count_tokens_and_seqs(MASK) == (3, 2)
    assert aggregate_loss(LOSS, MASK, mode, num_tokens=3, num_seqs=2).item() == pytest.approx(expected)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_fully_masked_and_empty_denominators_are_zero(mode):
    loss_mat = torch.randn(2, 3, requires_grad=True)
    out = aggregate_loss(loss_mat, torch.zeros(2, 3), mode, num_tokens=5, num_seqs=2)
    out.backward()
    assert out.item() == 0 and torch.all(loss_mat.grad == 0)
    assert aggregate_loss(torch.ones(2, 3), torch.ones(2, 3), mode, num_tokens=0, num_seqs=0).item() == 0


def test_unknown_mode():
    with pytest.raises(ValueError, match="loss_avg_mode"):
        aggregate_loss(torch.ones(1, 1), torch.ones(1, 1), "seq-mean-token-mean", 1, 1)


# ------------------------------------------------------------------ micro-batch / rank splitting
CLIP = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_dual": 3.0}
WORLD = 2
# Rows 0-4 go to rank 0 as micro-batches [0], [1, 2, 3], [4]; rows 5-9 to rank 1 as [5, 6], [7, 8, 9].
# Uneven on purpose: the global totals make the sum exact whatever the split.
SPLITS = [[[0], [1, 2, 3], [4]], [[5, 6], [7, 8, 9]]]


def _problem():
    """A tiny linear 'policy' (shared weights W) over random token features, in float64."""
    gen = torch.Generator().manual_seed(0)
    b, t, d, v = 10, 6, 4, 5
    feats = torch.randn(b, t, d, generator=gen, dtype=torch.float64)
    tokens = torch.randint(0, v, (b, t), generator=gen)
    weight = torch.randn(d, v, generator=gen, dtype=torch.float64)
    old_weight = weight + 0.4 * torch.randn(d, v, generator=gen, dtype=torch.float64)  # clipping happens
    lengths = torch.tensor([6, 3, 0, 1, 5, 6, 2, 4, 0, 6])  # two fully masked rows
    mask = (torch.arange(t)[None, :] < lengths[:, None]).long()
    adv = torch.randn(b, 1, generator=gen, dtype=torch.float64).expand(b, t).contiguous()
    return feats, tokens, weight, old_weight, mask, adv


def _log_probs(weight, feats, tokens):
    return torch.log_softmax(feats @ weight, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _loss(name, mode, rows, weight, problem, totals):
    feats, tokens, _, old_weight, mask, adv = problem
    logp = _log_probs(weight, feats[rows], tokens[rows])
    old = _log_probs(old_weight, feats[rows], tokens[rows]).detach()
    if name == "reinforce":  # a plain per-token loss, to test aggregation alone
        return aggregate_loss(-adv[rows] * logp, mask[rows], mode, *totals)
    loss, _ = compute_policy_loss(
        name,
        old,
        logp,
        adv[rows],
        mask[rows],
        **CLIP,
        loss_avg_mode=mode,
        num_tokens=totals[0],
        num_seqs=totals[1],
    )
    return loss


@pytest.mark.parametrize("name", ["reinforce", *sorted(POLICY_LOSSES)])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_split_gradient_equals_full_batch(name, mode):
    problem = _problem()
    weight, mask = problem[2], problem[4]
    totals = count_tokens_and_seqs(
        mask
    )  # global totals of the whole mini-batch (what the caller all-reduces)
    full_w = weight.clone().requires_grad_(True)
    (full_grad,) = torch.autograd.grad(_loss(name, mode, list(range(10)), full_w, problem, totals), full_w)

    rank_grads = []
    for micro_batches in SPLITS:  # each simulated rank accumulates over its micro-batches
        w = weight.clone().requires_grad_(True)
        for rows in micro_batches:
            (WORLD * _loss(name, mode, rows, w, problem, totals)).backward()  # x world size, as documented
        rank_grads.append(w.grad)
    dp_grad = torch.stack(rank_grads).mean(dim=0)  # what FSDP/DDP's all-reduce (average) produces
    assert full_grad.abs().sum() > 0
    torch.testing.assert_close(dp_grad, full_grad, rtol=1e-10, atol=1e-12)
