"""mrope position ids: equal to transformers 5.19's `get_rope_index`, plus the continuation rule."""

from __future__ import annotations

import re

import pytest
import torch
from data_helpers import image

from vlrl.models.processor import mrope_kwargs
from vlrl.models.rope import (
    continue_position_ids,
    left_pad_position_ids,
    mrope_position_ids,
    text_position_ids,
)

FAMILIES = ("qwen2_5_vl", "qwen2_vl", "qwen3_vl")


@pytest.fixture(scope="module")
def models(tiny_model):
    """arch -> (model, processor): the reference implementation lives on `model.model`."""
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    out = {}
    for arch in FAMILIES:
        path = tiny_model(arch)
        model = AutoModelForImageTextToText.from_pretrained(path)
        out[arch] = (model, AutoProcessor.from_pretrained(path), AutoConfig.from_pretrained(path))
    return out


def _frames(n: int, size: int) -> list:
    return [image(c, (size, size)) for c in ["red", "green", "blue", "yellow"] * (n // 4)]


CASES = {
    "text": ([{"type": "text", "text": "what is one and one"}], [], []),
    "one_image": ([{"type": "image"}, {"type": "text", "text": "what colour"}], [(56, 112)], []),
    "multi_image": (
        [
            {"type": "text", "text": "first"},
            {"type": "image"},
            {"type": "image"},
            {"type": "text", "text": "x"},
        ],
        [(56, 56), (112, 84)],
        [],
    ),
    # 4 frames of 64x64 (t=2 after temporal patching): temporal extent within the spatial one,
    # where the original rule and transformers 5.19's agree (see test_video_rule_follows_vllm).
    "video_and_image": (
        [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "video"}],
        [(64, 64)],
        [4],
    ),
}


def _processed(processor, arch: str, case: str):
    parts, image_sizes, videos = CASES[case]
    factor = 32 if arch == "qwen3_vl" else 28
    images = [image("red", (w // factor * factor, h // factor * factor)) for h, w in image_sizes]
    text = processor.apply_chat_template(
        [{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False
    )
    kwargs = {"images": images or None, "videos": [_frames(n, 64) for n in videos] or None}
    return processor(text=[text], return_tensors="pt", **kwargs)


@pytest.mark.parametrize("arch", FAMILIES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_mrope_matches_transformers(models, arch, case):
    model, processor, config = models[arch]
    out = _processed(processor, arch, case)
    expected, _ = model.model.get_rope_index(
        out["input_ids"],
        mm_token_type_ids=out["mm_token_type_ids"],
        image_grid_thw=out.get("image_grid_thw"),
        video_grid_thw=out.get("video_grid_thw"),
        second_per_grid_ts=out.get("second_per_grid_ts"),
    )
    ours = mrope_position_ids(
        out["input_ids"][0],
        out.get("image_grid_thw"),
        out.get("video_grid_thw"),
        second_per_grid_ts=out.get("second_per_grid_ts"),
        **mrope_kwargs(config),
    )
    assert ours.shape == (3, out["input_ids"].shape[1])
    assert torch.equal(ours, expected[:, 0])


@pytest.mark.parametrize("arch", FAMILIES)
def test_left_padded_batch_matches_transformers(models, arch):
    """Two prompts of different lengths, left-padded: reference with attention_mask == ours padded."""
    model, processor, config = models[arch]
    single = [_processed(processor, arch, case) for case in ("one_image", "multi_image")]
    ours = left_pad_position_ids(
        [
            mrope_position_ids(o["input_ids"][0], o["image_grid_thw"], None, **mrope_kwargs(config))
            for o in single
        ]
    )
    longest = ours.shape[-1]
    ids = torch.zeros(2, longest, dtype=torch.long)
    mask, types = torch.zeros_like(ids), torch.zeros_like(ids)
    for row, o in enumerate(single):
        n = o["input_ids"].shape[1]
        ids[row, longest - n :], mask[row, longest - n :] = o["input_ids"][0], 1
        types[row, longest - n :] = o["mm_token_type_ids"][0]
    grids = torch.cat([o["image_grid_thw"] for o in single])
    expected, _ = model.model.get_rope_index(
        ids, mm_token_type_ids=types, image_grid_thw=grids, attention_mask=mask
    )
    assert ours.shape == (2, 3, longest)
    assert torch.equal(ours, expected.permute(1, 0, 2))


def _ids(*pieces: tuple[int, int]) -> torch.Tensor:
    """Token ids from (token, count) runs."""
    return torch.tensor([t for token, count in pieces for t in [token] * count])


IDS = {"image_token_id": 5, "video_token_id": 6, "vision_start_token_id": 3, "spatial_merge_size": 2}


def test_video_rule_follows_vllm():
    """Qwen2-VL video with t=3 merged steps but 1x1 spatial: next text starts at max + 1 (vLLM and
    the original Qwen code), not at start + max(h, w) as in transformers 5.19."""
    ids = _ids((1, 2), (3, 1), (6, 3), (4, 1), (1, 1))  # text text <vs> vid*3 <ve> text
    pos = mrope_position_ids(ids, None, torch.tensor([[3, 2, 2]]), family="qwen2_vl", **IDS)
    assert pos[:, 3:6].tolist() == [[3, 4, 5], [3, 3, 3], [3, 3, 3]]
    assert pos[:, 6].tolist() == [6, 6, 6]


def test_qwen25_video_temporal_spacing():
    """Temporal index = floor(step * tokens_per_second * second_per_grid_ts)."""
    ids = _ids((3, 1), (6, 3))
    pos = mrope_position_ids(
        ids,
        None,
        torch.tensor([[3, 2, 2]]),
        family="qwen2_5_vl",
        tokens_per_second=2,
        second_per_grid_ts=[0.75],
        **IDS,
    )
    assert pos[0, 1:].tolist() == [1, 2, 4]  # 1 + floor([0, 1.5, 3.0])


def test_mismatched_grids_raise():
    ids = _ids((3, 1), (5, 4), (1, 1))
    with pytest.raises(ValueError, match="shorter than its grid"):
        mrope_position_ids(ids, torch.tensor([[1, 4, 6]]), None, family="qwen2_vl", **IDS)
    with pytest.raises(ValueError, match="more image grids"):
        mrope_position_ids(ids, torch.tensor([[1, 4, 4], [1, 2, 2]]), None, family="qwen2_vl", **IDS)
    with pytest.raises(ValueError, match=re.escape("not preceded by <|vision_start|>")):
        mrope_position_ids(_ids((1, 1), (5, 1)), torch.tensor([[1, 2, 2]]), None, family="qwen2_vl", **IDS)
    with pytest.raises(ValueError, match="more image placeholder blocks"):
        mrope_position_ids(ids, None, None, family="qwen2_vl", **IDS)
    with pytest.raises(ValueError, match="unknown mrope family"):
        mrope_position_ids(ids, None, None, family="llama", **IDS)


def test_text_only_mrope_equals_text_positions():
    ids = torch.arange(10, 17)
    assert torch.equal(
        mrope_position_ids(ids, None, None, family="qwen3_vl", **IDS), text_position_ids(7).expand(3, -1)
    )


def test_continue_position_ids():
    text = torch.tensor([[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]])  # left-padded [B, P]
    assert continue_position_ids(text, 3).tolist() == [[3, 4, 5], [5, 6, 7]]
    # mrope [B, 3, P]: continue from the max over all axes (image positions can exceed the text's).
    mrope = torch.tensor([[[0, 1, 1, 1, 3], [0, 1, 1, 2, 3], [0, 1, 2, 1, 3]]])
    out = continue_position_ids(mrope, 2)
    assert out.shape == (1, 3, 2)
    assert out.tolist() == [[[4, 5], [4, 5], [4, 5]]]
    # a single unpadded [3, P] sequence needs mrope=True ([3, P] is also a valid [B, P]).
    assert continue_position_ids(mrope[0], 2, mrope=True).tolist() == [[4, 5]] * 3
    assert continue_position_ids(torch.arange(4), 2).tolist() == [4, 5]


def test_left_pad_position_ids():
    out = left_pad_position_ids([torch.arange(2), torch.arange(4)])
    assert out.tolist() == [[0, 0, 0, 1], [0, 1, 2, 3]]
    out3 = left_pad_position_ids([torch.arange(2).expand(3, -1)], length=3)
    assert out3.shape == (1, 3, 3) and out3[0, :, 0].tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="shorter than the longest"):
        left_pad_position_ids([torch.arange(4)], length=2)
