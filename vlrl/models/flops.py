"""Model FLOPs of the text decoder and MFU (model FLOPs utilization).

What is counted: the decoder's matmuls (attention projections, gated MLP; the lm head on the
positions whose logits are computed, the response tokens in training) at 2 FLOPs per
multiply-add per token (mixture-of-experts layers: the router and the top-k experts a token is routed
to, i.e. the active parameters, not all experts; `vlrl.models.moe`), plus the attention scores and weighted sums (QK^T and AV), which grow with
the context each token attends to (causal: token t attends to t keys of its own sequence; packed
sequences do not attend to each other). Image tokens count as decoder tokens like any other.
NOT counted: the vision tower (it runs once per image, is small next to the decoder for typical
prompts, and its cost depends on image sizes), embeddings lookups, norms, rotary, softmax and
activation-recomputation of gradient checkpointing (these are "model" FLOPs, not hardware FLOPs).
Training = forward + backward = 3 x forward.

MFU = achieved model FLOP/s / peak FLOP/s of the device. GPU peaks come from a table (dense bf16,
no sparsity); on CPU the "peak" is a measured fp32 matmul rate of this process (measured once and
cached), so CPU MFU says how close the actor gets to plain matmul speed on these cores.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Sequence
from typing import Any

import torch

from vlrl.models.moe import mlp_matmul_params

# Dense bf16 tensor-core peaks (FLOP/s, no sparsity; NVIDIA data sheets), matched in this order
# against torch.cuda.get_device_name(): card variants first, as their names contain the family's.
# Names as torch reports them, e.g. "NVIDIA H100 80GB HBM3" (SXM), "NVIDIA H100 PCIe", "NVIDIA H100 NVL".
GPU_PEAK_BF16: tuple[tuple[str, float], ...] = (
    (r"\bH100 PCIe\b", 756e12),
    (r"\bH100 NVL\b", 835e12),
    (r"\bH100\b", 989e12),  # SXM (HBM3)
    (r"\bH200 NVL\b", 835e12),
    (r"\bH200\b", 989e12),
    (r"\bH800 PCIe\b", 756e12),
    (r"\bH800\b", 989e12),
    (r"\bH20\b", 148e12),
    (r"\bA100\b", 312e12),
    (r"\bA800\b", 312e12),
    (r"\bL40S\b", 362e12),
    (r"\bA10G\b", 70e12),
    (r"\b4090\b", 165e12),
)


def gpu_peak_bf16(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s of a GPU from its name (`torch.cuda.get_device_name`), None if unknown."""
    for pattern, value in GPU_PEAK_BF16:
        if re.search(pattern, device_name):
            return value
    return None


def _text_config(hf_config: Any) -> Any:
    return getattr(hf_config, "text_config", None) or hf_config


def decoder_matmul_params(hf_config: Any) -> int:
    """Parameters the decoder multiplies each token by: layers' projections + MLP (for MoE layers
    the router and top-k experts: active parameters), and the lm head."""
    c = _text_config(hf_config)
    h, heads = c.hidden_size, c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    hd = getattr(c, "head_dim", None) or h // heads
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h  # q, k, v, o
    mlp = sum(mlp_matmul_params(c, layer) for layer in range(c.num_hidden_layers))
    return c.num_hidden_layers * attn + mlp + h * c.vocab_size


def forward_flops(hf_config: Any, seq_lengths: Sequence[int], head_tokens: int | None = None) -> float:
    """Forward FLOPs of the decoder over independent (packed or padded-away) sequences.

    `head_tokens`: positions whose logits are computed. vlrl scores responses only
    (`logits_to_keep`, vlrl.models.packing), so the lm head (hidden x vocab per token: 1-2% of a 3B
    model's FLOPs, more with long image prompts) runs on the response tokens; None: every token."""
    c = _text_config(hf_config)
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    tokens = sum(seq_lengths)
    head = c.hidden_size * c.vocab_size
    body = decoder_matmul_params(hf_config) - head
    dense = 2.0 * (body * tokens + head * (tokens if head_tokens is None else head_tokens))
    # QK^T and AV: 2 matmuls x 2 FLOPs x heads x head_dim per (query, key) pair; L(L+1)/2 causal pairs.
    pairs = sum(n * (n + 1) / 2 for n in seq_lengths)
    attention = 4.0 * c.num_hidden_layers * c.num_attention_heads * hd * pairs
    return dense + attention


def training_flops(hf_config: Any, seq_lengths: Sequence[int], head_tokens: int | None = None) -> float:
    """Forward + backward model FLOPs (3 x forward) of one pass over `seq_lengths` (see `forward_flops`)."""
    return 3.0 * forward_flops(hf_config, seq_lengths, head_tokens)


def flops_per_token(hf_config: Any, context: int) -> float:
    """Training FLOPs per token for sequences of length `context` (6 N + attention term)."""
    return training_flops(hf_config, [context]) / max(context, 1)


@functools.cache
def measured_cpu_peak(size: int = 1024, repeats: int = 5) -> float:
    """Best fp32 matmul FLOP/s of this process on CPU (all of its threads). Cached per process."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best


def peak_flops(device: torch.device | str) -> float | None:
    """Peak FLOP/s of `device`: GPU table (bf16 dense) or the measured CPU matmul rate; None if unknown."""
    device = torch.device(device)
    if device.type == "cpu":
        return measured_cpu_peak()
    if device.type == "cuda":
        return gpu_peak_bf16(torch.cuda.get_device_name(device))
    return None


def mfu(flops: float, seconds: float, device: torch.device | str) -> float | None:
    """Achieved / peak FLOP/s on one device (pass this rank's FLOPs); None when the peak is unknown."""
    peak = peak_flops(device)
    if peak is None or seconds <= 0:
        return None
    return flops / seconds / peak
