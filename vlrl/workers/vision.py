"""Vision inputs built on the worker: per-sample pixel_values / image_grid_thw, cached per step.

`RolloutBatch.images` holds each sample's images, decoded on this rank at the size the data
pipeline chose by the Qwen rule (sides multiples of patch * merge; `vlrl.data.encoded_images`), so
the image processor runs with `do_resize=False` when they conform: the number of patches then
matches the image tokens the prompt was expanded with. The n samples of a GRPO group share the same PIL objects, and the old-log-prob, reference and
update passes of one step see the same samples, so results are cached by the identity of the
image objects (the cache keeps the images alive, so an id cannot be reused while cached).

Keeping FSDP in step across ranks: the vision blocks are FSDP units, so their all-gathers (and
reduce-scatters in backward) are collectives every rank must join. When any rank has images in a
call, every micro-batch without images gets an `Anchor` — a dummy 2x2-patch image (one merged
token) packed as its own sequence — whose logit enters the loss times zero. Its gradient is
exactly zero, but every rank runs the vision tower forward and backward in the same order.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from vlrl.data.encoded_images import decoded
from vlrl.models.families import Family, family_of
from vlrl.models.packing import Anchor

SampleVision = tuple[Tensor, Tensor]  # pixel_values [patches, D], image_grid_thw [images, 3]


class VisionCache:
    """Turns per-sample image lists into model inputs; caches the result per image tuple (LRU).

    pixel_values are large (an image of P patches holds P x 1176 fp32 values, ~4.7 KB per patch),
    so the cache is bounded by bytes and the actor clears it at the end of each update.
    """

    def __init__(
        self,
        image_processor: Any,
        max_bytes: int = 4 << 30,
        video_processor: Any | None = None,
        family: Family | None = None,
    ) -> None:
        self.image_processor = image_processor
        self.family = family  # None: a Qwen-VL family (patch grids, sides multiples of the block)
        self.video_processor = video_processor
        self.max_bytes = max_bytes
        self.bytes = 0
        self._cache: OrderedDict[tuple, tuple[list[Any], SampleVision]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._cache)

    def clear(self) -> None:
        """Drop every entry (the end of a training step: the next step brings new images)."""
        self._cache.clear()
        self.bytes = 0

    def _factor(self) -> int:
        ip = self.image_processor
        return int(getattr(ip, "patch_size", 14)) * int(getattr(ip, "merge_size", 2))

    def sample(self, images: Sequence[Any]) -> SampleVision | None:
        """pixel_values and grid of one sample's images, or None when it has none. The "grid" of a
        family that is not Qwen's is its rows of pixel_values per image ([n_img, 1]: InternVL's tiles)."""
        if not images:
            return None
        if self.family is not None and self.family.image_expansion == "processor":
            return self._cached(
                ("image", *(id(img) for img in images)),
                images,
                lambda: self._rows(images),
                ("pixel_values", "rows"),
            )
        factor = self._factor()
        conform = all(img.size[0] % factor == 0 and img.size[1] % factor == 0 for img in images)
        return self._cached(
            ("image", *(id(img) for img in images)),
            images,
            lambda: self.image_processor(
                images=[decoded(img) for img in images], return_tensors="pt", do_resize=not conform
            ),
            ("pixel_values", "image_grid_thw"),
        )

    def _rows(self, images: Sequence[Any]) -> dict[str, Tensor]:
        """pixel_values [rows, C, H, W] of the images in order and, as [n_img, 1], each image's
        row count. One processor call per image: a tiling processor's output then holds that
        image's tiles only (Idefics3's [1, tiles, C, H, W] would pad a sample's images to the
        longest; InternVL's is [tiles, C, H, W] already)."""
        pixels = [
            self.image_processor(images=[decoded(img)], return_tensors="pt")["pixel_values"] for img in images
        ]
        pixels = [p.reshape(-1, *p.shape[-3:]) for p in pixels]
        rows = torch.tensor([[len(p)] for p in pixels], dtype=torch.long)
        return {"pixel_values": torch.cat(pixels), "rows": rows}

    def sample_videos(self, videos: Sequence[Any]) -> SampleVision | None:
        """pixel_values_videos [patches, D] and video_grid_thw [n_vid, 3] of one sample's videos
        (`vlrl.data.video.Video`, sampled and resized by the data pipeline: no resize, no sampling)."""
        if not videos:
            return None
        if self.video_processor is None:
            raise ValueError("the batch has videos but the model's processor has no video processor")
        return self._cached(
            ("video", *(id(v) for v in videos)),
            videos,
            lambda: self.video_processor(
                videos=[v.frames for v in videos],
                video_metadata=[v.metadata() for v in videos],
                do_sample_frames=False,
                do_resize=False,
                return_tensors="pt",
            ),
            ("pixel_values_videos", "video_grid_thw"),
        )

    def _cached(self, key: tuple, items: Sequence[Any], run: Any, names: tuple[str, str]) -> SampleVision:
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit[1]
        out = run()
        value = (out[names[0]], out[names[1]])
        self._cache[key] = (list(items), value)
        self.bytes += _nbytes(value)
        while self.bytes > self.max_bytes and len(self._cache) > 1:
            _, (_, old) = self._cache.popitem(last=False)
            self.bytes -= _nbytes(old)
        return value

    def collate(self, images: Sequence[Sequence[Any]]) -> tuple[Tensor | None, Tensor | None]:
        """Concatenated (pixel_values, image_grid_thw) of samples in order; (None, None) if no image."""
        parts = [v for v in (self.sample(imgs) for imgs in images) if v is not None]
        if not parts:
            return None, None
        return torch.cat([p for p, _ in parts]), torch.cat([g for _, g in parts])

    def collate_shared(
        self, images: Sequence[Sequence[Any]]
    ) -> tuple[Tensor | None, Tensor | None, list[int] | None]:
        """Like `collate`, but samples with the same images (a GRPO group) contribute them once.

        Returns (pixel_values, image_grid_thw) of the distinct images and the image index for
        vlrl.models.shared_images: per image in token order, its row in the grid; None when no
        sample repeats another's images (then the result equals `collate`'s).
        """
        return _shared(images, self.sample)

    def collate_shared_videos(
        self, videos: Sequence[Sequence[Any]]
    ) -> tuple[Tensor | None, Tensor | None, list[int] | None]:
        """`collate_shared` for the samples' videos: (pixel_values_videos, video_grid_thw, index)."""
        return _shared(videos, self.sample_videos)


