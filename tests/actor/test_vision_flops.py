"""The vision tower's FLOPs in the actor's MFU (vlrl.models.flops.vision_forward_flops): a hand
count for a tiny Qwen2.5-VL-shaped config, and the count of what the tiny models' towers really
run (matmuls and convolutions by torch's FlopCounterMode, attention by counting the
(query, key) pairs of every scaled_dot_product_attention call)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from PIL import Image

from vlrl.models.flops import (
    batch_vision_grids,
    image_grid,
    vision_forward_flops,
    vision_training_flops,
)


def _qwen2_5_like() -> SimpleNamespace:
    vision = SimpleNamespace(
        depth=2, hidden_size=8, intermediate_size=16, out_hidden_size=12, num_heads=2, in_channels=3,
        patch_size=2, spatial_merge_size=2, temporal_patch_size=2, window_size=8, fullatt_block_indexes=[1],
    )  # fmt: skip
    return SimpleNamespace(vision_config=vision)


def test_qwen2_5_vl_by_hand():
    """One image of 4 x 6 patches (merged: 2 x 3; windows of 8 // 2 // 2 = 2 merged tokens a side)."""
    cfg = _qwen2_5_like()
    patches = 24
    embed = 2 * patches * (3 * 2 * 2 * 2 * 8)  # conv: 24 inputs per output channel
    blocks = 2 * 2 * patches * (4 * 8 * 8 + 3 * 8 * 16)  # qkv + proj, gated MLP, 2 blocks
    merger = 2 * (patches // 4) * (32 * 32 + 32 * 12)  # 6 merged tokens of width 4 x 8
    full = 4 * 8 * patches**2  # block 1: all 24 x 24 pairs
    # block 0: windows of merged spans [2] x [2, 1] -> 16 and 8 patches
    windowed = 4 * 8 * (16**2 + 8**2)
    expected = embed + blocks + merger + full + windowed
    assert vision_forward_flops(cfg, [(1, 4, 6)]) == expected
    assert vision_training_flops(cfg, [(1, 4, 6)], trainable=True) == 3 * expected
    assert vision_training_flops(cfg, [(1, 4, 6)], trainable=False) == expected
    # a video of 2 temporal patches: twice the per-frame work (attention stays within a frame)
    assert vision_forward_flops(cfg, [(2, 4, 6)]) == 2 * expected
    assert vision_forward_flops(SimpleNamespace(), [(1, 4, 6)]) == 0.0  # text-only model
    assert vision_forward_flops(cfg, []) == 0.0


def test_grids_of_a_batch_count_shared_images_once():
    cfg = _qwen2_5_like()  # patch 2, merge 2: sizes are multiples of 4
    a, b = Image.new("RGB", (12, 8)), Image.new("RGB", (4, 4))
    assert image_grid(cfg.vision_config, a.size) == (1, 4, 6)
    # a group of three samples sharing [a, b], one other sample with [a] alone, one without image
    grids = batch_vision_grids(cfg, [[a, b], [a, b], [a, b], [a], []])
    assert sorted(grids) == sorted([(1, 4, 6), (1, 2, 2), (1, 4, 6)])
    video = SimpleNamespace(size=(12, 8), frames=[a] * 4)
    assert batch_vision_grids(cfg, [[]], [[video], [video]]) == [(2, 4, 6)]
    assert batch_vision_grids(SimpleNamespace(), [[a]]) == []


class _CountAttention:
    """Wraps F.scaled_dot_product_attention: 4 x head_dim FLOPs per (query, key) pair per head."""

    def __init__(self) -> None:
        self.flops = 0.0
        self.inner = torch.nn.functional.scaled_dot_product_attention

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any):
        assert kwargs.get("attn_mask") is None  # else pairs would be computed and masked
        self.flops += 4.0 * q.shape[:-2].numel() * q.shape[-2] * k.shape[-2] * q.shape[-1]
        return self.inner(q, k, v, *args, **kwargs)


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_counts_what_the_tower_runs(arch, actor_model, monkeypatch):
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForImageTextToText

    from vlrl.models.loading import vision_tower

    model = AutoModelForImageTextToText.from_pretrained(actor_model(arch), attn_implementation="sdpa")
    tower = vision_tower(model)
    assert tower is not None
    vc = model.config.vision_config
    # an image with windows cut short at both edges (Qwen2.5-VL), a 2-frame video, a tall image
    grids = [(1, 12, 20), (2, 4, 6), (1, 18, 10)]
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), 3 * vc.temporal_patch_size * vc.patch_size**2)
    attention = _CountAttention()
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", attention)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        tower(pixels, grid_thw=torch.tensor(grids))
    measured = counter.get_total_flops() + attention.flops
    assert attention.flops > 0
    assert vision_forward_flops(model.config, grids) == pytest.approx(measured, rel=1e-12)
