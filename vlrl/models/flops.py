"""Model FLOPs of the text decoder and MFU (model FLOPs utilization).

What is counted: the decoder's matmuls (attention projections, gated MLP; the lm head on the
positions whose logits are computed, the response tokens in training) at 2 FLOPs per
multiply-add per token (mixture-of-experts layers: the router and the top-k experts a token is routed
to, i.e. the active parameters, not all experts; `vlrl.models.moe`), plus the attention scores and weighted sums (QK^T and AV), which grow with
the context each token attends to (causal: token t attends to t keys of its own sequence; packed
sequences do not attend to each other). Image tokens count as decoder tokens like any other.
The vision tower (`vision_forward_flops`): the patch embedding, each block's projections and MLP
per patch, its attention within each frame (Qwen2.5-VL: within each window in the windowed
blocks), and the merger(s) per merged token, from the images' patch grids (`image_grid`).
NOT counted: embeddings lookups, norms, rotary, softmax, Qwen3-VL's interpolated position
embeddings, and activation-recomputation of gradient checkpointing (these are "model" FLOPs, not
hardware FLOPs). Training = forward + backward = 3 x forward; a frozen vision tower (no trainable
weight in it, nothing before it to send gradients to) counts its forward only.

MFU = achieved model FLOP/s / peak FLOP/s of the device. GPU peaks come from a table (dense bf16,
no sparsity); on CPU the "peak" is a measured fp32 matmul rate of this process (measured once and
cached), so CPU MFU says how close the actor gets to plain matmul speed on these cores.
"""

from __future__ import annotations

import functools
import math
import re
import time
from collections.abc import Iterable, Sequence
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


def _layer_types(c: Any) -> list[str]:
    """Each decoder layer's kind: "full_attention" (default), "sliding_attention" or "linear_attention"."""
    return list(getattr(c, "layer_types", None) or ["full_attention"] * c.num_hidden_layers)


def _attention_params(c: Any, kind: str, gated_query: bool) -> int:
    """Matmul parameters of one layer's token mixer. Softmax attention: q, k, v, o (q twice as wide
    with an output gate). Gated-delta-rule linear attention (Qwen3.5): the q/k/v, z, b and a input
    projections and the output projection."""
    h = c.hidden_size
    if kind == "linear_attention":
        keys, values = (
            c.linear_num_key_heads * c.linear_key_head_dim,
            c.linear_num_value_heads * c.linear_value_head_dim,
        )
        return h * (2 * keys + values) + h * values + 2 * h * c.linear_num_value_heads + values * h
    heads = c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    hd = getattr(c, "head_dim", None) or h // heads
    return h * heads * hd * (2 if gated_query else 1) + 2 * h * kv * hd + heads * hd * h


def decoder_matmul_params(hf_config: Any) -> int:
    """Parameters the decoder multiplies each token by: layers' token mixers + MLP (for MoE layers
    the router and top-k experts: active parameters), and the lm head."""
    from vlrl.models.families import find_family

    c = _text_config(hf_config)
    family = find_family(hf_config)
    gated = family is not None and family.attention_output_gate
    attn = sum(_attention_params(c, kind, gated) for kind in _layer_types(c))
    mlp = sum(mlp_matmul_params(c, layer) for layer in range(c.num_hidden_layers))
    return attn + mlp + c.hidden_size * c.vocab_size


def _mixing_flops(c: Any, seq_lengths: Sequence[int]) -> float:
    """Forward FLOPs of the token mixing itself, beyond the projections. Softmax attention: QK^T and
    AV, 2 matmuls x 2 FLOPs x heads x head_dim per (query, key) pair: L(L+1)/2 causal pairs, or
    min(i + 1, window) keys per query for a sliding window. Linear attention: the state update and
    read-out, ~4 x d_k x d_v per value head and token."""
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    window = getattr(c, "sliding_window", None)
    total = 0.0
    for kind in _layer_types(c):
        if kind == "linear_attention":
            per_token = 4.0 * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim
            total += per_token * sum(seq_lengths)
            continue
        if kind == "sliding_attention" and window:
            w = int(window)
            pairs = sum(min(n, w) * (min(n, w) + 1) / 2 + max(n - w, 0) * w for n in seq_lengths)
        else:
            pairs = sum(n * (n + 1) / 2 for n in seq_lengths)
        total += 4.0 * c.num_attention_heads * hd * pairs
    return total