def _shared(
    per_sample: Sequence[Sequence[Any]], encode: Any
) -> tuple[Tensor | None, Tensor | None, list[int] | None]:
    """Distinct items' (pixels, grid) and, when some repeat, each item's row in the grid."""
    parts: list[SampleVision] = []
    first_row: dict[tuple[int, ...], int] = {}  # item tuple -> its first row in the grid
    index: list[int] = []
    rows = 0
    for items in per_sample:
        value = encode(items)
        if value is None:
            continue
        key, count = tuple(id(item) for item in items), len(value[1])
        if key not in first_row:
            first_row[key] = rows
            parts.append(value)
            rows += count
        index.extend(range(first_row[key], first_row[key] + count))
    if not parts:
        return None, None, None
    pixel_values, grid = torch.cat([p for p, _ in parts]), torch.cat([g for _, g in parts])
    return pixel_values, grid, (index if len(index) > rows else None)


def _nbytes(value: SampleVision) -> int:
    return sum(t.numel() * t.element_size() for t in value)


def image_token_id(hf_config: Any) -> int | None:
    """The <|image_pad|> id of a VLM config; None for a text-only model."""
    return getattr(hf_config, "image_token_id", None) if hasattr(hf_config, "vision_config") else None


def dummy_image_anchor(
    hf_config: Any, mrope: bool, device: torch.device | str, image: bool = True, video: bool = False
) -> Anchor:
    """A dummy 1x2x2-patch black image (one merged token) and/or a dummy 2-frame 2x2 video (one
    token), as one separate packed sequence: [image token][video token]; a family with its own
    dummy image (`Family.dummy_image`: images only) gets that one."""
    dummy = family_of(hf_config).dummy_image
    if dummy is not None:
        pixels, rows, ids = dummy(hf_config, device)
        tokens = torch.tensor(ids, device=device)
        anchor = Anchor(
            tokens, torch.zeros((3, len(ids)) if mrope else (len(ids),), dtype=torch.long, device=device)
        )
        anchor.pixel_values, anchor.image_grid_thw = pixels, rows
        return anchor
    vc = hf_config.vision_config
    channels = int(getattr(vc, "in_channels", getattr(vc, "in_chans", 3)))
    patch, temporal = int(vc.patch_size), int(getattr(vc, "temporal_patch_size", 2))
    merge = int(getattr(vc, "spatial_merge_size", 2))
    grid = torch.tensor([[1, merge, merge]], device=device)
    pixels = torch.zeros(merge * merge, channels * temporal * patch * patch, device=device)
    ids = [hf_config.image_token_id] * image + [hf_config.video_token_id] * video
    tokens = torch.tensor(ids, device=device)
    positions = torch.zeros((3, len(ids)) if mrope else (len(ids),), dtype=torch.long, device=device)
    anchor = Anchor(tokens, positions)
    if image:
        anchor.pixel_values, anchor.image_grid_thw = pixels, grid
    if video:
        anchor.pixel_values_videos, anchor.video_grid_thw = pixels.clone(), grid.clone()
    return anchor


def text_anchor(pad_token_id: int, mrope: bool, device: torch.device | str) -> Anchor:
    """One pad token as a separate sequence: lets a rank with no samples still run forward/backward."""
    tokens = torch.tensor([pad_token_id], device=device)
    positions = torch.zeros((3, 1) if mrope else (1,), dtype=torch.long, device=device)
    return Anchor(tokens, positions)
