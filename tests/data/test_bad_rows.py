"""Every kind of bad row: an error naming the file and row, or skipped and counted with skip_bad_rows."""

from __future__ import annotations

import logging
import re

import pytest
from data_helpers import write_empty_video, write_jsonl, write_png, write_video

from vlrl.data import DataError, RLDataset

GOOD = {"problem": "<image>What colour?", "answer": "red", "images": ["ok.png"]}

# (bad row, skip reason, message after "FILE row 1: ")
CASES = {
    "marker_count": (
        {"problem": "<image><image>Which?", "answer": "a", "images": ["ok.png"]},
        "marker_count",
        "has 2 <image> marker(s) but 1 image(s) in column 'images'",
    ),
    "images_without_marker": (
        {"problem": "Which?", "answer": "a", "images": ["ok.png"]},
        "marker_count",
        "has 0 <image> marker(s) but 1 image(s) in column 'images'",
    ),
    "missing_image": (
        {"problem": "<image>x", "answer": "a", "images": ["gone.png"]},
        "image",
        "image file {dir}/gone.png does not exist",
    ),
    "not_an_image": (
        {"problem": "<image>x", "answer": "a", "images": ["notes.png"]},
        "image",
        "image {dir}/notes.png is not a readable image",
    ),
    "empty_prompt": (
        {"problem": "  ", "answer": "a", "images": []},
        "missing_prompt",
        "prompt key 'problem' is missing or empty",
    ),
    "absent_prompt": (
        {"answer": "a", "images": []},
        "missing_prompt",
        "prompt key 'problem' is missing or empty",
    ),
    "absent_answer": ({"problem": "x", "images": []}, "missing_answer", "answer key 'answer' is missing"),
    "video_marker_without_video": (
        {"problem": "<video>x", "answer": "a"},
        "marker_count",
        "has 1 <video> marker(s) but 0 video(s) in column 'videos'",
    ),
    "video_file_missing": (
        {"problem": "<video>x", "answer": "a", "videos": ["missing.mp4"]},
        "video",
        "video file {dir}/missing.mp4 does not exist",
    ),
    "video_of_one_frame": (  # FFmpeg reads a PNG as a one-frame video
        {"problem": "<video>x", "answer": "a", "videos": ["ok.png"]},
        "video",
        "video {dir}/ok.png has 1 frame(s); a video needs at least 2",
    ),
    "video_not_readable": (
        {"problem": "<video>x", "answer": "a", "videos": ["junk.mp4"]},
        "video",
        "video {dir}/junk.mp4 is not a readable video",
    ),
    "video_of_zero_frames": (
        {"problem": "<video>x", "answer": "a", "videos": ["zero.avi"]},
        "video",
        "video {dir}/zero.avi has 0 frame(s); a video needs at least 2",
    ),
    "video_mp4_without_frames": (
        {"problem": "<video>x", "answer": "a", "videos": ["zero.mp4"]},
        "video",
        "video {dir}/zero.mp4 has no video stream",
    ),
    "video_empty_frame_list": (
        {"problem": "<video>x", "answer": "a", "videos": [[]]},
        "video",
        "video is an empty list of frames",
    ),
    "placeholder_in_text": (
        {"problem": "<|image_pad|> sneaky", "answer": "a"},
        "placeholder_in_text",
        "the prompt text itself contains the placeholder token <|image_pad|>",
    ),
}


@pytest.fixture
def qwen(tokenizer_processor):
    return tokenizer_processor("qwen2_5_vl")


