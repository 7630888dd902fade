"""Hand-computed tests of the policy losses, `compute_policy_loss` and `compute_kl_loss`."""

import math

import pytest
import torch

from vlrl.algorithms import LOSS_AGG_MODES, POLICY_LOSSES, compute_kl_loss, compute_policy_loss
from vlrl.algorithms.losses import cispo, gspo, gspo_token, ppo, sapo

CLIP = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.3, "clip_ratio_dual": 3.0}


def _leaf(values):
    return torch.tensor(values, dtype=torch.float64).log().reshape(1, -1).requires_grad_(True)


def test_ppo_clip_and_dual_clip():
    # old log-prob 0, new log-prob log r -> ratio r; clip range [0.8, 1.3], dual 3:
    #  r    A  | -A r   -A clip(r) | max   | dual (A<0: min(., -3A)) | grad d/dlogp
    # 1.5  +1  | -1.5   -1.3       | -1.3  |                         | 0 (ratio clipped)
    # 0.5  +1  | -0.5   -0.8       | -0.5  |                         | -A r = -0.5
    # 0.5  -1  |  0.5    0.8       |  0.8  | min(0.8, 3) = 0.8       | 0 (ratio clipped)
    # 4.0  -1  |  4.0    1.3       |  4.0  | min(4, 3) = 3 (dual)    | 0 (dual clipped)
    # 1.1  +2  | -2.2   -2.2       | -2.2  |                         | -A r = -2.2
    # 1.0 -0.5 |  0.5    0.5       |  0.5  | min(0.5, 1.5) = 0.5     | -A r = 0.5
    logp = _leaf([1.5, 0.5, 0.5, 4.0, 1.1, 1.0])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 2.0, -0.5]], dtype=torch.float64)
    loss, ind = ppo(torch.zeros_like(logp), logp, adv, torch.ones_like(adv), **CLIP)
    torch.testing.assert_close(loss, torch.tensor([[-1.3, -0.5, 0.8, 3.0, -2.2, 0.5]], dtype=torch.float64))
    assert ind["pg_clipfrac_higher"].tolist() == [[True, False, True, False, False, False]]
    assert ind["pg_clipfrac_lower"].tolist() == [[False, False, False, True, False, False]]
    loss.sum().backward()
    torch.testing.assert_close(
        logp.grad, torch.tensor([[0.0, -0.5, 0.0, 0.0, -2.2, 0.5]], dtype=torch.float64)
    )


def test_gspo_sequence_ratio():
    # seq 0: log-ratios [0.1, 0.3] -> s = e^0.2 = 1.2214 (inside [0.8, 1.3]); A = +1 -> loss -1.2214 per token
    #        gradient of the 2-token sum: each token gets 2 * (-A s / 2) = -1.2214
    # seq 1: log-ratios [-0.4, padding] -> s = e^-0.4 = 0.6703; A = -1: max(0.6703, 0.8) = 0.8, clipped, grad 0
    old = torch.zeros(2, 2, dtype=torch.float64)
    logp = torch.tensor([[0.1, 0.3], [-0.4, 7.0]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, ind = gspo(old, logp, adv, mask, **CLIP)
    s = math.exp(0.2)
    torch.testing.assert_close(loss, torch.tensor([[-s, -s], [0.8, 0.8]], dtype=torch.float64))
    assert ind["pg_clipfrac_higher"].tolist() == [[False, False], [True, True]]
    (loss * mask).sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-s, -s], [0.0, 0.0]], dtype=torch.float64))


