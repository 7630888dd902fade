"""Pure helpers of the actor: length balancing, optimizer/schedule/skip, FLOPs, vision inputs."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from vlrl.config import OptimConfig
from vlrl.models.flops import decoder_matmul_params, forward_flops, measured_cpu_peak, mfu, training_flops
from vlrl.workers import optim
from vlrl.workers.balance import (
    balance_across_ranks,
    count_micro_batches,
    imbalance,
    inverse_permutation,
    micro_batches_by_tokens,
    partition,
)
from vlrl.workers.optim import AdamWBf16, build_optimizer, clip_and_step, lr_factor
from vlrl.workers.vision import VisionCache


# ------------------------------------------------------------------------------------ balance
def test_balance_across_ranks_equal_counts_and_better_than_contiguous():
    rng = random.Random(0)
    lengths = [rng.choice([20, 30, 400, 900]) + rng.randrange(50) for _ in range(64)]
    parts = balance_across_ranks(lengths, 4)
    assert sorted(i for p in parts for i in p) == list(range(64))
    assert all(len(p) == 16 for p in parts)
    contiguous = [list(range(r * 16, (r + 1) * 16)) for r in range(4)]
    assert imbalance(lengths, parts) < 1.02 < imbalance(lengths, contiguous)


def test_inverse_permutation_restores_order_and_groups_travel_with_rows():
    lengths = [5, 1, 9, 3, 7, 2]
    group_ids = [0, 0, 1, 1, 2, 2]
    parts = balance_across_ranks(lengths, 2)
    flat = [i for p in parts for i in p]
    reordered = [group_ids[i] for i in flat]
    inverse = inverse_permutation(parts)
    assert [reordered[inverse[i]] for i in range(6)] == group_ids


def test_partition_rejects_uneven_equal_split():
    with pytest.raises(ValueError, match="equal size"):
        partition([1, 2, 3], 2)


def test_micro_batches_by_tokens_respect_the_budget():
    lengths = [100, 30, 60, 10, 90, 40, 70, 20]
    count = count_micro_batches(lengths, 150)
    parts = micro_batches_by_tokens(lengths, count)
    assert len(parts) == count == 3
    assert all(sum(lengths[i] for i in p) <= 150 for p in parts)
    assert sorted(i for p in parts for i in p) == list(range(8))
    assert len(micro_batches_by_tokens([5], 3)) == 3  # more micro-batches than samples: empties
    assert count_micro_batches([500, 10], 100) == 2  # an over-long sample gets its own


# -------------------------------------------------------------------------------------- optim
def _opt_cfg(**kw) -> OptimConfig:
    cfg = OptimConfig(lr=1.0)
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


def test_lr_factor_warmup_then_constant_or_cosine():
    const = _opt_cfg(lr_warmup_ratio=0.2)
    assert [lr_factor(s, const, 10) for s in range(3)] == [0.5, 1.0, 1.0]
    cos = _opt_cfg(lr_warmup_steps=0, lr_scheduler_type="cosine", min_lr_ratio=0.1)
    assert lr_factor(0, cos, 10) == 1.0
    assert lr_factor(5, cos, 10) == pytest.approx(0.55)
    assert lr_factor(10, cos, 10) == pytest.approx(0.1)


def test_adamw_bf16_tracks_adamw():
    torch.manual_seed(0)
    w0 = torch.randn(64, 64)
    weights = [w0.clone().requires_grad_(), w0.clone().requires_grad_()]
    opts = [
        torch.optim.AdamW([weights[0]], lr=1e-2, weight_decay=0.1),
        AdamWBf16([weights[1]], lr=1e-2, weight_decay=0.1),
    ]
    for _ in range(20):
        x = torch.randn(8, 64)
        for w, opt in zip(weights, opts):
            ((x @ w).square().mean()).backward()
            opt.step()
            opt.zero_grad()
    assert opts[1].state[weights[1]]["exp_avg"].dtype == torch.bfloat16
    moved = (weights[0] - w0).abs().mean()
    assert (weights[0] - weights[1]).abs().mean() < 0.05 * moved


def _adamw_bf16_by_hand(w, grads, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, decay=0.1):
    """AdamW with bf16-stored moments, one parameter, written out per step (fp32 arithmetic)."""
    m = torch.zeros_like(w, dtype=torch.bfloat16)
    v = torch.zeros_like(w, dtype=torch.bfloat16)
    for t, g in enumerate(grads, start=1):
        m32 = m.float() * betas[0] + (1 - betas[0]) * g
        v32 = v.float() * betas[1] + (1 - betas[1]) * g * g
        m, v = m32.bfloat16(), v32.bfloat16()
        update = (m32 / (1 - betas[0] ** t)) / ((v32 / (1 - betas[1] ** t)).sqrt() + eps) + decay * w
        w = w - lr * update
    return w


def test_adamw_bf16_foreach_chunks_match_the_formula(monkeypatch):
    """Several parameters in several chunks, one of them skipped on a step (its own step count)."""
    monkeypatch.setattr(optim, "CHUNK_ELEMENTS", 40)  # 3 chunks: [6x6], [4x5], [3]
    torch.manual_seed(0)
    shapes = [(6, 6), (4, 5), (3,)]
    start = [torch.randn(s) for s in shapes]
    params = [torch.nn.Parameter(w.clone()) for w in start]
    opt = AdamWBf16(params, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    seen: list[list[torch.Tensor]] = [[] for _ in shapes]
    for step in range(5):
        for i, p in enumerate(params):
            p.grad = None if (i == 2 and step == 1) else torch.randn(p.shape)
            if p.grad is not None:
                seen[i].append(p.grad.clone())
        opt.step()
    assert [float(opt.state[p]["step"]) for p in params] == [5.0, 5.0, 4.0]
    for p, w0, grads in zip(params, start, seen):
        torch.testing.assert_close(p.detach(), _adamw_bf16_by_hand(w0, grads), rtol=1e-6, atol=1e-7)


def test_non_finite_step_is_skipped_and_finite_step_is_clipped():
    w = torch.nn.Parameter(torch.ones(3))
    opt = build_optimizer([w], _opt_cfg(lr=0.1, weight_decay=0.0))
    w.grad = torch.tensor([1.0, float("inf"), 0.0])
    norm, skipped = clip_and_step(opt, [w], 1.0)
    assert skipped and not math.isfinite(norm) and w.grad is None
    assert torch.equal(w.detach(), torch.ones(3)) and not opt.state
    w.grad = torch.tensor([30.0, 40.0, 0.0])
    norm, skipped = clip_and_step(opt, [w], 1.0)
    assert not skipped and norm == pytest.approx(50.0)
    assert not torch.equal(w.detach(), torch.ones(3))


# -------------------------------------------------------------------------------------- flops
def test_flops_by_hand():
    cfg = SimpleNamespace(
        hidden_size=8,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=16,
        num_hidden_layers=3,
        vocab_size=10,
    )
    # per layer: q 8*8 + k,v 2*8*4 + o 8*8 = 192; mlp 3*8*16 = 384; lm head 80
    assert decoder_matmul_params(cfg) == 3 * (192 + 384) + 80
    n = decoder_matmul_params(cfg)
    assert forward_flops(cfg, [4]) == 2 * n * 4 + 4 * 3 * 2 * 4 * (4 * 5 / 2)
    assert training_flops(cfg, [4, 2]) == 3 * (forward_flops(cfg, [4]) + forward_flops(cfg, [2]))
    # logits for 3 of the 4 positions (the response): the lm head (80 params) runs 3 times, not 4
    assert forward_flops(cfg, [4], head_tokens=3) == forward_flops(cfg, [4]) - 2 * 80


def test_moe_flops_count_active_parameters_only():
    dense = dict(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, intermediate_size=16,
                 num_hidden_layers=3, vocab_size=10)  # fmt: skip
    moe = SimpleNamespace(**dense, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=4,
                          decoder_sparse_step=1, mlp_only_layers=[1])  # fmt: skip
    # layers 0, 2 sparse: router 8*6 + 2 experts * 3*8*4 = 240; layer 1 dense: 384
    assert decoder_matmul_params(moe) == 3 * 192 + 2 * 240 + 384 + 80
    every_other = SimpleNamespace(**{**vars(moe), "mlp_only_layers": [], "decoder_sparse_step": 2})
    assert decoder_matmul_params(every_other) == 3 * 192 + 240 + 2 * 384 + 80  # only layer 1 sparse


def test_qwen3_vl_30b_a3b_counts_3b_active_of_30b():
    """Qwen3-VL-30B-A3B's published text shapes: the name's 3B active / 30B total parameters."""
    text = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                intermediate_size=6144, num_hidden_layers=48, vocab_size=151936, num_experts=128,
                num_experts_per_tok=8, moe_intermediate_size=768, decoder_sparse_step=1, mlp_only_layers=[])  # fmt: skip
    active = decoder_matmul_params(SimpleNamespace(**text))
    every_expert = decoder_matmul_params(SimpleNamespace(**{**text, "num_experts_per_tok": 128}))
    assert 2.9e9 < active < 3.2e9 and 29.5e9 < every_expert < 31e9


def test_moe_flops_match_the_tiny_models_weights(actor_model):
    """Active parameters from the config == the real model's matmul weights with each layer's
    experts counted top_k / num_experts times (all experts exist; a token uses top_k of them)."""
    from vlrl.models.loading import load_model

    model = load_model(actor_model("qwen3_vl_moe"))
    text = model.config.text_config
    share = text.num_experts_per_tok / text.num_experts
    counted = 0.0
    for name, param in model.named_parameters():
        if name.startswith("model.language_model.layers.") and param.dim() >= 2:
            counted += param.numel() * (share if ".mlp.experts." in name else 1.0)
    counted += model.lm_head.weight.numel()
    assert any(".mlp.experts.gate_up_proj" in n for n, _ in model.named_parameters())
    assert decoder_matmul_params(model.config) == counted


def test_cpu_peak_and_mfu():
    peak = measured_cpu_peak()
    assert peak > 1e8
    assert mfu(peak, 2.0, "cpu") == pytest.approx(0.5)


# ------------------------------------------------------------------------------------- vision
class _CountingProcessor:
    """Wraps an image processor and counts calls."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0
        self.patch_size, self.merge_size = inner.patch_size, inner.merge_size

    def __call__(self, **kwargs):
        self.calls += 1
        return self.inner(**kwargs)


