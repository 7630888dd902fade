"""The vision tower's attention: same result as transformers' sdpa path, one kernel call per block
on the varlen path (instead of one sdpa call per window)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vlrl.models import attention
from vlrl.models.attention import VISION_ATTENTION
from vlrl.models.loading import load_model, vision_tower


@pytest.fixture(scope="module")
def tower(actor_model):
    model = load_model(actor_model("qwen2_5_vl"), padding_free=True)
    return model.config.vision_config, vision_tower(model)


def _inputs(vision_config):
    torch.manual_seed(0)
    grid = torch.tensor([[1, 16, 24], [1, 8, 8]])  # 6 + 1 windows of 8x8 patches (window_size 112 / 14)
    size = vision_config.in_channels * vision_config.temporal_patch_size * vision_config.patch_size**2
    return torch.randn(int(grid.prod(-1).sum()), size, requires_grad=True), grid


def _run(tower_module, pixels, grid):
    out = tower_module(pixels, grid_thw=grid).last_hidden_state
    (grad,) = torch.autograd.grad(out.square().sum(), pixels)
    return out.detach(), grad


def test_vision_attention_matches_transformers_sdpa(tower):
    config, module = tower
    assert config._attn_implementation == VISION_ATTENTION
    pixels, grid = _inputs(config)
    ours = _run(module, pixels, grid)
    config._attn_implementation = "sdpa"
    try:
        reference = _run(module, pixels, grid)
    finally:
        config._attn_implementation = VISION_ATTENTION
    torch.testing.assert_close(ours[0], reference[0])
    torch.testing.assert_close(ours[1], reference[1])


def _bidirectional_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                          enable_gqa=False, return_aux=None, seqused_k=None, block_table=None, num_splits=None):  # fmt: skip
    """A CPU stand-in with torch 2.13's varlen_attn signature: [T, H, D] per sequence."""
    outs, bounds = [], cu_seq_q.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        q, k, v = (x[start:end].transpose(0, 1) for x in (query, key, value))
        causal = window_size == (-1, 0)
        outs.append(F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale).transpose(0, 1))
    return torch.cat(outs)


def test_varlen_path_is_one_bidirectional_call_per_block(tower, monkeypatch):
    """What runs on CUDA: every window of a block in one varlen call, not causal."""
    config, module = tower
    pixels, grid = _inputs(config)
    expected = _run(module, pixels, grid)
    calls = []

    def fake(*args, **kwargs):
        calls.append(kwargs.get("window_size"))
        return _bidirectional_varlen(*args, **kwargs)

    monkeypatch.setattr(attention, "_torch_varlen", lambda: fake)
    monkeypatch.setattr(attention, "_resolve_backend", lambda backend, device, dtype: "torch_varlen")
    got = _run(module, pixels, grid)
    assert calls == [(-1, -1)] * config.depth  # one call per block, bidirectional
    torch.testing.assert_close(got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1])
