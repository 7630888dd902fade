"""The actor scores the distribution the engines sample from (vlrl.models.sampling), in bounded memory.

The log-prob path's memory is measured with a dispatch-level probe: every storage an op allocates
is counted while it is alive, forward and backward, so "one chunk, whatever the token count" is a
number we can assert on CPU.
"""

from __future__ import annotations

import weakref
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from vlrl.models import packing
from vlrl.models.packing import ForwardInputs, forward_log_probs, score_tokens
from vlrl.models.sampling import SamplingDistribution, banned_token_ids, truncation_warning

BANNED = (3, 7)


def masked_reference(logits: torch.Tensor, temperature: float) -> torch.distributions.Categorical:
    """The engines' distribution written out independently: -inf on banned ids, then / temperature."""
    z = logits.double().clone()
    z[:, list(BANNED)] = float("-inf")
    return torch.distributions.Categorical(logits=z / temperature)


def test_log_probs_and_entropy_are_those_of_the_masked_distribution():
    torch.manual_seed(0)
    logits = torch.randn(37, 50)
    logits[:, 3] += 20.0  # the banned token has by far the largest logit
    allowed = torch.tensor([v for v in range(50) if v not in BANNED])
    targets = allowed[torch.randint(0, len(allowed), (37,))]
    sampling = SamplingDistribution(0.7, BANNED)
    log_probs, entropy = score_tokens(logits, targets, sampling, with_entropy=True)
    ref = masked_reference(logits, 0.7)
    torch.testing.assert_close(log_probs, ref.log_prob(targets).float(), atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, ref.entropy().float(), atol=1e-5, rtol=0)
    # the unbanned distribution is far from it here: the test can tell them apart
    plain, plain_entropy = score_tokens(logits, targets, SamplingDistribution(0.7), with_entropy=True)
    assert (plain - log_probs).abs().min() > 10 and (plain_entropy - entropy).abs().max() > 0.5
    assert score_tokens(logits.bfloat16(), targets, sampling)[0].dtype == torch.float32


def test_gradients_are_finite_and_never_reach_banned_logits():
    torch.manual_seed(1)
    logits = torch.randn(9, 20, requires_grad=True)
    targets = torch.randint(8, 20, (9,))
    log_probs, entropy = score_tokens(logits, targets, SamplingDistribution(1.3, BANNED), True, True)
    (log_probs.sum() + entropy.sum()).backward()
    assert torch.isfinite(logits.grad).all()
    assert (logits.grad[:, list(BANNED)] == 0).all() and logits.grad.abs().sum() > 0
    # without entropy_grad the entropy is a metric only
    _, metric = score_tokens(logits, targets, SamplingDistribution(1.0, BANNED), True, False)
    assert not metric.requires_grad


def test_greedy_has_no_scored_distribution():
    with pytest.raises(ValueError, match="temperature"):
        SamplingDistribution(0.0)


def test_banned_ids_come_from_the_config_and_the_vocabulary():
    class Tok:
        def get_vocab(self):
            return {"<|image_pad|>": 5, "<|vision_start|>": 6, "a": 0}

    config = SimpleNamespace(text_config=SimpleNamespace(video_token_id=9), image_token_id=5)
    assert banned_token_ids(Tok(), config) == [5, 6, 9]
    assert banned_token_ids(SimpleNamespace(tokenizer=Tok()), None) == [5, 6]  # a processor works too


def test_truncation_warning():
    assert truncation_warning(1.0, -1) is None and truncation_warning(1.0, 0) is None
    assert "top_p=0.9" in truncation_warning(0.9, -1)
    assert "top_k=20" in truncation_warning(1.0, 20)


# ------------------------------------------------------------------------------------ memory
class LiveBytes(TorchDispatchMode):
    """Peak bytes of the storages that ops allocate inside the mode (forward and backward).

    Storages that existed before (`external`, e.g. the logits a model returned) are not counted."""

    def __init__(self, external: set[int]) -> None:
        super().__init__()
        self.external, self.live, self.now, self.peak = external, {}, 0, 0

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                key, size = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
                if size and key not in self.live and key not in self.external:
                    self.live[key] = size
                    self.now += size
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(t, self._free, key)
        return out


class FixedLogits(torch.nn.Module):
    """A "model" that returns given packed logits [1, M, V]."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = logits

    def forward(self, **kwargs):
        return SimpleNamespace(logits=self.logits)


def peak_bytes(rows: int, vocab: int, grad: bool) -> int:
    """Peak bytes allocated by forward_log_probs (+ backward when `grad`) over bf16 logits [1, rows, V]."""
    gen = torch.Generator().manual_seed(rows)
    logits = torch.randn(1, rows, vocab, generator=gen).bfloat16().requires_grad_(grad)
    targets = torch.randint(8, vocab, (rows,), generator=gen)
    inputs = ForwardInputs({}, torch.zeros(rows, dtype=torch.long), torch.arange(rows), targets,
                           1, rows, has_anchor=False, padded=False)  # fmt: skip
    probe = LiveBytes({logits.untyped_storage().data_ptr()})
    with probe, torch.set_grad_enabled(grad):
        out = forward_log_probs(FixedLogits(logits), inputs, SamplingDistribution(0.7, BANNED), True, grad)
        if grad:
            (out.log_probs.sum() + out.entropy.sum() + out.anchor).backward()
    return probe.peak


def test_log_prob_memory_is_bounded_by_the_chunk(monkeypatch):
    """No fp32 copy of all the logits, in the forward (the anchor) nor kept for the backward."""
    monkeypatch.setattr(packing, "LOGIT_CHUNK", 64)
    vocab = 1000
    chunk_fp32 = 64 * vocab * 4
    small, large = 16 * 64, 32 * 64  # 16 and 32 chunks
    # no autograd (old / reference log-probs): a few chunk-sized temporaries, whatever the length
    for rows in (small, large):
        assert peak_bytes(rows, vocab, grad=False) < 4 * chunk_fp32
    # autograd: only bf16 gradient-sized buffers grow with the length. Autograd's backward of the
    # views (select, slice, split) makes 3 of them, 2 bytes per logit each = 6; an fp32 copy of the
    # chunks kept for backward (before checkpointing) added 8 more, the anchor's fp32 copy 4.
    growth = peak_bytes(large, vocab, grad=True) - peak_bytes(small, vocab, grad=True)
    assert growth / ((large - small) * vocab) <= 6.3
