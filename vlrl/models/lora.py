"""Low-rank adapters (LoRA, built on peft) for the policy, and merging them into plain weights.

    model = apply_lora(hf_model, config.worker.actor.model.lora)   # a peft.PeftModel
    for name, tensor in merged_named_tensors(model.state_dict().items(), scaling): ...

`apply_lora` wraps a transformers model in a `peft.PeftModel` (no task type: its forward passes every
keyword through unchanged) whose only trainable parameters are the adapters' `lora_A` [r, in] and
`lora_B` [out, r]. The vision tower never gets adapters; `exclude_modules` (a regex, full match
against module names such as `model.language_model.layers.0.mlp.up_proj`) excludes more.

Parameter names of the wrapped model: `base_model.model.<transformers name>`, and every adapted
linear `X` becomes `X.base_layer.{weight,bias}` plus `X.lora_A.default.weight` and
`X.lora_B.default.weight`. `merged_named_tensors` turns such a stream back into the transformers
names with `W' = W + (alpha / r) * B @ A`, which is what the rollout engines and exported folders get.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from vlrl.config import LoraConfig

ADAPTER = "default"  # peft's name for the only adapter we train
PEFT_PREFIX = "base_model.model."
_LORA_PARTS = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])\.(?:[^.]+\.)?weight$")
_BASE_LAYER = ".base_layer."


def is_lora_model(model: torch.nn.Module) -> bool:
    """True for a model wrapped by `apply_lora` (a `peft.PeftModel`, FSDP-sharded or not)."""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def target_modules(cfg: LoraConfig) -> str | list[str]:
    """peft's `target_modules`: "all-linear" as is, else the comma list as module-name suffixes."""
    if cfg.target_modules.strip().lower() == "all-linear":
        return "all-linear"
    names = [item.strip() for item in cfg.target_modules.split(",") if item.strip()]
    if not names:
        raise ValueError("worker.actor.model.lora.target_modules is empty: give 'all-linear' or a comma list")
    return names


def exclude_pattern(model: torch.nn.Module, cfg: LoraConfig) -> str | None:
    """A regex (full match) over module names: the vision tower (and a projector kept apart from
    it), and `cfg.exclude_modules`."""
    from vlrl.models.loading import vision_modules

    vision = vision_modules(model)
    parts = [rf"{re.escape(name)}(\..*)?" for name, _ in vision]
    if cfg.exclude_modules and (vision or _matches_a_module(model, cfg.exclude_modules)):
        # (EasyR1's config excludes `.*visual.*`, which a text model does not have: passing it on
        # would change nothing but a peft warning on every rank)
        parts.append(cfg.exclude_modules)
    return "|".join(f"(?:{p})" for p in parts) or None


def _matches_a_module(model: torch.nn.Module, pattern: str) -> bool:
    regex = re.compile(pattern)
    return any(regex.fullmatch(name) for name, _ in model.named_modules())


def peft_config(model: torch.nn.Module, cfg: LoraConfig) -> Any:
    """The `peft.LoraConfig` of `cfg` for `model` (no dropout, no bias training)."""
    import peft

    return peft.LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        target_modules=target_modules(cfg),
        exclude_modules=exclude_pattern(model, cfg),
        lora_dropout=0.0,
        bias="none",
    )


def apply_lora(model: torch.nn.Module, cfg: LoraConfig) -> torch.nn.Module:
    """Wrap `model` with adapters; only they require grad. Raises when no module matched."""
    import peft

    settings = peft_config(model, cfg)
    try:
        wrapped = peft.get_peft_model(model, settings)
    except ValueError as err:  # peft: "Target modules ... not found in the base model"
        raise ValueError(
            f"worker.actor.model.lora: no module of {type(model).__name__} got an adapter "
            f"(target_modules={cfg.target_modules!r}, exclude_modules={cfg.exclude_modules!r}): {err}"
        ) from err
    return wrapped


def lora_scaling_of(model: torch.nn.Module) -> float:
    """The factor on `B @ A` of a wrapped model's adapter: alpha / rank (peft, no rsLoRA)."""
    configs: Any = model.peft_config  # {adapter name: peft.LoraConfig}
    settings = configs[ADAPTER]
    if settings.use_rslora:
        raise ValueError("rank-stabilized LoRA is not used by vlrl")
    return settings.lora_alpha / settings.r


def is_adapter_factor(name: str) -> bool:
    """Whether a wrapped model's state_dict key is a `lora_A` / `lora_B` weight."""
    return _LORA_PARTS.match(name) is not None


def base_name(name: str) -> str:
    """The transformers name of a wrapped model's base parameter (`base_layer` and prefix removed)."""
    if name.startswith(PEFT_PREFIX):
        name = name[len(PEFT_PREFIX) :]
    return name.replace(_BASE_LAYER, ".")


def merged_named_tensors(
    named: Iterable[tuple[str, torch.Tensor]], scaling: float
) -> Iterator[tuple[str, torch.Tensor]]:
    """(transformers name, merged tensor) from a wrapped model's (name, full tensor) stream, in order.

    peft registers `base_layer` before `lora_A` and `lora_B`, so each adapted weight waits only for
    its two factors: at most one base weight is held back at a time. Names may carry wrapper parts
    (FSDP, checkpointing) in any position; they are kept for the engines' name mapping to drop.
    """
    pending: dict[str, torch.Tensor] = {}  # module name -> base weight, A [r, in] or B [out, r]
    for name, tensor in named:
        lora = _LORA_PARTS.match(name)
        if lora is not None:
            pending[f"{lora['module']}#{lora['which']}"] = tensor
        elif name.endswith(".base_layer.weight"):
            pending[f"{name[: -len('.base_layer.weight')]}#W"] = tensor
        else:
            yield base_name(name), tensor
            continue
        module = lora["module"] if lora is not None else name[: -len(".base_layer.weight")]
        keys = [f"{module}#{part}" for part in "WAB"]
        if all(k in pending for k in keys):
            weight, a, b = (pending.pop(k) for k in keys)
            delta = (b.float() @ a.float()) * scaling  # [out, r] @ [r, in]
            yield base_name(f"{module}.weight"), (weight.float() + delta).to(weight.dtype)
    if pending:
        raise ValueError(f"LoRA merge: unpaired adapter tensors {sorted(pending)[:4]}")
