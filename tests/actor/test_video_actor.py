"""Videos in the actor's forward: packed == padded, a group's shared video encoding == one encoding
per copy (log-probs and every gradient), and the dummy-video anchor changes nothing."""

from __future__ import annotations

import random

import pytest
import torch
from PIL import Image
from transformers import AutoConfig

from vlrl.config import DataConfig
from vlrl.data.collate import collate_prompts
from vlrl.data.prepare import RowPreparer
from vlrl.models.attention import VARLEN_ATTENTION, set_text_attention
from vlrl.models.loading import load_model
from vlrl.models.packing import build_packed_inputs, build_padded_inputs, forward_log_probs
from vlrl.models.processor import load_processor
from vlrl.rollout.output import assemble_rollout_batch
from vlrl.workers.vision import VisionCache, dummy_image_anchor

COLOURS = ["red", "green", "blue", "yellow", "white", "black"]


def _frames(start: int, count: int, size: int) -> list[Image.Image]:
    return [Image.new("RGB", (size, size), COLOURS[(start + k) % len(COLOURS)]) for k in range(count)]


ROWS = [
    {"problem": "<video> which way", "answer": "left", "videos": [_frames(0, 4, 56)]},
    {"problem": "<image> and <video> same?", "answer": "yes", "images": [_frames(1, 1, 56)[0]],
     "videos": [_frames(2, 3, 84)]},
    {"problem": "one plus two", "answer": "3"},
]  # fmt: skip


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def setup(request, actor_model):
    path = actor_model(request.param)
    tokenizer, processor = load_processor(path)
    config = DataConfig(prompt_key="problem", min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16)
    preparer = RowPreparer(config, tokenizer, processor, AutoConfig.from_pretrained(path))
    prompts = collate_prompts(
        [preparer.sample(r, "", i, False) for i, r in enumerate(ROWS)], tokenizer.pad_token_id
    )
    rng = random.Random(0)
    responses = [[rng.randrange(0, 400) for _ in range(rng.randint(2, 6))] for _ in range(len(ROWS) * 2)]
    batch = assemble_rollout_batch(prompts, responses, 2, tokenizer.pad_token_id, [tokenizer.eos_token_id])
    model = load_model(path, padding_free=False).eval()
    set_text_attention(model, VARLEN_ATTENTION)  # packed rows need it; padded rows are unaffected
    cache = VisionCache(processor.image_processor, video_processor=processor.video_processor)
    return model, batch, cache


def _forward(model, batch, cache, padded: bool, shared: bool = True, anchor=None, grad: bool = False):
    """(sum of response log-probs, log-probs [N, R], {param: grad})."""
    if shared:
        pv, grid, index = cache.collate_shared(batch.images)
        vpv, vgrid, vindex = cache.collate_shared_videos(batch.videos)
    else:
        (pv, grid), index = cache.collate(batch.images), None
        per = [cache.sample_videos(v) for v in batch.videos if v]
        vpv, vgrid, vindex = torch.cat([p for p, _ in per]), torch.cat([g for _, g in per]), None
    videos = None if vpv is None else (vpv, vgrid, vindex)
    args = (batch.input_ids, batch.attention_mask, batch.position_ids, batch.prompt_length)
    build = build_padded_inputs if padded else build_packed_inputs
    inputs = build(
        *args, pixel_values=pv, image_grid_thw=grid, image_index=index, anchor=anchor, videos=videos
    )
    model.zero_grad()
    with torch.set_grad_enabled(grad):
        out = forward_log_probs(model, inputs)
        loss = (out.log_probs * batch.response_mask).sum()
        if grad:
            loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), out.log_probs.detach(), grads


def test_packed_equals_padded(setup):
    model, batch, cache = setup
    mask = batch.response_mask.bool()
    _, packed, _ = _forward(model, batch, cache, padded=False)
    _, padded, _ = _forward(model, batch, cache, padded=True)
    assert (packed - padded)[mask].abs().max() < 1e-4


@pytest.mark.parametrize("padded", [False, True])
def test_shared_video_matches_one_encoding_per_copy(setup, padded):
    model, batch, cache = setup
    _, vgrid, vindex = cache.collate_shared_videos(batch.videos)
    assert len(vgrid) == 2 and vindex == [0, 0, 1, 1]  # two videos, each encoded once for its group
    loss, _, grads = _forward(model, batch, cache, padded, shared=False, grad=True)
    shared_loss, _, shared_grads = _forward(model, batch, cache, padded, shared=True, grad=True)
    torch.testing.assert_close(shared_loss, loss, rtol=1e-5, atol=1e-4)
    assert grads.keys() == shared_grads.keys() and any("visual" in n for n in grads)
    for name, value in grads.items():
        torch.testing.assert_close(shared_grads[name], value, rtol=1e-4, atol=1e-5, msg=name)


def test_dummy_video_anchor_changes_nothing(setup):
    model, batch, cache = setup
    text_rows = batch.select([4, 5])  # the text-only prompt's group
    assert not any(text_rows.videos) and not any(text_rows.images)
    mask = text_rows.response_mask.bool()
    _, plain, _ = _forward(model, text_rows, cache, padded=False)
    anchor = dummy_image_anchor(model.config, True, "cpu", image=True, video=True)
    for padded in (False, True):
        _, out, _ = _forward(model, text_rows, cache, padded=padded, anchor=anchor)
        assert (out - plain)[mask].abs().max() < 1e-4
