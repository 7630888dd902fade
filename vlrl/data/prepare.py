"""Turning one dataset row into a `PromptSample`, and the cheap per-row checks used at load time."""

from __future__ import annotations

import json
from collections.abc import Callable, Container
from types import SimpleNamespace
from typing import Any

import torch

from vlrl.data.answers import AnswerProblem, normalize_answer
from vlrl.data.collate import PromptSample
from vlrl.data.encoded_images import decoded, encode_image
from vlrl.data.image_check import image_key
from vlrl.data.images import (
    ImageProblem,
    check_exists,
    image_list,
    probe_size,
    scale_into_bounds,
    smart_resize,
)
from vlrl.data.prompts import (
    ChatFormatter,
    FormatPrompt,
    count_markers,
    expand_image_tokens,
    expand_video_tokens,
)
from vlrl.data.video import Video, frame_size_rule, load_video
from vlrl.models.families import TEXT, Family, family_of, family_of_processor
from vlrl.models.processor import VisionSpec, image_tokens_by_size, vision_spec
from vlrl.models.rope import mrope_position_ids, text_position_ids


class RowProblem(ValueError):
    """A row that breaks the dataset rules; skippable with `data.skip_bad_rows`.

    `reason` is a short category for the skip counter."""

    def __init__(self, message: str, reason: str = "other") -> None:
        super().__init__(message)
        self.reason = reason


def _parse_cell_list(cell: Any) -> list[Any]:
    """A list-valued cell; CSV stores lists as JSON text (`["a.png", "b.png"]`)."""
    if isinstance(cell, str) and cell.lstrip().startswith("["):
        try:
            cell = json.loads(cell)
        except json.JSONDecodeError as err:
            raise RowProblem(f"cannot parse the list {cell!r}: {err}", "bad_list") from err
    if isinstance(cell, str) and not cell.strip():
        return []
    return image_list(cell)


def _verified(cell: Any, image_dir: str, known_good: Container[str]) -> bool:
    """Whether the start-up check decoded this image as it is now (a missing file: no)."""
    try:
        key = image_key(cell, image_dir)
    except (OSError, ImageProblem):
        return False
    return key is not None and key in known_good


def _family(processor: Any | None, hf_config: Any | None) -> Family:
    if hf_config is not None:
        return family_of(hf_config)
    return family_of_processor(processor) if processor is not None else TEXT


