"""One prepared prompt (`PromptSample`) and the collate function that left-pads them into a `PromptBatch`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from vlrl.batch.rows import PromptBatch
from vlrl.models.rope import left_pad_position_ids


@dataclass
class PromptSample:
    """A dataset row ready for the model. L = prompt length after image tokens are expanded."""

    input_ids: torch.Tensor  # [L] long, each <|image_pad|> expanded to its image's token count
    position_ids: torch.Tensor  # [L] (text models) or [3, L] (mrope)
    raw_prompt_ids: list[int]  # unexpanded ids: one <|image_pad|> per image (vLLM expands itself)
    images: list[Any]  # EncodedImage: file bytes + the size the model sees (multiples of patch*merge)
    prompt: str  # the rendered prompt (chat template applied)
    ground_truth: str | list[str]  # vlrl.data.answers rule
    extras: dict[str, Any] = field(default_factory=dict)  # the row's other columns
    uid: int = 0  # unique per dataset row, stable across epochs
    image_grid_thw: torch.Tensor | None = None  # [n_img, 3] patch grid per image (None without images)
    videos: list[Any] = field(default_factory=list)  # vlrl.data.video.Video, sampled and resized
    video_grid_thw: torch.Tensor | None = None  # [n_vid, 3] (frames / 2, h / patch, w / patch)


def collate_prompts(samples: Sequence[PromptSample], pad_token_id: int) -> PromptBatch:
    """Left-pad `samples` to the longest prompt P into a `PromptBatch`.

    input_ids [B, P] (pad: `pad_token_id`), attention_mask [B, P] (0 on padding), position_ids
    [B, P] or [B, 3, P] with 0 on padding. Left padding puts every prompt's last token in the
    last column, where generation continues.
    """
    if not samples:
        raise ValueError("collate_prompts needs at least one sample")
    longest = max(len(s.input_ids) for s in samples)
    input_ids = torch.full((len(samples), longest), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(samples), longest), dtype=torch.long)
    for row, sample in enumerate(samples):
        length = len(sample.input_ids)
        input_ids[row, longest - length :] = sample.input_ids
        attention_mask[row, longest - length :] = 1
    return PromptBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=left_pad_position_ids([s.position_ids for s in samples], longest),
        raw_prompt_ids=[list(s.raw_prompt_ids) for s in samples],
        images=[list(s.images) for s in samples],
        prompts=[s.prompt for s in samples],
        ground_truths=[s.ground_truth for s in samples],
        extras=[dict(s.extras) for s in samples],
        uids=[s.uid for s in samples],
        videos=[list(s.videos) for s in samples],
    )
