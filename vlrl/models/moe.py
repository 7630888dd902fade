"""Facts about Qwen3-VL-MoE (transformers 5.19 `Qwen3VLMoeForConditionalGeneration`) in one place.

- Sparse layers: layer i routes each token to `num_experts_per_tok` of `num_experts` experts unless
  i is in `mlp_only_layers` or (i + 1) is not a multiple of `decoder_sparse_step` (then a dense
  MLP of `intermediate_size`). Experts are SwiGLU MLPs of width `moe_intermediate_size`; the router
  is a bias-free linear [E, H] followed by softmax, top-k and renormalization of the k weights.
- Storage: transformers 5 keeps each layer's experts as two fused 3-D parameters,
  `mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I]. Qwen's checkpoints
  (and vLLM 0.32's loader, `is_fused_checkpoint_transposed=True`) hold them transposed,
  [E, H, 2I] and [E, I, H]. transformers loads either layout (it transposes when the shape differs
  from the parameter's) but saves its own.
- FSDP2 shards every parameter along dim 0, which for the fused experts is the expert dim: with
  world size W each rank holds E / W experts of every layer between gathers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# Name endings of the fused expert tensors whose checkpoint layout is the transpose of the runtime one.
TRANSPOSED_EXPERTS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def checkpoint_layout(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A runtime expert tensor (`name` ends with a `TRANSPOSED_EXPERTS` entry) in Qwen's checkpoint
    layout, as a view ([E, A, B] -> [E, B, A]); any other tensor unchanged."""
    return tensor.transpose(1, 2) if name.endswith(TRANSPOSED_EXPERTS) else tensor


def write_checkpoint_layout(folder: str | Path, hf_config: Any) -> int:
    """After `save_pretrained(folder)` of an MoE model: rewrite its safetensors files with the fused
    experts in Qwen's checkpoint layout, so that vLLM (and Qwen's tooling) read them right. No-op
    for other models. Returns how many tensors were transposed. One file in memory at a time."""
    from safetensors.torch import load_file, save_file

    if not is_moe_config(getattr(hf_config, "text_config", None) or hf_config):
        return 0
    count = 0
    for path in sorted(Path(folder).glob("*.safetensors")):
        tensors = load_file(str(path))
        hits = [name for name in tensors if name.endswith(TRANSPOSED_EXPERTS)]
        for name in hits:
            tensors[name] = checkpoint_layout(name, tensors[name]).contiguous()
        if hits:
            save_file(tensors, str(path), metadata={"format": "pt"})
        count += len(hits)
    return count


def is_moe_config(text_config: Any) -> bool:
    """True for a text config with routed experts (Qwen3-VL-MoE / Qwen3-MoE style)."""
    return int(getattr(text_config, "num_experts", 0) or 0) > 0


def is_sparse_layer(text_config: Any, layer: int) -> bool:
    """Whether decoder layer `layer` routes through experts (transformers' rule, see above)."""
    if not is_moe_config(text_config):
        return False
    dense = getattr(text_config, "mlp_only_layers", None) or []
    step = int(getattr(text_config, "decoder_sparse_step", 1) or 1)
    return layer not in dense and (layer + 1) % step == 0


def mlp_matmul_params(text_config: Any, layer: int) -> int:
    """MLP parameters one token is multiplied by in `layer`: the dense gated MLP, or for a sparse
    layer the router plus its top-k experts only (the active parameters)."""
    h = text_config.hidden_size
    if not is_sparse_layer(text_config, layer):
        return 3 * h * text_config.intermediate_size  # gate, up, down
    experts, top_k = text_config.num_experts, text_config.num_experts_per_tok
    return h * experts + top_k * 3 * h * text_config.moe_intermediate_size


def check_engine_config(hf_config: Any) -> None:
    """Fail at start-up when vLLM would route differently from the actor.

    transformers 5.19 always renormalizes the top-k router weights; vLLM 0.32 does so only with
    `norm_topk_prob: true` in the text config and fails without the key (AttributeError)."""
    text = getattr(hf_config, "text_config", None) or hf_config
    if not is_moe_config(text):
        return
    value = getattr(text, "norm_topk_prob", None)
    if value is not True:
        raise ValueError(
            f"MoE model config: text_config.norm_topk_prob is {value!r}; the actor (transformers) always "
            "renormalizes the top-k expert weights, so the vLLM engine needs norm_topk_prob: true in "
            "config.json's text_config (Qwen's Qwen3-VL-MoE configs have it)"
        )
