"""A folder laid out like a user's EasyR1 checkout, for running EasyR1's commands unchanged.

`easyr1_workdir(root)` writes, once per test session:
- `examples/`: EasyR1's config.yaml, launch scripts, reward files and format prompts (the fixtures);
- every hub id the commands name, as a local folder of the same name: datasets as the hub lays them
  out (`data/train-00000-of-00001.parquet`, `data/test-...`, images as `{bytes, path}` structs of
  several sizes and modes, multi-image rows, math-style answers), and models as links to a tiny
  model of the same family.
A command run from that folder then finds everything locally without one argument changed.

The tiny models get a short supervised warm-up (`teach_answer_forms`) so that their sampled responses
have varied lengths, end at EOS (or run past the limit), and sometimes hold an answer in the forms
EasyR1's rewards read: rewards vary within a group, so advantages are non-zero and online filtering
keeps groups.
"""

from __future__ import annotations

import io
import random
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from PIL import Image

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "easyr1"

# hub dataset id -> images per row (0: a text dataset)
DATASETS = {
    "hiyouga/math12k": 0,
    "hiyouga/geometry3k": 1,
    "BUAADreamer/clevr_count_70k": 1,
    "leonardPKU/GEOQA_8K_R1V": 1,
    "yuehua-s/numbergame": 1,
    "hiyouga/journeybench-multi-image-vqa": 2,
    "Saigyouji-Yuyuko1000/dapo17k": 0,
}
# hub model id -> tiny arch of the same family
MODELS = {
    "Qwen/Qwen2.5-7B-Instruct": "qwen2",
    "Qwen/Qwen2.5-3B-Instruct": "qwen2",  # vlrl's calculator example
    "Qwen/Qwen3-4B": "qwen3",
    "Qwen/Qwen3-14B-Base": "qwen3",
    "Qwen/Qwen2.5-VL-3B-Instruct": "qwen2_5_vl",
    "Qwen/Qwen2.5-VL-7B-Instruct": "qwen2_5_vl",
    "Qwen/Qwen2.5-VL-32B-Instruct": "qwen2_5_vl",
    "Qwen/Qwen3-VL-4B-Instruct": "qwen3_vl",
    "Qwen/Qwen3-VL-30B-A3B-Instruct": "qwen3_vl_moe",
    "Qwen/Qwen3.5-27B": "qwen3_5",
    "OpenGVLab/InternVL3-8B-hf": "internvl",
    "HuggingFaceTB/SmolVLM2-2.2B-Instruct": "smolvlm",
    "zai-org/GLM-4.1V-9B-Thinking": "glm4v",
}
# Answers the warm-up teaches; the datasets hold these and math-style ones it never gives
ANSWERS = ("1", "2")
DATA_ANSWERS = ("1", "2", "1", "2", r"\frac{3}{4}")
# (mode, width, height) of the images, cycled through the rows
IMAGE_KINDS = (("RGB", 60, 40), ("RGBA", 64, 64), ("L", 90, 30), ("P", 33, 77))


def easyr1_workdir(root: Path, train_rows: int = 12, test_rows: int = 4) -> Path:
    """The folder described above, under `root` (models and data built on first use)."""
    work = root / "easyr1"
    if work.exists():
        return work
    shutil.copytree(FIXTURES / "examples", work / "examples")
    for hub_id, images in DATASETS.items():
        write_hub_dataset(work / hub_id, images, train_rows, test_rows, seed=len(hub_id))
    built: dict[str, Path] = {}
    for hub_id, arch in MODELS.items():
        if arch not in built:
            built[arch] = build_warm_model(root / "models" / arch, arch)
        (work / hub_id).parent.mkdir(parents=True, exist_ok=True)
        (work / hub_id).symlink_to(built[arch], target_is_directory=True)
    return work