class RowPreparer:
    """Everything needed to turn rows into prompts: keys, templates, tokenizer, processor, pixel bounds."""

    def __init__(
        self,
        config: Any,
        tokenizer: Any,
        processor: Any | None,
        hf_config: Any | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.processor = processor
        self.format = FormatPrompt(config.format_prompt) if config.format_prompt else None
        self.chat = ChatFormatter(tokenizer, processor, config.override_chat_template, tools)
        self.family: Family = _family(processor, hf_config)
        self.spec: VisionSpec | None = vision_spec(processor, hf_config) if processor is not None else None
        self._pixel_bounds(config)  # data.min_pixels/max_pixels checked against one block (raises)
        # the processor's own bounds: its resize runs after the data bounds' rescale
        self.processor_bounds = self._pixel_bounds(SimpleNamespace(min_pixels=None, max_pixels=None))
        self.used_keys = {config.prompt_key, config.answer_key, config.image_key, config.video_key}
        # frame_size(frames, height, width), built on the first video (needs the video processor)
        self._frame_size: Callable[[int, int, int], tuple[int, int]] | None = None
        # (height, width) -> tokens its expansion writes, for a family its processor expands
        self._image_tokens: dict[tuple[int, int], int] = {}

    @property
    def vision(self) -> VisionSpec:
        """The model's vision layout; only image paths ask for it, and only a VLM has one."""
        if self.spec is None:
            raise RuntimeError("this model has no vision tower: rows with images cannot be prepared")
        return self.spec

    @property
    def expands_by_processor(self) -> bool:
        """The family's images are expanded by its HF processor (`Family.image_expansion`)."""
        return self.family.image_expansion == "processor"

    def _pixel_bounds(self, config: Any) -> tuple[int, int]:
        """Config bounds; None falls back to the image processor's own (a tiling or fixed-size
        processor has none: only the config's bound the images, 0 and no limit by default)."""
        if self.processor is None:
            return 0, 0
        if self.expands_by_processor:
            return int(config.min_pixels or 0), int(config.max_pixels or 1 << 62)
        image_processor = self.processor.image_processor
        size = dict(getattr(image_processor, "size", None) or {})
        if self.family.processor_bounds_span_time:  # they bound t x h x w: an image is t frames
            frames = int(image_processor.temporal_patch_size)
            size = {key: value // frames for key, value in size.items() if isinstance(value, int)}
        low = config.min_pixels if config.min_pixels is not None else size.get("shortest_edge")
        high = config.max_pixels if config.max_pixels is not None else size.get("longest_edge")
        factor = self.vision.factor
        low, high = int(low or factor * factor), int(high or 16384 * factor * factor)
        if high < low or high < factor * factor:
            raise ValueError(
                f"data.max_pixels={high} must be >= data.min_pixels={low} and >= {factor * factor} "
                f"(one {factor}x{factor} block)"
            )
        return low, high

    # ---- checks that need no pixels (run for every row at load time)
    def text(self, row: dict[str, Any]) -> tuple[str, list[Any]]:
        """(rendered prompt string, image cells) of a row; raises RowProblem for rule breaks."""
        cfg = self.config
        content = row.get(cfg.prompt_key)
        if not isinstance(content, str) or not content.strip():
            raise RowProblem(f"prompt key {cfg.prompt_key!r} is missing or empty", "missing_prompt")
        if row.get(cfg.answer_key) is None:
            raise RowProblem(f"answer key {cfg.answer_key!r} is missing", "missing_answer")
        try:
            normalize_answer(row[cfg.answer_key], cfg.answer_key)
        except AnswerProblem as err:
            raise RowProblem(str(err), "bad_answer") from None
        videos = self.video_cells(row)
        images = _parse_cell_list(row.get(cfg.image_key))
        text = self.format.render(content) if self.format else content
        n_image_markers, n_video_markers = count_markers(text)
        if n_video_markers != len(videos):
            raise RowProblem(
                f"has {n_video_markers} <video> marker(s) but {len(videos)} video(s) in column {cfg.video_key!r}",
                "marker_count",
            )
        if videos and self.processor is None:
            raise RowProblem(
                f"has {len(videos)} video(s) but the model is text-only (no video processor)", "text_model"
            )
        if videos and not self.family.videos:
            raise RowProblem(
                f"has {len(videos)} video(s): videos are supported for the Qwen-VL families only, not "
                f"{self.family.name!r}",
                "video_family",
            )
        if n_image_markers != len(images):
            raise RowProblem(
                f"has {n_image_markers} <image> marker(s) but {len(images)} image(s) in column {cfg.image_key!r}",
                "marker_count",
            )
        if images and self.processor is None:
            raise RowProblem(
                f"has {len(images)} image(s) but the model is text-only (no image processor)", "text_model"
            )
        prompt = self.chat(text)
        if self.spec is not None:
            for token, count in ((self.spec.image_token, len(images)), (self.video_token, len(videos))):
                if prompt.count(token) != count:
                    raise RowProblem(
                        f"the prompt text itself contains the placeholder token {token}",
                        "placeholder_in_text",
                    )
        return prompt, images

    # ---- videos (vlrl.data.video)
    def video_cells(self, row: dict[str, Any]) -> list[Any]:
        """The row's videos: each a file path or a list of frames."""
        cell = row.get(self.config.video_key)
        if isinstance(cell, str) and cell.lstrip().startswith("["):
            return _parse_cell_list(cell)
        return image_list(cell)

    @property
    def video_token(self) -> str:
        return getattr(self.processor, "video_token", "<|video_pad|>")

    def load_videos(self, cells: list[Any], image_dir: str) -> list[Video]:
        """Read, sample and resize each video (raises VideoProblem)."""
        if not cells:
            return []
        if self._frame_size is None:
            assert self.processor is not None  # text() refused videos for a text model
            size = getattr(self.processor.video_processor, "size", None) or {}
            factor = self.vision.factor
            bounds = (
                int(size.get("shortest_edge") or factor * factor),
                int(size.get("longest_edge") or 1 << 40),
            )
            self._frame_size = frame_size_rule(
                self.vision.family,
                factor,
                self.temporal_patch_size,
                (self.config.min_pixels, self.config.max_pixels),
                bounds,
            )
        return [load_video(cell, image_dir, self.config.video_fps, self._frame_size) for cell in cells]

    @property
    def temporal_patch_size(self) -> int:
        video_processor = getattr(self.processor, "video_processor", None)
        return int(getattr(video_processor, "temporal_patch_size", 2))

    def video_grid_thw(self, videos: list[Video]) -> torch.Tensor:
        """[n_vid, 3] patch grids: (frames / temporal patch, height / patch, width / patch)."""
        patch, tp = self.vision.patch_size, self.temporal_patch_size
        rows = [[len(v.frames) // tp, v.size[1] // patch, v.size[0] // patch] for v in videos]
        return torch.tensor(rows, dtype=torch.long).reshape(-1, 3)

    def second_per_grid_ts(self, videos: list[Video]) -> list[float]:
        """Seconds spanned by one temporal patch of each video (Qwen2.5-VL's temporal positions)."""
        return [self.temporal_patch_size / v.sample_fps for v in videos]

    def video_placeholder_ids(self, video: Video) -> list[int]:
        """The ids one `<|video_pad|>` becomes, as the model's processor writes them: Qwen2/2.5-VL
        one video token per merged patch; Qwen3-VL per temporal patch `<t seconds>` then that
        frame's tokens between vision start/end."""
        spec, tp = self.vision, self.temporal_patch_size
        width, height = video.size
        per_frame = (height // spec.factor) * (width // spec.factor)
        if spec.family != "qwen3_vl":
            return [spec.video_token_id] * (len(video.frames) // tp * per_frame)
        start = getattr(self.processor, "vision_start_token", "<|vision_start|>")
        end = getattr(self.processor, "vision_end_token", "<|vision_end|>")
        text = "".join(
            f"<{t:.1f} seconds>{start}{self.video_token * per_frame}{end}" for t in video.timestamps(tp)
        )
        return self.tokenizer.encode(text, add_special_tokens=False)

    def video_extra_tokens(self, videos: list[Video]) -> int:
        """Tokens the videos add to the prompt beyond their one placeholder each."""
        return sum(len(self.video_placeholder_ids(v)) - 1 for v in videos)

    def target_sizes(self, images: list[Any], image_dir: str) -> list[tuple[int, int]]:
        """(height, width) each image is resized to, read from image headers only."""
        sizes = []
        for cell in images:
            check_exists(cell, image_dir)
            width, height = probe_size(cell, image_dir)
            sizes.append(self.target_size(height, width))
        return sizes

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) the model sees, sides multiples of patch * merge (EasyR1's sizes).

        Two steps, as EasyR1 does them: scale into [data.min_pixels, data.max_pixels] keeping the
        aspect ratio (sides truncated to integers), then the image processor's rounding to
        multiples of the block size within its own bounds. (A 180x240 image at min_pixels=262144
        becomes 443x591, then 448x588; rounding straight to the bounds would give 448x616.)"""
        height, width = scale_into_bounds(height, width, self.config.min_pixels, self.config.max_pixels)
        if self.expands_by_processor:  # the processor resizes (tiles) itself
            return height, width
        return smart_resize(height, width, self.vision.factor, *self.processor_bounds)

    def tokens_per_image(self, sizes: list[tuple[int, int]]) -> list[int]:
        """LLM tokens per image: (h / factor) * (w / factor) after the 2x2 merge; for a family the
        processor expands, its own count from the size alone (brackets included)."""
        if self.expands_by_processor:
            assert self.processor is not None  # only a vision family expands by its processor
            missing = [size for size in dict.fromkeys(sizes) if size not in self._image_tokens]
            if missing:
                self._image_tokens.update(zip(missing, image_tokens_by_size(self.processor, missing)))
            return [self._image_tokens[size] for size in sizes]
        return [(h // self.vision.factor) * (w // self.vision.factor) for h, w in sizes]

    def grid_thw(self, sizes: list[tuple[int, int]]) -> torch.Tensor:
        """[n_img, 3] predicted patch grids (t=1 for images)."""
        patch = self.vision.patch_size
        return torch.tensor([[1, h // patch, w // patch] for h, w in sizes], dtype=torch.long).reshape(-1, 3)

    # ---- the full preparation (run in __getitem__)
    def sample(
        self,
        row: dict[str, Any],
        image_dir: str,
        uid: int,
        use_processor: bool,
        known_good: Container[str] = (),
    ) -> PromptSample:
        """The model-ready sample of a row; its images as `EncodedImage`s (the file's bytes and the
        size the model sees: the ranks decode and resize them, `vlrl.data.encoded_images`).

        `known_good`: image-check keys (`image_check.image_key`) the start-up check decoded; an
        image not among them is decoded here, so a file changed since start-up fails now."""
        prompt, cells = self.text(row)
        raw_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        images = [
            encode_image(cell, image_dir, self.target_size, _verified(cell, image_dir, known_good))
            for cell in cells
        ]
        sizes = [(image.height, image.width) for image in images]
        grid = self.grid_thw(sizes) if images and not self.expands_by_processor else None  # [n_img, 3]
        videos = self.load_videos(self.video_cells(row), image_dir)
        video_grid = self.video_grid_thw(videos) if videos else None  # [n_vid, 3]
        input_ids = self._expand(prompt, raw_ids, images, sizes, grid, videos, use_processor)
        if self.spec is None or not self.family.mrope:
            position_ids = text_position_ids(len(input_ids))
        else:
            seconds = self.second_per_grid_ts(videos) if videos else None
            position_ids = mrope_position_ids(
                input_ids, grid, video_grid, second_per_grid_ts=seconds, **self.spec.rope_kwargs()
            )
        extras = {k: v for k, v in row.items() if k not in self.used_keys}
        return PromptSample(
            input_ids=input_ids,
            position_ids=position_ids,
            raw_prompt_ids=raw_ids,
            images=images,
            prompt=prompt,
            ground_truth=normalize_answer(row[self.config.answer_key]),
            extras=extras,
            uid=uid,
            image_grid_thw=grid,
            videos=videos,
            video_grid_thw=video_grid,
        )

    def _expand(self, prompt, raw_ids, images, sizes, grid, videos, use_processor: bool) -> torch.Tensor:
        """[L] expanded ids: by the processor (reference path) or from the predicted grids (fast path)."""
        if not images and not videos:
            return torch.tensor(raw_ids, dtype=torch.long)
        if self.expands_by_processor:  # no fast rule: the processor tiles and expands
            assert self.processor is not None
            out = self.processor(
                text=[prompt], images=[decoded(image) for image in images], return_tensors="pt"
            )
            return out["input_ids"][0].long()
        if not use_processor:
            ids = raw_ids
            if videos:
                per_video = [self.video_placeholder_ids(v) for v in videos]
                ids = expand_video_tokens(ids, self.vision.video_token_id, per_video)
            if images:
                ids = expand_image_tokens(ids, self.vision.image_token_id, self.tokens_per_image(sizes))
            return torch.tensor(ids, dtype=torch.long)
        # Images and frames already have the target size: do_resize=False makes the processor's
        # resize a no-op. (This reference path decodes on the driver; the fast path never does.)
        assert self.processor is not None  # a vision spec comes from a processor
        media: dict[str, Any] = {"images": [decoded(image) for image in images] or None}
        if videos:
            media.update(
                videos=[v.frames for v in videos],
                video_metadata=[v.metadata() for v in videos],
                do_sample_frames=False,
            )
        out = self.processor(text=[prompt], **media, do_resize=False, return_tensors="pt")
        for key, predicted in (("image_grid_thw", grid), ("video_grid_thw", self.video_grid_thw(videos))):
            if key in out and not torch.equal(out[key], predicted):
                raise RuntimeError(
                    f"processor {key} {out[key].tolist()} != predicted {predicted.tolist()} (pixel-bound mismatch)"
                )
        return out["input_ids"][0].long()
