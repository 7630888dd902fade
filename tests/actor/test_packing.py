"""Padding-free forward: packed == padded log-probs, attention backends, anchors, log-prob math."""

from __future__ import annotations

import pytest
import torch
from actor_helpers import make_batch

from vlrl.models.attention import (
    VARLEN_ATTENTION,
    make_varlen_info,
    set_text_attention,
    varlen_attention_forward,
)
from vlrl.models.loading import load_model
from vlrl.models.packing import (
    build_packed_inputs,
    build_padded_inputs,
    forward_log_probs,
)
from vlrl.models.processor import load_processor
from vlrl.models.sampling import SamplingDistribution
from vlrl.workers.vision import VisionCache, dummy_image_anchor, text_anchor

SPECS = [(True, 5), (False, 9), (True, 1), (False, 3), (True, 12)]


def _run(model, batch, vision, padded: bool, **kwargs):
    args = (batch.input_ids, batch.attention_mask, batch.position_ids, batch.prompt_length)
    build = build_padded_inputs if padded else build_packed_inputs
    with torch.no_grad():
        return forward_log_probs(
            model,
            build(*args, pixel_values=vision[0], image_grid_thw=vision[1], **kwargs),
            SamplingDistribution(0.8),
            True,
        )


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen2_vl", "qwen2"])
def setup(request, actor_model):
    path = actor_model(request.param)
    batch = make_batch(path, SPECS, group_size=2, seed=11)
    model = load_model(path, padding_free=False).eval()
    _, processor = load_processor(path)
    vision = VisionCache(processor.image_processor).collate(batch.images) if processor else (None, None)
    padded = _run(model, batch, vision, padded=True)
    set_text_attention(model, VARLEN_ATTENTION)
    return model, batch, vision, padded


@pytest.mark.parametrize("backend", ["loop", "mask"])
def test_packed_equals_padded(setup, backend):
    model, batch, vision, padded = setup
    packed = _run(model, batch, vision, padded=False, attention_backend=backend)
    mask = batch.response_mask.bool()
    assert (packed.log_probs - padded.log_probs)[mask].abs().max() < 1e-4
    assert (packed.entropy - padded.entropy)[mask].abs().max() < 1e-4
    assert (packed.log_probs[~mask] == 0).all()


def test_anchor_sequences_change_nothing(setup):
    model, batch, vision, padded = setup
    mrope = batch.position_ids.dim() == 3
    cfg = model.config
    anchor = (
        dummy_image_anchor(cfg, mrope, "cpu")
        if hasattr(cfg, "vision_config")
        else text_anchor(0, mrope, "cpu")
    )
    text_rows = [i for i, imgs in enumerate(batch.images) if not imgs]
    sub = batch.select(text_rows)  # no images: the dummy image is the only vision input
    mask = sub.response_mask.bool()
    plain = _run(model, sub, (None, None), padded=False)
    for is_padded in (False, True):
        out = _run(model, sub, (None, None), padded=is_padded, anchor=anchor)
        assert (out.log_probs - plain.log_probs)[mask].abs().max() < 1e-4
        assert out.anchor.item() == 0.0


def _loss_and_grads(model, batch, vision, padded: bool, image_index=None):
    """Sum of response log-probs and the gradient of every parameter."""
    args = (batch.input_ids, batch.attention_mask, batch.position_ids, batch.prompt_length)
    build = build_padded_inputs if padded else build_packed_inputs
    inputs = build(*args, pixel_values=vision[0], image_grid_thw=vision[1], image_index=image_index)
    model.zero_grad()
    out = forward_log_probs(model, inputs)
    loss = (out.log_probs * batch.response_mask).sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("padded", [False, True])
def test_shared_images_match_one_encoding_per_copy(setup, padded):
    """Encoding each distinct image once gives the per-copy log-probs and gradients."""
    model, batch, vision, _ = setup
    if vision[0] is None:
        pytest.skip("text-only model")
    pv, grid, index = VisionCache(load_processor(model.name_or_path)[1].image_processor).collate_shared(
        batch.images
    )
    copies = sum(1 for imgs in batch.images if imgs)
    assert len(grid) * 2 == copies == len(index)  # groups of 2 share their image: half the encodings
    loss, grads = _loss_and_grads(model, batch, vision, padded)
    shared_loss, shared_grads = _loss_and_grads(model, batch, (pv, grid), padded, image_index=index)
    torch.testing.assert_close(shared_loss, loss, rtol=1e-5, atol=1e-4)
    assert grads.keys() == shared_grads.keys() and any("visual" in n for n in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(shared_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_empty_micro_batch_still_has_a_graph(actor_model):
    path = actor_model("qwen2_5_vl")
    model = load_model(path)
    batch = make_batch(path, [(True, 3)]).select([])
    anchor = dummy_image_anchor(model.config, True, "cpu")
    args = (batch.input_ids, batch.attention_mask, batch.position_ids, batch.prompt_length)
    out = forward_log_probs(model, build_packed_inputs(*args, anchor=anchor))
    assert out.log_probs.shape == (0, batch.responses.shape[1])
    out.anchor.backward()
    visual = model.model.visual.blocks[0].attn.qkv.weight
    assert visual.grad is not None and (visual.grad == 0).all()  # reached, but zero


def test_varlen_attention_isolates_sequences():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 10, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)  # GQA 4 -> 2
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True  # what transformers' sdpa reads
    outs = {
        b: varlen_attention_forward(module, q, k, v, None, vlrl_varlen=make_varlen_info([3, 7], "cpu", b))[0]
        for b in ("loop", "mask")
    }
    torch.testing.assert_close(outs["loop"], outs["mask"])
    second = varlen_attention_forward(module, q[:, :, 3:], k[:, :, 3:], v[:, :, 3:], None)[0]  # alone, causal
    torch.testing.assert_close(outs["loop"][:, 3:], second)
