"""RLDataset + collate: mixed rows, image forms, pixel bounds, processor agreement, overlong prompts."""

from __future__ import annotations

import logging

import pytest
import torch
from data_helpers import png_bytes, write_jsonl, write_png

from vlrl.data import DataError, RLDataset, collate_prompts
from vlrl.data.encoded_images import decoded


@pytest.fixture
def mixed_file(tmp_path):
    """Text-only, one-image and two-image rows in one jsonl, with an extra column."""
    write_png(tmp_path / "img" / "red.png", "red", (56, 56))
    write_png(tmp_path / "img" / "big.png", "blue", (400, 300))
    write_png(tmp_path / "img" / "tiny.png", "green", (10, 10))
    rows = [
        {"problem": "what is one plus one", "answer": "2", "images": [], "level": "easy"},
        {
            "problem": "<image>What colour is the shape?",
            "answer": "red",
            "images": ["img/red.png"],
            "level": "a",
        },
        {
            "problem": "first <image> then <image> which?",
            "answer": "x",
            "images": ["img/big.png", "img/tiny.png"],
            "level": "b",
        },  # fmt: skip
        {"problem": "no images key at all", "answer": "y", "level": "c"},
    ]
    return write_jsonl(tmp_path / "mixed.jsonl", rows)


def test_mixed_rows(tokenizer_processor, make_config, mixed_file):
    tokenizer, processor = tokenizer_processor("qwen2_5_vl")
    dataset = RLDataset(mixed_file, make_config(), tokenizer, processor)
    assert len(dataset) == dataset.num_rows == 4
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    text, one, two, bare = (dataset[i] for i in range(4))
    assert (
        text.images == []
        and text.image_grid_thw is None
        and text.position_ids.shape == (3, len(text.input_ids))
    )
    assert text.raw_prompt_ids == text.input_ids.tolist()
    assert one.raw_prompt_ids.count(pad) == 1 and one.images[0].size == (56, 56)
    assert (one.input_ids == pad).sum() == 4  # 56x56 -> 2x2 merged tokens
    # big (200x150 > max_pixels): scaled to 129x96, rounded to 140x84 (EasyR1's sizes); tiny upscaled: 2x2
    assert two.raw_prompt_ids.count(pad) == 2 and [im.size for im in two.images] == [(140, 84), (56, 56)]
    assert (two.input_ids == pad).sum() == 5 * 3 + 2 * 2
    assert two.image_grid_thw.tolist() == [[1, 6, 10], [1, 4, 4]]
    assert [s.uid for s in (text, one, two, bare)] == [0, 1, 2, 3]
    assert one.extras == {"level": "a"} and one.ground_truth == "red" and bare.images == []
    assert "<|vision_start|><|image_pad|><|vision_end|>What colour" in one.prompt


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen2_vl", "qwen3_vl"])
def test_processor_expansion_equals_prediction(tokenizer_processor, make_config, mixed_file, arch):
    """The processor (do_resize=False on pre-resized images) yields exactly the predicted grids and ids."""
    tokenizer, processor = tokenizer_processor(arch)
    config = make_config(min_pixels=4 * 32 * 32 if arch == "qwen3_vl" else None)
    reference = RLDataset(mixed_file, config, tokenizer, processor, use_processor=True)
    fast = RLDataset(mixed_file, config, tokenizer, processor, use_processor=False)
    for i in range(len(reference)):
        a, b = reference[i], fast[i]
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.position_ids, b.position_ids)
        if a.images:
            pixels = [decoded(image) for image in a.images]  # what a rank gets
            out = processor(text=[a.prompt], images=pixels, return_tensors="pt")  # its own resize on
            assert torch.equal(out["image_grid_thw"], a.image_grid_thw)
            assert torch.equal(out["input_ids"][0], a.input_ids)


