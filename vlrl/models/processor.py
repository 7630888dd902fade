"""Tokenizer/processor loading and the model facts the data pipeline and mrope need.

`load_processor` returns `(tokenizer, processor)`; the processor is None for text-only models.
`VisionSpec` gathers what prompt preparation needs from a processor (and, when given, the model
config): the family, the placeholder token ids, patch and merge sizes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from vlrl.models.families import family_of, family_of_processor


def resolve_chat_template(value: str | None) -> str | None:
    """A chat template given as a Jinja string or as a path to a file holding one."""
    if value is None or value == "":
        return None
    looks_like_path = "{" not in value and "\n" not in value
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if looks_like_path:
        raise FileNotFoundError(f"chat template file {value!r} does not exist")
    return value


def load_processor(path: str, override_chat_template: str | None = None) -> tuple[Any, Any | None]:
    """Load `(tokenizer, processor)` from a model folder; processor is None for text-only models.

    `override_chat_template` (Jinja string or file path) replaces the chat template of both.
    A tokenizer without a pad token gets its EOS token as pad token (left padding needs one).
    """
    from transformers import AutoProcessor, AutoTokenizer

    processor = None
    try:
        loaded = AutoProcessor.from_pretrained(path)
    except (OSError, ValueError, KeyError, TypeError):  # no processor config: a text model
        loaded = None
    if loaded is not None and hasattr(loaded, "image_processor"):
        processor = loaded
        tokenizer = processor.tokenizer
    elif loaded is not None and hasattr(loaded, "apply_chat_template") and hasattr(loaded, "encode"):
        tokenizer = loaded  # AutoProcessor falls back to the tokenizer for text models
    else:
        tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    template = resolve_chat_template(override_chat_template)
    if template is not None:
        tokenizer.chat_template = template
        if processor is not None:
            processor.chat_template = template
    return tokenizer, processor


def model_family(hf_config: Any) -> str:
    """The family name of a transformers config (or its dict): "qwen2_5_vl", ..., "text"
    (`vlrl.models.families`)."""
    return family_of(hf_config).name


def _config_value(hf_config: Any, name: str) -> Any:
    """Attribute of the config, falling back to its text_config (4.x kept some ids there)."""
    value = getattr(hf_config, name, None)
    if value is None and getattr(hf_config, "text_config", None) is not None:
        value = getattr(hf_config.text_config, name, None)
    return value


def vision_token_ids(hf_config: Any) -> dict[str, int]:
    """{image_token_id, video_token_id, vision_start_token_id, vision_end_token_id} of a VL config."""
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    family = family_of(hf_config)
    ids = {name: _config_value(hf_config, family.config_key(name)) for name in names}
    missing = [name for name, value in ids.items() if value is None]
    if missing:
        raise ValueError(f"model config ({model_family(hf_config)}) has no {', '.join(missing)}")
    return {name: int(value) for name, value in ids.items()}


def mrope_kwargs(hf_config: Any) -> dict[str, Any]:
    """Keyword arguments of `vlrl.models.rope.mrope_position_ids` for this model config."""
    family = family_of(hf_config)
    if not family.mrope:
        raise ValueError(f"mrope_kwargs needs an mrope family's config; {family.name} uses 1-D positions")
    ids = vision_token_ids(hf_config)
    vision = hf_config.vision_config
    return {
        "image_token_id": ids["image_token_id"],
        "video_token_id": ids["video_token_id"],
        "vision_start_token_id": ids["vision_start_token_id"],
        "spatial_merge_size": int(vision.spatial_merge_size),
        "tokens_per_second": float(getattr(vision, "tokens_per_second", None) or 2.0),
        "family": family.vision_scheme,
    }


@dataclass(frozen=True)
class VisionSpec:
    """What prompt preparation needs to know about a Qwen-VL processor."""

    family: str  # the vision scheme (`Family.vision_scheme`): qwen2_vl | qwen2_5_vl | qwen3_vl
    image_token: str  # "<|image_pad|>"
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    patch_size: int  # 14 (Qwen2/2.5-VL) or 16 (Qwen3-VL)
    merge_size: int  # 2: 2x2 patches become one LLM token
    tokens_per_second: float = 2.0  # Qwen2.5-VL video temporal spacing (unused for images)

    @property
    def factor(self) -> int:
        """Image sides must be multiples of this (28 for Qwen2/2.5-VL, 32 for Qwen3-VL)."""
        return self.patch_size * self.merge_size

    def rope_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `mrope_position_ids`."""
        return {
            "image_token_id": self.image_token_id,
            "video_token_id": self.video_token_id,
            "vision_start_token_id": self.vision_start_token_id,
            "spatial_merge_size": self.merge_size,
            "tokens_per_second": self.tokens_per_second,
            "family": self.family,
        }


