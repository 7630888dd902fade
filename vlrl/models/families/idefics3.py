"""Idefics3 and SmolVLM (`Idefics3ForConditionalGeneration`, `SmolVLMForConditionalGeneration`;
model types "idefics3" and "smolvlm"): a SigLIP-style vision tower (`model.vision_model`), a
pixel-shuffle connector and a Llama text model; 1-D positions.

The image processor resizes each image to `size["longest_edge"]`, splits it into tiles of
`max_image_size` plus a global view, and the processor writes, per tile,
`<fake_token_around_image><row_i_col_j>` and `image_seq_len` `<image>` tokens (the global view's
with `<global-img>`). The model takes pixel_values as [batch, tiles, C, H, W] and drops all-zero
tiles as padding; vlrl gives it one batch row holding the micro-batch's tiles in token order
(`Family.pixel_layout`). vLLM 0.32 serves both (vllm/model_executor/models/idefics3.py, smolvlm.py:
a subclass) from the same raw prompt ids and images, under the same weight names.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from vlrl.models.families import GATES, Family

# The processor's tile tokens (`Idefics3Processor`: rows and columns 1..6).
TILE_TOKENS = tuple(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7))
IMAGE_TOKENS = ("<fake_token_around_image>", "<image>", "<global-img>", *TILE_TOKENS)


def tokens_per_tile(hf_config: Any) -> int:
    """`<image>` tokens of one tile: its patches, pixel-shuffled by `scale_factor` in each side."""
    vision = hf_config.vision_config
    return (int(vision.image_size) // int(vision.patch_size)) ** 2 // int(hf_config.scale_factor) ** 2


def dummy_tile(hf_config: Any, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """One grey tile [1, C, S, S] (not all zero: the model drops all-zero tiles as padding), its
    row count [[1]], and its `<image>` tokens (the model checks only that they match the features)."""
    vision = hf_config.vision_config
    size = int(vision.image_size)
    pixels = torch.full((1, int(vision.num_channels), size, size), 0.5, device=device)
    rows = torch.ones(1, 1, dtype=torch.long, device=device)
    return pixels, rows, [int(hf_config.image_token_id)] * tokens_per_tile(hf_config)


IDEFICS3 = Family(
    name="idefics3",
    model_types=("idefics3",),
    vision=True,
    processor_prefixes=("Idefics3",),
    positions="1d",
    projector="model.connector",
    vision_tower="model.vision_model",
    videos=False,
    vision_flops=False,
    image_expansion="processor",
    rows_are_model_input=False,
    pixel_layout="batch_of_tiles",
    shared_image_encoding=False,
    banned_tokens=IMAGE_TOKENS,
    dummy_image=dummy_tile,
    tiny_arch="idefics3",
    gates=tuple(GATES),
)
# SmolVLM (and SmolVLM2): Idefics3's model and processor under other class names (transformers
# generates its modeling from Idefics3's); its processor adds video, which vlrl refuses here.
SMOLVLM = replace(IDEFICS3, name="smolvlm", model_types=("smolvlm",), processor_prefixes=("SmolVLM",),
                  tiny_arch="smolvlm")  # fmt: skip
