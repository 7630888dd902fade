"""The lm head per chunk of scored tokens (vlrl.models.lm_head): the values and gradients of a plain
full-logits forward, without ever building an [M, V] tensor.

The reference here runs the model as transformers defines it (the head inside the forward, all
kept logits at once) and scores them independently: banned columns dropped, fp32 log_softmax.
"""

from __future__ import annotations

import pytest
import torch
from actor_helpers import make_batch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from vlrl.models import packing
from vlrl.models.lm_head import output_head, passthrough_head
from vlrl.models.loading import load_model
from vlrl.models.packing import build_packed_inputs, build_padded_inputs, forward_log_probs
from vlrl.models.sampling import SamplingDistribution
from vlrl.workers.vision import VisionCache, dummy_image_anchor

SPECS = [(True, 5), (False, 9), (True, 1), (False, 7)]
TEMPERATURE = 0.7


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen2"])
def setup(request, actor_model):
    from vlrl.models.processor import load_processor

    path = actor_model(request.param)
    batch = make_batch(path, SPECS, group_size=2, seed=3)
    model = load_model(path, padding_free=False)
    _, processor = load_processor(path)
    vision = VisionCache(processor.image_processor).collate(batch.images) if processor else (None, None)
    # banned ids that no response token uses (a banned target's log-prob is -1e30 by design)
    used = set(batch.responses[batch.response_mask.bool()].tolist())
    banned = tuple(v for v in range(5, 40) if v not in used)[:3]
    return model, batch, vision, SamplingDistribution(TEMPERATURE, banned)


def build(batch, vision, padded: bool, **kwargs):
    args = (batch.input_ids, batch.attention_mask, batch.position_ids, batch.prompt_length)
    builder = build_padded_inputs if padded else build_packed_inputs
    return builder(*args, pixel_values=vision[0], image_grid_thw=vision[1], **kwargs)


def reference(model, inputs, sampling: SamplingDistribution) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs [M], entropies [M]) from all kept logits at once, the head inside the forward."""
    logits = model(**inputs.model_kwargs, use_cache=False).logits
    if inputs.padded:
        scored = logits[inputs.rows, inputs.cols]  # [M, V]
    else:
        scored = logits[0, : inputs.rows.numel()]
    vocab = scored.shape[-1]
    allowed = torch.tensor([v for v in range(vocab) if v not in sampling.banned_token_ids])
    log_p = torch.log_softmax(scored.float()[:, allowed] / sampling.temperature, dim=-1)  # [M, V']
    column = torch.full((vocab,), -1, dtype=torch.long)
    column[allowed] = torch.arange(allowed.numel())
    log_probs = log_p.gather(-1, column[inputs.targets].unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    return log_probs, entropy


def weights(inputs, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed per-token loss weights [M] for the log-probs and the entropies."""
    gen = torch.Generator().manual_seed(seed)
    m = inputs.rows.numel()
    return torch.randn(m, generator=gen), torch.randn(m, generator=gen)


def assert_grad_close(got: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """Equal up to fp32 rounding: sums over tokens in another order, relative to the tensor's scale."""
    atol = 1e-4 * float(expected.abs().max()) + 1e-8
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=atol, msg=lambda m: f"{name}: {m}")


def grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("entropy_grad", [True, False])
def test_values_and_gradients_match_full_logits(setup, padded, entropy_grad, monkeypatch):
    """Several chunks (3 tokens each), temperature, banned tokens; packed and padded."""
    model, batch, vision, sampling = setup
    monkeypatch.setattr(packing, "LOGIT_CHUNK", 3)
    inputs = build(batch, vision, padded)
    w_lp, w_ent = weights(inputs, 0)
    model.zero_grad(set_to_none=True)
    ref_lp, ref_ent = reference(model, inputs, sampling)
    ((ref_lp * w_lp).sum() + (entropy_grad * ref_ent * w_ent).sum()).backward()
    expected = grads(model)

    out = forward_log_probs(model, inputs, sampling, True, entropy_grad)
    lp, ent = out.log_probs[inputs.rows, inputs.cols], out.entropy[inputs.rows, inputs.cols]
    torch.testing.assert_close(lp, ref_lp.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent.detach(), rtol=1e-5, atol=1e-5)
    assert ent.requires_grad == entropy_grad
    loss = (lp * w_lp).sum() + out.anchor
    if entropy_grad:
        loss = loss + (ent * w_ent).sum()
    loss.backward()
    got = grads(model)
    assert got.keys() == expected.keys() and "lm_head.weight" in got
    for name, grad in expected.items():
        assert_grad_close(got[name], grad, name)
    # the head is the model's own again
    head = output_head(model)
    assert "forward" not in head.__dict__