def forward_flops(hf_config: Any, seq_lengths: Sequence[int], head_tokens: int | None = None) -> float:
    """Forward FLOPs of the decoder over independent (packed or padded-away) sequences.

    `head_tokens`: positions whose logits are computed. vlrl scores responses only
    (`logits_to_keep`, vlrl.models.packing), so the lm head (hidden x vocab per token: 1-2% of a 3B
    model's FLOPs, more with long image prompts) runs on the response tokens; None: every token."""
    c = _text_config(hf_config)
    tokens = sum(seq_lengths)
    head = c.hidden_size * c.vocab_size
    body = decoder_matmul_params(hf_config) - head
    dense = 2.0 * (body * tokens + head * (tokens if head_tokens is None else head_tokens))
    return dense + _mixing_flops(c, seq_lengths)


def training_flops(hf_config: Any, seq_lengths: Sequence[int], head_tokens: int | None = None) -> float:
    """Forward + backward model FLOPs (3 x forward) of one pass over `seq_lengths` (see `forward_flops`)."""
    return 3.0 * forward_flops(hf_config, seq_lengths, head_tokens)


Grid = tuple[int, int, int]  # (t, h, w): temporal patches x patch rows x patch columns of one image/video


def image_grid(vision_config: Any, size: tuple[int, int], frames: int = 1) -> Grid:
    """The patch grid of an image (or video of `frames` frames) the processor will not resize:
    `size` = (width, height) as PIL's `Image.size`, a multiple of patch_size x spatial_merge_size
    (vlrl's data pipeline resizes to that, vlrl.data.encoded_images; otherwise the nearest grid).
    An image is one temporal patch (the processor repeats it temporal_patch_size times)."""
    p, m = int(vision_config.patch_size), int(vision_config.spatial_merge_size)
    width, height = size
    h, w = (max(round(x / (p * m)), 1) * m for x in (height, width))
    t = max(math.ceil(frames / int(vision_config.temporal_patch_size)), 1)
    return (t, h, w)


