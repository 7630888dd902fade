"""Videos: reading (PyAV), frame sampling at `data.video_fps`, the per-frame pixel rule.

A dataset cell holding one video is
- a path to a video file (absolute, or relative to the data file's folder / `data.image_dir`;
  `file://` allowed), read with PyAV (`av`), which installs on CPU and GPU machines alongside vLLM
  (torchvision 0.28 no longer reads videos, and torchcodec breaks our torch pin);
- a list of frames, each in any image form of `vlrl.data.images` (path, PIL, bytes, dict).

Sampling follows qwen-vl-utils (the reference for Qwen-VL inputs, used by EasyR1): a file of `N`
frames at `r` fps gives `n = N / r * video_fps` frames, clamped to [4, min(768, N)] and floored
to an even number (`qwen_vl_utils.smart_nframes`), taken at `linspace(0, N - 1, n).round()`. A
frame list is taken whole, as sampled at `video_fps`, and an odd count is padded by repeating
the last frame. Each frame is resized with the image rule (`vlrl.data.images.smart_resize`) into
the per-frame bounds of `frame_pixel_bounds`, then rounded by the model's video processor so that
its own resize is a no-op (vLLM runs it with its defaults).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image

from vlrl.data.images import ImageProblem, describe, image_path, load_image, smart_resize

# qwen-vl-utils' video constants (qwen_vl_utils.vision_process), named here so the rule reads whole.
FRAME_FACTOR = 2  # frames come in pairs: the vision tower's temporal patch is 2 frames
MIN_FRAMES = 4
MAX_FRAMES = 768
VIDEO_MIN_TOKENS = 128  # per frame, when data.min_pixels is null
VIDEO_MAX_TOKENS = 768  # per frame, always
MODEL_SEQ_LEN = 128000  # qwen-vl-utils' default total budget (x 0.9) shared by a video's frames


class VideoProblem(ImageProblem):
    """A video cell that cannot be used; the message names the video (not the row)."""

    reason = "video"  # the skip counter's category


@dataclass
class Video:
    """Sampled, resized frames of one video and where they came from.

    `fps`, `frame_indices` and `total_frames` describe the source (for a frame list: `video_fps`,
    `0..T-1`, `T`); vLLM and the processors derive the sampling rate and Qwen3-VL's frame
    timestamps from them."""

    frames: list[Image.Image]  # T RGB frames, T even, all (height, width)
    fps: float  # frames per second of the source
    frame_indices: list[int]  # source frame of each sampled frame
    total_frames: int  # frames in the source
    source: str = ""  # for messages
    _array: np.ndarray | None = field(default=None, repr=False, compare=False)

    @property
    def sample_fps(self) -> float:
        """Frames per second of the sampled frames."""
        return len(self.frame_indices) / self.total_frames * self.fps

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) of every frame, like PIL's `Image.size`."""
        return self.frames[0].size

    def metadata(self) -> dict[str, Any]:
        """transformers' `VideoMetadata` fields (the processors' `video_metadata`)."""
        width, height = self.size
        return {
            "fps": self.fps,
            "frames_indices": list(self.frame_indices),
            "total_num_frames": self.total_frames,
            "duration": self.total_frames / self.fps,
            "width": width,
            "height": height,
            "video_backend": "pyav",
        }

    def vllm_item(self) -> tuple[np.ndarray, dict[str, Any]]:
        """A vLLM video item: ([T, H, W, 3] frames, metadata); already sampled, so vLLM must not
        sample again (`do_sample_frames=False`)."""
        return self.array(), {**self.metadata(), "do_sample_frames": False}

    def array(self) -> np.ndarray:
        """[T, H, W, 3] uint8 frames (built once)."""
        if self._array is None:
            self._array = np.stack([np.asarray(f) for f in self.frames])
        return self._array

    def timestamps(self, temporal_patch_size: int = FRAME_FACTOR) -> list[float]:
        """Seconds of each temporal patch: the mean time of its first and last frame (Qwen3-VL)."""
        times = [i / self.fps for i in self.frame_indices]
        step = temporal_patch_size
        return [(times[i] + times[i + step - 1]) / 2 for i in range(0, len(times), step)]


def is_frame_list(cell: Any) -> bool:
    """A video given as a list of frames (rather than a file)."""
    return isinstance(cell, (list, tuple))


def video_path(cell: Any, image_dir: str) -> str:
    """Filesystem path of a video-file cell (raises VideoProblem when missing or not a file)."""
    import os

    path = image_path(cell, image_dir)
    if path is None:
        raise VideoProblem(
            f"unsupported video value {describe(cell)}: expected a file path or a list of frames"
        )
    if os.path.isdir(path):
        raise VideoProblem(f"video path {path} is a directory, not a video file")
    if not os.path.isfile(path):
        raise VideoProblem(f"video file {path} does not exist")
    return path


def sample_count(total_frames: int, source_fps: float, video_fps: float) -> int:
    """Frames to sample from a file of `total_frames` at `source_fps` (qwen-vl-utils' rule)."""
    if total_frames < FRAME_FACTOR:
        raise VideoProblem(f"has {total_frames} frame(s); a video needs at least {FRAME_FACTOR}")
    low = math.ceil(MIN_FRAMES / FRAME_FACTOR) * FRAME_FACTOR
    high = math.floor(min(MAX_FRAMES, total_frames) / FRAME_FACTOR) * FRAME_FACTOR
    wanted = total_frames / source_fps * video_fps
    n = min(max(wanted, low), high, total_frames)
    return int(math.floor(n / FRAME_FACTOR) * FRAME_FACTOR)


