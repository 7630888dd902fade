"""Model families: one record per family of checkpoints, holding every fact about it that the rest
of vlrl needs (position rule, processor scheme, weight names, packing support, engine needs, the
conformance gates it passes). Nothing outside this package branches on the family.

    family = family_of(hf_config)          # by config.model_type; text models fall back to TEXT
    family_errors(family, config)          # start-up: what this run asks that the family cannot do

Adding a family: write its record (see `vlrl.models.families.qwen`), add its tiny builder
(`vlrl.models.tiny`), and run `python -m vlrl.tools.family_check --arch NAME` until every gate
passes; then list the gates in the record. docs/models.md walks through it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# (pixel_values, grid, token ids) of a dummy image in the family's layout: what a micro-batch
# without images runs through the vision tower so that every rank joins its FSDP collectives.
DummyImage = Callable[[Any, "torch.device | str"], tuple[torch.Tensor, torch.Tensor, list[int]]]

# The conformance gates of `vlrl.tools.family_check`, in the order it runs them.
GATES = {
    "prompt_ids": "the processor's expanded prompt ids equal vlrl's and the engine's",
    "positions": "vlrl's position ids equal transformers' (and so the engine's)",
    "packing": "packed rows give the log-probs and gradients of padded rows (or padded rows those of "
    "each row alone, for a padded-only family); shared image encoding equals encoding each copy",
    "engine_log_probs": "the actor's log-probs of the engine's sampled tokens equal the engine's",
    "weight_sync": "a weight sync sets every engine parameter: with every actor parameter changed, the "
    "engine samples the new weights' distribution, not the old one's",
    "lora": "LoRA leaves the vision tower and its projector untouched; a merged sync gives the engine "
    "the LoRA actor's distribution",
    "export": "a saved checkpoint reloads to identical log-probs; the merged export loads in "
    "transformers with the same log-probs",
}


@dataclass(frozen=True)
class Family:
    """What vlrl must know about one family of models (`vlrl.models.families.qwen` has examples)."""

    name: str
    model_types: tuple[str, ...]  # config.model_type values of its checkpoints
    vision: bool
    # Class-name prefixes of its multimodal processors (family from a processor alone).
    processor_prefixes: tuple[str, ...] = ()
    # Position ids: "1d" (0..L-1) or "mrope" ((t, h, w) per token, `vlrl.models.rope`).
    positions: str = "1d"
    # The Qwen-VL generation whose processor, image-token rule and video mrope rule it follows
    # ("qwen2_vl" | "qwen2_5_vl" | "qwen3_vl"); None for text models.
    vision_scheme: str | None = None
    # transformers-5 runtime prefix -> checkpoint prefix of the weights (first match wins).
    checkpoint_prefixes: tuple[tuple[str, str], ...] = ()
    # Fused experts stored transposed in transformers 5 vs the checkpoint (`vlrl.models.moe`).
    transposed_experts: bool = False
    # Padding-free training: "packed" (rows packed into one sequence) or "padded" (only
    # `worker.actor.padding_free=false`; `packing_note` says why).
    packing: str = "packed"
    packing_note: str = ""
    # vLLM 0.32 needs chunked prefill for it (hybrid linear-attention models cache their state
    # per block with prefix caching: `MambaModelConfig.verify_and_update_config`).
    engine_needs_chunked_prefill: bool = False
    # The only dtype vLLM 0.32's CPU kernels run it in (None: any; Qwen3.5's gated-delta-rule op
    # asserts bf16, vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py).
    cpu_engine_dtype: str | None = None
    # Full-attention layers gate their output by a second query-width projection (q_proj is twice
    # as wide: Qwen3.5); FLOPs count it (`vlrl.models.flops`).
    attention_output_gate: bool = False
    # The vision tower takes `cu_seqlens` and may use vlrl's varlen attention (`vlrl.models.attention`).
    varlen_vision_attention: bool = False
    # The projector from vision features to the text width when it is not inside the vision tower
    # (module path; None: Qwen's merger is the tower's last part). LoRA and freeze_vision_tower
    # treat it as part of the tower.
    projector: str | None = None
    # The vision tower's module path in the transformers model (with the merger, for Qwen).
    vision_tower: str = "model.visual"
    # The token opening a vision block, and the config attributes that hold vlrl's id names when
    # they differ (GLM-4.1V: `<|begin_of_image|>`, vision_start_token_id -> image_start_token_id).
    vision_start_token: str = "<|vision_start|>"
    config_token_keys: tuple[tuple[str, str], ...] = ()
    # Rows with videos are accepted (False: each such row is a bad row, counted at load).
    videos: bool = True
    # The image processor's min/max pixels bound t x h x w with t = temporal_patch_size (GLM-4.1V
    # counts an image as two frames): per image they are that many times smaller.
    processor_bounds_span_time: bool = False
    # vlrl counts its vision tower's FLOPs (`vlrl.models.flops`: Qwen's towers); else the decoder's only.
    vision_flops: bool = True
    # Text-config values both libraries must read alike: (attribute, required value, why).
    text_config_requirements: tuple[tuple[str, Any, str], ...] = ()
    # Prompt expansion of each image placeholder: "qwen_grid" (vlrl's fast rule from the image
    # size: sides rounded to patch x merge, one token per merged patch; the data pipeline never
    # decodes an image) or "processor" (the HF processor expands it on the driver: correct by
    # construction; images keep their size within data.min_pixels/max_pixels).
    image_expansion: str = "qwen_grid"
    # Whether the model takes each image's count of `pixel_values` rows as an input (Qwen's
    # `image_grid_thw`); a processor-expanded family's counts (its tiles per image) are bookkeeping.
    rows_are_model_input: bool = True
    # How the model takes the rows of all images: "rows" ([rows, ...] as concatenated) or
    # "batch_of_tiles" ([1, tiles, C, H, W]: Idefics3's batch x images layout, one batch row).
    pixel_layout: str = "rows"
    # Each distinct image of a micro-batch is encoded once (`vlrl.models.shared_images`).
    shared_image_encoding: bool = True
    # Tokens never sampled (placeholders and image brackets), beside the config's *_token_id.
    banned_tokens: tuple[str, ...] = ()
    # The dummy image of `DummyImage` (None: Qwen's one-merged-token image, `vlrl.workers.vision`).
    dummy_image: DummyImage | None = None
    # The tiny random builder's arch name (`vlrl.models.tiny`); None: no tiny model, no gates.
    tiny_arch: str | None = None
    # The gates of `vlrl.tools.family_check` this family passes (checked in the test suite).
    gates: tuple[str, ...] = ()

    @property
    def mrope(self) -> bool:
        return self.positions == "mrope"

    def config_key(self, name: str) -> str:
        """The config attribute holding vlrl's token id `name` (vision_start_token_id, ...)."""
        return dict(self.config_token_keys).get(name, name)

    def model_inputs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Model keyword arguments in this family's layout, from vlrl's (`pixel_values` rows
        concatenated, `image_grid_thw` the rows per image): changed in place and returned."""
        if not self.rows_are_model_input:  # per-image row counts: bookkeeping, not a model input
            kwargs.pop("image_grid_thw", None)
        pixels = kwargs.get("pixel_values")
        if self.pixel_layout == "batch_of_tiles" and pixels is not None:
            kwargs["pixel_values"] = pixels.unsqueeze(0)  # [1, tiles, C, H, W]
        return kwargs


def _registry() -> dict[str, Family]:
    from vlrl.models.families.glm import GLM4V
    from vlrl.models.families.idefics3 import IDEFICS3, SMOLVLM
    from vlrl.models.families.internvl import INTERNVL
    from vlrl.models.families.qwen import QWEN_FAMILIES, TEXT

    return {family.name: family for family in (*QWEN_FAMILIES, INTERNVL, IDEFICS3, SMOLVLM, GLM4V, TEXT)}


FAMILIES = _registry()
TEXT = FAMILIES["text"]


def _model_type(hf_config: Any) -> str:
    if isinstance(hf_config, dict):
        return str(hf_config.get("model_type") or "")
    return str(getattr(hf_config, "model_type", "") or "")


def _has_vision(hf_config: Any) -> bool:
    if isinstance(hf_config, dict):
        return hf_config.get("vision_config") is not None
    return getattr(hf_config, "vision_config", None) is not None


def find_family(hf_config: Any) -> Family | None:
    """The record naming this config's model_type, or None (no raise: for code that has a
    fallback, such as the FLOPs of a config built by hand)."""
    model_type = _model_type(hf_config)
    return next((f for f in FAMILIES.values() if model_type in f.model_types), None)


def family_of(hf_config: Any) -> Family:
    """The record of a transformers config (or its dict). A text model of a type no record names
    is a `TEXT` model (any causal LM transformers and vLLM both serve); a vision model must have one."""
    model_type = _model_type(hf_config)
    for family in FAMILIES.values():
        if model_type in family.model_types:
            return family
    if _has_vision(hf_config):
        known = sorted(t for f in FAMILIES.values() if f.vision for t in f.model_types)
        raise ValueError(
            f"vision model type {model_type!r} has no family record in vlrl.models.families "
            f"(known: {', '.join(known)}); docs/models.md says how to add one and gate it with "
            "`python -m vlrl.tools.family_check`"
        )
    return TEXT


def family_of_processor(processor: Any) -> Family:
    """The record of a multimodal processor, from its class name (the longest matching prefix)."""
    name = type(processor).__name__
    matches = [(len(p), f) for f in FAMILIES.values() for p in f.processor_prefixes if name.startswith(p)]
    if not matches:
        raise ValueError(f"unsupported processor {name}: no family record names it (vlrl.models.families)")
    return max(matches, key=lambda m: m[0])[1]


def engine_errors(family: Family, rollout: Any, on_gpu: bool) -> list[str]:
    """What the vLLM engine needs from `worker.rollout` for `family` (empty: nothing)."""
    errors = []
    if family.engine_needs_chunked_prefill and not rollout.enable_chunked_prefill:
        errors.append(
            f"model family {family.name!r} needs worker.rollout.enable_chunked_prefill=true: vLLM 0.32 "
            "caches its linear-attention state per block with prefix caching, which needs chunked prefill"
        )
    wanted = family.cpu_engine_dtype
    if not on_gpu and wanted and rollout.dtype not in (wanted, {"bf16": "bfloat16"}.get(wanted)):
        errors.append(
            f"worker.rollout.dtype={rollout.dtype}: vLLM 0.32's CPU kernels run model family "
            f"{family.name!r} in {wanted} only; set worker.rollout.dtype={wanted}"
        )
    return errors


def checkpoint_errors(family: Family, hf_config: Any) -> list[str]:
    """What the model's own config must say for transformers and vLLM to build the same model."""
    text = getattr(hf_config, "text_config", None) or hf_config
    return [
        f"the model's text config has {key}={getattr(text, key, None)!r}; model family {family.name!r} "
        f"needs {key}={value!r} ({why}): set it in the model folder's config.json"
        for key, value, why in family.text_config_requirements
        if getattr(text, key, None) != value
    ]


