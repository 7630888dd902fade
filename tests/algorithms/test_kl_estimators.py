"""Hand-computed tests of the KL estimators, controllers and the in-reward KL penalty."""

import math

import pytest
import torch

from vlrl.algorithms import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    compute_kl_loss,
    kl_estimate,
    low_var_kl_clamped,
    make_kl_controller,
    penalized_rewards,
)

# logp - ref = [0.5, -1.0]
LOGP = torch.tensor([[-1.0, -2.0]])
REF = torch.tensor([[-1.5, -1.0]])


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("kl", [0.5, -1.0]),  # k1 = logp - ref
        ("abs", [0.5, 1.0]),  # |logp - ref|
        ("mse", [0.125, 0.5]),  # 0.5 * 0.25, 0.5 * 1
        # k3 with d = ref - logp = [-0.5, 1]: e^-0.5 + 0.5 - 1 = 0.1065307; e^1 - 1 - 1 = 0.7182818
        ("low_var_kl", [math.exp(-0.5) - 0.5, math.e - 2.0]),
    ],
)
def test_per_token_estimators(kind, expected):
    torch.testing.assert_close(kl_estimate(LOGP, REF, kind), torch.tensor([expected]))


def test_low_var_kl_clamps_extreme_log_ratios():
    # d = ref - logp = -50 -> clamp to -20: e^-20 + 20 - 1 = 19.000 -> clamp to 10
    # d = +50 -> clamp to 20: e^20 - 21 = 4.85e8 -> clamp to 10
    logp = torch.tensor([[50.0, -50.0, 0.0]], requires_grad=True)
    kl = kl_estimate(logp, torch.zeros(1, 3), "low_var_kl")
    torch.testing.assert_close(kl, torch.tensor([[10.0, 10.0, 0.0]]))
    kl.sum().backward()
    assert torch.isfinite(logp.grad).all()


def test_low_var_kl_without_a_bound_keeps_the_gradient_where_the_bound_would_remove_it():
    # d = ref - logp = 3: k3 = e^3 - 3 - 1 = 16.0855 (beyond the bound of 10), d(k3)/d(logp) = 1 - e^3
    # = -19.0855; bounded: 10 and no gradient. d = 0.5: e^0.5 - 1.5 = 0.14872, gradient 1 - e^0.5.
    ref = torch.tensor([[3.0, 0.5]])
    for clamp, value, grad in ((None, 16.0855, -19.0855), (10.0, 10.0, 0.0)):
        logp = torch.zeros(1, 2, requires_grad=True)
        kl = kl_estimate(logp, ref, "low_var_kl", low_var_clamp=clamp)
        kl.sum().backward()
        torch.testing.assert_close(kl, torch.tensor([[value, 0.148721]]), rtol=0, atol=1e-4)
        torch.testing.assert_close(logp.grad, torch.tensor([[grad, -0.648721]]), rtol=0, atol=1e-4)
    assert low_var_kl_clamped(torch.zeros(1, 2), ref, 10.0).tolist() == [[True, False]]
    assert low_var_kl_clamped(torch.zeros(1, 2), ref, None).tolist() == [[False, False]]


@pytest.mark.parametrize("kind", ["kl", "abs", "mse", "low_var_kl"])
def test_extreme_values_finite(kind):
    logp = torch.tensor([[50.0, -50.0]], requires_grad=True)
    kl = kl_estimate(logp, torch.tensor([[-50.0, 50.0]]), kind)
    kl.sum().backward()
    assert torch.isfinite(kl).all() and torch.isfinite(logp.grad).all()


def test_full_kl_from_distributions():
    # p = [0.5, 0.5], q = [0.25, 0.75]: 0.5 ln(0.5/0.25) + 0.5 ln(0.5/0.75) = 0.1438410
    # p = [1, 0],     q = [0.5, 0.5]:   1 ln(1/0.5) + 0 (the p = 0 entry contributes nothing) = ln 2
    p = torch.tensor([[[0.5, 0.5], [1.0, 0.0]]])
    q = torch.tensor([[[0.25, 0.75], [0.5, 0.5]]])
    logp = p.log().requires_grad_(True)  # contains -inf
    kl = kl_estimate(logp, q.log(), "full")
    torch.testing.assert_close(kl, torch.tensor([[0.5 * math.log(2) + 0.5 * math.log(2 / 3), math.log(2)]]))
    kl.sum().backward()
    assert torch.isfinite(logp.grad).all()


def test_full_kl_rejects_per_token_log_probs():
    with pytest.raises(ValueError, match=r"\[B, T, V\]"):
        kl_estimate(LOGP, REF, "full")
    with pytest.raises(ValueError, match="valid:"):
        kl_estimate(LOGP, REF, "k4")
    assert set(KL_ESTIMATORS) == {"kl", "abs", "mse", "low_var_kl", "full"}


def test_fixed_controller():
    ctl = FixedKLController(0.05)
    ctl.update(current_kl=10.0, n_steps=1000)
    assert ctl.value == 0.05


def test_adaptive_controller():
    # target 0.1, horizon 100, n_steps 10
    # KL 0.15: error = clip(0.5, -0.2, 0.2) = 0.2 -> 0.1 * (1 + 0.2 * 10 / 100) = 0.102
    # KL 0.09: error = -0.1 -> 0.102 * (1 - 0.1 * 10 / 100) = 0.10098
    ctl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.1, horizon=100)
    ctl.update(0.15, 10)
    assert ctl.value == pytest.approx(0.102)
    ctl.update(0.09, 10)
    assert ctl.value == pytest.approx(0.10098)
    ctl.update(0.0, 10)  # error = clip(-1) = -0.2 -> * 0.98
    assert ctl.value == pytest.approx(0.10098 * 0.98)