def vision_spec(processor: Any, hf_config: Any | None = None) -> VisionSpec:
    """`VisionSpec` of `processor`; ids and tokens_per_second from `hf_config` when given. A family
    whose processor expands its images (`Family.image_expansion`) has no patch rule: factor 1."""
    family_record = family_of(hf_config) if hf_config is not None else family_of_processor(processor)
    if family_record.image_expansion == "processor":
        return _processor_spec(processor, family_record.name)
    return _qwen_spec(processor, hf_config)


def image_tokens_by_size(processor: Any, sizes: list[tuple[int, int]]) -> list[int]:
    """Tokens the processor's expansion writes for one image of each (height, width), brackets
    included: its `_get_num_multimodal_tokens` where it has one (InternVL's, Idefics3's), else
    counted by expanding a blank image of that size (SmolVLM's processor in transformers 5.19 has
    no counter; its expansion is Idefics3's)."""
    if hasattr(processor, "_get_num_multimodal_tokens"):
        counts = processor._get_num_multimodal_tokens(image_sizes=[list(size) for size in sizes])
        return [int(n) for n in counts["num_image_tokens"]]
    from PIL import Image

    placeholder = processor.image_token
    alone = len(processor.tokenizer(placeholder)["input_ids"])  # the placeholder and any BOS
    counts = []
    for height, width in sizes:
        out = processor(text=[placeholder], images=[Image.new("RGB", (width, height))])
        counts.append(len(out["input_ids"][0]) - alone + 1)
    return counts


def _processor_spec(processor: Any, name: str) -> VisionSpec:
    tokenizer = processor.tokenizer
    image_token = processor.image_token
    video_token = getattr(processor, "video_token", None)
    video_id = tokenizer.convert_tokens_to_ids(video_token) if video_token else None
    return VisionSpec(
        family=name,
        image_token=image_token,
        image_token_id=int(tokenizer.convert_tokens_to_ids(image_token)),
        video_token_id=int(video_id) if video_id is not None else -1,
        vision_start_token_id=-1,
        patch_size=1,
        merge_size=1,
    )


def _qwen_spec(processor: Any, hf_config: Any | None) -> VisionSpec:
    tokenizer = processor.tokenizer
    image_token = getattr(processor, "image_token", "<|image_pad|>")
    video_token = getattr(processor, "video_token", "<|video_pad|>")
    ids = {
        "image_token_id": tokenizer.convert_tokens_to_ids(image_token),
        "video_token_id": tokenizer.convert_tokens_to_ids(video_token),
        "vision_start_token_id": tokenizer.convert_tokens_to_ids(
            family_of_processor(processor).vision_start_token
        ),
    }
    tokens_per_second = 2.0  # released Qwen2.5-VL checkpoints
    family = family_of_processor(processor).vision_scheme
    if hf_config is not None:
        family = family_of(hf_config).vision_scheme
        config_ids = vision_token_ids(hf_config)
        ids = {name: config_ids[name] for name in ids}
        tokens_per_second = float(getattr(hf_config.vision_config, "tokens_per_second", None) or 2.0)
    image_processor = processor.image_processor
    return VisionSpec(
        family=str(family),
        image_token=image_token,
        patch_size=int(image_processor.patch_size),
        merge_size=int(image_processor.merge_size),
        tokens_per_second=tokens_per_second,
        **ids,
    )
