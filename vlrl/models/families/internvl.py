"""InternVL in transformers' format (`InternVLForConditionalGeneration`, model_type "internvl"): an
InternViT vision tower, a pixel-shuffle MLP projector and a Qwen2 text model; 1-D positions.

Each image becomes tiles of `vision_config.image_size` (the image processor's crop to patches,
plus a thumbnail); the processor writes `<img>`, `image_seq_length` context tokens per tile and
`</img>` for each image placeholder (`<IMG_CONTEXT>` in the prompt). vLLM 0.32 serves it as
`InternS1ForConditionalGeneration` (vllm/model_executor/models/interns1.py) from the same raw
prompt ids and images.
"""

from __future__ import annotations

from typing import Any

import torch

from vlrl.models.families import GATES, Family


def dummy_tile(hf_config: Any, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """One black tile [1, C, S, S], its row count [[1]], and its `image_seq_length` context tokens
    (the model checks that the image tokens match the features: no brackets are needed)."""
    vision = hf_config.vision_config
    size = vision.image_size if isinstance(vision.image_size, int) else vision.image_size[0]
    pixels = torch.zeros(1, int(vision.num_channels), int(size), int(size), device=device)
    rows = torch.ones(1, 1, dtype=torch.long, device=device)
    return pixels, rows, [int(hf_config.image_token_id)] * int(hf_config.image_seq_length)


INTERNVL = Family(
    name="internvl",
    model_types=("internvl",),
    vision=True,
    processor_prefixes=("InternVL",),
    positions="1d",
    # the "-hf" checkpoints keep InternVL's 4.x layout: the text model whole under language_model.
    checkpoint_prefixes=(
        ("model.language_model.", "language_model.model."),
        ("lm_head.", "language_model.lm_head."),
        ("model.vision_tower.", "vision_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
    ),
    projector="model.multi_modal_projector",
    image_expansion="processor",
    vision_tower="model.vision_tower",
    videos=False,
    vision_flops=False,
    rows_are_model_input=False,
    shared_image_encoding=False,
    banned_tokens=("<img>", "</img>", "<IMG_CONTEXT>"),
    dummy_image=dummy_tile,
    tiny_arch="internvl",
    gates=tuple(GATES),
)
