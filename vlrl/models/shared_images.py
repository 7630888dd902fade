"""Run the vision tower once per distinct image of a micro-batch, not once per sample.

The n samples of a GRPO group share their prompt's images, so a micro-batch of whole groups holds
each image n times, and transformers' Qwen-VL forward would encode every copy. Instead the caller
passes the distinct images' `pixel_values` / `image_grid_thw` plus the forward kwarg
`vlrl_image_index` (list, one entry per image in token order: its position among the distinct
images). `share_image_features(model)` wraps the model's `get_image_features` so it encodes the
distinct images and returns the per-image features in token order by indexing them. Indexing
reuses the same tensors, so autograd sums the copies' gradients into the one encoding: the forward
and the gradient are those of the per-copy computation (tests check log-probs and gradients).

All three Qwen-VL generations return `pooler_output` as a tuple of per-image tensors (Qwen3-VL also
`deepstack_features`: one such tuple per deepstack layer in transformers 5.19, one tensor per layer
before; see `_pick_layer`) and concatenate them in the forward, which is what the indexing relies on; `share_image_features` refuses a model without `get_image_features`.

Videos work the same way with `vlrl_video_index` (per video in token order: its position among
the distinct videos), wrapping `get_video_features`.

Ulysses sequence parallelism (vlrl.models.ulysses) passes `vlrl_image_rows=(a, b)` as well: the
rank holds image tokens a..b-1 of the micro-batch (in token order), so only those feature rows are
returned (every rank of the group encodes all the images; see `_rows`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

IMAGE_INDEX_KWARG = "vlrl_image_index"
IMAGE_ROWS_KWARG = "vlrl_image_rows"
VIDEO_INDEX_KWARG = "vlrl_video_index"  # the same for videos (`get_video_features`)
_OURS = (IMAGE_INDEX_KWARG, IMAGE_ROWS_KWARG, VIDEO_INDEX_KWARG)


def _select(per_image: Any, index: list[int]) -> tuple:
    return tuple(per_image[i] for i in index)


def _rows(per_image: Any, rows: tuple[int, int]) -> tuple:
    """The feature rows [a, b) of the concatenated per-image features, as a one-tensor tuple.

    Slicing keeps the whole encoding in the autograd graph even when the slice is empty, so every
    rank of the group runs the vision tower's backward (its FSDP reduce-scatters are collectives)."""
    return (torch.cat(tuple(per_image), 0)[rows[0] : rows[1]],)


def _pick(output: Any, pick: Any, arg: Any) -> Any:
    """`output` with its per-item features (and deepstack features) reduced by `pick(.., arg)`."""
    sizes = [len(item) for item in output.pooler_output]  # feature rows per distinct item
    output.pooler_output = pick(output.pooler_output, arg)
    deepstack = getattr(output, "deepstack_features", None)
    if deepstack is not None:
        output.deepstack_features = [_pick_layer(layer, sizes, pick, arg) for layer in deepstack]
    return output


def _pick_layer(layer: Any, sizes: list[int], pick: Any, arg: Any) -> Any:
    """One deepstack layer reduced like `pooler_output`, in the layout the forward expects.

    transformers 5.19 splits each layer per item, as `pooler_output`, and the forward concatenates
    them; 5.16-5.18 return each layer as one tensor (rows of all items, in order) that the forward
    uses as is (`Qwen3VL[Moe]Model.get_image_features` / `forward`). Picking from such a tensor
    directly would index feature rows, not items: split it, pick, and hand back one tensor."""
    if isinstance(layer, torch.Tensor):
        return torch.cat(pick(torch.split(layer, sizes), arg), 0)
    return pick(layer, arg)


def share_image_features(model: torch.nn.Module) -> None:
    """Make `model` accept `vlrl_image_index` / `vlrl_video_index` (see the module docstring);
    idempotent.

    The forward hands its kwargs to both `get_image_features` and `get_video_features`, and
    Qwen3-VL's `get_video_features` calls `get_image_features`: each wrapper takes every vlrl
    kwarg out, applies only its own modality's, and calls the original without them."""
    inner = getattr(model, "model", model)
    original = getattr(inner, "get_image_features", None)
    if original is None:
        raise ValueError(f"{type(model).__name__} has no get_image_features: not a Qwen-VL model")
    if getattr(original, "vlrl_shared", False):
        return

    @functools.wraps(original)
    def get_image_features(pixel_values, image_grid_thw=None, **kwargs):
        mine = {k: kwargs.pop(k, None) for k in _OURS}
        output = original(pixel_values, image_grid_thw, **kwargs)
        for pick, arg in ((_select, mine[IMAGE_INDEX_KWARG]), (_rows, mine[IMAGE_ROWS_KWARG])):
            if arg is not None:
                output = _pick(output, pick, arg)
        return output

    get_image_features.vlrl_shared = True  # type: ignore[attr-defined]
    inner.get_image_features = get_image_features
    original_video = getattr(inner, "get_video_features", None)
    if original_video is None:
        return

    @functools.wraps(original_video)
    def get_video_features(pixel_values_videos, video_grid_thw=None, **kwargs):
        mine = {k: kwargs.pop(k, None) for k in _OURS}
        output = original_video(pixel_values_videos, video_grid_thw, **kwargs)
        if mine[VIDEO_INDEX_KWARG] is not None:
            output = _pick(output, _select, mine[VIDEO_INDEX_KWARG])
        return output

    inner.get_video_features = get_video_features