def test_no_grad_pass_matches_and_chunk_size_does_not_matter(setup, monkeypatch):
    model, batch, vision, sampling = setup
    inputs = build(batch, vision, padded=False)
    with torch.no_grad():
        ref_lp, ref_ent = reference(model, inputs, sampling)
        whole = forward_log_probs(model, inputs, sampling, True)
        monkeypatch.setattr(packing, "LOGIT_CHUNK", 2)
        chunked = forward_log_probs(model, inputs, sampling, True)
    index = (inputs.rows, inputs.cols)
    for out in (whole, chunked):
        torch.testing.assert_close(out.log_probs[index], ref_lp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.entropy[index], ref_ent, rtol=1e-5, atol=1e-5)


class Ops(TorchDispatchMode):
    """Records every op's name and the largest number of rows of any [.., V]-shaped result (the
    head's weight transposed, [H, V], and its gradient excepted)."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.vocab, self.hidden, self.names, self.max_rows = vocab, hidden, [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.names.append(str(func))
        for t in tree_flatten(out)[0]:
            weight_like = t.shape[-2:] == (self.hidden, self.vocab) if isinstance(t, torch.Tensor) else True
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == self.vocab and not weight_like:
                self.max_rows = max(self.max_rows, t.numel() // self.vocab)
        return out


@pytest.mark.parametrize("padded", [False, True])
def test_no_logits_beyond_one_chunk_and_no_entropy_in_backward(setup, padded, monkeypatch):
    """Forward and backward: no tensor with more than LOGIT_CHUNK rows of V; the metric entropy's
    softmax runs once in the forward and never in the backward."""
    model, batch, vision, sampling = setup
    monkeypatch.setattr(packing, "LOGIT_CHUNK", 4)
    inputs = build(batch, vision, padded)
    vocab, hidden = model.get_output_embeddings().weight.shape
    assert 4 * 4 < inputs.rows.numel() < hidden  # more than 4 chunks; never taken for the weight
    forward = Ops(vocab, hidden)
    with forward:
        out = forward_log_probs(model, inputs, sampling, True, entropy_grad=False)
    backward = Ops(vocab, hidden)
    with backward:
        (out.log_probs.sum() + out.anchor).backward()
    model.zero_grad(set_to_none=True)
    assert 0 < forward.max_rows <= 4 and 0 < backward.max_rows <= 4
    chunks = -(-inputs.rows.numel() // 4)
    assert forward.names.count("aten._softmax.default") == chunks
    assert "aten._softmax.default" not in backward.names


def test_empty_micro_batch_gives_the_head_a_zero_gradient(actor_model):
    """The anchor term runs the head: its weight gets a gradient on a rank with nothing scored."""
    path = actor_model("qwen2_5_vl")
    model = load_model(path)
    batch = make_batch(path, [(True, 3)]).select([])
    anchor = dummy_image_anchor(model.config, True, "cpu")
    for padded in (False, True):
        out = forward_log_probs(model, build(batch, (None, None), padded, anchor=anchor))
        assert out.log_probs.shape == (0, batch.responses.shape[1])
        out.anchor.backward()
        grad = model.lm_head.weight.grad
        assert grad is not None and (grad == 0).all()
        model.zero_grad(set_to_none=True)


def test_tied_embeddings(actor_model, monkeypatch):
    """lm_head.weight is embed_tokens.weight: both uses add into the one gradient."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = actor_model("qwen2")
    config = AutoConfig.from_pretrained(path)
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    monkeypatch.setattr(packing, "LOGIT_CHUNK", 5)
    batch = make_batch(path, [(False, 9), (False, 4), (False, 7)], seed=1)
    sampling = SamplingDistribution(1.3)
    inputs = build(batch, (None, None), padded=False)
    ref_lp, _ = reference(model, inputs, sampling)
    ref_lp.sum().backward()
    expected = grads(model)
    out = forward_log_probs(model, inputs, sampling)
    (out.log_probs.sum() + out.anchor).backward()
    got = grads(model)
    torch.testing.assert_close(out.log_probs[inputs.rows, inputs.cols], ref_lp.detach(), rtol=1e-5, atol=1e-5)
    for name, grad in expected.items():
        assert_grad_close(got[name], grad, name)


