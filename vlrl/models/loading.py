"""Load a policy / reference model from a Hugging Face folder, ready to be sharded.

VLMs (a config with `vision_config`) load with `AutoModelForImageTextToText`, text-only models with
`AutoModelForCausalLM`. The text decoder's attention is switched to our packed implementation when
`padding_free` (see vlrl.models.attention); the vision tower attends per window/image through
`vision_varlen_attention_forward`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from vlrl.config.checks import gradient_checkpointing_interval
from vlrl.models.attention import VARLEN_ATTENTION, set_text_attention, set_vision_attention
from vlrl.models.families import family_of
from vlrl.models.shared_images import share_image_features

if TYPE_CHECKING:
    from transformers.modeling_layers import GradientCheckpointingLayer

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(name: str | torch.dtype | None, default: torch.dtype = torch.float32) -> torch.dtype:
    """torch dtype from a config string (float32/fp32/bfloat16/bf16/float16/fp16); None -> default."""
    if name is None:
        return default
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; valid: {sorted(DTYPES)}")
    return DTYPES[name]


def is_vision_model(hf_config: Any) -> bool:
    """True for configs with a vision tower (Qwen2/2.5/3-VL)."""
    return getattr(hf_config, "vision_config", None) is not None


def load_config(model_path: str, overrides: dict[str, Any] | None = None, trust_remote_code: bool = False):
    """The model's config with `overrides` applied (to the text sub-config too when it has the key)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
        text = getattr(config, "text_config", None)
        if text is not None and hasattr(text, key):
            setattr(text, key, value)
    return config


def model_class(hf_config: Any):
    """The Auto class that builds this config's model with an LM head."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_model(hf_config) else AutoModelForCausalLM


def vision_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of the vision tower and, where the family keeps it apart, its projector:
    what LoRA never adapts and `freeze_vision_tower` freezes. Empty for a text model."""
    tower = vision_tower(model)
    if tower is None:
        return []
    named = dict(model.named_modules())
    found = [(next(n for n, m in named.items() if m is tower), tower)]
    projector = family_of(model.config).projector
    for name, module in named.items():
        if projector is not None and (name == projector or name.endswith("." + projector)):
            found.append((name, module))
    return found


def vision_tower(model: torch.nn.Module) -> torch.nn.Module | None:
    """The vision encoder of a vision model (Qwen's with its merger; `Family.vision_tower`), or None."""
    config = getattr(model, "config", None)
    if config is None or not is_vision_model(config):
        return None
    full = family_of(config).vision_tower
    for path in (full, full.removeprefix("model.")):  # the top-level model's path, or its inner model's
        module: Any = model
        for name in path.split("."):
            module = getattr(module, name, None)
            if module is None:
                break
        if isinstance(module, torch.nn.Module):
            return module
    return None


def checkpointable_stacks(model: torch.nn.Module) -> list[list[GradientCheckpointingLayer]]:
    """The model's stacks of checkpointable layers, each in forward order: the vision tower's
    blocks and the decoder's layers (transformers' `GradientCheckpointingLayer` children of one
    `nn.ModuleList`)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    stacks: list[list[GradientCheckpointingLayer]] = []
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList):
            layers = [m for m in module if isinstance(m, GradientCheckpointingLayer)]
            if layers:
                stacks.append(layers)
    return stacks


def select_checkpointed_layers(model: torch.nn.Module, every: int) -> int:
    """Keep activation checkpointing on layers 0, every, 2 x every, ... of each stack (decoder
    layers and vision blocks counted apart), off on the others; returns how many are on.

    Call after `gradient_checkpointing_enable`, which sets every layer's `gradient_checkpointing`
    flag and its `_gradient_checkpointing_func`. The flag is read at each call
    (transformers 5.19 modeling_layers.py `GradientCheckpointingLayer.__call__`: checkpoint(
    `nn.Module.__call__`) when the flag is set and the module trains). transformers' own
    `every_n_layers` counts all such layers in one sequence, vision blocks and decoder layers
    together, hence this per-stack count. FSDP2 composes either way: `fully_shard`
    (vlrl.workers.fsdp, after loading) registers its all-gather/free as forward hooks of the same
    layer modules, so they run inside the checkpointed call and again on its recompute; a layer
    whose flag is off keeps its activations like a model without checkpointing."""
    count = 0
    for layers in checkpointable_stacks(model):
        for i, layer in enumerate(layers):
            layer.gradient_checkpointing = i % every == 0
            count += int(layer.gradient_checkpointing)
    return count


def load_model(
    model_path: str,
    *,
    dtype: torch.dtype = torch.float32,
    overrides: dict[str, Any] | None = None,
    padding_free: bool = True,
    gradient_checkpointing: bool = False,
    checkpoint_layers: str = "all",
    freeze_vision: bool = False,
    trust_remote_code: bool = False,
    on_meta: bool = False,
) -> torch.nn.Module:
    """Build the model of `model_path` in `dtype` on CPU (or with empty weights on meta when `on_meta`).

    `on_meta` is for ranks > 0 when rank 0 broadcasts the weights after sharding (vlrl.workers.fsdp).
    `checkpoint_layers`: which layers `gradient_checkpointing` recomputes ("all" or "every_k:K",
    `select_checkpointed_layers`).
    """
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    config = load_config(model_path, overrides, trust_remote_code)
    cls = model_class(config)
    if on_meta:
        with torch.device("meta"):
            model = cls.from_config(
                config, dtype=dtype, attn_implementation="sdpa", trust_remote_code=trust_remote_code
            )
    else:
        model = cls.from_pretrained(
            model_path,
            config=config,
            dtype=dtype,
            attn_implementation="sdpa",
            trust_remote_code=trust_remote_code,
        )
    model.config.use_cache = False
    if family_of(config).shared_image_encoding and is_vision_model(config):
        share_image_features(model)  # accepts vlrl_image_index: one encoding per distinct image
        set_vision_attention(model)  # all windows of a block in one varlen kernel call on GPU
    if padding_free:
        set_text_attention(model, VARLEN_ATTENTION)
    if gradient_checkpointing:
        # Non-reentrant checkpointing composes with FSDP2 and passes our forward kwargs through.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        select_checkpointed_layers(model, gradient_checkpointing_interval(checkpoint_layers))
    if freeze_vision:
        modules = vision_modules(model)
        if not modules:
            raise ValueError("freeze_vision_tower=true but the model has no vision tower")
        for _, module in modules:
            module.requires_grad_(False)
    return model