def write_hub_dataset(folder: Path, images_per_row: int, train_rows: int, test_rows: int, seed: int) -> None:
    """`folder/data/{train,test}-00000-of-00001.parquet` with EasyR1's columns (problem, answer,
    images); prompts carry one `<image>` marker per image, as geometry3k's do."""
    rng = random.Random(seed)
    (folder / "data").mkdir(parents=True)
    for split, n in (("train", train_rows), ("test", test_rows)):
        rows: dict[str, list[Any]] = {"problem": [], "answer": [], "images": []}
        for i in range(n):
            markers = "<image>" * images_per_row
            rows["problem"].append(f"{markers}Question {i}: what is the value of x{i % 3}?")
            rows["answer"].append(DATA_ANSWERS[rng.randrange(len(DATA_ANSWERS))])
            rows["images"].append(
                [_image_cell(rng, i + k, f"{split}_{i}_{k}.png") for k in range(images_per_row)]
            )
        table = (
            pa.table(rows) if images_per_row else pa.table({k: v for k, v in rows.items() if k != "images"})
        )
        pq.write_table(table, folder / "data" / f"{split}-00000-of-00001.parquet")


def _image_cell(rng: random.Random, index: int, name: str) -> dict[str, Any]:
    mode, width, height = IMAGE_KINDS[index % len(IMAGE_KINDS)]
    image = Image.new("RGB", (width, height), tuple(rng.randrange(256) for _ in range(3)))
    image = image.convert(mode) if mode != "P" else image.convert("P", palette=Image.Palette.ADAPTIVE)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return {"bytes": buffer.getvalue(), "path": name}


def build_warm_model(folder: Path, arch: str) -> Path:
    from vlrl.models.tiny import build_tiny_model

    # Qwen2.5's and Qwen3's tokenizers have <tool_call> tokens (vlrl's multi-turn examples need them)
    build_tiny_model(folder, arch=arch, seed=0, min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 16,
                     tool_tokens=True, reasoning_tokens=True)  # fmt: skip
    teach_answer_forms(folder, arch)
    return folder


# One answer form that every EasyR1 reward reads: r1v's tags around math's \boxed{} (r1v grades
# the boxed answer too), DAPO's `Answer:` line inside the reasoning, and android_gui's first digit.
ANSWER_FORM = "<think> {steps}\nAnswer: {answer}\n</think><answer>\\boxed{{{answer}}}</answer>"


def answer_form_example(rng: random.Random) -> str:
    """A response in `ANSWER_FORM` with 0 to 15 words of "reasoning" and one of `ANSWERS`."""
    return ANSWER_FORM.format(steps=" ".join(["step"] * rng.randrange(0, 16)), answer=rng.choice(ANSWERS))


def teach_answer_forms(folder: Path, arch: str, steps: int = 100, batch: int = 8) -> None:
    """A short supervised fit on (format prompt, `answer_form_example` + EOS) pairs, text only, so
    sampled responses vary in length, end at EOS and sometimes hold a right answer."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    from vlrl.models.moe import write_checkpoint_layout
    from vlrl.models.tiny import TEXT_ARCHS

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model_cls = AutoModelForCausalLM if arch in TEXT_ARCHS else AutoModelForImageTextToText
    model = model_cls.from_pretrained(folder, dtype=torch.float32)
    # EasyR1's format prompts but android_gui's (~600 tokens to this tokenizer: slow to fit on)
    prompts = [
        (FIXTURES / "examples" / "format_prompt" / f"{form}.jinja").read_text()
        for form in ("math", "r1v", "dapo")
    ]
    rng = random.Random(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    for _ in range(steps):
        ids, labels = [], []
        for _ in range(batch):
            question = rng.choice(prompts).replace(
                "{{ content | trim }}", f"Question {rng.randrange(99)}: x?"
            )
            prompt = tokenizer.apply_chat_template(
                [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
            )
            p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            r = tokenizer(answer_form_example(rng) + "<|im_end|>", add_special_tokens=False)["input_ids"]
            ids.append(p + r)
            labels.append([-100] * len(p) + r)
        width = max(map(len, ids))
        pad = tokenizer.pad_token_id
        input_ids = torch.tensor([x + [pad] * (width - len(x)) for x in ids])
        label_ids = torch.tensor([x + [-100] * (width - len(x)) for x in labels])
        mask = torch.arange(width) < torch.tensor([len(x) for x in ids])[:, None]
        loss = model(input_ids=input_ids, attention_mask=mask.long(), labels=label_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(folder)
    write_checkpoint_layout(folder, model.config)  # MoE experts in Qwen's layout again (vLLM reads it)