def test_make_kl_controller():
    assert isinstance(make_kl_controller("fixed", 0.01), FixedKLController)
    ctl = make_kl_controller("adaptive", 0.01, kl_target=0.2, kl_horizon=50)
    assert isinstance(ctl, AdaptiveKLController) and (ctl.value, ctl.target, ctl.horizon) == (0.01, 0.2, 50)
    with pytest.raises(ValueError, match="kl_type"):
        make_kl_controller("pid", 0.01)


def test_penalized_rewards():
    # k1 = logp - ref = [[0.1, 0.2, 0.3], [0.4, 0.5, 9 (masked)], [all masked]], kl_coef 0.5:
    # rewards row 0: [0 - 0.05, 0 - 0.1, 1 - 0.15]; row 1: [0 - 0.2, 2 - 0.25, 0]; row 2 unchanged
    # per-seq mean KL: row 0 0.2, row 1 0.45; row 2 has no tokens and is left out -> 0.325
    # masked sums: row 0 0.7, row 1 1.55, row 2 0 (no tokens; its raw sum is 3)
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0], [0.0, 0.0, 3.0]])
    logp = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 9.0], [1.0, 1.0, 1.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    penalized = penalized_rewards(scores, logp, torch.zeros(3, 3), mask, kl_coef=0.5, kind="kl")
    rewards = penalized.token_rewards
    expected = torch.tensor([[-0.05, -0.1, 0.85], [-0.2, 1.75, 0.0], [0.0, 0.0, 3.0]])
    torch.testing.assert_close(rewards, expected)
    assert penalized.current_kl() == pytest.approx(0.325)
    torch.testing.assert_close(penalized.sequence_scores, torch.tensor([0.7, 1.55, 0.0]))
    torch.testing.assert_close(penalized.sums, torch.tensor([0.7, 1.55, 3.0]))
    assert penalized.has_tokens.tolist() == [True, True, False]
    assert (
        penalized_rewards(scores, logp, torch.zeros(3, 3), mask, 0.5, "kl", per_token=False).token_rewards
        is None
    )
    assert not rewards.requires_grad, "rewards are targets, detached from the policy graph"


def test_ratio_weighted_k3_loss_has_the_per_token_reverse_kl_gradient():
    # On the sampling policy (old = logp) r = 1, and d(r * k3)/d(logp) = k3 + 1 - e^d = -d = logp - ref,
    # d = ref - logp. Token 1: d = 0.5 -> -0.5; token 2: d = -1 -> 1. Unweighted: 1 - e^d = -0.648721,
    # 0.632121. Token mean over 2 tokens halves both; the third position is padding.
    ref = torch.tensor([[-0.5, -3.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    for weighted, grad in ((True, [-0.25, 0.5]), (False, [-0.324361, 0.316060])):
        logp = torch.tensor([[-1.0, -2.0, float("-inf")]], requires_grad=True)
        old = logp.detach() if weighted else None
        loss = compute_kl_loss(logp, ref, mask, "low_var_kl", "token", 2.0, 1.0, None, old_log_probs=old)
        loss.backward()
        torch.testing.assert_close(loss, torch.tensor((0.148721 + 0.367879) / 2), rtol=0, atol=1e-5)
        torch.testing.assert_close(logp.grad, torch.tensor([[*grad, 0.0]]), rtol=0, atol=1e-5)


def test_ratio_weighted_k3_gradient_is_the_reverse_kl_gradient_in_expectation():
    """Over a token's whole vocabulary, weighted by pi: E_pi[grad(r k3)] = grad KL(pi || ref), and
    E_pi[grad k3] = grad KL(ref || pi) (which is why the weight exists)."""
    logits = torch.tensor([0.3, -1.2, 2.0, 0.1], requires_grad=True)
    ref = torch.log_softmax(torch.tensor([1.0, 0.5, -0.5, 0.0]), -1)

    def expected_grad(weighted: bool) -> torch.Tensor:
        logp = torch.log_softmax(logits, -1)[:, None]  # [V, 1]: each entry one sampled token
        one = torch.ones(1, 1)
        losses = [  # the loss of a batch of one token, v, sampled from pi
            compute_kl_loss(lp[None], r.view(1, 1), one, "low_var_kl", "token", 1.0, 1.0, None,
                            old_log_probs=lp[None].detach() if weighted else None)
            for lp, r in zip(logp, ref, strict=True)
        ]  # fmt: skip
        (grad,) = torch.autograd.grad((logp[:, 0].exp().detach() * torch.stack(losses)).sum(), logits)
        return grad

    def exact_grad(forward: bool) -> torch.Tensor:
        logp = torch.log_softmax(logits, -1)
        kl = (ref.exp() * (ref - logp)).sum() if forward else (logp.exp() * (logp - ref)).sum()
        (grad,) = torch.autograd.grad(kl, logits)
        return grad

    torch.testing.assert_close(expected_grad(True), exact_grad(forward=False))
    torch.testing.assert_close(expected_grad(False), exact_grad(forward=True))
    assert (exact_grad(forward=False) - exact_grad(forward=True)).abs().max() > 0.1  # they differ here


def test_ratio_weighted_kl_loss_stays_finite_far_off_policy():
    logp = torch.tensor([[50.0, -50.0]], requires_grad=True)
    old, ref = torch.tensor([[-50.0, 50.0]]), torch.tensor([[-50.0, 50.0]])
    loss = compute_kl_loss(
        logp, ref, torch.ones(1, 2), "low_var_kl", "token", 2.0, 1.0, None, old_log_probs=old
    )
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
