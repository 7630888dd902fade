"""Supervised fit on whole conversations, trained on chosen segments only (multi-turn format warm-up).

An example is a list of `Segment`s whose texts, concatenated, are the conversation as the chat
template renders it (prompt, assistant turns, tool turns...). Only segments with `trained=True`
(the assistant's turns) are in the loss. Images are placed with one `<|image_pad|>` each in the
text and expanded here; positions are vlrl's own mrope (as the actor computes them).

Used by the multi-turn demo (teach the *form* of a tool call, not the answer) and by tests that need
a tiny model which calls tools on cue.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vlrl.data.encoded_images import decoded
from vlrl.tools.warmup import supervised_step


@dataclass
class Segment:
    text: str
    trained: bool = False
    images: list[Any] = field(default_factory=list)  # PIL images, sides multiples of patch * merge


def _encode(example: list[Segment], tokenizer: Any, spec: Any) -> tuple[list[int], list[int], list[Any]]:
    """(expanded ids, labels with -100 on untrained tokens, images) of one example."""
    ids: list[int] = []
    labels: list[int] = []
    images: list[Any] = []
    for seg in example:
        raw = tokenizer.encode(seg.text, add_special_tokens=False)
        if spec is not None and seg.images:
            from vlrl.data.prompts import expand_image_tokens

            counts = [(img.height // spec.factor) * (img.width // spec.factor) for img in seg.images]
            raw = expand_image_tokens(raw, spec.image_token_id, counts)
        ids += raw
        labels += raw if seg.trained else [-100] * len(raw)
        images += seg.images
    return ids, labels, images


def fit_segments(
    model_dir: str | Path,
    examples: list[list[Segment]] | Any,
    steps: int = 60,
    batch_size: int = 8,
    lr: float = 1e-3,
    seed: int = 0,
) -> dict[str, float]:
    """Fit `model_dir` on `examples` (a list, or a callable `rng -> example` that draws fresh ones)
    and save it in place. Returns {"loss_first", "loss_last", "seconds"}."""
    from vlrl.models.loading import load_config, model_class
    from vlrl.models.processor import load_processor, vision_spec
    from vlrl.models.rope import mrope_position_ids

    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer, processor = load_processor(str(model_dir))
    hf_config = load_config(str(model_dir))
    model = model_class(hf_config).from_pretrained(model_dir, dtype=torch.float32)
    spec = vision_spec(processor, hf_config) if processor is not None else None
    pad = tokenizer.pad_token_id
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses, start = [], time.perf_counter()
    for _ in range(steps):
        batch = (
            [examples(rng) for _ in range(batch_size)]
            if callable(examples)
            else rng.choices(examples, k=batch_size)
        )
        encoded = [_encode(ex, tokenizer, spec) for ex in batch]
        width = max(len(ids) for ids, _, _ in encoded)
        input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        positions = torch.zeros((len(batch), 3, width) if spec else (len(batch), width), dtype=torch.long)
        all_images = []
        for row, (ids, lab, imgs) in enumerate(encoded):
            n = len(ids)
            input_ids[row, :n], labels[row, :n], mask[row, :n] = torch.tensor(ids), torch.tensor(lab), 1
            if spec is not None:
                grid = torch.tensor(
                    [[1, i.height // spec.patch_size, i.width // spec.patch_size] for i in imgs]
                )
                positions[row, :, :n] = mrope_position_ids(torch.tensor(ids), grid if imgs else None, None,
                                                           **spec.rope_kwargs())  # fmt: skip
            else:
                positions[row, :n] = torch.arange(n)
            all_images += imgs
        kwargs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": mask}
        kwargs["position_ids"] = positions.transpose(0, 1) if spec else positions
        if all_images and processor is not None:
            # dataset rows hold EncodedImage (decoded here, once per object); PIL images pass as they are
            pixels = processor.image_processor(
                images=[decoded(image) for image in all_images], do_resize=False, return_tensors="pt"
            )
            kwargs.update(pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"])
        losses.append(supervised_step(model, optimizer, kwargs, labels))
    model.save_pretrained(model_dir)
    return {"loss_first": losses[0], "loss_last": losses[-1], "seconds": time.perf_counter() - start}