def family_errors(family: Family, config: Any) -> list[str]:
    """What a run (`PPOConfig`) asks of `family` that the family cannot do or has not passed
    (empty: nothing); each names the gate or key and what to do."""
    errors = []
    missing = [gate for gate in GATES if gate not in family.gates]
    if missing:
        errors.append(
            f"model family {family.name!r} has not passed the conformance gate {missing[0]!r} "
            f"({GATES[missing[0]]}); run `python -m vlrl.tools.family_check --arch "
            f"{family.tiny_arch or family.name}` and see docs/models.md"
        )
    packed = config.worker.actor.padding_free or bool(config.worker.ref.padding_free)
    if packed and family.packing == "padded":
        errors.append(
            f"worker.actor.padding_free=true: model family {family.name!r} trains on padded rows only "
            f"({family.packing_note}); set worker.actor.padding_free=false (and leave "
            "worker.ref.padding_free unset or false)"
        )
    if family.vision and family.image_expansion != "qwen_grid" and config.worker.actor.ulysses_size > 1:
        errors.append(
            f"worker.actor.ulysses_size={config.worker.actor.ulysses_size}: sequence parallelism splits "
            f"image features by Qwen's layout; model family {family.name!r} trains with ulysses_size=1"
        )
    if family.vision and family.image_expansion != "qwen_grid" and config.worker.rollout.multi_turn.enable:
        errors.append(
            f"worker.rollout.multi_turn: tool images follow Qwen's expansion rule; model family "
            f"{family.name!r} expands its images with its processor, which multi-turn rollouts do not call yet"
        )
    if family.vision and family.image_expansion != "qwen_grid" and config.worker.rollout.name == "hf":
        errors.append(
            f"worker.rollout.name=hf: the transformers engine builds Qwen-VL image inputs; model family "
            f"{family.name!r} generates with worker.rollout.name=vllm"
        )
    if config.worker.rollout.name == "vllm":
        on_gpu = config.trainer.device != "cpu" and torch.cuda.is_available()
        errors += engine_errors(family, config.worker.rollout, on_gpu)
    return errors