def test_gspo_token_same_value_per_token_gradient():
    # same sequence as above (s = e^0.2) but token advantages [1, 2]:
    # value: -A_t s = [-s, -2s] for both variants
    # gspo: every token's grad = -(A_0 + A_1) s / 2 = -1.5 s (the sequence ratio mixes the tokens)
    # gspo_token: token t's grad = -A_t s = [-s, -2s]
    s = math.exp(0.2)
    adv = torch.tensor([[1.0, 2.0]], dtype=torch.float64)
    expected_value = torch.tensor([[-s, -2 * s]], dtype=torch.float64)
    for fn, grad in ((gspo, [-1.5 * s, -1.5 * s]), (gspo_token, [-s, -2 * s])):
        logp = torch.tensor([[0.1, 0.3]], dtype=torch.float64, requires_grad=True)
        loss, _ = fn(torch.zeros_like(logp), logp, adv, torch.ones_like(adv), **CLIP)
        torch.testing.assert_close(loss, expected_value)
        loss.sum().backward()
        torch.testing.assert_close(logp.grad, torch.tensor([grad], dtype=torch.float64))


def test_cispo():
    # token 0: old 0, new ln 1.5 = 0.405465 -> r = 1.5, weight clipped to 1.3; A = 1
    #          loss = -1.3 * 1 * 0.405465 = -0.527105; grad = -w A = -1.3 (still learns, unlike PPO)
    # token 1: old -1, new -1.2 -> r = e^-0.2 = 0.818731 (inside [0.8, 1.3]); A = -2
    #          loss = -0.818731 * -2 * -1.2 = -1.964954; grad = -w A = 1.637462
    old = torch.tensor([[0.0, -1.0]], dtype=torch.float64)
    logp = torch.tensor([[math.log(1.5), -1.2]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[1.0, -2.0]], dtype=torch.float64)
    loss, ind = cispo(old, logp, adv, torch.ones_like(adv), **CLIP)
    w1 = math.exp(-0.2)
    torch.testing.assert_close(
        loss, torch.tensor([[-1.3 * math.log(1.5), -w1 * 2 * 1.2]], dtype=torch.float64)
    )
    assert ind["pg_clipfrac_higher"].tolist() == [[True, False]]
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.3, 2 * w1]], dtype=torch.float64))


def test_sapo_soft_gate():
    # f(r) = sigmoid(tau (r - 1)) * 4 / tau, loss = -A f(r), d/dlogp = -A 4 sig (1 - sig) r
    # token 0: r = 1, A = 1, tau 1: f = 0.5 * 4 = 2 -> loss -2; grad = -1 * 1 * 1 = -1 (plain PG)
    # token 1: r = e, A = -1, tau 1.05: x = 1.05 (e - 1) = 1.804196, sig = 0.858659
    #          f = 0.858659 * 4 / 1.05 = 3.271082 -> loss 3.271082; grad = 4 sig (1 - sig) e = 1.319604
    logp = torch.tensor([[0.0, 1.0]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    loss, ind = sapo(torch.zeros_like(logp), logp, adv, torch.ones_like(adv), **CLIP)
    torch.testing.assert_close(loss, torch.tensor([[-2.0, 3.2710816552]], dtype=torch.float64))
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0, 1.3196037084]], dtype=torch.float64))
    assert not ind["pg_clipfrac_higher"].any() and not ind["pg_clipfrac_lower"].any()


def test_compute_policy_loss_metrics():
    # the PPO table above, with a 7th padded token (garbage values, -inf log-prob) and token mode:
    # loss = (-1.3 - 0.5 + 0.8 + 3 - 2.2 + 0.5) / 6 = 0.3 / 6 = 0.05
    # clipfrac higher 2/6, lower 1/6; ppo_kl = mean(old - new) = -mean(ln r)
    # entropy_estimate = mean(-ln r)
    ratios = [1.5, 0.5, 0.5, 4.0, 1.1, 1.0]
    logp = torch.tensor(
        [[*(math.log(r) for r in ratios), -math.inf]], dtype=torch.float64, requires_grad=True
    )
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 2.0, -0.5, 1e9]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0]])
    loss, metrics = compute_policy_loss(
        "ppo",
        torch.zeros_like(logp),
        logp,
        adv,
        mask,
        **CLIP,
        loss_avg_mode="token",
        num_tokens=6,
        num_seqs=1,
    )
    assert loss.item() == pytest.approx(0.05)
    mean_log_r = sum(math.log(r) for r in ratios) / 6
    # 0-dim tensors on the inputs' device: reading them (a host sync on GPU) is left to the caller
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in metrics.values())
    assert {k: float(v) for k, v in metrics.items()} == pytest.approx(
        {
            "pg_loss": 0.05,
            "pg_clipfrac_higher": 2 / 6,
            "pg_clipfrac_lower": 1 / 6,
            "ppo_kl": -mean_log_r,
            "entropy_estimate": -mean_log_r,
        }
    )
    loss.backward()
    assert torch.isfinite(logp.grad).all() and logp.grad[0, -1] == 0


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_extreme_log_ratios_finite(name, mode):
    # log-ratios of +-50 (clamped to +-20 before exp), both advantage signs
    logp = torch.tensor([[50.0, -50.0, 50.0, -50.0], [0.0, 1.0, -1.0, 0.0]], requires_grad=True)
    old = torch.tensor([[0.0, 0.0, 0.0, 0.0], [-50.0, 50.0, 0.0, 0.0]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0], [1.0, -1.0, 1.0, -1.0]])
    loss, metrics = compute_policy_loss(
        name, old, logp, adv, torch.ones(2, 4), **CLIP, loss_avg_mode=mode, num_tokens=8, num_seqs=2
    )
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert all(math.isfinite(float(v)) for v in metrics.values())