def sample_indices(total_frames: int, count: int) -> list[int]:
    """`count` source frames spread evenly over `total_frames` (first and last included)."""
    return np.linspace(0, total_frames - 1, count).round().astype(int).tolist()


def read_video_file(path: str, video_fps: float) -> tuple[list[Image.Image], float, list[int], int]:
    """(sampled RGB frames, source fps, their indices, total frames) of a video file, with PyAV."""
    import av

    try:
        with av.open(path) as container:
            if not container.streams.video:
                raise VideoProblem(f"video {path} has no video stream")
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate
            fps = float(rate) if rate else 0.0
            total = stream.frames or sum(1 for p in container.demux(stream) if p.size)
            if fps <= 0:
                raise VideoProblem(f"video {path} has no frame rate in its header")
            try:
                count = sample_count(total, fps, video_fps)
            except VideoProblem as err:
                raise VideoProblem(f"video {path} {err}") from None
            indices = sample_indices(total, count)
            frames = _decode_frames(container, path, indices, total)
    except (av.error.FFmpegError, OSError, ValueError) as err:
        if isinstance(err, VideoProblem):
            raise
        raise VideoProblem(f"video {path} is not a readable video ({err})") from err
    return frames, fps, indices, total


def _decode_frames(container: Any, path: str, indices: list[int], total: int) -> list[Image.Image]:
    """Decode from the start, keeping frames `indices` (sorted, repeats allowed)."""
    container.seek(0)
    wanted = sorted(set(indices))
    kept: dict[int, Image.Image] = {}
    decoded = 0
    for decoded, frame in enumerate(container.decode(video=0)):
        if decoded in wanted:
            kept[decoded] = frame.to_image().convert("RGB")
            if len(kept) == len(wanted):
                break
    if len(kept) < len(wanted):
        raise VideoProblem(
            f"video {path}: its header says {total} frames but only {decoded + 1 if kept else decoded} decoded"
        )
    return [kept[i] for i in indices]


def frame_pixel_bounds(
    factor: int, frames: int, min_pixels: int | None, max_pixels: int | None
) -> tuple[int, int]:
    """(min, max) pixels per frame: qwen-vl-utils' video bounds with the data bounds inside them.

    min: `data.min_pixels` (null: 128 tokens). max: `data.max_pixels` capped at 768 tokens per
    frame and at an even share of the 128k-token budget, never below 1.05 x min."""
    low = min_pixels if min_pixels is not None else VIDEO_MIN_TOKENS * factor * factor
    budget = MODEL_SEQ_LEN * factor * factor * 0.9
    cap = max(min(VIDEO_MAX_TOKENS * factor * factor, budget / frames * FRAME_FACTOR), int(low * 1.05))
    high = min(max_pixels, cap) if max_pixels is not None else cap
    return int(low), int(high)


def pad_to_pairs(frames: list[Any]) -> list[Any]:
    """`frames` with the last one repeated to an even count."""
    return frames + frames[-1:] * (len(frames) % FRAME_FACTOR)


def load_video(
    cell: Any,
    image_dir: str,
    video_fps: float,
    frame_size: Callable[[int, int, int], tuple[int, int]],
) -> Video:
    """Read and sample a video cell; `frame_size(frames, height, width)` gives the target size."""
    if is_frame_list(cell):
        if not cell:
            raise VideoProblem("video is an empty list of frames")
        frames = pad_to_pairs([load_image(frame, image_dir) for frame in cell])
        sizes = {f.size for f in frames}
        if len(sizes) > 1:
            raise VideoProblem(f"video frames have different sizes {sorted(sizes)}; give all frames one size")
        fps, indices, total, source = float(video_fps), list(range(len(frames))), len(frames), "frame list"
    else:
        source = video_path(cell, image_dir)
        frames, fps, indices, total = read_video_file(source, video_fps)
    width, height = frames[0].size
    h, w = frame_size(len(frames), height, width)
    resized = [f if f.size == (w, h) else f.resize((w, h), Image.Resampling.BICUBIC) for f in frames]
    return Video(resized, fps, indices, total, source)


def frame_size_rule(
    family: str,
    factor: int,
    temporal_patch_size: int,
    data_bounds: tuple[int | None, int | None],
    processor_bounds: tuple[int, int],
) -> Callable[[int, int, int], tuple[int, int]]:
    """`frame_size(frames, height, width)`: the data rule, then the video processor's own rounding
    (Qwen2/2.5-VL bound each frame; Qwen3-VL bounds frames x height x width)."""

    def frame_size(frames: int, height: int, width: int) -> tuple[int, int]:
        h, w = smart_resize(height, width, factor, *frame_pixel_bounds(factor, frames, *data_bounds))
        low, high = processor_bounds
        if family == "qwen3_vl":
            from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as qwen3_resize

            return qwen3_resize(frames, h, w, temporal_patch_size, factor, low, high)
        return smart_resize(h, w, factor, low, high)

    return frame_size
