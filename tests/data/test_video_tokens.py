"""Video prompts: our placeholder expansion == the processor's, our mrope positions == transformers'
`get_rope_index` (Qwen2-VL, Qwen2.5-VL with second_per_grid_ts, Qwen3-VL with frame timestamps)."""

from __future__ import annotations

import pytest
import torch
from data_helpers import write_jsonl, write_png, write_video

from vlrl.data.dataset import RLDataset
from vlrl.data.encoded_images import decoded

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
COLOURS = ["red", "green", "blue", "yellow", "white", "black", "magenta", "cyan"]

ROWS = {
    "video": {"problem": "<video>Which way does it move?", "answer": "left", "videos": ["v.mp4"]},
    "image_and_video": {
        "problem": "<image>and<video>same colour?",
        "answer": "yes",
        "images": ["i.png"],
        "videos": ["v.mp4"],
    },
    "frame_list": {"problem": "x<video>", "answer": "a", "videos": [["f0.png", "f1.png", "f2.png"]]},
}


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("video_tokens")
    # 8 frames at 4 fps (2 s): sampled at 2 fps -> 4 frames, 2 temporal patches. 140x140 frames
    # (5x5 merged tokens) keep Qwen2.5-VL's temporal extent (1 patch x 1 s x 4 tokens/s) within the
    # spatial one, where transformers agrees with vLLM's rule (see tests/data/test_rope.py).
    write_video(folder / "v.mp4", COLOURS, size=(140, 140), fps=4)
    write_png(folder / "i.png", "red", (56, 84))
    for k in range(3):
        write_png(folder / f"f{k}.png", COLOURS[k], (140, 140))
    return write_jsonl(folder / "data.jsonl", list(ROWS.values()))


@pytest.mark.parametrize("arch", FAMILIES)
def test_video_ids_and_positions_match_transformers(
    tiny_model, tokenizer_processor, make_config, data_file, arch
):
    from transformers import AutoConfig, AutoModelForImageTextToText

    tokenizer, processor = tokenizer_processor(arch)
    model = AutoModelForImageTextToText.from_pretrained(tiny_model(arch))
    config = make_config(max_prompt_length=1024, max_pixels=28 * 28 * 25)
    hf_config = AutoConfig.from_pretrained(tiny_model(arch))  # Qwen2.5-VL: its tokens_per_second
    fast = RLDataset(data_file, config, tokenizer, processor, hf_config=hf_config)
    reference = RLDataset(data_file, config, tokenizer, processor, hf_config=hf_config, use_processor=True)
    for row, case in enumerate(ROWS):
        ours, theirs = fast[row], reference[row]
        assert torch.equal(ours.input_ids, theirs.input_ids), case
        video = ours.videos[0]
        assert len(video.frames) == 4 and ours.video_grid_thw[0, 0].item() == 2
        out = processor(
            text=[ours.prompt],
            images=[decoded(image) for image in ours.images] or None,  # they cross encoded
            videos=[v.frames for v in ours.videos],
            video_metadata=[v.metadata() for v in ours.videos],
            do_sample_frames=False,
            do_resize=False,
            return_tensors="pt",
        )
        assert torch.equal(out["input_ids"][0], ours.input_ids), case
        assert torch.equal(out["video_grid_thw"], ours.video_grid_thw), case
        expected, _ = model.model.get_rope_index(
            out["input_ids"],
            mm_token_type_ids=out["mm_token_type_ids"],
            image_grid_thw=out.get("image_grid_thw"),
            video_grid_thw=out["video_grid_thw"],
            second_per_grid_ts=out.get("second_per_grid_ts"),
        )
        assert torch.equal(ours.position_ids, expected[:, 0]), case
        if arch == "qwen3_vl" and case == "video":  # frame timestamps are text in the prompt
            # frames 0, 2, 5, 7 of 8 at 4 fps: patches at (0 + 0.5) / 2 and (1.25 + 1.75) / 2 s
            text = tokenizer.decode(ours.input_ids)
            assert "<0.2 seconds>" in text and "<1.5 seconds>" in text