def _windows(grid_h: int, grid_w: int, vision_config: Any) -> list[int]:
    """Patches in each attention window of one frame of a Qwen2.5-VL windowed block: windows of
    `window_size // spatial_merge_size // patch_size` merged tokens a side, the last row/column of
    windows cut short by the frame's edge (transformers 5.19 vision_utils.py `get_vision_window_index`)."""
    m = int(vision_config.spatial_merge_size)
    side = int(vision_config.window_size) // m // int(vision_config.patch_size)

    def spans(n: int) -> list[int]:  # n merged tokens cut into runs of `side`
        return [min(side, n - i) for i in range(0, n, side)]

    return [a * b * m * m for a in spans(grid_h // m) for b in spans(grid_w // m)]


def _vision_dims(vc: Any) -> tuple[int, float, int, int]:
    """(width, MLP matmul params per block, merger output width, mergers) of a Qwen-VL vision config.

    Qwen2-VL: width `embed_dim`, MLP fc1/fc2 of `mlp_ratio` x width, merger to `hidden_size`.
    Qwen2.5-VL: width `hidden_size`, gated MLP (gate, up, down) of `intermediate_size`.
    Qwen3-VL: width `hidden_size`, MLP fc1/fc2 of `intermediate_size`, one more merger per
    `deepstack_visual_indexes` entry (each as large as the main one)."""
    if getattr(vc, "embed_dim", None) is not None and getattr(vc, "mlp_ratio", None) is not None:
        dim = int(vc.embed_dim)
        return dim, 2.0 * dim * dim * float(vc.mlp_ratio), int(vc.hidden_size), 1
    dim, inter = int(vc.hidden_size), int(vc.intermediate_size)
    out = int(getattr(vc, "out_hidden_size", None) or dim)
    if getattr(vc, "fullatt_block_indexes", None) is not None:  # Qwen2.5-VL
        return dim, 3.0 * dim * inter, out, 1
    deepstack = len(getattr(vc, "deepstack_visual_indexes", None) or ())
    return dim, 2.0 * dim * inter, out, 1 + deepstack


def vision_forward_flops(hf_config: Any, grids: Iterable[Grid]) -> float:
    """Forward FLOPs of the vision tower over images/videos of patch grids `grids` (t, h, w).

    Per patch: the patch embedding (a conv with stride = kernel: in_channels x temporal_patch_size
    x patch_size^2 inputs per output), then per block qkv + proj (4 width^2) and the MLP; per merged
    token (spatial_merge_size^2 patches): the merger's two linears (each merger). Attention: QK^T
    and AV, 4 x width FLOPs per (query, key) pair, over all pairs of a frame (bidirectional) or,
    in Qwen2.5-VL's windowed blocks (those not in `fullatt_block_indexes`), of a window."""
    vc = getattr(hf_config, "vision_config", None)
    grids = list(grids)
    if vc is None or not grids:
        return 0.0
    dim, mlp, out, mergers = _vision_dims(vc)
    depth, m2 = int(vc.depth), int(vc.spatial_merge_size) ** 2
    embed = int(getattr(vc, "in_channels", 3)) * int(vc.temporal_patch_size) * int(vc.patch_size) ** 2 * dim
    patches = sum(t * h * w for t, h, w in grids)
    dense = 2.0 * patches * (embed + depth * (4.0 * dim * dim + mlp))
    merger = 2.0 * (patches / m2) * mergers * ((dim * m2) ** 2 + dim * m2 * out)
    full_pairs = sum(t * (h * w) ** 2 for t, h, w in grids)
    full_blocks = depth
    window_pairs = 0.0
    if getattr(vc, "fullatt_block_indexes", None) is not None:
        full_blocks = len([i for i in vc.fullatt_block_indexes if 0 <= i < depth])
        window_pairs = (depth - full_blocks) * sum(
            t * sum(n * n for n in _windows(h, w, vc)) for t, h, w in grids
        )
    attention = 4.0 * dim * (full_blocks * full_pairs + window_pairs)
    return dense + merger + attention


def vision_training_flops(hf_config: Any, grids: Iterable[Grid], trainable: bool) -> float:
    """The vision tower's share of one training pass: 3 x forward, or 1 x when it is frozen."""
    return (3.0 if trainable else 1.0) * vision_forward_flops(hf_config, grids)


def batch_vision_grids(
    hf_config: Any, images: Sequence[Sequence[Any]], videos: Sequence[Sequence[Any]] | None = None
) -> list[Grid]:
    """Patch grids of the images and videos a batch's vision tower encodes: each distinct tuple of
    a sample's items once (the samples of a GRPO group share theirs: vlrl.workers.vision
    `collate_shared`, vlrl.models.shared_images). Items need `.size` (width, height); videos also
    `.frames`. A group split over micro-batches is encoded once per micro-batch: that extra work
    is not counted (model FLOPs)."""
    from vlrl.models.families import find_family

    vc = getattr(hf_config, "vision_config", None)
    family = find_family(hf_config)
    if vc is None or (family is not None and not family.vision_flops):
        return []  # no vision tower, or no FLOPs rule for it (InternVL, GLM-4.1V): the decoder's only
    grids: list[Grid] = []
    for per_sample, is_video in ((images, False), (videos or [], True)):
        seen: set[tuple[int, ...]] = set()
        for items in per_sample:
            key = tuple(id(item) for item in items)
            if not items or key in seen:
                continue
            seen.add(key)
            for item in items:  # PIL images, vlrl EncodedImage / Video: all have `.size`
                if getattr(item, "size", None) is not None:
                    grids.append(image_grid(vc, item.size, len(item.frames) if is_video else 1))
    return grids


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