@pytest.mark.parametrize("bounds", [(28 * 28 * 4, 28 * 28 * 8), (28 * 28 * 20, 28 * 28 * 30)])
def test_pixel_bounds(tokenizer_processor, make_config, mixed_file, bounds):
    tokenizer, processor = tokenizer_processor("qwen2_5_vl")
    dataset = RLDataset(
        mixed_file, make_config(min_pixels=bounds[0], max_pixels=bounds[1]), tokenizer, processor
    )
    # EasyR1's rule: scale into the bounds (sides truncated), then round each side to the nearest
    # 28-pixel block, so the area may end up to a block's rounding outside the bounds.
    from vlrl.data.images import scale_into_bounds

    for image, (w0, h0) in zip(dataset[2].images, [(400, 300), (10, 10)]):
        width, height = image.size
        scaled_h, scaled_w = scale_into_bounds(h0, w0, *bounds)
        assert width % 28 == 0 and height % 28 == 0
        assert abs(width - scaled_w) <= 14 and abs(height - scaled_h) <= 14, (image.size, scaled_w, scaled_h)


def test_pixel_bounds_default_to_the_processor(tokenizer_processor, make_config, mixed_file):
    tokenizer, processor = tokenizer_processor("qwen2_5_vl")
    dataset = RLDataset(mixed_file, make_config(min_pixels=None, max_pixels=None), tokenizer, processor)
    assert dataset.prep.processor_bounds == (28 * 28 * 4, 28 * 28 * 64)  # the resize that runs last
    with pytest.raises(ValueError, match="max_pixels=10 must be >= data.min_pixels"):
        RLDataset(mixed_file, make_config(max_pixels=10), tokenizer, processor)


def test_image_forms_in_parquet(tokenizer_processor, make_config, tmp_path):
    """datasets Image features ({bytes, path} dicts), raw bytes columns and path columns."""
    import datasets

    tokenizer, processor = tokenizer_processor("qwen2_5_vl")
    write_png(tmp_path / "p.png", "blue")
    features = datasets.Features(
        {
            "problem": datasets.Value("string"),
            "answer": datasets.Value("string"),
            "images": datasets.List(datasets.Image()),
        }
    )
    rows = {"problem": ["<image>a", "<image>b"], "answer": ["red", "blue"]}
    images = [[{"bytes": png_bytes("red"), "path": None}], [{"bytes": None, "path": str(tmp_path / "p.png")}]]
    datasets.Dataset.from_dict({**rows, "images": images}, features=features).to_parquet(
        tmp_path / "feat.parquet"
    )
    raw = datasets.Dataset.from_dict({**rows, "images": [[png_bytes("red")], [png_bytes("blue")]]})
    raw.to_parquet(tmp_path / "raw.parquet")
    for name in ("feat.parquet", "raw.parquet"):
        dataset = RLDataset(str(tmp_path / name), make_config(), tokenizer, processor)
        colours = [decoded(dataset[i].images[0]).getpixel((5, 5)) for i in range(2)]
        assert colours == [(255, 0, 0), (0, 0, 255)], name


def test_csv_lists_and_format_prompt(tokenizer_processor, make_config, tmp_path):
    tokenizer, processor = tokenizer_processor("qwen2_5_vl")
    write_png(tmp_path / "a.png")
    (tmp_path / "d.csv").write_text('problem,answer,images\n"<image>x",red,"[""a.png""]"\nplain,1,\n')
    (tmp_path / "fmt.jinja").write_text("{{ content }} Answer in one word.")
    dataset = RLDataset(
        str(tmp_path / "d.csv"), make_config(format_prompt=str(tmp_path / "fmt.jinja")), tokenizer, processor
    )
    assert len(dataset[0].images) == 1 and dataset[1].images == []
    assert "x Answer in one word.<|im_end|>" in dataset[0].prompt and dataset[1].ground_truth == "1"