def _file(tmp_path, bad: dict) -> str:
    write_png(tmp_path / "ok.png")
    (tmp_path / "notes.png").write_text("this is not a png")
    (tmp_path / "junk.mp4").write_bytes(b"\x00" * 100)  # FFmpeg would read a text file as one frame
    write_empty_video(tmp_path / "zero.avi")
    write_empty_video(tmp_path / "zero.mp4")
    return write_jsonl(tmp_path / "data.jsonl", [GOOD, bad, GOOD])


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_row_is_an_error_naming_file_and_row(qwen, make_config, tmp_path, case):
    bad, _, message = CASES[case]
    path = _file(tmp_path, bad)
    expected = f"{path} row 1: " + message.format(dir=tmp_path)
    with pytest.raises(DataError, match=re.escape(expected)) as info:
        RLDataset(path, make_config(), *qwen)
    assert info.value.file == path and info.value.row == 1
    assert str(info.value).endswith("; set data.skip_bad_rows=true to skip (and count) such rows")


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_row_is_skipped_and_counted(qwen, make_config, tmp_path, case, caplog):
    bad, reason, _ = CASES[case]
    path = _file(tmp_path, bad)
    with caplog.at_level(logging.WARNING, logger="vlrl.data"):
        dataset = RLDataset(path, make_config(skip_bad_rows=True), *qwen)
    assert len(dataset) == 2 and dataset.num_skipped == 1 and dataset.skipped_reasons == {reason: 1}
    assert [dataset[i].uid for i in range(2)] == [0, 2]  # uids stay the row numbers
    assert dataset.bad_rows[0].row == 1 and f"skipped 1 bad rows {{'{reason}': 1}}" in caplog.text


def test_missing_answer_column_lists_the_columns(qwen, make_config, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "x", "solution": "y"}])
    with pytest.raises(
        DataError,
        match=re.escape("row 0: prompt key 'problem' is missing or empty (columns: question, solution)"),
    ):
        RLDataset(path, make_config(), *qwen)
    dataset = RLDataset(path, make_config(prompt_key="question", answer_key="solution"), *qwen)
    assert dataset[0].ground_truth == "y"


def test_images_for_a_text_model(tokenizer_processor, make_config, tmp_path):
    tokenizer, _ = tokenizer_processor("qwen2")
    path = _file(tmp_path, {"problem": "plain", "answer": "a"})
    with pytest.raises(DataError, match=re.escape("row 0: has 1 image(s) but the model is text-only")):
        RLDataset(path, make_config(), tokenizer, None)
    dataset = RLDataset(path, make_config(skip_bad_rows=True), tokenizer, None)
    assert len(dataset) == 1 and dataset.skipped_reasons == {"text_model": 2}


def test_all_rows_bad(qwen, make_config, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"problem": "", "answer": "a"}])
    with pytest.raises(DataError, match="no usable rows left"):
        RLDataset(path, make_config(skip_bad_rows=True), *qwen)


def test_template_errors_are_fatal_even_when_skipping(qwen, make_config, tmp_path):
    (tmp_path / "evil.jinja").write_text("{{ content.__class__ }}")
    path = _file(tmp_path, GOOD)
    with pytest.raises(
        DataError, match=r"data.jsonl row 0: format_prompt .*evil.jinja' failed at line 1 \(SecurityError\)"
    ):
        RLDataset(path, make_config(skip_bad_rows=True, format_prompt=str(tmp_path / "evil.jinja")), *qwen)


def test_video_over_max_prompt_length_is_found_at_start_up(qwen, make_config, tmp_path):
    """A video whose tokens push the prompt past data.max_prompt_length: an error naming the file
    and row (filter_overlong_prompts=false), or filtered and counted; the text alone fits."""
    write_video(tmp_path / "v.mp4", ["red", "green"] * 4)  # 8 frames at 4 fps: 4 frames sampled
    text = {"problem": "x", "answer": "b"}
    path = write_jsonl(
        tmp_path / "data.jsonl", [text, {**text, "problem": "<video>x", "videos": ["v.mp4"]}, text]
    )
    roomy = RLDataset(path, make_config(max_prompt_length=999), *qwen)
    with_video, text_only = len(roomy[1].input_ids), len(roomy[2].input_ids)
    limit = with_video - 1
    assert text_only + 1 < limit  # the video's tokens (not its one marker) are what overflow
    with pytest.raises(
        DataError,
        match=re.escape(f"{path} row 1: prompt is {with_video} tokens (images and videos expanded), "
                        f"longer than data.max_prompt_length={limit}"),
    ) as info:  # fmt: skip
        RLDataset(path, make_config(max_prompt_length=limit, filter_overlong_prompts=False), *qwen)
    assert info.value.row == 1
    filtered = RLDataset(path, make_config(max_prompt_length=limit), *qwen)
    assert filtered.num_filtered_overlong == 1 and [filtered[i].uid for i in range(len(filtered))] == [0, 2]
    # the start-up count of the video's tokens is exact: a limit equal to the length keeps the row
    assert len(RLDataset(path, make_config(max_prompt_length=with_video), *qwen)) == 3