@pytest.mark.parametrize("targets", ["all-linear", "q_proj,lm_head"])
def test_lora_finds_the_head(actor_model, targets, monkeypatch):
    """Through peft the head is found (adapted or not) and the adapters' gradients match."""
    from vlrl.config import LoraConfig
    from vlrl.models.lora import apply_lora

    path = actor_model("qwen2")
    model = apply_lora(load_model(path), LoraConfig(rank=4, alpha=8, target_modules=targets))
    for name, p in model.named_parameters():  # move B off zero so the adapters matter
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    head = output_head(model)
    inner = model.base_model.model
    assert head is inner.lm_head
    assert ("lora_A" in dict(head.named_modules())) == ("lm_head" in targets)
    monkeypatch.setattr(packing, "LOGIT_CHUNK", 4)
    batch = make_batch(path, [(False, 9), (False, 6)], seed=2)
    sampling = SamplingDistribution(0.9)
    inputs = build(batch, (None, None), padded=False)
    ref_lp, _ = reference(model, inputs, sampling)
    ref_lp.sum().backward()
    expected = grads(model)
    assert any("lora" in n for n in expected)
    out = forward_log_probs(model, inputs, sampling)
    (out.log_probs.sum() + out.anchor).backward()
    got = grads(model)
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        assert_grad_close(got[name], grad, name)


def test_passthrough_is_undone_on_error_and_checks_its_calls():
    head = torch.nn.Linear(4, 6)
    with pytest.raises(ValueError), passthrough_head(head) as calls:
        x = torch.randn(2, 4)
        assert head(x) is x and calls == [1]
        raise ValueError
    assert "forward" not in head.__dict__ and head(torch.randn(2, 4)).shape == (2, 6)

    class TwoHeads(torch.nn.Module):  # calls its head twice: cannot be split per chunk
        def __init__(self) -> None:
            super().__init__()
            self.lm_head = head

        def get_output_embeddings(self):
            return self.lm_head

        def forward(self, **kwargs):
            x = torch.randn(1, 3, 4)
            return type("Out", (), {"logits": self.lm_head(self.lm_head(x))})()

    inputs = packing.ForwardInputs({}, torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                                   torch.zeros(0, dtype=torch.long), 0, 3, False, padded=False)  # fmt: skip
    with pytest.raises(RuntimeError, match="2 times"):
        forward_log_probs(TwoHeads(), inputs)


@pytest.mark.slow
def test_compiled_scorer_with_the_head(setup, monkeypatch):
    """`compiled=True` (torch.compile'd scoring; the head stays eager): eager values and gradients."""
    model, batch, vision, sampling = setup
    monkeypatch.setattr(packing, "LOGIT_CHUNK", 8)
    inputs = build(batch, vision, padded=False)
    results = []
    for compiled in (False, True):
        out = forward_log_probs(model, inputs, sampling, True, True, compiled)
        (out.log_probs.sum() + out.entropy.sum() + out.anchor).backward()
        results.append((out.log_probs.detach(), out.entropy.detach(), grads(model)))
    (lp, ent, g), (lp_c, ent_c, g_c) = results
    torch.testing.assert_close(lp_c, lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent_c, ent, rtol=1e-5, atol=1e-5)
    for name, grad in g.items():
        assert_grad_close(g_c[name], grad, name)