def test_overlong_prompts(tokenizer_processor, make_config, tmp_path, caplog):
    tokenizer, processor = tokenizer_processor("qwen2_5_vl")
    write_png(tmp_path / "big.png", "red", (400, 400))  # 16 tokens at max_pixels = 28*28*16
    rows = [
        {"problem": "<image>short", "answer": "a", "images": ["big.png"]},
        {"problem": "word " * 30, "answer": "b"},
        {"problem": "short", "answer": "c"},
    ]
    path = write_jsonl(tmp_path / "long.jsonl", rows)
    lengths = [
        len(RLDataset(path, make_config(max_prompt_length=999), tokenizer, processor)[i].input_ids)
        for i in range(3)
    ]
    limit = lengths[2] + 5  # the image row (16 image tokens) and the wordy row exceed it
    assert lengths[0] > limit and lengths[1] > limit
    with caplog.at_level(logging.INFO, logger="vlrl.data"):
        dataset = RLDataset(path, make_config(max_prompt_length=limit), tokenizer, processor)
    assert len(dataset) == 1 and dataset.num_filtered_overlong == 2 and dataset[0].ground_truth == "c"
    assert "filtered 2 prompts longer than max_prompt_length" in caplog.text
    with pytest.raises(
        DataError, match=rf"long.jsonl row 0: prompt is {lengths[0]} tokens .*max_prompt_length={limit}"
    ):
        RLDataset(
            path, make_config(max_prompt_length=limit, filter_overlong_prompts=False), tokenizer, processor
        )
    # the load-time length check counts expanded image tokens exactly: a limit equal to a length keeps it
    for limit in (lengths[0], lengths[0] - 1):
        kept = RLDataset(path, make_config(max_prompt_length=limit), tokenizer, processor)
        assert [kept[i].ground_truth for i in range(len(kept))] == [
            g for g, n in zip("abc", lengths) if n <= limit
        ]


def test_collate_left_pads(tokenizer_processor, make_config, mixed_file):
    tokenizer, processor = tokenizer_processor("qwen2_5_vl")
    dataset = RLDataset(mixed_file, make_config(), tokenizer, processor)
    samples = [dataset[i] for i in range(3)]
    batch = collate_prompts(samples, dataset.pad_token_id)
    longest = max(len(s.input_ids) for s in samples)
    assert batch.input_ids.shape == (3, longest) and batch.position_ids.shape == (3, 3, longest)
    for row, sample in enumerate(samples):
        n, pad = len(sample.input_ids), longest - len(sample.input_ids)
        assert torch.equal(batch.input_ids[row, pad:], sample.input_ids)
        assert (batch.input_ids[row, :pad] == dataset.pad_token_id).all()
        assert batch.attention_mask[row].tolist() == [0] * pad + [1] * n
        assert (batch.position_ids[row, :, :pad] == 0).all()
        assert torch.equal(batch.position_ids[row, :, pad:], sample.position_ids)
    assert batch.uids == [0, 1, 2] and batch.ground_truths == ["2", "red", "x"] and len(batch.images[2]) == 2
    assert batch.raw_prompt_ids[1] == samples[1].raw_prompt_ids and batch.prompts[0] == samples[0].prompt


def test_text_model(tokenizer_processor, make_config, tmp_path):
    tokenizer, processor = tokenizer_processor("qwen2")
    rows = [{"problem": "one plus one", "answer": "2"}, {"problem": "what is the sum of one", "answer": "1"}]
    dataset = RLDataset(write_jsonl(tmp_path / "t.jsonl", rows), make_config(), tokenizer, None)
    batch = collate_prompts([dataset[0], dataset[1]], dataset.pad_token_id)
    assert batch.position_ids.shape == batch.input_ids.shape and batch.position_ids.dim() == 2
    assert batch.raw_prompt_ids[0] == dataset[0].input_ids.tolist() and batch.images == [[], []]


def test_length_check_threads_keep_the_same_rows(tokenizer_processor, make_config, tmp_path):
    """`data.filter_overlong_prompts_workers` tokenizes in threads; the kept rows do not change."""
    tokenizer, _ = tokenizer_processor("qwen2_5_vl")
    rows = [{"problem": "word " * (1 + i % 40), "answer": str(i)} for i in range(300)]
    path = write_jsonl(tmp_path / "many.jsonl", rows)
    kept = {}
    for workers in (1, 4):
        dataset = RLDataset(
            path, make_config(max_prompt_length=30, filter_overlong_prompts_workers=workers), tokenizer, None
        )
        kept[workers] = [dataset.location(i)[1] for i in range(len(dataset))]
    assert kept[1] == kept[4] and 0 < len(kept[1]) < 300