def test_vision_cache_reuses_group_images_and_keeps_sizes(actor_model):
    from vlrl.models.processor import load_processor

    _, processor = load_processor(actor_model("qwen2_5_vl"))
    counting = _CountingProcessor(processor.image_processor)
    cache = VisionCache(counting)
    img = Image.new("RGB", (28 * 5, 28 * 3), (10, 200, 30))  # conforming: not resized
    pv, grid = cache.collate([[img], [img], [], [img]])
    assert counting.calls == 1
    assert grid.tolist() == [[1, 6, 10]] * 3
    assert pv.shape[0] == 3 * 60
    assert cache.collate([[], []]) == (None, None)


def test_vision_cache_collate_shared_lists_each_distinct_image_once(actor_model):
    from vlrl.models.processor import load_processor

    _, processor = load_processor(actor_model("qwen2_5_vl"))
    cache = VisionCache(processor.image_processor)
    red, blue, green = (Image.new("RGB", (56, 56), c) for c in ((200, 0, 0), (0, 0, 200), (0, 200, 0)))
    pv, grid, index = cache.collate_shared([[red], [red, blue], [], [red], [red, blue], [green]])
    assert grid.shape[0] == 4  # red; red, blue; green
    assert index == [0, 1, 2, 0, 1, 2, 3]  # per image in token order: its row in the grid
    full_pv, full_grid = cache.collate([[red], [red, blue], [green]])
    assert pv.equal(full_pv) and grid.equal(full_grid)
    _, _, none_repeated = cache.collate_shared([[red], [blue]])
    assert none_repeated is None
    assert cache.collate_shared([[], []]) == (None, None, None)


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),  # SXM
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA H20", 148e12),  # not H200's peak, though "H20" is a prefix of "H200"
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA GeForce RTX 4090", 165e12),
        ("Tesla T4", None),
    ],
)
def test_gpu_peak_by_device_name(name, peak):
    from vlrl.models.flops import gpu_peak_bf16

    assert gpu_peak_bf16(name) == peak