def test_compute_policy_loss_fully_masked_micro_batch():
    logp = torch.randn(2, 3, requires_grad=True)
    kw = {"loss_avg_mode": "seq", "num_tokens": 10, "num_seqs": 4}
    loss, metrics = compute_policy_loss(
        "ppo", logp.detach(), logp, torch.ones(2, 3), torch.zeros(2, 3), **CLIP, **kw
    )
    loss.backward()
    assert loss.item() == 0 and torch.all(logp.grad == 0)
    assert all(float(v) == 0 for v in metrics.values())


def test_unknown_policy_loss():
    x = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="valid:.*ppo"):
        compute_policy_loss("trpo", x, x, x, x, **CLIP, loss_avg_mode="token", num_tokens=1, num_seqs=1)


def test_compute_kl_loss():
    # low_var_kl with d = ref - logp = [-0.5, 1]: [0.1065307, 0.7182818]; third token padded
    # token mode over 2 tokens: 0.8248125 / 2 = 0.41240625; seq-mean-token-sum: 0.8248125 / 1
    logp = torch.tensor([[-1.0, -2.0, 5.0]])
    ref = torch.tensor([[-1.5, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    total = math.exp(-0.5) - 0.5 + math.e - 2
    token = compute_kl_loss(logp, ref, mask, "low_var_kl", "token", num_tokens=2, num_seqs=1)
    seq_sum = compute_kl_loss(logp, ref, mask, "low_var_kl", "seq-mean-token-sum", num_tokens=2, num_seqs=1)
    assert token.item() == pytest.approx(total / 2) and seq_sum.item() == pytest.approx(total)


@pytest.mark.parametrize("kind", ["kl", "abs", "mse", "low_var_kl"])
def test_kl_loss_ignores_non_finite_padding(kind):
    # the padded third token holds -inf / nan: loss and gradient stay finite, padding gets no gradient
    logp = torch.tensor([[-1.0, -2.0, -math.inf]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, math.nan]])
    loss = compute_kl_loss(logp, ref, torch.tensor([[1, 1, 0]]), kind, "seq", num_tokens=2, num_seqs=1)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all() and logp.grad[0, 2] == 0


def test_kl_loss_full_distributions():
    # [B=1, T=2, V=2]; token 0: p = [0.5, 0.5], q = [0.25, 0.75] -> 0.1438410; token 1 is padding (nan)
    logp = torch.tensor([[[0.5, 0.5], [math.nan, math.nan]]]).log().requires_grad_(True)
    ref = torch.tensor([[[0.25, 0.75], [0.5, 0.5]]]).log()
    loss = compute_kl_loss(logp, ref, torch.tensor([[1, 0]]), "full", "token", num_tokens=1, num_seqs=1)
    loss.backward()
    assert loss.item() == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(2 / 3))
    assert torch.isfinite(logp.grad).all()
