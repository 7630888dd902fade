"""Videos: reading with PyAV, frame sampling (qwen-vl-utils' rule), pixel bounds, bad videos at start-up."""

from __future__ import annotations

import numpy as np
import pytest
from data_helpers import image, write_jsonl, write_png, write_video

from vlrl.data.dataset import RLDataset
from vlrl.data.sources import DataError
from vlrl.data.video import (
    VideoProblem,
    frame_pixel_bounds,
    load_video,
    read_video_file,
    sample_count,
)

COLOURS = ["red", "green", "blue", "yellow", "white", "black", "magenta", "cyan"]
RGB = {
    "red": (255, 0, 0), "green": (0, 128, 0), "blue": (0, 0, 255), "yellow": (255, 255, 0),
    "white": (255, 255, 255), "black": (0, 0, 0), "magenta": (255, 0, 255), "cyan": (0, 255, 255),
}  # fmt: skip


@pytest.mark.parametrize(
    ("total", "fps", "video_fps"),
    [(12, 4, 2), (8, 4, 2), (3, 30, 2), (100, 25, 2), (2000, 10, 2), (9, 4, 0.5)],
)
def test_sample_count_is_qwen_vl_utils_rule(total, fps, video_fps):
    from qwen_vl_utils.vision_process import smart_nframes

    assert sample_count(total, fps, video_fps) == smart_nframes({"fps": video_fps}, total, fps)


def test_read_file_samples_the_right_frames(tmp_path):
    path = write_video(tmp_path / "v.mp4", COLOURS + ["red"] * 4, fps=4)  # 12 frames, 3 s
    frames, fps, indices, total = read_video_file(path, video_fps=2.0)
    assert (fps, total) == (4.0, 12)
    assert indices == [0, 2, 4, 7, 9, 11]  # 6 frames: 3 s at 2 fps, spread like linspace(0, 11, 6)
    source = COLOURS + ["red"] * 4
    for frame, index in zip(frames, indices):
        mean = np.asarray(frame).reshape(-1, 3).mean(0)
        assert np.abs(mean - RGB[source[index]]).max() < 12, (index, mean)  # lossy codec


def test_frame_list_is_padded_to_pairs_and_resized(tmp_path):
    frames = [write_png(tmp_path / f"{c}.png", c, (60, 50)) for c in COLOURS[:3]]
    video = load_video(frames, str(tmp_path), 2.0, lambda n, h, w: (56, 56))
    assert len(video.frames) == 4  # the last frame repeated
    assert np.array_equal(np.asarray(video.frames[3]), np.asarray(video.frames[2]))
    assert video.size == (56, 56) and video.sample_fps == 2.0 and video.frame_indices == [0, 1, 2, 3]
    with pytest.raises(VideoProblem, match="different sizes"):
        load_video([image("red", (56, 56)), image("red", (84, 56))], "", 2.0, lambda n, h, w: (56, 56))


def test_frame_bounds_follow_qwen_vl_utils():
    # EasyR1's defaults (min 262144, max 4194304): capped at 768 tokens of 28x28 per frame
    assert frame_pixel_bounds(28, 8, 262144, 4194304) == (262144, 768 * 28 * 28)
    # null bounds: 128..768 tokens; many frames share the 128k-token budget
    assert frame_pixel_bounds(28, 4, None, None) == (128 * 784, 768 * 784)
    assert frame_pixel_bounds(28, 768, None, None)[1] == int(128000 * 784 * 0.9 / 768 * 2)


def test_too_short_and_unreadable_videos(tmp_path):
    one = write_video(tmp_path / "one.mp4", ["red"])
    with pytest.raises(VideoProblem, match="has 1 frame"):
        read_video_file(one, 2.0)
    (tmp_path / "junk.mp4").write_bytes(b"\x00" * 100)
    with pytest.raises(VideoProblem, match="not a readable video"):
        read_video_file(str(tmp_path / "junk.mp4"), 2.0)


def test_bad_video_fails_at_startup_naming_file_and_row(tokenizer_processor, make_config, tmp_path):
    tokenizer, processor = tokenizer_processor("qwen2_5_vl")
    good = write_video(tmp_path / "good.mp4", COLOURS)
    write_video(tmp_path / "one.mp4", ["red"])
    rows = [
        {"problem": "<video>which way?", "answer": "left", "videos": [good]},
        {"problem": "<video>which way?", "answer": "left", "videos": ["one.mp4"]},
    ]
    path = write_jsonl(tmp_path / "data.jsonl", rows)
    with pytest.raises(DataError, match=r"data.jsonl row 1: video .*one.mp4.* has 1 frame"):
        RLDataset(path, make_config(), tokenizer, processor)
    skipped = RLDataset(path, make_config(skip_bad_rows=True), tokenizer, processor)
    assert len(skipped) == 1 and skipped.skipped_reasons == {"video": 1}


def test_video_fps_must_be_positive():
    from vlrl.config import PPOConfig
    from vlrl.config.checks import check_config

    config = PPOConfig()
    config.data.video_fps = 0.0
    assert any("data.video_fps=0.0 must be > 0" in e for e in check_config(config))


def test_video_key_and_fps_pick_the_column_and_the_frame_count(tokenizer_processor, make_config, tmp_path):
    """A non-default `data.video_key` reads its own column (the default column holds a file that does
    not exist, so reading it would fail), and `data.video_fps` sets how many frames are sampled."""
    import json

    from vlrl.data.synthetic import make_moving_square_dataset

    tokenizer, processor = tokenizer_processor("qwen2_5_vl")
    train, _ = make_moving_square_dataset(tmp_path, n_train=1, n_val=0, frames=16, fps=4)  # 4 s
    row = json.loads(train.read_text())
    row["clips"], row["videos"] = row["videos"], ["no_such_video.mp4"]
    path = write_jsonl(tmp_path / "renamed.jsonl", [row])
    with pytest.raises(DataError, match="no_such_video.mp4 does not exist"):
        RLDataset(path, make_config(), tokenizer, processor)  # the default key reads the decoy
    for video_fps, frames, indices in ((1.0, 4, [0, 5, 10, 15]), (2.0, 8, None), (4.0, 16, list(range(16)))):
        sample = RLDataset(path, make_config(video_key="clips", video_fps=video_fps), tokenizer, processor)[0]
        (video,) = sample.videos
        assert len(video.frames) == frames and video.sample_fps == video_fps
        assert indices is None or video.frame_indices == indices
        assert sample.video_grid_thw[0, 0].item() == frames // 2  # temporal patches of 2 frames
